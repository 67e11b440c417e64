"""fastload.data.labels: the images->labels path rule and row validation (every fault kind)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from fastload.data.config import load_data_config
from fastload.data.labels import FlatLabels, img2label_path, parse_labels, read_label_file


def test_img2label_uses_the_last_images_folder():
    sep = os.sep
    assert img2label_path(f"{sep}d{sep}images{sep}train{sep}a.jpg") == f"{sep}d{sep}labels{sep}train{sep}a.txt"
    assert img2label_path(f"{sep}images{sep}x{sep}images{sep}b.PNG") == f"{sep}images{sep}x{sep}labels{sep}b.txt"
    assert img2label_path(f"{sep}flat{sep}c.d.jpeg") == f"{sep}flat{sep}c.d.txt"


def test_good_rows_parse_to_float32_n5():
    res = parse_labels("0 0.5 0.5 0.2 0.4\n2 0.1 0.2 0.05 0.1\n\n", nc=3)
    assert res.labels.dtype == np.float32 and res.labels.shape == (2, 5)
    assert res.problems == [] and res.rows_dropped == 0 and res.duplicates == 0
    np.testing.assert_allclose(res.labels[1], [2, 0.1, 0.2, 0.05, 0.1], rtol=1e-6)


def test_empty_text_gives_0x5():
    res = parse_labels("", nc=3)
    assert res.labels.shape == (0, 5) and not res.problems


def test_polygon_row_becomes_its_bounding_box():
    res = parse_labels("1 0.1 0.2 0.5 0.2 0.3 0.6 0.2 0.4\n", nc=2)
    np.testing.assert_allclose(res.labels[0], [1, 0.3, 0.4, 0.4, 0.4], atol=1e-6)


@pytest.mark.parametrize(
    "row,kind",
    [
        ("0 0.5 0.5 0.1", "bad_columns"),
        ("0 0.5 0.5 0.1 0.1 0.3", "bad_columns"),
        ("0", "bad_columns"),
        ("cat 0.5 0.5 0.1 0.1", "non_numeric"),
        ("0 0.5 nan 0.1 0.1", "non_numeric"),
        ("99 0.5 0.5 0.1 0.1", "bad_class"),
        ("-1 0.5 0.5 0.1 0.1", "bad_class"),
        ("1.5 0.5 0.5 0.1 0.1", "bad_class"),
        ("0 1.7 0.5 0.1 0.1", "out_of_range"),
        ("0 0.5 -0.2 0.1 0.1", "out_of_range"),
        ("0 0.5 0.5 0 0.1", "bad_size"),
        ("0 0.5 0.5 0.1 -0.1", "out_of_range"),
    ],
)
def test_each_fault_kind_drops_only_its_row(row, kind):
    text = f"0 0.5 0.5 0.2 0.2\n{row}\n1 0.3 0.3 0.1 0.1\n"
    res = parse_labels(text, nc=3, path="lab.txt")
    assert [p.kind for p in res.problems] == [kind]
    assert res.problems[0].path == "lab.txt" and "line 2" in res.problems[0].message
    assert res.rows_dropped == 1
    np.testing.assert_allclose(res.labels[:, 0], [0, 1])


def test_coordinates_within_tolerance_are_clipped():
    res = parse_labels("0 1.005 0.5 0.2 0.2\n", nc=1)
    assert not res.problems and res.labels[0, 1] == pytest.approx(1.0)


def test_duplicates_are_removed_and_counted_keeping_order():
    text = "1 0.5 0.5 0.2 0.2\n0 0.1 0.1 0.1 0.1\n1 0.5 0.5 0.2 0.2\n1 0.5 0.5 0.2 0.2\n"
    res = parse_labels(text, nc=2)
    assert res.duplicates == 2 and [p.kind for p in res.problems] == ["duplicate_row"]
    np.testing.assert_allclose(res.labels[:, 0], [1, 0])


def test_read_label_file(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("0 0.5 0.5 0.2 0.2\n")
    assert read_label_file(p, 1).labels.shape == (1, 5)
    bad = tmp_path / "bin.txt"
    bad.write_bytes(b"\xff\xfe\x00garbage")
    res = read_label_file(bad, 1)
    assert res.labels.shape == (0, 5) and res.problems[0].kind == "label_unreadable"


def test_flat_labels_are_a_sequence_of_per_image_views():
    arrays = [np.arange(10, dtype=np.float32).reshape(2, 5), np.zeros((0, 5), np.float32),
              np.full((3, 5), 7, np.float32), np.ones((1, 5), np.float32)]
    flat = FlatLabels.from_arrays(arrays)
    assert len(flat) == 4 and flat.counts.tolist() == [2, 0, 3, 1] and flat.rows.shape == (6, 5)
    for got, want in zip(flat, arrays):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(flat[-1], arrays[-1])
    assert flat[2].base is not None and not flat[2].flags.writeable  # a view of the one array, read-only
    with pytest.raises(IndexError):
        flat[4]
    sub = flat.subset(np.array([3, 1, 0]))
    assert [x.tolist() for x in sub] == [arrays[3].tolist(), [], arrays[0].tolist()]
    assert FlatLabels.from_arrays(flat) is flat and len(flat.subset(np.array([], np.int64))) == 0
    with pytest.raises(ValueError):
        FlatLabels(flat.rows, np.array([0, 2, 9]))


def test_a_view_of_every_sample_shares_the_store_arrays(tmp_path):
    from fastload.data.synthetic import make_synthetic_dataset
    from fastload.store.files import FileStore
    from fastload.store.view import StoreView

    y = make_synthetic_dataset(tmp_path / "ds", n_train=4, n_val=0, seed=1)
    store = FileStore.from_config(load_data_config(y), "train")
    view = StoreView(store)
    assert view.im_files is store.im_files and view.labels is store.labels
    part = StoreView(store, np.array([2, 0]))
    assert part.im_files == [store.im_files[2], store.im_files[0]]
    for got, i in zip(part.labels, (2, 0)):
        np.testing.assert_array_equal(got, store.labels[i])


def test_label_paths_equal_img2label_path_one_by_one():
    from fastload.data.labels import label_paths

    files = ["/d/images/train/a.jpg", "/d/images/train/images/b.c.jpg", "/d/x/.jpg", "rel.jpg", "/images/x.png",
             "/d/imagesX/images/y.jpg", "im/images/z.JPG", "/d/images/train/sub/images/q.jpg", "/a/images/",
             "/d/images/train/a2.png"]
    assert label_paths(files) == [img2label_path(f) for f in files]
