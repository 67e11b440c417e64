"""Torch HSV / flip kernels vs the OpenCV (stock) path."""
from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch

from fastload.augment.functional.color import apply_hsv_reference
from fastload.augment.functional.torch_ops import apply_hsv_batch, hsv8_to_rgb, rgb_to_hsv8
from tests.augment_helpers import smooth_images

# one intra-op thread (conftest's one_torch_thread): the HSV kernels on a 512 x 512 image spin-wait with two threads
# on the busy 2-core CI machine
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _batch(n=6, size=192, seed=0):
    # A width that is a multiple of 64: OpenCV's 8-bit HSV->RGB truncates in its SIMD loop but rounds in the
    # scalar tail of each row (64-pixel blocks in OpenCV 5.1, 32 in 5.0), so at other widths the reference
    # itself mixes both and differs from itself by one level on the tail pixels.
    rng = np.random.default_rng(seed)
    imgs = [cv2.resize(im, (size, size)) for im in smooth_images(n - 1, size, seed)]
    imgs.append(rng.integers(0, 256, (size, size, 3)).astype(np.uint8))
    return np.stack(imgs)


def test_rgb_to_hsv_exact_and_back_within_one_level():
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (1, 512, 512, 3)).astype(np.uint8)
    h, s, v = rgb_to_hsv8(torch.from_numpy(rgb).permute(0, 3, 1, 2))
    want = cv2.cvtColor(rgb[0], cv2.COLOR_RGB2HSV)
    assert np.array_equal(torch.stack((h[0], s[0], v[0]), -1).numpy(), want)
    back = hsv8_to_rgb(h, s, v)[0].permute(1, 2, 0).numpy()
    d = np.abs(back.astype(int) - cv2.cvtColor(want, cv2.COLOR_HSV2RGB))
    assert d.max() <= 1 and (d > 0).mean() < 1e-3


def _check_batch(device: str, rule: str = "yolov9", hue: float = 0.015) -> None:
    imgs = _batch()
    rng = np.random.default_rng(1)
    gains = rng.uniform(-1, 1, (len(imgs), 3)) * [hue, 0.7, 0.4] + 1
    gains[2] = 1.0  # an untouched image
    ref = imgs.copy()
    for i in range(len(imgs)):
        apply_hsv_reference(ref[i], gains[i], rule)
    t = torch.from_numpy(imgs).permute(0, 3, 1, 2).contiguous().to(device)
    out = apply_hsv_batch(t, torch.from_numpy(gains).to(device), rule=rule, chunk=4).permute(0, 2, 3, 1).cpu().numpy()
    d = np.abs(out.astype(int) - ref)
    assert d.max() <= 1 and (d > 0).mean() < 1e-3, (d.max(), (d > 0).mean())
    assert np.array_equal(out[2], imgs[2])


def test_apply_hsv_batch_cpu():
    _check_batch("cpu")


def test_apply_hsv_batch_ultralytics_rule():
    """Ultralytics' added hue (wrapping both ways at hsv_h 0.5) equals the numpy tables within one level."""
    _check_batch("cpu", "ultralytics", hue=0.5)
    with pytest.raises(ValueError, match="HSV rule"):
        apply_hsv_batch(torch.zeros(1, 3, 4, 4, dtype=torch.uint8), torch.full((1, 3), 1.1), rule="other")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_apply_hsv_batch_cuda():
    _check_batch("cuda")
    _check_batch("cuda", "ultralytics", hue=0.5)


def test_apply_hsv_batch_errors():
    with pytest.raises(ValueError, match="uint8"):
        apply_hsv_batch(torch.zeros(2, 3, 4, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="rows"):
        apply_hsv_batch(torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.ones(3, 3))
