"""Moving labels with a :class:`~fastload.augment.params.SampleParams` record.

:func:`transform_labels` is the only place where boxes are moved, clipped, filtered and flipped;
every engine calls it, so boxes are identical whatever engine drew the pixels.

Sub-pixel convention: boxes are continuous coordinates whose pixel *edges* are integers (a
w-pixel image spans ``[0, w]``), while tile matrices use the warpAffine *centre* convention.
Boxes are therefore moved with ``E = T(+0.5) @ M @ T(-0.5)``, which keeps every box edge on the
image edge it was drawn on (YOLOv9 applies ``M`` to box edges directly, a shift of at most
``0.5 * |1 - scale|`` px; its letterbox also shifts boxes by the float pad ``dw`` while the
pixels move by ``round(dw - 0.1)``: up to 0.5 px more). Validation is the exception: there a tile's
``box_matrix`` reproduces YOLOv9's float pad, so that targets (and val.py's mapping back through
``shapes``) are the official ones.
"""
from __future__ import annotations

from typing import Callable, Sequence, Union

import numpy as np

from fastload.augment.params import ImageParams, SampleParams, translation

__all__ = ["batch_targets", "transform_labels", "box_candidates", "xyxy_to_xywhn", "moved_boxes", "batch_images"]

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


def moved_boxes(
    images: Sequence[ImageParams], owners: Sequence[int], get_labels: Callable[[int], np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """float64 [n, 5] ``(cls, x0, y0, x1, y1)`` boxes in output pixels of every tile of several
    images sharing one output size, in one vectorised pass, and per box the ``owners`` entry of its
    image (the sample it belongs to).

    The per-tile loop only collects label arrays and tile constants; every row then carries its
    tile's crop, matrix and candidate scale, so the arithmetic is a handful of array operations
    per call whatever the number of samples, tiles and boxes (a whole batch costs little more
    than one sample: the per-call overhead of its small numpy operations dominated).
    """
    labs, counts, consts, mats, tile_owner = [], [], [], [], []
    persp = False
    for image, owner in zip(images, owners):
        cand = np.nan if image.candidate_scale is None else float(image.candidate_scale)
        for tile in image.tiles:
            lab = get_labels(tile.src)
            if len(lab) == 0:
                continue
            if tile.src_hw is None:
                raise ValueError(f"TileParams of image {tile.src} has no src_hw (loaded shape); records must come from ParamSampler")
            h, w = tile.src_hw
            x0, y0, x1, y1 = tile.crop
            labs.append(np.asarray(lab).reshape(-1, 5))
            counts.append(len(labs[-1]))
            consts.append((x0, y0, x0, y0, x1, y1, x1, y1, w, h, cand))
            mats.append(tile.matrix if tile.box_matrix is None else tile.box_matrix)
            tile_owner.append(owner)
            persp = persp or not tile.is_affine
    if not labs:
        return np.zeros((0, 5)), np.zeros(0, np.intp)
    lab = np.concatenate(labs, dtype=np.float64) if len(labs) > 1 else labs[0].astype(np.float64)
    rows = np.repeat(np.arange(len(counts)), counts) if len(counts) > 1 else np.zeros(len(lab), np.intp)
    c = np.array(consts, np.float64)[rows]  # per row: crop lo (x, y, x, y), crop hi, (w, h), candidate scale
    m = (_EDGE_OUT @ np.array(mats) @ _EDGE_IN)[rows]  # box edges -> output edges (module docstring)
    # normalised (xc, yc, w, h) -> loaded px (x0, y0, x1, y1), clipped to the visible crop
    # (YOLOv9 clips to its canvas, which is the same region)
    xy = np.empty((len(lab), 4))
    half = lab[:, 3:5] / 2
    np.subtract(lab[:, 1:3], half, out=xy[:, 0:2])
    np.add(lab[:, 1:3], half, out=xy[:, 2:4])
    xy *= c[:, [8, 9, 8, 9]]
    np.maximum(xy, c[:, 0:4], out=xy)  # np.clip's exact semantics, without its Python-level overhead
    np.minimum(xy, c[:, 4:8], out=xy)
    # four corners through each row's matrix, then their bounding box
    cx = xy[:, [0, 2, 0, 2]]
    cy = xy[:, [1, 3, 3, 1]]
    mx = m[:, 0, 0:1] * cx + m[:, 0, 1:2] * cy + m[:, 0, 2:3]
    my = m[:, 1, 0:1] * cx + m[:, 1, 1:2] * cy + m[:, 1, 2:3]
    if persp:  # affine rows have mz == 1 exactly, so dividing every row changes none of them
        mz = m[:, 2, 0:1] * cx + m[:, 2, 1:2] * cy + m[:, 2, 2:3]
        mx, my = mx / mz, my / mz
    oh, ow = images[0].out_hw
    out = np.empty((len(lab), 5))
    out[:, 0] = lab[:, 0]
    np.min(mx, 1, out=out[:, 1])
    np.min(my, 1, out=out[:, 2])
    np.max(mx, 1, out=out[:, 3])
    np.max(my, 1, out=out[:, 4])
    np.maximum(out[:, 1:5], 0, out=out[:, 1:5])
    np.minimum(out[:, 1:5], (ow, oh, ow, oh), out=out[:, 1:5])
    owner = np.asarray(tile_owner, np.intp)[rows]
    cand = c[:, 10]
    filtered = ~np.isnan(cand)
    if filtered.any():
        keep = box_candidates(xy * cand[:, None], out[:, 1:5]) | ~filtered
        out, owner = out[keep], owner[keep]
    return out, owner


def xyxy_to_xywhn(boxes: np.ndarray, out_hw: tuple[int, int], eps: float = 1e-3) -> np.ndarray:
    """(cls, x0, y0, x1, y1) px -> float32 (cls, xc, yc, w, h) normalised, clipped to
    ``[0, size - eps]`` first (YOLOv9 ``xyxy2xywhn(clip=True, eps=1e-3)``)."""
    h, w = out_hw
    b = np.maximum(boxes[:, 1:5], 0)
    np.minimum(b, (w - eps, h - eps, w - eps, h - eps), out=b)
    x, y = b[:, 0::2], b[:, 1::2]
    out = np.empty((len(boxes), 5), np.float32)
    out[:, 0] = boxes[:, 0]
    out[:, 1] = (x[:, 0] + x[:, 1]) / 2 / w
    out[:, 2] = (y[:, 0] + y[:, 1]) / 2 / h
    out[:, 3] = (x[:, 1] - x[:, 0]) / w
    out[:, 4] = (y[:, 1] - y[:, 0]) / h
    return out


def batch_images(records: Sequence[SampleParams]) -> tuple[list[ImageParams], list[int]]:
    """The composed images of a batch in label order (each record's main image, then its mixup
    partner) and the position of the record each belongs to. Raises ``ValueError`` when the
    records do not share one output size."""
    out_hw = records[0].image.out_hw if records else None
    if any(p.image.out_hw != out_hw for p in records):
        raise ValueError(f"records of one batch have different output sizes {sorted({p.image.out_hw for p in records})}")
    images, owners = [], []
    for k, p in enumerate(records):
        images.append(p.image)
        owners.append(k)
        if p.mixup is not None:
            images.append(p.mixup)
            owners.append(k)
    return images, owners


def batch_targets(records: Sequence[SampleParams], labels: Labels) -> np.ndarray:
    """YOLOv9 ``targets`` of a batch: float32 [N, 6] (position in ``records``, cls, xc, yc, w, h)
    normalised to the output, ordered by sample, boxes of one sample in tile order (the main
    image's tiles, then the mixup partner's). All records must share one output size.

    Args:
        records: the batch's sample records.
        labels: per-dataset-index float32 [n, 5] labels normalised to the image (a sequence or a
            callable ``index -> labels``).
    """
    if not records:
        return np.zeros((0, 6), np.float32)
    out_hw = records[0].image.out_hw
    get = labels if callable(labels) else labels.__getitem__
    images, owners = batch_images(records)
    boxes, owner = moved_boxes(images, owners, get)
    out = np.empty((len(boxes), 6), np.float32)
    out[:, 0] = owner
    out[:, 1:] = xyxy_to_xywhn(boxes, out_hw)
    flip_ud = np.array([p.flip_ud for p in records], bool)[owner]
    flip_lr = np.array([p.flip_lr for p in records], bool)[owner]
    out[flip_ud, 3] = 1 - out[flip_ud, 3]
    out[flip_lr, 2] = 1 - out[flip_lr, 2]
    return out


def transform_labels(params: SampleParams, labels: Labels) -> np.ndarray:
    """Labels of output sample ``params`` as float32 [n, 5] (cls, xc, yc, w, h) normalised to the
    output (:func:`batch_targets` of a batch of one, without the position column)."""
    return np.ascontiguousarray(batch_targets((params,), labels)[:, 1:])
