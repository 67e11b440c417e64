"""Torch twins of :mod:`fastload.data.images` for images on a device: decode and the loaded resize.

* :func:`decode_on_device`: encoded bytes -> RGB CHW uint8 tensors on ``device`` (EXIF
  orientation applied, JPEGs batched through ``torchvision.io.decode_jpeg``: nvJPEG on CUDA, libjpeg
  on CPU; non-JPEG and undecodable-on-device images fall back to the CPU decoder, whose errors name
  the file), optionally resized to their loaded shape;
* :func:`resize_loaded`: the YOLOv9 loaded resize (:func:`fastload.data.images.resize_to`) on a
  tensor, with OpenCV's weights (:func:`resize_weights`).

Used by the GPU-resident store (:mod:`fastload.store.gpu`) and the PyTorch engine.
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import Sequence

import numpy as np
import torch

from fastload.data.images import SHRINK_FILTERS, CorruptImageError, ShrinkFilter, decode_image, jpeg_is_complete, probe_header

__all__ = ["decode_on_device", "resize_loaded", "resize_weights"]

_EXACT = 1e-9
_RESIZE_COEF = 2048.0  # OpenCV INTER_RESIZE_COEF_SCALE: cv2.resize's 11-bit bilinear weights


# ------------------------------------------------------------------------------------------- resize
@functools.lru_cache(maxsize=4096)
def _weights(n_in: int, n_out: int, area: bool) -> np.ndarray:
    w = np.zeros((n_out, n_in), np.float64)
    s = n_in / n_out
    if n_in == n_out:
        np.fill_diagonal(w, 1.0)
    elif area and n_out < n_in:
        # INTER_AREA shrink: output i averages the input cells [i*s, (i+1)*s), weighted by overlap
        for i in range(n_out):
            a, b = i * s, (i + 1) * s
            for j in range(int(math.floor(a)), min(int(math.ceil(b - _EXACT)), n_in)):
                w[i, j] = (min(b, j + 1) - max(a, j)) / s
    else:
        # INTER_LINEAR: sample (i + 0.5) * s - 0.5, clamped to the borders, 11-bit weights
        for i in range(n_out):
            f = (i + 0.5) * s - 0.5
            j = int(math.floor(f))
            f -= j
            if j < 0:
                j, f = 0, 0.0
            if j >= n_in - 1:
                j, f = n_in - 1, 0.0
            w0 = round((1.0 - f) * _RESIZE_COEF) / _RESIZE_COEF
            w[i, j] += w0
            w[i, min(j + 1, n_in - 1)] += 1.0 - w0
    w.setflags(write=False)
    return w


def resize_weights(n_in: int, n_out: int, *, area: bool) -> np.ndarray:
    """``float64 [n_out, n_in]`` 1-D resampling matrix equal to OpenCV's ``cv2.resize`` weights.

    ``area=True``: ``INTER_AREA`` box-overlap weights when shrinking; otherwise (and when
    enlarging) ``INTER_LINEAR`` with OpenCV's 11-bit weights. Equal sizes give the identity.
    """
    if n_in < 1 or n_out < 1:
        raise ValueError(f"resize sizes must be >= 1, got {n_in} -> {n_out}")
    return _weights(int(n_in), int(n_out), bool(area))


def resize_loaded(img: torch.Tensor, hw: Sequence[int], *, shrink: ShrinkFilter = "area") -> torch.Tensor:
    """Resize a CHW uint8 tensor to ``hw`` as :meth:`fastload.store.base.Store.load` does with OpenCV.

    INTER_LINEAR when the image grows; when it shrinks INTER_AREA (``shrink="area"``, YOLOv9
    validation) or INTER_LINEAR (``"linear"``, YOLOv9 training); ``img`` itself when the size
    already matches. Two float32 matrix products with separable weights, then rounding: equal to
    OpenCV up to 1 grey level (its fixed-point rounding).
    """
    h, w = int(hw[0]), int(hw[1])
    h0, w0 = int(img.shape[-2]), int(img.shape[-1])
    if (h0, w0) == (h, w):
        return img
    if shrink not in SHRINK_FILTERS:
        raise ValueError(f"shrink must be one of {', '.join(SHRINK_FILTERS)}, got {shrink!r}")
    area = shrink == "area" and h * w <= h0 * w0  # as fastload.data.images.resize_to
    dev = img.device
    wy = torch.from_numpy(resize_weights(h0, h, area=area).astype(np.float32)).to(dev, non_blocking=True)
    wx = torch.from_numpy(resize_weights(w0, w, area=area).astype(np.float32)).to(dev, non_blocking=True)
    f = img.to(torch.float32)
    # contract the axis that shrinks most first: the second product is then the smaller one
    if h0 * w <= w0 * h:
        out = torch.matmul(wy, torch.matmul(f, wx.T))
    else:
        out = torch.matmul(torch.matmul(wy, f), wx.T)
    return out.add_(0.5).floor_().clamp_(0, 255).to(torch.uint8)


# ------------------------------------------------------------------------------------------- decode
def _orient(img: torch.Tensor, orientation: int) -> torch.Tensor:
    """EXIF orientation on a CHW tensor (same cases as :func:`fastload.data.images.apply_orientation`)."""
    if orientation == 2:
        return img.flip(-1)
    if orientation == 3:
        return img.flip(-1).flip(-2)
    if orientation == 4:
        return img.flip(-2)
    if orientation == 5:
        return img.transpose(-1, -2)
    if orientation == 6:
        return torch.rot90(img, -1, (-2, -1))
    if orientation == 7:
        return img.transpose(-1, -2).flip(-1).flip(-2)
    if orientation == 8:
        return torch.rot90(img, 1, (-2, -1))
    return img


def _cpu_decode(buf: bytes, path: str | None) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(decode_image(buf, path))).permute(2, 0, 1)


def _jpeg_batch(bufs: list[bytes], device: torch.device) -> list[torch.Tensor] | None:
    """One batched ``decode_jpeg`` call (nvJPEG on CUDA); None when it fails (caller decodes one by one)."""
    # torchvision loads its model zoo and torch._dynamo when first imported (1-2 s of CPU): imported here, only a
    # device decode pays that, not every process that imports fastload's loader (DDP ranks, workers, the CLI)
    from torchvision.io import ImageReadMode, decode_jpeg

    data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in bufs]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torchvision >= 0.29 marks its decoders deprecated
            out = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:
        return None
    return list(out)


def decode_on_device(
    bufs: Sequence[bytes],
    paths: Sequence[str | None],
    loaded_hw: Sequence[Sequence[int]] | None,
    device: torch.device | str,
    *,
    shrink: ShrinkFilter = "area",
) -> list[torch.Tensor]:
    """Decode encoded images to RGB CHW uint8 tensors on ``device`` (EXIF orientation applied).

    Args:
        bufs: encoded file bytes.
        paths: the file of every buffer (named in errors).
        loaded_hw: resize each image to this ``(h, w)`` (its loaded shape) with :func:`resize_loaded`;
            None keeps the decoded size.
        device: where the images go; JPEGs are decoded there (nvJPEG on CUDA), other formats on the
            CPU and uploaded.
        shrink: the filter when an image shrinks, ``"area"`` or ``"linear"`` (see :func:`resize_loaded`).

    Raises :class:`fastload.data.images.CorruptImageError` naming the file of an undecodable image.
    """
    device = torch.device(device)
    out: list[torch.Tensor | None] = [None] * len(bufs)
    jpeg_k: list[int] = []
    orient: dict[int, int] = {}
    for k, buf in enumerate(bufs):
        fmt, _, _, orientation = probe_header(buf, paths[k])
        if fmt == "jpeg":
            if not jpeg_is_complete(buf):
                raise CorruptImageError(paths[k], "truncated JPEG (no end-of-image marker after the last scan)")
            jpeg_k.append(k)
            orient[k] = orientation
        else:
            out[k] = _cpu_decode(bytes(buf), paths[k]).to(device, non_blocking=True)
    if jpeg_k:
        decoded = _jpeg_batch([bytes(bufs[k]) for k in jpeg_k], device)
        for j, k in enumerate(jpeg_k):
            img = decoded[j] if decoded is not None else None
            if img is None:  # the batch failed: find the culprit (CMYK, damaged...) one by one
                one = _jpeg_batch([bytes(bufs[k])], device)
                img = one[0] if one is not None else _cpu_decode(bytes(bufs[k]), paths[k]).to(device)
            out[k] = _orient(img, orient[k])
    result = []
    for k, img in enumerate(out):
        assert img is not None
        if loaded_hw is not None:
            img = resize_loaded(img, loaded_hw[k], shrink=shrink)
        result.append(img)
    return result
