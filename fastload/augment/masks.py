"""Instance masks from moved polygons (:class:`~fastload.augment.geometry.Geometry`), as both references build them.

Both YOLOv9 (``utils/segment/dataloaders.py``) and Ultralytics 8.4 (``data/utils.py``) fill each polygon, its
points truncated to int32, into a zero image of the full output size with ``cv2.fillPoly``, then shrink it with
``cv2.resize`` (INTER_LINEAR) to ``(h // mask_ratio, w // mask_ratio)``; overlap masks rank the instances by
their shrunk mask's pixel count, largest first (``np.argsort(-areas)``), and draw them in that order, a later
(smaller) instance over an earlier one, as its rank + 1. YOLOv9 flips the finished masks with the image;
Ultralytics flips the polygons before filling them.

Where the output size is a multiple of ``mask_ratio``, the shrink is an exact integer factor and each shrunk pixel
reads only pixels of its own ``mask_ratio``-square block, so :func:`polygon_mask` fills and shrinks only the
block-aligned box around the polygon: the same pixels as the full image, bit for bit, at a fraction of the cost
(``benchmarks/mask_raster.py``). Rasterising straight at the reduced size is cheaper still but not the same
masks (measured there).

:func:`batch_masks` also drops each truncated point equal to the one before it (:func:`pixel_outlines`): ``fillPoly``
draws every edge's line, both ends included, and fills between the edges that are not horizontal, so an edge of
length 0 adds nothing; a resampled polygon of Ultralytics' (1000 points along a few hundred pixels of outline) keeps
about a quarter of its points, and its fill costs about half.
"""
from __future__ import annotations

from typing import Sequence

import cv2
import numpy as np

from fastload.augment.geometry import Geometry

__all__ = ["polygon_mask", "image_masks", "batch_masks", "pixel_outlines"]


def polygon_mask(poly: np.ndarray, out_hw: tuple[int, int], mask_ratio: int) -> np.ndarray:
    """uint8 [h // mask_ratio, w // mask_ratio] mask of one polygon ``[k, 2]`` in output pixels (1 inside; all 0
    for a polygon without points)."""
    h, w = out_hw
    out = np.zeros((h // mask_ratio, w // mask_ratio), np.uint8)
    block, y0, x0 = _mask_block(poly, out_hw, mask_ratio)
    out[y0:y0 + block.shape[0], x0:x0 + block.shape[1]] = block
    return out


def pixel_outlines(points: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    """The polygons ``points`` [p, 2] (polygon ``i``: ``points[offsets[i]:offsets[i + 1]]``) as ``fillPoly`` fills
    them: int32, truncated, as both references convert them, without the points equal to the point before them (the
    same fill: module docstring)."""
    pixels = points.astype(np.int32)  # [p, 2] C-ordered: each point's two int32 read as one int64 below
    pairs = pixels.view(np.int64).reshape(-1)
    keep = np.ones(len(pairs), bool)
    np.not_equal(pairs[1:], pairs[:-1], out=keep[1:])
    offsets = np.asarray(offsets, np.int64)
    keep[offsets[:-1][np.diff(offsets) > 0]] = True  # each polygon's first point (the one before is another's)
    at = np.flatnonzero(keep)
    kept = pairs[at].view(np.int32).reshape(-1, 2)
    starts = np.searchsorted(at, offsets).tolist()  # where each polygon starts among the kept points
    return [kept[a:b] for a, b in zip(starts[:-1], starts[1:])]


def _mask_block(poly: np.ndarray, out_hw: tuple[int, int], mask_ratio: int) -> tuple[np.ndarray, int, int]:
    """:func:`polygon_mask` as the part of it that can be non-zero: ``(block, y0, x0)``, the shrunk mask's pixels
    ``[y0:y0 + block.shape[0], x0:x0 + block.shape[1]]`` (outside them it is 0; the block may be empty). ``poly``:
    output px, or int32 pixels (:func:`pixel_outlines`)."""
    h, w = out_hw
    r = int(mask_ratio)
    if r < 1 or r > min(h, w):
        raise ValueError(f"mask_ratio must be in [1, {min(h, w)}] for output size {out_hw}, got {mask_ratio}")
    pts = np.asarray(poly).astype(np.int32, copy=False).reshape(1, -1, 2)
    nh, nw = h // r, w // r
    if not pts.size:  # a row without points: no mask (YOLOv9's validation, one mask per instance)
        return np.zeros((0, 0), np.uint8), 0, 0
    if h % r or w % r:  # not an integer shrink: the full image, as the references
        full = np.zeros((h, w), np.uint8)
        cv2.fillPoly(full, pts, 1)
        return cv2.resize(full, (nw, nh)), 0, 0
    x, y, bw, bh = cv2.boundingRect(pts)  # the points' extent: x .. x + bw - 1, y .. y + bh - 1
    if bw <= 0 or bh <= 0:  # an extent of 2**31 px or more wraps OpenCV's int: every block then
        x, y, bw, bh = 0, 0, w, h
    # the blocks the polygon's pixels touch (fillPoly also draws the outline's pixels)
    bx0, by0 = max(x // r, 0), max(y // r, 0)
    bx1, by1 = min((x + bw - 1) // r + 1, nw), min((y + bh - 1) // r + 1, nh)
    if bx1 <= bx0 or by1 <= by0:
        return np.zeros((0, 0), np.uint8), 0, 0
    roi = np.zeros(((by1 - by0) * r, (bx1 - bx0) * r), np.uint8)
    cv2.fillPoly(roi, pts, 1, offset=(-bx0 * r, -by0 * r))
    return (roi if r == 1 else cv2.resize(roi, (bx1 - bx0, by1 - by0))), by0, bx0


def image_masks(polygons: Sequence[np.ndarray], out_hw: tuple[int, int], mask_ratio: int, overlap: bool
                ) -> tuple[np.ndarray, np.ndarray]:
    """The masks of one image and the order of its instances (``polygons``: output px, or int32 pixels:
    :func:`pixel_outlines`).

    Returns:
        ``overlap=False``: uint8 [n, h', w'] one mask per polygon, and ``arange(n)``.
        ``overlap=True``: [h', w'] (uint8, int32 beyond 255 instances) holding ``k + 1`` where the ``k``-th largest
        instance is the smallest one covering the pixel, and that area order (the instances' new order: the
        references reorder the labels by it).
    """
    h, w = out_hw
    shape = (h // mask_ratio, w // mask_ratio)
    if not overlap:
        masks = [polygon_mask(p, out_hw, mask_ratio) for p in polygons]
        stack = np.stack(masks) if masks else np.zeros((0, *shape), np.uint8)
        return stack, np.arange(len(masks))
    blocks = [_mask_block(p, out_hw, mask_ratio) for p in polygons]  # each instance's non-zero part only
    order = np.argsort(-np.array([cv2.countNonZero(b) if b.size else 0 for b, _, _ in blocks], np.int64))  # 0 / 1
    merged = np.zeros(shape, np.int32 if len(blocks) > 255 else np.uint8)
    for rank, k in enumerate(order.tolist()):
        block, y0, x0 = blocks[k]
        under = merged[y0:y0 + block.shape[0], x0:x0 + block.shape[1]]
        # a running maximum: the rank exceeds every earlier value, so it is "drawn over" them
        np.maximum(under, block.astype(merged.dtype) * (rank + 1), out=under)
    return merged, order


def batch_masks(geometry: Geometry, batch_size: int, mask_ratio: int, overlap: bool) -> tuple[np.ndarray, np.ndarray]:
    """The masks of a segment batch, as its reference's loader collates them, and the instances' order.

    Returns:
        ``(masks, order)``: ``overlap=True``: [batch_size, h', w'] (uint8; int32 if an image has more than 255
        instances), one overlap mask per sample; ``overlap=False``: uint8 [N, h', w'], one per instance in ``order``.
        ``order``: int64 [N], the instances' order in the batch (per sample: by decreasing mask area with
        ``overlap``, as the references reorder their labels; else unchanged): index ``geometry.targets`` with it.
        Flips: YOLOv9 flips the masks, Ultralytics fills the flipped polygons (module docstring).
    """
    if geometry.task != "segment":
        raise ValueError(f"masks are built for the segment task, got a {geometry.task!r} Geometry")
    h, w = geometry.out_hw
    flip_polygons = geometry.recipe == "ultralytics"
    polygons = pixel_outlines(geometry.flipped_points() if flip_polygons else geometry.points, geometry.offsets)
    owner = geometry.targets[:, 0].astype(np.intp)
    per_sample, orders = [], []
    for b in range(int(batch_size)):
        rows = np.flatnonzero(owner == b)
        masks, order = image_masks([polygons[i] for i in rows.tolist()], (h, w), mask_ratio, overlap)
        if not flip_polygons and len(rows):
            flip_ud, flip_lr = bool(geometry.flip_ud[rows[0]]), bool(geometry.flip_lr[rows[0]])
            if flip_ud:
                masks = masks[..., ::-1, :]
            if flip_lr:
                masks = masks[..., ::-1]
        per_sample.append(masks)
        orders.append(rows[order])
    order = np.concatenate(orders).astype(np.int64) if orders else np.zeros(0, np.int64)
    if overlap:
        dtype = np.int32 if any(m.dtype == np.int32 for m in per_sample) else np.uint8
        return np.stack([m.astype(dtype, copy=False) for m in per_sample]), order
    if not per_sample or not sum(len(m) for m in per_sample):
        return np.zeros((0, h // mask_ratio, w // mask_ratio), np.uint8), order
    return np.ascontiguousarray(np.concatenate(per_sample, 0)), order
