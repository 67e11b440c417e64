"""Torch twins of the pixel kernels, batched, on any device (the GPU in training).

:func:`apply_hsv_batch` reproduces YOLOv9 ``augment_hsv`` (OpenCV 8-bit HSV, per-channel tables,
HSV->RGB) for a batch of CHW uint8 images with per-image gains:

* RGB -> HSV uses OpenCV's own fixed-point formulation of the 8-bit conversion (12-bit division
  tables), in int32, so H, S and V equal ``cv2.cvtColor(..., COLOR_RGB2HSV)`` exactly;
* the tables are computed in float64 exactly as YOLOv9 does (or, with ``rule="ultralytics"``, as
  Ultralytics' additive hue: :func:`fastload.augment.functional.color.hsv_luts`) and applied with ``gather``;
* HSV -> RGB follows OpenCV's float32 formula (sector table, S and V scaled by 1/255, result
  times 255 *truncated*, as OpenCV's 8-bit path does); over all 180*256*256 HSV triples it
  differs from ``cv2.cvtColor(..., COLOR_HSV2RGB)`` by one grey level on 5e-5 of them (float
  operation order), never more. (OpenCV's scalar tail of each row -- the last ``width mod 64``
  pixels in OpenCV 5.1, ``mod 32`` in 5.0 -- rounds instead of truncating, so there stock itself
  is one level off its own SIMD result; 640-wide images have no tail.)

Images are processed in chunks of ``chunk`` images to bound the int32 / float32 temporaries.
"""
from __future__ import annotations

import torch

from fastload.augment.params import Recipe

__all__ = ["apply_hsv_batch", "rgb_to_hsv8", "hsv8_to_rgb"]

_SHIFT = 12
# OpenCV: sdiv[i] = round((255 << 12) / i), hdiv[i] = round((180 << 12) / (6 i)); entry 0 is 0.
_I = torch.arange(256, dtype=torch.float64)
_SDIV = torch.where(_I > 0, torch.round((255 << _SHIFT) / _I.clamp(min=1)), torch.zeros(())).to(torch.int32)
_HDIV = torch.where(_I > 0, torch.round((180 << _SHIFT) / (6 * _I.clamp(min=1))), torch.zeros(())).to(torch.int32)
# OpenCV HSV2RGB sector table: which of (v, v(1-s), v(1-s f), v(1-s(1-f))) each of r, g, b takes.
_R_IDX = (0, 2, 1, 1, 3, 0)
_G_IDX = (3, 0, 0, 2, 1, 1)
_B_IDX = (1, 1, 3, 0, 0, 2)


def rgb_to_hsv8(rgb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 [B, 3, H, W] RGB -> int32 H (0..179), S, V (0..255) as OpenCV ``COLOR_RGB2HSV``."""
    x = rgb.to(torch.int32)
    r, g, b = x[:, 0], x[:, 1], x[:, 2]
    v = torch.maximum(torch.maximum(r, g), b)
    vmin = torch.minimum(torch.minimum(r, g), b)
    diff = v - vmin
    sdiv, hdiv = _SDIV.to(rgb.device), _HDIV.to(rgb.device)
    half = 1 << (_SHIFT - 1)
    s = (diff * sdiv[v.long()] + half) >> _SHIFT
    vr, vg = v == r, v == g
    h = torch.where(vr, g - b, torch.where(vg, b - r + 2 * diff, r - g + 4 * diff))
    h = (h * hdiv[diff.long()] + half) >> _SHIFT
    h = torch.where(h < 0, h + 180, h)
    return h, s, v


def hsv8_to_rgb(h: torch.Tensor, s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """OpenCV 8-bit HSV (H in [0, 180)) -> uint8 [B, 3, H, W] RGB (OpenCV's float formula)."""
    hf = h.to(torch.float32) * (6.0 / 180.0)
    hf = torch.where(hf >= 6, hf - 6, hf)
    sf = s.to(torch.float32) * (1.0 / 255.0)
    vf = v.to(torch.float32) * (1.0 / 255.0)
    sector = torch.floor(hf)
    f = hf - sector
    sector = sector.to(torch.int64).clamp_(0, 5)
    tab = torch.stack((vf, vf * (1 - sf), vf * (1 - sf * f), vf * (1 - sf * (1 - f))), dim=1)  # [B, 4, H, W]
    dev = h.device
    idx = torch.stack(
        [torch.tensor(t, device=dev)[sector] for t in (_R_IDX, _G_IDX, _B_IDX)], dim=1
    )  # [B, 3, H, W] indices into tab
    out = torch.gather(tab, 1, idx)
    grey = (s == 0).unsqueeze(1)
    out = torch.where(grey, vf.unsqueeze(1).expand_as(out), out)
    return torch.trunc(out * 255).clamp_(0, 255).to(torch.uint8)


def _tables(gains: torch.Tensor, rule: Recipe = "yolov9") -> torch.Tensor:
    """int64 [B, 3, 256] tables of ``rule`` (hue mod 180, S/V clipped), computed in float64."""
    x = torch.arange(256, dtype=torch.float64, device=gains.device)
    g = gains.to(torch.float64)[:, :, None]
    t = x * g
    if rule == "ultralytics":  # floor, then mod: the same level as numpy's mod, then truncation
        hue = torch.remainder(torch.floor(x + (g[:, 0] - 1.0) * 180), 180)
    elif rule == "yolov9":
        hue = torch.remainder(torch.floor(t[:, 0]), 180)
    else:
        raise ValueError(f"HSV rule must be 'yolov9' or 'ultralytics', got {rule!r}")
    sv = torch.floor(t[:, 1:].clamp(0, 255))
    if rule == "ultralytics":
        sv[:, 0, 0] = 0  # saturation 0 stays 0 (a grey pixel stays grey)
    return torch.cat((hue[:, None], sv), dim=1).to(torch.int64)


def apply_hsv_batch(imgs: torch.Tensor, gains: torch.Tensor, *, rule: Recipe = "yolov9", chunk: int = 16) -> torch.Tensor:
    """YOLOv9 HSV gains (or ``rule``'s tables) on uint8 [B, 3, H, W] RGB images (any device); returns a new tensor.

    Args:
        imgs: uint8 [B, 3, H, W] RGB.
        gains: float [B, 3] ``(gh, gs, gv)`` per image (rows of exactly 1 are left untouched). Pass them on the
            host, as the parameter records hold them: choosing the images to touch then needs no device sync.
        rule: the records' ``hsv_rule`` (``"yolov9"``: multiplied hue; ``"ultralytics"``: added hue).
        chunk: images per step (bounds the temporaries: about 60 bytes per pixel).
    """
    if imgs.dtype != torch.uint8 or imgs.dim() != 4 or imgs.shape[1] != 3:
        raise ValueError(f"imgs must be uint8 [B, 3, H, W], got {imgs.dtype} {tuple(imgs.shape)}")
    host_gains = torch.as_tensor(gains, dtype=torch.float64).reshape(-1, 3).cpu()
    if host_gains.shape[0] != imgs.shape[0]:
        raise ValueError(f"gains has {host_gains.shape[0]} rows for {imgs.shape[0]} images")
    out = imgs.clone()
    active_host = torch.nonzero((host_gains != 1).any(dim=1)).flatten()
    if active_host.numel() == 0:
        return out
    active = active_host.to(imgs.device, non_blocking=True)
    tables = _tables(host_gains[active_host], rule).to(imgs.device, non_blocking=True)
    for k in range(0, active.numel(), chunk):
        sel = active[k : k + chunk]
        tab = tables[k : k + chunk]
        h, s, v = rgb_to_hsv8(imgs[sel])
        n = h.shape[0]
        flat = lambda a: a.reshape(n, -1).long()  # noqa: E731 - local reshaping helper
        h2 = torch.gather(tab[:, 0], 1, flat(h)).view_as(h)
        s2 = torch.gather(tab[:, 1], 1, flat(s)).view_as(s)
        v2 = torch.gather(tab[:, 2], 1, flat(v)).view_as(v)
        out[sel] = hsv8_to_rgb(h2, s2, v2)
    return out

