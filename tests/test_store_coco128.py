"""coco128 converted to lmdb, disk and ram: bytes/pixels/labels read back exactly; verify and info agree."""
from __future__ import annotations

import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest

from fastload.data.index import build_index
from fastload.store import open_store
from fastload.store.convert import convert
from fastload.store.info import dataset_info
from fastload.store.verify import verify_target
from store_helpers import isolated_shm


@pytest.fixture(scope="module")
def coco(coco128_yaml, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        shm_root = isolated_shm(mp, "coco")
        out = tmp_path_factory.mktemp("coco_stores")  # the dataset folder itself is read-only in CI
        result = convert(coco128_yaml, "lmdb,disk,ram", out=out, workers=2, progress=False, log=lambda s: None)
        index = build_index(coco128_yaml, "train", progress=False)
        yield result, index
        shutil.rmtree(shm_root, ignore_errors=True)


def independent_loaded(path: str, imgsz: int = 640) -> np.ndarray:
    """cv2.imread (EXIF applied) + YOLOv9's validation resize rule (truncated sizes, INTER_AREA when
    shrinking: what decoded stores hold), written out here without fastload helpers."""
    img = cv2.cvtColor(cv2.imread(path), cv2.COLOR_BGR2RGB)
    h0, w0 = img.shape[:2]
    r = imgsz / max(h0, w0)
    if r != 1:
        size = (int(w0 * r), int(h0 * r))
        img = cv2.resize(img, size, interpolation=cv2.INTER_LINEAR if r > 1 else cv2.INTER_AREA)
    return img


def test_all_splits_recorded_and_shared(coco):
    result, _ = coco
    assert set(result.stores) == {"train", "val"}
    # coco128's train and val are the same folder: one store each kind, recorded for both splits
    assert result.stores["train"] == result.stores["val"]
    assert result.yaml_path.is_file()


def test_lmdb_bytes_identical(coco):
    result, index = coco
    with open_store(result.yaml_path, "train", kind="lmdb") as store:
        assert len(store) == len(index) == 128
        assert store.im_files == index.im_files
        np.testing.assert_array_equal(store.shapes, index.shapes)
        for i in range(len(store)):
            assert store.read_image(i) == Path(index.im_files[i]).read_bytes()
            np.testing.assert_array_equal(store.labels[i], index.labels[i])


@pytest.mark.parametrize("kind", ["disk", "ram"])
def test_decoded_pixels_identical(coco, kind):
    result, index = coco
    with open_store(result.yaml_path, "val", kind=kind, imgsz=640) as store:
        assert store.kind == kind and store.decoded and store.imgsz == 640
        assert len(store) == 128
        for i in range(len(store)):
            np.testing.assert_array_equal(store.read_image(i), independent_loaded(index.im_files[i]))
            np.testing.assert_array_equal(store.labels[i], index.labels[i])
        np.testing.assert_array_equal(store.shapes, index.shapes)


def test_auto_prefers_ram_then_falls_back_by_imgsz(coco):
    result, _ = coco
    with open_store(result.yaml_path, "train") as store:
        assert store.kind == "ram"
    with open_store(result.yaml_path, "train", imgsz=320) as store:  # decoded stores are for 640
        assert store.kind == "lmdb"
        assert store.load(0, 320).shape[:2] == (
            int(store.shapes[0][0] * (320 / store.shapes[0].max())),
            int(store.shapes[0][1] * (320 / store.shapes[0].max())),
        )


def test_verify_passes(coco):
    result, _ = coco
    results = verify_target(result.yaml_path)
    assert len(results) == 3
    assert all(r.ok for r in results), [r.format() for r in results]


def test_info_counts(coco, coco128_yaml):
    info = dataset_info(coco128_yaml, ["train"])["splits"]["train"]
    assert info["images"] == 128
    assert info["backgrounds"] == 2 and info["without_label_file"] == 2
    assert info["labels_without_image"] == 2  # counted, not turned into samples
    result, _ = coco
    store = dataset_info(result.stores["train"]["lmdb"])["splits"]["store"]
    assert store["images"] == 128 and store["backgrounds"] == 2
    assert store["instances"] == info["instances"] and store["per_class"] == info["per_class"]
