"""YOLOv9 HSV augmentation on RGB uint8 images (in place).

YOLOv9 ``augment_hsv``: convert to OpenCV's 8-bit HSV (H in [0, 180), S, V in [0, 255]), map
each channel through a table ``H' = floor(H * gh) mod 180``, ``S' = floor(clip(S * gs))``,
``V' = floor(clip(V * gv))`` and convert back.  :func:`apply_hsv_reference` is that algorithm
literally (split, three ``cv2.LUT``, merge: the stock cost).

:func:`apply_hsv` gives **bit-identical** output faster by replacing split + 3 LUT + merge with
one pass over the interleaved HSV image (in a reused scratch buffer), whichever is faster on the
installed OpenCV (:data:`TRANSFORM_MIDDLE`):

* OpenCV >= 5: one ``cv2.transform`` (a per-channel gain and offset): ``round(x * g - 0.5 + d)``
  equals ``floor(x * g)`` for all 256 inputs when the small offset ``d`` is chosen right, which is
  checked on a 256-value ramp for every gain triple (a few microseconds; the rare triple that no
  offset makes exact uses the tables).  A linear map cannot wrap the hue, and OpenCV's HSV->RGB
  conversion of ``180 + k`` is not exactly that of ``k`` (one level apart for about 1 % of S, V
  pairs), so the wrap is done exactly on the pixels that need it: levels that would go below 0 are
  raised by 180 first, levels that reach 180 are lowered by 180 after (one threshold over the
  interleaved bytes, their S and V bytes masked off, one add).  A 3-channel ``cv2.LUT`` costs about
  four ``cv2.transform`` here.
* OpenCV 4: one 3-channel ``cv2.LUT`` with the three tables (exactly the stock mapping).

Every function takes the record's ``rule`` (:attr:`fastload.augment.params.SampleParams.hsv_rule`):
``"yolov9"`` as above, or ``"ultralytics"``: Ultralytics 8.4's tables, an additive hue
``H' = floor(H + 180 (gh - 1)) mod 180`` and saturation level 0 kept at 0 (S and V as YOLOv9's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import cv2
import numpy as np

from fastload.augment.functional.scratch import scratch
from fastload.augment.params import Rect, Recipe

__all__ = ["apply_hsv", "apply_hsv_in_box", "apply_hsv_reference", "hsv_luts"]

# Every level each channel can hold, several times over (2 x 512 pixels: SIMD body and tail):
# hue cycles through 0..179 (OpenCV never produces H >= 180), saturation and value through 0..255.
_RAMP = np.stack([np.arange(1024) % 180, np.arange(1024) % 256, np.arange(1024) % 256], -1).reshape(2, 512, 3).astype(np.uint8)
_OFFSETS = (2e-5, 1e-4, 5e-6, 1e-3)  # tried in order; see the module docstring

#: The middle step of :func:`apply_hsv`: ``cv2.transform`` (True) or one 3-channel ``cv2.LUT``,
#: whichever is cheaper on the installed OpenCV major version (the transform from OpenCV 5; the HSV
#: row of ``benchmarks/augment_kernels.py`` times the whole step against the stock split/LUT/merge).
TRANSFORM_MIDDLE: bool = int(cv2.__version__.split(".")[0]) >= 5


def _is_identity(gains: Sequence[float]) -> bool:
    return all(float(g) == 1.0 for g in gains)


def hsv_luts(gains: Sequence[float], rule: Recipe = "yolov9") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The three uint8 tables of ``rule`` for ``(gh, gs, gv)`` (hue wrapped mod 180)."""
    r = np.asarray(gains, dtype=np.float64)
    x = np.arange(0, 256, dtype=np.float64)
    if rule == "ultralytics":
        lut_h = ((x + (r[0] - 1.0) * 180) % 180).astype(np.uint8)
    elif rule == "yolov9":
        lut_h = ((x * r[0]) % 180).astype(np.uint8)
    else:
        raise ValueError(f"HSV rule must be 'yolov9' or 'ultralytics', got {rule!r}")
    lut_s = np.clip(x * r[1], 0, 255).astype(np.uint8)
    lut_v = np.clip(x * r[2], 0, 255).astype(np.uint8)
    if rule == "ultralytics":
        lut_s[0] = 0  # a grey pixel stays grey whatever the saturation gain
    return lut_h, lut_s, lut_v


def apply_hsv_reference(img: np.ndarray, gains: Sequence[float], rule: Recipe = "yolov9") -> np.ndarray:
    """YOLOv9 ``augment_hsv`` (or ``rule``'s tables) with given gains, on an RGB uint8 HWC image, in place
    (stock path)."""
    if _is_identity(gains):
        return img
    lut_h, lut_s, lut_v = hsv_luts(gains, rule)
    h, s, v = cv2.split(cv2.cvtColor(img, cv2.COLOR_RGB2HSV))
    hsv = cv2.merge((cv2.LUT(h, lut_h), cv2.LUT(s, lut_s), cv2.LUT(v, lut_v)))
    cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB, dst=img)
    return img


@dataclass(frozen=True)
class _HueTransform:
    """The middle step as ``cv2.transform`` (see the module docstring): hue levels below ``lift_below``
    raised by 180 first, then ``matrix``, then levels of 180 and above lowered by 180 when ``may_reach_180``."""

    matrix: np.ndarray  # float64 3x4
    lift_below: int
    may_reach_180: bool


def _exact_transform(gains: Sequence[float], rule: Recipe) -> _HueTransform | None:
    """A :class:`_HueTransform` reproducing ``rule``'s three tables exactly, or None."""
    g = np.array([float(v) for v in gains])
    lut_h, lut_s, lut_v = hsv_luts(gains, rule)
    m = np.zeros((3, 4), np.float64)
    m[1, 1], m[2, 2] = g[1], g[2]
    if rule == "ultralytics":  # an added hue: a whole number of levels k, |k| < 180
        k = int(lut_h[0]) if lut_h[0] < 90 else int(lut_h[0]) - 180
        if not np.array_equal(lut_h[:180], (np.arange(180) + k) % 180):
            return None
        if abs(k) > 76:
            return None  # 179 + |k| would not fit a byte before its wrap (|hsv_h| > ~0.4): use the tables
        m[0, 0], hue_offset, lift = 1.0, float(k), max(-k, 0)
    else:  # floor(H * gh), up to 179 gh
        if g[0] < 0 or 179 * g[0] >= 256:
            return None  # hue would need more than one wrap (|hsv_h| > ~0.4): use the tables
        m[0, 0], hue_offset, lift = g[0], 0.0, 0
    candidate = _HueTransform(m, lift, int(max(179 * m[0, 0] + hue_offset, 0)) >= 180)
    want = cv2.LUT(_RAMP, np.stack((lut_h, lut_s, lut_v), -1).reshape(1, 256, 3))
    for d in _OFFSETS:
        m[:, 3] = -0.5 + d
        m[0, 3] += hue_offset
        if np.array_equal(_transform_middle(_RAMP.copy(), candidate), want):
            return candidate
    return None


def _transform_middle(hsv: np.ndarray, t: _HueTransform) -> np.ndarray:
    """``t`` applied to a contiguous HSV image in place (see :class:`_HueTransform`)."""
    if t.lift_below:
        _move_hue(hsv, cv2.THRESH_BINARY_INV, t.lift_below - 1, up=True)
    cv2.transform(hsv, t.matrix, dst=hsv)
    if t.may_reach_180:
        _move_hue(hsv, cv2.THRESH_BINARY, 179, up=False)
    return hsv


def _move_hue(hsv: np.ndarray, kind: int, level: int, *, up: bool) -> None:
    """The hue of the pixels whose hue is above ``level`` (``THRESH_BINARY``) or at most ``level``
    (``THRESH_BINARY_INV``) raised (``up``) or lowered by 180, in a contiguous HSV image, in place.

    One threshold over every byte of the interleaved image, its saturation and value bytes then masked off, and
    one add: half the cost of extracting the hue plane, thresholding it and a masked add.
    """
    if not hsv.flags.c_contiguous:
        raise ValueError("the hue is moved in a contiguous HSV image only (a reshaped copy would be lost)")
    flat = hsv.reshape(1, -1)
    step = cv2.threshold(flat, level, 180, kind, dst=scratch("hue_step", flat.shape))[1]
    cv2.bitwise_and(step, _hue_bytes(flat.shape[1]), dst=step)
    (cv2.add if up else cv2.subtract)(flat, step, dst=flat)


_HUE_BYTES = np.zeros(0, np.uint8)


def _hue_bytes(n: int) -> np.ndarray:
    """``[1, n]`` uint8: 255 at every hue byte of an interleaved HSV image (each third byte from the first), 0
    elsewhere; one growing read-only array, its prefixes shared by every image size."""
    global _HUE_BYTES
    if _HUE_BYTES.size < n:
        grown = np.zeros(max(n, 2 * _HUE_BYTES.size), np.uint8)
        grown[0::3] = 255
        _HUE_BYTES = grown
    return _HUE_BYTES[:n].reshape(1, n)


def apply_hsv(img: np.ndarray, gains: Sequence[float], rule: Recipe = "yolov9") -> np.ndarray:
    """HSV gains (``rule``'s tables) on an RGB uint8 HWC image, in place; bit-identical to
    :func:`apply_hsv_reference` and faster (see the module docstring).

    The HSV image lives in a reused scratch buffer (a fresh 1.2 MB array per call costs page faults).
    """
    if _is_identity(gains):
        return img
    return _apply_hsv_middle(img, _hsv_middle(gains, rule))


def _hsv_middle(gains: Sequence[float], rule: Recipe = "yolov9") -> _HueTransform | np.ndarray:
    """The middle step for ``gains``: an exact :class:`_HueTransform` (OpenCV >= 5) or the three tables as
    one uint8 ``[1, 256, 3]`` ``cv2.LUT`` table."""
    t = _exact_transform(gains, rule) if TRANSFORM_MIDDLE else None
    return t if t is not None else np.stack(hsv_luts(gains, rule), -1).reshape(1, 256, 3)


def _apply_hsv_middle(img: np.ndarray, middle: _HueTransform | np.ndarray) -> np.ndarray:
    """RGB -> HSV, ``middle`` (see :func:`_hsv_middle`), HSV -> RGB, in place."""
    hsv = cv2.cvtColor(img, cv2.COLOR_RGB2HSV, dst=scratch("hsv", img.shape))
    if isinstance(middle, _HueTransform):
        _transform_middle(hsv, middle)
    else:  # the three tables in one interleaved pass
        cv2.LUT(hsv, middle, dst=hsv)
    cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB, dst=img)
    return img


def apply_hsv_in_box(img: np.ndarray, gains: Sequence[float], box: Rect | None, rule: Recipe = "yolov9") -> np.ndarray:
    """:func:`apply_hsv` on an image whose pixels outside ``box`` all hold one colour (a mosaic's grey border; None: the whole image is that colour), in place.

    Only the rows ``y0:y1`` are converted and the other rows get that colour's own HSV result
    (from the same kernels on a small patch), so the output equals :func:`apply_hsv` on the whole
    image. Whole rows, not the box: OpenCV's vector and scalar colour conversions differ by one
    level at times, so a narrower region would move the row tails onto the scalar path.
    A scratch-high mosaic (random scale) often leaves whole rows of border.
    """
    h, w = img.shape[:2]
    y0, y1 = (0, 0) if box is None else (max(box.y0, 0), min(box.y1, h))
    aligned = (y0 * w) % 64 == 0 and ((y1 * w) % 64 == 0 or y1 == h)  # same vector blocks as the whole image
    if (y0 <= 0 and y1 >= h) or not aligned or not img.flags.c_contiguous:
        return apply_hsv(img, gains, rule)
    if _is_identity(gains):
        return img
    middle = _hsv_middle(gains, rule)  # once for the border patch and the rows
    corner = img[0, 0] if y0 > 0 else img[h - 1, 0]  # a border pixel
    patch = np.empty((1, 64, 3), np.uint8)
    patch[...] = corner
    border = _apply_hsv_middle(patch, middle)[0, 0].copy()
    if y1 > y0:
        _apply_hsv_middle(img[y0:y1], middle)
    _fill_rows(img, 0, y0, border)
    _fill_rows(img, y1, h, border)
    return img


def _fill_rows(img: np.ndarray, start: int, stop: int, colour: np.ndarray) -> None:
    """Rows ``start:stop`` of an HWC image set to one ``colour``. Broadcasting a 3-value colour
    over many rows runs numpy's slow 3-byte inner loop; filling one row and copying it down runs
    whole-row copies, many times cheaper."""
    if stop <= start:
        return
    img[start] = colour
    img[start + 1 : stop] = img[start]
