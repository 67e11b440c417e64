"""Moving labels with a :class:`~fastload.augment.params.SampleParams` record.

:func:`transform_labels` is the only place where boxes are moved, clipped, filtered and flipped;
every engine calls it, so boxes are identical whatever engine drew the pixels.

Sub-pixel convention: boxes are continuous coordinates whose pixel *edges* are integers (a
w-pixel image spans ``[0, w]``), while tile matrices use the warpAffine *centre* convention.
Boxes are therefore moved with ``E = T(+0.5) @ M @ T(-0.5)``, which keeps every box edge on the
image edge it was drawn on (YOLOv9 applies ``M`` to box edges directly, a shift of at most
``0.5 * |1 - scale|`` px; its letterbox also shifts boxes by the float pad ``dw`` while the
pixels move by ``round(dw - 0.1)``: up to 0.5 px more).
"""
from __future__ import annotations

from typing import Callable, Sequence, Union

import numpy as np

from fastload.augment.params import ImageParams, SampleParams, translation

__all__ = ["transform_labels", "image_boxes", "box_candidates", "xyxy_to_xywhn"]

Labels = Union[Sequence[np.ndarray], Callable[[int], np.ndarray]]

_EDGE_IN = translation(-0.5, -0.5)
_EDGE_OUT = translation(0.5, 0.5)


def box_candidates(
    box1: np.ndarray, box2: np.ndarray, wh_thr: float = 2, ar_thr: float = 100, area_thr: float = 0.1, eps: float = 1e-16
) -> np.ndarray:
    """YOLOv9's filter: keep boxes wider and taller than ``wh_thr`` px, aspect < ``ar_thr`` and
    area above ``area_thr`` of the (scaled) box before the transform. Boxes are [n, 4] xyxy."""
    w1, h1 = box1[:, 2] - box1[:, 0], box1[:, 3] - box1[:, 1]
    w2, h2 = box2[:, 2] - box2[:, 0], box2[:, 3] - box2[:, 1]
    ar = np.maximum(w2 / (h2 + eps), h2 / (w2 + eps))
    return (w2 > wh_thr) & (h2 > wh_thr) & (w2 * h2 / (w1 * h1 + eps) > area_thr) & (ar < ar_thr)


def image_boxes(image: ImageParams, get_labels: Callable[[int], np.ndarray]) -> np.ndarray:
    """float64 [n, 5] (cls, x0, y0, x1, y1) in output pixels for every tile of ``image``.

    All tiles are processed in one vectorised pass (rows carry their tile's crop and matrix).
    """
    labs, crops, mats, persp = [], [], [], False
    for tile in image.tiles:
        lab = np.asarray(get_labels(tile.src), dtype=np.float64).reshape(-1, 5)
        if len(lab) == 0:
            continue
        if tile.src_hw is None:
            raise ValueError(f"TileParams of image {tile.src} has no src_hw (loaded shape); records must come from ParamSampler")
        h, w = tile.src_hw
        px = np.empty_like(lab)
        px[:, 0] = lab[:, 0]
        px[:, 1] = (lab[:, 1] - lab[:, 3] / 2) * w
        px[:, 2] = (lab[:, 2] - lab[:, 4] / 2) * h
        px[:, 3] = (lab[:, 1] + lab[:, 3] / 2) * w
        px[:, 4] = (lab[:, 2] + lab[:, 4] / 2) * h
        labs.append(px)
        crops.append(np.broadcast_to(np.asarray(tile.crop, np.float64), (len(lab), 4)))
        mats.append(np.broadcast_to(_EDGE_OUT @ tile.matrix @ _EDGE_IN, (len(lab), 3, 3)))
        persp = persp or not tile.is_affine
    if not labs:
        return np.zeros((0, 5))
    lab = np.concatenate(labs)
    crop = np.concatenate(crops)
    m = np.concatenate(mats)
    # clip to the visible crop (YOLOv9 clips to its canvas, which is the same region)
    xy = np.empty((len(lab), 4))
    xy[:, 0] = np.clip(lab[:, 1], crop[:, 0], crop[:, 2])
    xy[:, 1] = np.clip(lab[:, 2], crop[:, 1], crop[:, 3])
    xy[:, 2] = np.clip(lab[:, 3], crop[:, 0], crop[:, 2])
    xy[:, 3] = np.clip(lab[:, 4], crop[:, 1], crop[:, 3])
    # four corners through each row's matrix, then their bounding box
    cx = xy[:, [0, 2, 0, 2]]
    cy = xy[:, [1, 3, 3, 1]]
    mx = m[:, 0, 0:1] * cx + m[:, 0, 1:2] * cy + m[:, 0, 2:3]
    my = m[:, 1, 0:1] * cx + m[:, 1, 1:2] * cy + m[:, 1, 2:3]
    if persp:
        mz = m[:, 2, 0:1] * cx + m[:, 2, 1:2] * cy + m[:, 2, 2:3]
        mx, my = mx / mz, my / mz
    oh, ow = image.out_hw
    new = np.empty((len(lab), 4))
    new[:, 0] = mx.min(1).clip(0, ow)
    new[:, 1] = my.min(1).clip(0, oh)
    new[:, 2] = mx.max(1).clip(0, ow)
    new[:, 3] = my.max(1).clip(0, oh)
    out = np.concatenate((lab[:, :1], new), axis=1)
    if image.candidate_scale is not None:
        out = out[box_candidates(xy * image.candidate_scale, new)]
    return out


def xyxy_to_xywhn(boxes: np.ndarray, out_hw: tuple[int, int], eps: float = 1e-3) -> np.ndarray:
    """(cls, x0, y0, x1, y1) px -> float32 (cls, xc, yc, w, h) normalised, clipped to
    ``[0, size - eps]`` first (YOLOv9 ``xyxy2xywhn(clip=True, eps=1e-3)``)."""
    h, w = out_hw
    b = boxes.copy()
    b[:, [1, 3]] = b[:, [1, 3]].clip(0, w - eps)
    b[:, [2, 4]] = b[:, [2, 4]].clip(0, h - eps)
    out = np.empty((len(b), 5), np.float32)
    out[:, 0] = b[:, 0]
    out[:, 1] = (b[:, 1] + b[:, 3]) / 2 / w
    out[:, 2] = (b[:, 2] + b[:, 4]) / 2 / h
    out[:, 3] = (b[:, 3] - b[:, 1]) / w
    out[:, 4] = (b[:, 4] - b[:, 2]) / h
    return out


def transform_labels(params: SampleParams, labels: Labels) -> np.ndarray:
    """Labels of output sample ``params`` as float32 [n, 5] (cls, xc, yc, w, h) normalised to the output.

    Args:
        params: the sample record.
        labels: per-dataset-index float32 [n, 5] labels normalised to the image (a sequence or a
            callable ``index -> labels``).
    """
    get = labels if callable(labels) else labels.__getitem__
    parts = [image_boxes(params.image, get)]
    if params.mixup is not None:
        parts.append(image_boxes(params.mixup, get))
    out = xyxy_to_xywhn(np.concatenate(parts, axis=0), params.image.out_hw)
    if params.flip_ud:
        out[:, 2] = 1 - out[:, 2]
    if params.flip_lr:
        out[:, 1] = 1 - out[:, 1]
    return out
