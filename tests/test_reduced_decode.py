"""``CPUOptions(decode_scale="reduced")``: JPEGs at least twice ``imgsz`` decoded at a reduced DCT scale, then resized
to the same loaded shape. Pixels stay close to the full decode, boxes and shapes do not change, and
images below twice ``imgsz`` are untouched."""
from __future__ import annotations

import numpy as np
import pytest

from fastload.engines.cpu import CPUOptions
from fastload.fastloader import loader
from fastload.store.factory import open_store


def _loaded_pairs(yaml_path, imgsz):
    with open_store(yaml_path, "train", kind="files", imgsz=imgsz) as store:
        for i in range(len(store)):
            yield store.im_files[i], store.load(i, imgsz), store.load(i, imgsz, reduced=True)


def test_half_scale_decode_close_to_full_decode(coco128_yaml):
    """coco128's 640-px photographs at imgsz 320 take the 1/2-scale DCT path."""
    means = []
    for path, full, red in _loaded_pairs(coco128_yaml, 320):
        assert red.shape == full.shape and red.dtype == np.uint8, path
        means.append(np.abs(full.astype(np.int16) - red).mean())
    means = np.array(means)
    assert (means > 0).sum() >= 100, "the reduced path was not taken"
    # measured: mean 1.25 grey levels; the worst image (dense texture) 11.3, where an odd original
    # size leaves the reduced image one row/column longer and its resize drifts by <= 0.5 px
    assert means.mean() <= 2.0, means.mean()
    assert means.max() <= 15.0, means.max()


def test_images_below_twice_imgsz_are_untouched(coco128_yaml):
    for path, full, red in _loaded_pairs(coco128_yaml, 640):
        assert np.array_equal(full, red), path


def test_loader_batches_keep_boxes_and_shapes(coco128_yaml):
    kw = dict(imgsz=320, batch_size=16, workers=0, store="files", seed=3)
    with loader(coco128_yaml, engine_options=CPUOptions(decode_cache_mb=0), **kw) as a, \
            loader(coco128_yaml, engine_options=CPUOptions(decode_cache_mb=0, decode_scale="reduced"), **kw) as b:
        for k, (ba, bb) in enumerate(zip(a, b)):
            assert ba.paths == bb.paths and ba.shapes == bb.shapes
            assert np.array_equal(ba.targets.numpy(), bb.targets.numpy())  # boxes do not depend on pixels
            diff = np.abs(ba.imgs.numpy().astype(np.int16) - bb.imgs.numpy()).mean()
            assert 0 < diff <= 3.0, diff  # measured 0.56-0.74 (mosaics mix the loaded images, scaled)
            if k == 2:
                break


def test_reduced_decode_is_a_cpu_engine_option(synth_yaml):
    with pytest.raises(ValueError, match="engine 'gpu' takes TorchGPUOptions options"):
        loader(synth_yaml, imgsz=64, batch_size=4, engine="gpu", engine_options=CPUOptions(decode_scale="reduced"))
