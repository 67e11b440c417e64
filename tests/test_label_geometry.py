"""Segment, pose and OBB labels: rows parsed with their points (the references' rules, checked against YOLOv9's and
Ultralytics' own ``verify_image_label``), FlatLabels' points, the index cache, every local store kind (points
bit-exact, covered by the checksum, checked by verify, counted by info) and ``fastload synth --task``."""
from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import cv2
import numpy as np
import pytest

from fastload.data.config import DataConfigError, load_data_config
from fastload.data.index import build_index
from fastload.data.labels import FlatLabels, parse_labels
from fastload.data.synthetic import make_synthetic_dataset
from fastload.store import open_store
from fastload.store.base import StoreError
from fastload.store.convert import convert
from fastload.store.info import dataset_info, format_info
from fastload.store.verify import verify_target
from official_helpers import require_upstream
from store_helpers import isolated_shm

QUIET = {"workers": 1, "progress": False, "log": lambda *_: None}
KINDS = ("lmdb", "encoded", "disk", "ram")


# ----------------------------------------------------------------------------- parsing
def test_polygon_rows_keep_their_points_and_their_box_spans_them():
    res = parse_labels("1 0.1 0.2 0.5 0.2 0.3 0.6 0.2 0.4\n0 0.1 0.1 0.9 0.1 0.9 0.8 0.1 0.8\n", nc=2)
    np.testing.assert_allclose(res.labels[0], [1, 0.3, 0.4, 0.4, 0.4], atol=1e-6)
    assert res.points.dtype == np.float32 and res.points.shape == (8, 2)
    assert res.point_offsets.tolist() == [0, 4, 8] and not res.problems
    np.testing.assert_array_equal(res.points[4:], np.float32([[0.1, 0.1], [0.9, 0.1], [0.9, 0.8], [0.1, 0.8]]))


def test_box_rows_alone_carry_no_points():
    res = parse_labels("0 0.5 0.5 0.2 0.2\n", nc=1)
    assert res.points is None and res.point_offsets is None


def test_a_box_row_in_a_polygon_file_is_the_two_point_polygon_yolov9_reads():
    res = parse_labels("0 0.2 0.3 0.6 0.7\n1 0.1 0.1 0.4 0.1 0.3 0.5\n", nc=2, path="mix.txt")
    np.testing.assert_allclose(res.labels[0], [0, 0.4, 0.5, 0.4, 0.4], atol=1e-6)  # spans (0.2 0.3) (0.6 0.7)
    assert res.point_offsets.tolist() == [0, 2, 5]
    assert [(p.kind, "line 1" in p.message) for p in res.problems] == [("box_row_in_polygon_file", True)]
    assert res.rows_dropped == 0


@pytest.mark.parametrize("row,kind", [
    ("0 0.1 0.1 0.5 0.1 0.3", "bad_columns"),  # an odd coordinate count
    ("0 0.1 0.1", "bad_columns"),  # one point
    ("0 0.1 0.1 1.5 0.1 0.3 0.6", "out_of_range"),
    ("0 0.1 0.1 0.1 0.1 0.1 0.1", "bad_size"),  # every point the same
    ("0 0.1 x 0.5 0.1 0.3 0.6", "non_numeric"),
    ("7 0.1 0.1 0.5 0.1 0.3 0.6", "bad_class"),
])
def test_each_bad_polygon_row_is_named_dropped_and_counted(row, kind):
    res = parse_labels(f"0 0.1 0.1 0.5 0.1 0.3 0.6\n{row}\n1 0.2 0.2 0.6 0.2 0.4 0.7 0.2 0.5\n", nc=2, path="p.txt")
    assert [(p.kind, "line 2" in p.message) for p in res.problems] == [(kind, True)]
    assert res.rows_dropped == 1 and res.labels[:, 0].tolist() == [0, 1] and res.point_offsets.tolist() == [0, 3, 7]


def test_pose_rows_with_and_without_visibility():
    d3 = parse_labels("0 0.5 0.5 0.4 0.4 0.4 0.4 2 0.6 0.6 1 0 0 0\n", nc=1, kpt_shape=(3, 3))
    np.testing.assert_array_equal(d3.points, np.float32([[0.4, 0.4, 2], [0.6, 0.6, 1], [0, 0, 0]]))
    # D=2: visible unless a coordinate is negative (read before the clip to [0, 1], as Ultralytics derives it)
    d2 = parse_labels("0 0.5 0.5 0.4 0.4 0.4 0.4 -0.005 0.6 0 0\n", nc=1, kpt_shape=(3, 2))
    np.testing.assert_array_equal(d2.points, np.float32([[0.4, 0.4, 1], [0, 0.6, 0], [0, 0, 1]]))
    assert d2.point_offsets.tolist() == [0, 3] and not d2.problems
    empty = parse_labels("", nc=1, kpt_shape=(3, 2))
    assert empty.points.shape == (0, 3) and empty.point_offsets.tolist() == [0]


@pytest.mark.parametrize("row,kind", [
    ("0 0.5 0.5 0.4 0.4", "bad_keypoints"),  # a box row in a pose file
    ("0 0.5 0.5 0.4 0.4 0.4 0.4 2 0.6 0.6 1", "bad_keypoints"),  # two keypoints of three
    ("0 0.5 0.5 0.4 0.4 0.4 1.4 2 0.6 0.6 1 0 0 0", "out_of_range"),
    ("0 0.5 0.5 0.4 0.4 0.4 0.4 -1 0.6 0.6 1 0 0 0", "out_of_range"),  # a negative visibility
    ("0 0.5 0.5 0 0.4 0.4 0.4 2 0.6 0.6 1 0 0 0", "bad_size"),
])
def test_each_bad_pose_row_is_named_dropped_and_counted(row, kind):
    good = "0 0.5 0.5 0.4 0.4 0.4 0.4 2 0.6 0.6 1 0 0 0"
    res = parse_labels(f"{good}\n{row}\n", nc=1, path="k.txt", kpt_shape=(3, 3))
    assert [(p.kind, "line 2" in p.message) for p in res.problems] == [(kind, True)]
    assert res.rows_dropped == 1 and len(res.labels) == 1 and res.point_offsets.tolist() == [0, 3]
    if kind == "bad_keypoints":
        assert "kpt_shape [3, 3]" in res.problems[0].message


def test_duplicates_compare_the_points_too():
    a, b = "0 0.1 0.1 0.5 0.1 0.5 0.5", "0 0.1 0.1 0.5 0.5 0.5 0.1"  # the same box, other polygons
    res = parse_labels(f"{a}\n{b}\n{a}\n", nc=1)
    assert res.duplicates == 1 and len(res.labels) == 2 and res.point_offsets.tolist() == [0, 3, 6]


def _jpeg(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(path), np.full((32, 48, 3), 100, np.uint8))


LABEL_FILES = {  # name: (text, kpt_shape)
    "segment": ("0 0.1 0.2 0.5 0.2 0.3 0.6 0.2 0.4\n1 0.6 0.6 0.9 0.6 0.8 0.9\n", None),
    "obb": ("2 0.1 0.1 0.4 0.2 0.3 0.5 0.0 0.4\n", None),
    "mixed": ("0 0.2 0.3 0.6 0.7\n1 0.1 0.1 0.4 0.1 0.3 0.5\n", None),
    "pose2": ("0 0.5 0.5 0.4 0.4 0.4 0.4 -0.005 0.6 0 0\n", (3, 2)),
    "pose3": ("0 0.5 0.5 0.4 0.4 0.4 0.4 2 0.6 0.6 1 0 0 0\n", (3, 3)),
}


def _label_files(root: Path) -> dict[str, tuple[str, str]]:
    files = {}
    for name, (text, _) in LABEL_FILES.items():
        _jpeg(root / "images" / f"{name}.jpg")
        (root / "labels").mkdir(exist_ok=True)
        (root / "labels" / f"{name}.txt").write_text(text)
        files[name] = (str(root / "images" / f"{name}.jpg"), str(root / "labels" / f"{name}.txt"))
    return files


def test_ultralytics_reads_the_same_rows_points_and_visibility(tmp_path):
    """Ultralytics' own verify_image_label: the same boxes, polygons and keypoints (D=2 visibility derived); a file
    that mixes box and polygon rows it rejects whole (fastload reads it as YOLOv9 does, below)."""
    utils = pytest.importorskip("ultralytics.data.utils", reason="the Ultralytics reference is not installed")
    for name, (im, lb) in _label_files(tmp_path).items():
        text, kpt = LABEL_FILES[name]
        ours = parse_labels(text, nc=3, kpt_shape=kpt)
        theirs = utils.verify_image_label((im, lb, "", kpt is not None, 3, kpt[0] if kpt else 0, kpt[1] if kpt else 0,
                                           False))
        if name == "mixed":
            assert theirs[0] is None and "mix segment and detection rows" in theirs[-1]
            continue
        _, boxes, _, segments, keypoints = theirs[:5]
        np.testing.assert_allclose(ours.labels, boxes, atol=1e-6)
        if kpt is None:
            np.testing.assert_array_equal(ours.points, np.concatenate(segments))
            assert np.diff(ours.point_offsets).tolist() == [len(s) for s in segments]
        else:
            np.testing.assert_allclose(ours.points, keypoints.reshape(-1, 3), atol=0.0051)  # ours clipped within tol
            np.testing.assert_array_equal(ours.points[:, 2], keypoints.reshape(-1, 3)[:, 2])


def _upstream_functions(names: dict[str, str], namespace: dict) -> dict:
    """The top-level functions ``names`` ({name: file under the official checkout}) of the official YOLOv9 code,
    run as written from its own source in ``namespace`` (the image checks and the torch branch of its box helpers
    are not what is compared: importing its utils would start torch in a process of its own, tens of seconds)."""
    root = require_upstream()
    for name, rel in names.items():
        tree = ast.parse((root / rel).read_text())
        [node] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
        exec(compile(ast.Module([node], []), str(root / rel), "exec"), namespace)
    return namespace


def test_yolov9_reads_the_same_boxes_and_segments_mixed_rows_included(tmp_path):
    """The official ``utils/dataloaders.py verify_image_label``: a box row in a polygon file is a 2-point polygon."""
    from PIL import Image, ImageOps

    ns = _upstream_functions({"verify_image_label": "utils/dataloaders.py", "segments2boxes": "utils/general.py",
                              "xyxy2xywh": "utils/general.py"},
                             {"np": np, "os": __import__("os"), "Image": Image, "ImageOps": ImageOps,
                              "exif_size": lambda im: im.size, "IMG_FORMATS": ("jpg", "jpeg"),
                              "torch": SimpleNamespace(Tensor=type(None))})
    for name, (im, lb) in _label_files(tmp_path).items():
        text, kpt = LABEL_FILES[name]
        if kpt is not None:  # YOLOv9 has no pose labels
            continue
        _, boxes, _, segments, *_, msg = ns["verify_image_label"]((im, lb, ""))
        assert boxes is not None, msg
        ours = parse_labels(text, nc=3)
        np.testing.assert_allclose(ours.labels, boxes, atol=1e-6)
        np.testing.assert_array_equal(ours.points, np.concatenate(segments))


# ----------------------------------------------------------------------------- FlatLabels
def test_flat_labels_keep_rows_takes_the_points_along():
    rows = [np.array([[0, .5, .5, .2, .2], [1, .5, .5, .2, .2]], np.float32), np.zeros((0, 5), np.float32),
            np.array([[1, .1, .1, .1, .1]], np.float32)]
    pts = [np.arange(14, dtype=np.float32).reshape(7, 2), None, np.full((4, 2), 0.5, np.float32)]
    flat = FlatLabels.from_arrays(rows, pts, [np.array([0, 3, 7]), None, np.array([0, 4])])
    kept = flat.keep_rows(flat.rows[:, 0] == 1)  # the second row of image 0 and image 2's row
    assert kept.counts.tolist() == [1, 0, 1] and kept.point_offsets.tolist() == [0, 4, 8]
    np.testing.assert_array_equal(kept.image(0).points, pts[0][3:])
    np.testing.assert_array_equal(kept.image(2).points, pts[2])
    plain = FlatLabels.from_arrays(rows).keep_rows(np.array([True, False, False]))
    assert plain.counts.tolist() == [1, 0, 0] and plain.points is None
    with pytest.raises(ValueError, match="one flag per row"):
        flat.keep_rows(np.ones(2, bool))


def test_flat_labels_points_per_image_subset_and_concatenate():
    rows = [np.ones((2, 5), np.float32), np.zeros((0, 5), np.float32), np.full((1, 5), 2, np.float32)]
    pts = [np.arange(14, dtype=np.float32).reshape(7, 2), None, np.full((4, 2), 0.5, np.float32)]
    offs = [np.array([0, 3, 7]), None, np.array([0, 4])]
    flat = FlatLabels.from_arrays(rows, pts, offs)
    assert flat.points.shape == (11, 2) and flat.point_offsets.tolist() == [0, 3, 7, 11]
    assert not flat.points.flags.writeable and flat.point_counts.tolist() == [3, 4, 4]
    one = flat.image(0)
    np.testing.assert_array_equal(one.points, pts[0])
    assert one.point_offsets.tolist() == [0, 3, 7] and one.rows.shape == (2, 5)
    assert flat.image(1).points.shape == (0, 2) and flat.image(1).point_offsets.tolist() == [0]
    assert flat.image(-1).point_offsets.tolist() == [0, 4]
    sub = flat.subset(np.array([2, 0]))
    np.testing.assert_array_equal(sub.points, np.concatenate([pts[2], pts[0]]))
    assert sub.point_offsets.tolist() == [0, 4, 7, 11] and sub.counts.tolist() == [1, 2]
    again = FlatLabels.concatenate([flat.subset(np.array([0])), FlatLabels.from_arrays(rows[1:2]),
                                    flat.subset(np.array([2]))])
    np.testing.assert_array_equal(again.points, flat.points)
    np.testing.assert_array_equal(again.point_offsets, flat.point_offsets)
    plain = FlatLabels.from_arrays(rows)
    assert plain.points is None and plain.image(0).points is None and plain.subset(np.array([0])).points is None
    with pytest.raises(ValueError, match="both or neither"):
        FlatLabels(flat.rows, flat.offsets, flat.points)
    with pytest.raises(ValueError, match="point offsets"):
        FlatLabels(flat.rows, flat.offsets, flat.points, np.array([0, 3, 7, 12]))
    with pytest.raises(ValueError, match="different dimensions"):
        FlatLabels.from_arrays(rows[:2], [pts[0], np.zeros((0, 3), np.float32)], [offs[0], np.zeros(1, np.int64)])


# ----------------------------------------------------------------------------- data yaml
@pytest.mark.parametrize("extra,message", [
    ("kpt_shape: [17]\n", "'kpt_shape' must be \\[K, D\\]"),
    ("kpt_shape: [17, 4]\n", "'kpt_shape' must be"),
    ("kpt_shape: [3, 3]\nflip_idx: [0, 1]\n", "'flip_idx' must list each keypoint 0..2 once"),
    ("flip_idx: [0]\n", "'flip_idx' is given without 'kpt_shape'"),
])
def test_bad_kpt_shape_or_flip_idx_is_named_with_the_yaml(tmp_path, extra, message):
    (tmp_path / "images").mkdir()
    y = tmp_path / "data.yaml"
    y.write_text("train: images\nnames: [a]\n" + extra)
    with pytest.raises(DataConfigError, match=f"{y}: {message}"):
        load_data_config(y)


def test_kpt_shape_and_flip_idx_are_read(tmp_path):
    (tmp_path / "images").mkdir()
    y = tmp_path / "data.yaml"
    y.write_text("train: images\nnames: [a]\nkpt_shape: [3, 2]\nflip_idx: [0, 2, 1]\n")
    cfg = load_data_config(y)
    assert cfg.kpt_shape == (3, 2) and cfg.flip_idx == [0, 2, 1]


# ----------------------------------------------------------------------------- synth, index, stores, info, verify
@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("geometry")
    return {task: make_synthetic_dataset(root / task, n_train=6, n_val=0, seed=2, max_size=120, task=task)
            for task in ("segment", "pose", "obb")}


def test_synth_tasks_scan_clean_with_exact_geometry(synth):
    for task, y in synth.items():
        index = build_index(y, "train", cache=False, progress=False)
        assert not index.report.problems and index.report.rows_dropped == 0
        counts = index.labels.point_counts
        assert index.labels.points.shape[1] == (3 if task == "pose" else 2) and len(counts) == len(index.labels.rows)
        if task == "obb":
            assert (counts == 4).all()
        elif task == "pose":
            assert (counts == 5).all() and index.kpt_shape == (5, 3)
            assert load_data_config(y).flip_idx == [0, 2, 1, 4, 3]
            visible = index.labels.points[index.labels.points[:, 2] > 0]
            rows = np.repeat(index.labels.rows, counts, axis=0)[index.labels.points[:, 2] > 0]
            # every labelled keypoint lies in its box (within the 6 decimals the label file has)
            assert (np.abs(visible[:, :2] - rows[:, 1:3]) <= rows[:, 3:5] / 2 + 3e-6).all()
        else:
            assert (counts >= 3).all() and (counts > 4).any()


def test_the_index_cache_keeps_the_points(synth):
    first = build_index(synth["pose"], "train", progress=False)
    again = build_index(synth["pose"], "train", progress=False)
    assert again.report.cache_hit and not first.report.cache_hit
    np.testing.assert_array_equal(again.labels.points, first.labels.points)
    np.testing.assert_array_equal(again.labels.point_offsets, first.labels.point_offsets)
    assert again.kpt_shape == (5, 3)
    # the same files under another kpt_shape: the cache does not serve them, every row is read again (and refused)
    other = synth["pose"].with_name("other.yaml")
    other.write_text(synth["pose"].read_text().replace("kpt_shape:\n- 5\n- 3", "kpt_shape:\n- 5\n- 2"))
    wrong = build_index(other, "train", progress=False)
    assert not wrong.report.cache_hit and wrong.kpt_shape == (5, 2)
    assert wrong.report.rows_dropped == len(first.labels.rows) and set(wrong.report.by_kind()) == {"bad_keypoints"}


@pytest.fixture(scope="module")
def converted(synth, tmp_path_factory) -> Iterator[dict[str, Path]]:
    out = tmp_path_factory.mktemp("geometry-stores")
    with pytest.MonkeyPatch.context() as mp:  # the ram stores in a private shm root, removed after the module
        root = isolated_shm(mp, "geometry-stores")
        try:
            yield {task: convert(y, list(KINDS), out=out / task, imgsz=64, splits="train", **QUIET).yaml_path
                   for task, y in synth.items()}
        finally:
            shutil.rmtree(root, ignore_errors=True)


def test_every_store_kind_carries_the_points_bit_exactly(synth, converted):
    for task, y in converted.items():
        index = build_index(synth[task], "train", progress=False)
        for kind in KINDS:
            with open_store(y, "train", kind=kind, imgsz=64) as s:
                np.testing.assert_array_equal(s.labels.rows, index.labels.rows)
                assert s.labels.points.tobytes() == index.labels.points.tobytes(), (task, kind)
                np.testing.assert_array_equal(s.labels.point_offsets, index.labels.point_offsets)
                geometry = s.meta["geometry"]
                assert geometry["task"] == task and geometry["point_dim"] == (3 if task == "pose" else 2)
                assert geometry.get("kpt_shape") == ([5, 3] if task == "pose" else None)
                assert all(s.record_ok(i) for i in range(len(s)))
    assert all(r.ok for r in verify_target(converted["segment"]))


def test_a_changed_point_fails_the_checksum_and_verify(converted, tmp_path):
    import lmdb
    import msgpack

    y = load_data_config(converted["segment"])
    disk, enc, lm = (Path(y.stores["train"][k]) for k in ("disk", "encoded", "lmdb"))
    for src in (disk, enc):
        copy = tmp_path / src.name
        shutil.copytree(src, copy)
        points = np.load(copy / "points.npy")
        points[5, 1] += np.float32(1e-3)
        np.save(copy / "points.npy", points)
        [result] = verify_target(copy)
        assert not result.ok and [b[0] for b in result.bad] == [int(np.searchsorted(
            np.load(copy / "label_counts.npy").cumsum(), np.searchsorted(np.load(copy / "point_counts.npy").cumsum(),
                                                                          5, side="right"), side="right"))]
    copy = tmp_path / lm.name
    shutil.copytree(lm, copy)
    env = lmdb.open(str(copy), subdir=True)
    with env.begin(write=True) as txn:
        index = msgpack.unpackb(txn.get(b"__index__"), raw=False)
        points = np.frombuffer(index["points"], np.float32).copy()
        points[0] += np.float32(1e-3)
        index["points"] = points.tobytes()
        txn.put(b"__index__", msgpack.packb(index))
    env.close()
    [result] = verify_target(copy)
    assert not result.ok and [b[0] for b in result.bad] == [0]


def test_a_store_with_points_has_the_next_schema_and_refuses_a_newer_one(converted, tmp_path):
    y = load_data_config(converted["obb"])
    src = Path(y.stores["train"]["disk"])
    meta = json.loads((src / "meta.json").read_text())
    assert meta["schema"] == 3  # PACKED_SCHEMA 2, + 1: label points (a detection store stays at 2)
    newer = tmp_path / "newer.disk"
    shutil.copytree(src, newer)
    (newer / "meta.json").write_text(json.dumps({**meta, "schema": 4}))
    with pytest.raises(StoreError, match="newer fastload"):
        open_store(newer, kind="disk")


def test_info_counts_polygons_keypoints_and_obb_rows(synth, converted):
    for task in ("segment", "pose", "obb"):
        index = build_index(synth[task], "train", progress=False)
        counts = index.labels.point_counts
        store = load_data_config(converted[task]).stores["train"]["lmdb"]
        for info in (dataset_info(synth[task], ["train"]), dataset_info(store)):
            stats = next(iter(info["splits"].values()))
            text = format_info(info)
            if task == "pose":
                assert stats["keypoint_instances"] == len(counts) and stats["kpt_shape"] == [5, 3]
                assert "polygons" not in stats and f"keypoint instances {len(counts)}, kpt_shape [5, 3]" in text
            else:
                assert stats["polygons"] == len(counts) and stats["obb_shaped"] == int((counts == 4).sum())
                assert f"polygons (segments) {len(counts)}" in text
    detect = make_synthetic_dataset(Path(converted["obb"]).parent / "detect", n_train=2, n_val=0)
    plain = dataset_info(detect, ["train"])
    assert not {"polygons", "keypoint_instances"} & set(plain["splits"]["train"])


def test_the_loader_reads_stores_whose_labels_carry_points(converted):
    import fastload

    with fastload.loader(converted["segment"], imgsz=64, batch_size=2, workers=0, store="disk", augment=False) as dl:
        imgs, targets = next(iter(dl))[:2]
        assert imgs.shape[0] == 2 and targets.shape[1] == 6
        assert dl.dataset.labels.points is not None


def test_real_images_with_polygons_round_trip_every_kind(coco128_yaml, tmp_path, shm_root):
    """coco128's first images (real JPEGs, EXIF and all) with polygons made from their boxes: an octagon inscribed in
    each box, a diamond (4 corners, OBB-shaped) in every other one; every kind holds them bit-exactly."""
    root = coco128_yaml.parent
    images = sorted((root / "images" / "train2017").glob("*.jpg"))[:6]
    (tmp_path / "images").mkdir()
    (tmp_path / "labels").mkdir()
    angles = np.arange(8) * np.pi / 4
    for im in images:
        (tmp_path / "images" / im.name).symlink_to(im)
        label = root / "labels" / "train2017" / f"{im.stem}.txt"
        rows = np.loadtxt(label, ndmin=2) if label.is_file() else np.zeros((0, 5))
        lines = []
        for k, (c, xc, yc, w, h) in enumerate(rows):
            step = 2 if k % 2 else 1  # every other box: the diamond through 4 of the octagon's vertices
            xy = np.stack([xc + w / 2 * np.cos(angles[::step]), yc + h / 2 * np.sin(angles[::step])], 1).clip(0, 1)
            lines.append(f"{int(c)} " + " ".join(f"{v:.6f}" for v in xy.ravel()))
        (tmp_path / "labels" / f"{im.stem}.txt").write_text("\n".join(lines) + "\n")
    y = tmp_path / "data.yaml"
    y.write_text("path: .\ntrain: images\nnc: 80\n")
    index = build_index(y, "train", cache=False, progress=False)
    assert len(index) == len(images) and not index.report.rows_dropped
    assert {4, 8} == set(index.labels.point_counts.tolist())
    out = convert(y, list(KINDS), out=tmp_path / "stores", imgsz=64, **QUIET).yaml_path
    for kind in KINDS:
        with open_store(out, "train", kind=kind, imgsz=64) as s:
            assert s.labels.points.tobytes() == index.labels.points.tobytes(), kind
            np.testing.assert_array_equal(s.labels.point_offsets, index.labels.point_offsets)
            assert s.labels.rows.tobytes() == index.labels.rows.tobytes() and s.meta["geometry"]["task"] == "segment"
            assert all(s.record_ok(i) for i in range(len(s)))


def test_synth_cli_task_option(tmp_path, capsys):
    from fastload.cli import main
    from fastload.cli.synth_cmd import TASKS as CLI_TASKS
    from fastload.data.synthetic import TASKS

    assert CLI_TASKS == TASKS
    assert main(["synth", str(tmp_path / "p"), "--task", "pose", "--n-train", "2", "--n-val", "1", "--min-size", "32",
                 "--max-size", "64"]) == 0
    assert load_data_config(tmp_path / "p" / "data.yaml").kpt_shape == (5, 3)
    with pytest.raises(SystemExit):
        main(["synth", str(tmp_path / "x"), "--task", "classify"])
    assert "invalid choice: 'classify'" in capsys.readouterr().err


def test_min_items_and_single_cls_keep_the_points():
    from fastload.fastloader import _filter

    rows = [np.array([[3, 0.5, 0.5, 0.2, 0.2]], np.float32), np.zeros((0, 5), np.float32),
            np.array([[1, 0.5, 0.5, 0.2, 0.2], [2, 0.4, 0.4, 0.1, 0.1]], np.float32)]
    pts = [np.full((3, 2), 0.5, np.float32), None, np.arange(14, dtype=np.float32).reshape(7, 2) / 20]
    flat = FlatLabels.from_arrays(rows, pts, [np.array([0, 3]), None, np.array([0, 4, 7])])
    keep, out = _filter(flat, 1, True)
    assert keep.tolist() == [0, 2] and out.rows[:, 0].tolist() == [0, 0, 0]
    np.testing.assert_array_equal(out.points, np.concatenate([pts[0], pts[2]]))
    assert out.point_offsets.tolist() == [0, 3, 7, 10]
