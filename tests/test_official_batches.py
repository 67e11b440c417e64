"""Validation batches bit-identical to the official YOLOv9 loader's, on all of coco128.

The official ``utils.dataloaders`` (a temporary copy of ../shared/upstream/yolov9) runs in a subprocess
(tests/official_batches.py) and saves its batches with ``np.savez`` (no pickle); fastload's
``create_dataloader`` (what the official val.py gets after the README's switch) builds the same
loaders here. Images must be equal bit for bit (RGB), targets to 1e-6, ``shapes`` exactly. The
official loaded images of the *training* dataset (INTER_LINEAR shrink, truncated sizes) must equal
what fastload's CPU engine loads for training.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fastload.compat.yolov9 import create_dataloader
from official_batches import TRAIN_SIZES, VAL_CONFIGS
import preloaded
from official_helpers import coco_subset, copy_upstream, official_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def official(coco128_yaml, tmp_path_factory, preloaded_python):
    tmp = tmp_path_factory.mktemp("official_batches")
    checkout = copy_upstream(tmp / "yolov9")
    data = coco_subset(Path(coco128_yaml).parent, tmp / "coco128", 128)
    images = str(data.parent / "images")
    out = tmp / "dump"
    out.mkdir()
    proc = preloaded.run(preloaded_python, [str(Path(__file__).with_name("official_batches.py")), str(checkout), images,
                                            str(out)], tmp, official_env(tmp), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return images, out


@pytest.mark.parametrize("name", list(VAL_CONFIGS))
def test_validation_batches_identical_to_official(official, name):
    images, out = official
    imgsz, batch, rect, pad = VAL_CONFIGS[name]
    want = np.load(out / f"val_{name}.npz", allow_pickle=False)
    want_paths = json.loads((out / f"val_{name}.json").read_text())
    loader = create_dataloader(images, imgsz, batch, 32, False, pad=pad, rect=rect, workers=2, prefix="")[0]
    try:
        got = [(im.numpy().copy(), t.numpy().copy(), list(p), s) for im, t, p, s in loader]
    finally:
        loader.close()
    assert len(got) == len(want_paths)
    differing = []
    for k, (imgs, targets, paths, shapes) in enumerate(got):
        assert paths == want_paths[k], f"batch {k}: other images or order"
        ref = want[f"imgs_{k}"]
        assert imgs.shape == ref.shape, f"batch {k}: shape {imgs.shape} vs official {ref.shape}"
        differing += [paths[i] for i in range(len(paths)) if not np.array_equal(imgs[i], ref[i])]
        np.testing.assert_allclose(targets, want[f"targets_{k}"], rtol=0, atol=1e-6)
        flat = np.array([[*s[0], *s[1][0], *s[1][1]] for s in shapes], np.float64)
        np.testing.assert_array_equal(flat, want[f"shapes_{k}"], err_msg=f"batch {k}: shapes")
    assert not differing, f"{len(differing)} images differ from the official loader's: {differing[:5]}"


@pytest.mark.parametrize("imgsz", TRAIN_SIZES)
def test_training_loaded_images_identical_to_official(official, imgsz):
    """Training shrinks with INTER_LINEAR (validation: INTER_AREA) to int(w0 * r) x int(h0 * r)."""
    images, out = official
    want = np.load(out / f"loaded_{imgsz}.npz", allow_pickle=False)
    want_files = json.loads((out / f"loaded_{imgsz}.json").read_text())
    loader, dataset = create_dataloader(images, imgsz, 16, 32, hyp=None, augment=True, workers=0, shuffle=True)
    try:
        index = {f: i for i, f in enumerate(dataset.im_files)}
        assert sorted(index) == sorted(want_files)
        renderer = loader.engine.renderer  # what the CPU engine draws its tiles from
        for k, f in enumerate(want_files):
            ref = want[f"img_{k}"]
            img = renderer.get_image(index[f])
            assert img.shape == ref.shape, f"{f}: loaded {img.shape[:2]}, official {ref.shape[:2]}"
            assert np.array_equal(img, ref), f"{f}: pixels differ (mean {np.abs(img.astype(int) - ref).mean():.3f})"
    finally:
        loader.close()
