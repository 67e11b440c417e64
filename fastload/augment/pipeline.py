"""One output sample from its record: tiles, copy-paste, mixup blend, HSV, flips.

:func:`render_sample` is what the CPU engine runs per sample; the GPU engines apply the same
records with their own kernels.  Order (YOLOv9 ``__getitem__``): mosaic / letterbox (+ copy-paste on the
canvas, then the random perspective, folded into the tile matrices), mixup, HSV, flip up-down, flip left-right.
"""
from __future__ import annotations

from typing import Callable

import cv2
import numpy as np

from fastload.augment.functional.color import apply_hsv_in_box
from fastload.augment.functional.flip import flip_inplace
from fastload.augment.functional.paste import paste_mirrored
from fastload.augment.functional.scratch import scratch as scratch_buffer
from fastload.augment.functional.tiles import render_image_bbox, union_rect
from fastload.augment.geometry import GeometryLabels, RecordGeometry, paste_outlines
from fastload.augment.params import Rect, SampleParams

__all__ = ["render_sample", "mixup_blend"]

# cv2.addWeighted rounds; YOLOv9 truncates ((a*r + b*(1-r)).astype(uint8)).  round(x - 0.5 + d)
# equals floor(x) except within d of an integer, where float noise decides either way.
_FLOOR_BIAS = -0.5 + 1e-4


def mixup_blend(img: np.ndarray, other: np.ndarray, ratio: float) -> np.ndarray:
    """``img = floor(img * ratio + other * (1 - ratio))`` in place (YOLOv9 mixup), one cv2 pass."""
    cv2.addWeighted(img, float(ratio), other, 1.0 - float(ratio), _FLOOR_BIAS, dst=img)
    return img


def render_sample(
    params: SampleParams,
    get_image: Callable[[int], np.ndarray],
    out: np.ndarray | None = None,
    *,
    hsv: bool = True,
    scratch: np.ndarray | None = None,
    axis_kernel: str | None = None,
    labels: GeometryLabels | None = None,
    moved: RecordGeometry | None = None,
) -> np.ndarray:
    """Draw sample ``params`` into ``out`` (HWC uint8, allocated when None) and return it.

    Args:
        get_image: loaded RGB HWC uint8 image of a dataset index.
        hsv: apply the HSV gains here (False: the caller applies ``params.hsv_gain`` later,
            e.g. :func:`fastload.augment.functional.torch_ops.apply_hsv_batch` on the GPU; flips
            commute with HSV, so deferring it is exact).
        scratch: optional HWC uint8 buffer of the output size for the mixup partner.
        axis_kernel: how axis-aligned tiles are drawn, ``"warp"`` or ``"resize"`` (None: the faster
            for the installed OpenCV, see :func:`fastload.augment.functional.tiles.default_axis_kernel`).
        labels: ``index -> (rows, points, point_offsets)`` (:data:`~fastload.augment.geometry.GeometryLabels`): the
            segment labels, needed by records with copy-paste (the pasted instances' outlines make its pixel mask).
        moved: the record's labels already moved (:func:`~fastload.augment.geometry.move_record`): copy-paste takes
            its outlines from there instead of moving ``labels`` again.
    """
    out, box = render_image_bbox(params.image, get_image, out, axis_kernel=axis_kernel)
    box = _copy_paste(out, box, params, 0, get_image, labels, moved, axis_kernel)
    if params.mixup is not None:
        if scratch is None:  # a reused buffer: a fresh 1.2 MB array per mixup sample costs page faults
            oh, ow = params.mixup.out_hw
            scratch = scratch_buffer("mixup", (oh, ow, 3))
        other, box2 = render_image_bbox(params.mixup, get_image, scratch, axis_kernel=axis_kernel)
        box2 = _copy_paste(other, box2, params, 1, get_image, labels, moved, axis_kernel)
        box = union_rect(box, box2)  # outside both, the blend of two grey fills is one colour again
        mixup_blend(out, other, params.mixup_ratio)
    if hsv:  # only the drawn box is converted: the uniform grey border is mapped once
        apply_hsv_in_box(out, params.hsv_gain, box, params.hsv_rule)
    flip_inplace(out, params.flip_ud, params.flip_lr)
    return out


def _copy_paste(out: np.ndarray, box: Rect | None, params: SampleParams, k: int, get_image: Callable[[int], np.ndarray],
                labels: GeometryLabels | None, moved: RecordGeometry | None, axis_kernel: str | None) -> Rect | None:
    """The copy-paste of the record's image ``k`` (0: its image, 1: its mixup partner) drawn into its rendered pixels
    ``out``, and the drawn box grown by what it changed (the mirrored canvas can land on the grey fill)."""
    image = params.image if k == 0 else params.mixup
    if image is None or image.copy_paste is None:
        return box
    if moved is not None:
        outlines, flip_fill = moved.paste_outlines(k)
    elif labels is None:
        raise ValueError(f"sample {params.index} has copy-paste: render_sample needs labels= (the segment labels whose "
                         f"pasted outlines make its pixel mask)")
    else:
        outlines, flip_fill = paste_outlines(image, labels)
    return union_rect(box, paste_mirrored(out, image, outlines, flip_fill, get_image, axis_kernel=axis_kernel))
