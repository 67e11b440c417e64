"""Replays fastload's augmentation records the stock YOLOv9 way: the oracle of the pixel and box parity tests.

:func:`render_record` / :func:`labels_record` draw a :class:`~fastload.augment.params.SampleParams`
record with the stock algorithm's pieces (:mod:`fastload.bench.stock`: a canvas, then one warp), so
that pixel and box parity can be checked on identical geometry.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from fastload.bench.stock import augment_hsv, finish_labels, letterbox, mixup_pixels, warp, warp_boxes, xywhn2xyxy


def _canvas_frame(image: Any) -> tuple[np.ndarray, list[tuple[int, int]], tuple[int, int, int, int]]:
    """Split tile matrices ``M @ T(o_i)`` into one shared warp and integer canvas offsets.

    The first tile's matrix is taken as the warp (its offset is 0); the others' offsets follow.
    Returns (M, offsets, canvas bounds x0, y0, x1, y1 covering every tile's crop).
    """
    m0 = image.tiles[0].matrix
    inv = np.linalg.inv(m0)
    offsets = []
    for t in image.tiles:
        rel = inv @ t.matrix
        o = (int(round(rel[0, 2])), int(round(rel[1, 2])))
        assert np.allclose(rel[:2, :2], np.eye(2), atol=1e-6) and np.allclose(rel[:2, 2], o, atol=1e-4), rel
        offsets.append(o)
    xs0 = min(t.crop[0] + o[0] for t, o in zip(image.tiles, offsets))
    ys0 = min(t.crop[1] + o[1] for t, o in zip(image.tiles, offsets))
    xs1 = max(t.crop[2] + o[0] for t, o in zip(image.tiles, offsets))
    ys1 = max(t.crop[3] + o[1] for t, o in zip(image.tiles, offsets))
    return m0, offsets, (xs0, ys0, xs1, ys1)


def render_image_record(image: Any, get_image: Callable[[int], np.ndarray], mosaic: bool) -> np.ndarray:
    """Stock pixels of one ImageParams: paste tiles on a canvas, then one warp (or letterbox)."""
    oh, ow = image.out_hw
    if not mosaic:
        t = image.tiles[0]
        src = get_image(t.src)
        for scaleup in (False, True):
            lb, _, _ = letterbox(src, (oh, ow), scaleup=scaleup)
            M = t.matrix @ np.linalg.inv(_letterbox_matrix(src.shape[:2], (oh, ow), scaleup))
            if image.candidate_scale is None:
                if np.allclose(M, np.eye(3), atol=1e-9):
                    return lb
            elif scaleup:
                return warp(lb, M, (oh, ow))
        raise AssertionError("record is not a letterbox")
    M, offsets, (cx0, cy0, cx1, cy1) = _canvas_frame(image)
    canvas = np.full((cy1 - cy0, cx1 - cx0, 3), image.fill, np.uint8)
    for t, (ox, oy) in zip(image.tiles, offsets):
        x0, y0, x1, y1 = t.crop
        src = get_image(t.src)
        canvas[y0 + oy - cy0 : y1 + oy - cy0, x0 + ox - cx0 : x1 + ox - cx0] = src[y0:y1, x0:x1]
    return warp(canvas, M @ _translate(cx0, cy0), (oh, ow))


def _translate(tx: float, ty: float) -> np.ndarray:
    m = np.eye(3)
    m[:2, 2] = tx, ty
    return m


def _letterbox_matrix(hw: tuple[int, int], out_hw: tuple[int, int], scaleup: bool) -> np.ndarray:
    h, w = hw
    r = min(out_hw[0] / h, out_hw[1] / w)
    if not scaleup:
        r = min(r, 1.0)
    nw, nh = int(round(w * r)), int(round(h * r))
    top, left = int(round((out_hw[0] - nh) / 2 - 0.1)), int(round((out_hw[1] - nw) / 2 - 0.1))
    sx, sy = nw / w, nh / h
    return np.array([[sx, 0, 0.5 * (sx - 1) + left], [0, sy, 0.5 * (sy - 1) + top], [0, 0, 1.0]])


def render_record(params: Any, get_image: Callable[[int], np.ndarray], *, hsv: bool = True) -> np.ndarray:
    """Stock pixels of a SampleParams record (canvas + warpAffine, floor mixup, LUT HSV, flips)."""
    img = render_image_record(params.image, get_image, params.mosaic)
    if params.mixup is not None:
        img = mixup_pixels(img, render_image_record(params.mixup, get_image, True), params.mixup_ratio)
    if hsv and any(g != 1.0 for g in params.hsv_gain):
        augment_hsv(img, params.hsv_gain)
    if params.flip_ud:
        img = np.flipud(img)
    if params.flip_lr:
        img = np.fliplr(img)
    return np.ascontiguousarray(img)


def _image_labels_record(image: Any, labels: Sequence[np.ndarray], mosaic: bool) -> np.ndarray:
    """Stock box maths of one ImageParams: canvas boxes clipped, M applied to box edges, candidates."""
    if not mosaic:
        t = image.tiles[0]
        h, w = t.src_hw
        for scaleup in (False, True):
            L = _letterbox_matrix((h, w), image.out_hw, scaleup)
            M = t.matrix @ np.linalg.inv(L)
            if (image.candidate_scale is None and np.allclose(M, np.eye(3), atol=1e-9)) or (image.candidate_scale is not None and scaleup):
                break
        r = min(image.out_hw[0] / h, image.out_hw[1] / w) if scaleup else min(image.out_hw[0] / h, image.out_hw[1] / w, 1.0)
        nw, nh = int(round(w * r)), int(round(h * r))
        dw, dh = (image.out_hw[1] - nw) / 2, (image.out_hw[0] - nh) / 2
        lab = np.asarray(labels[t.src], np.float64).reshape(-1, 5).copy()
        if lab.size:
            lab[:, 1:] = xywhn2xyxy(lab[:, 1:], r * w, r * h, dw, dh)
        if image.candidate_scale is None:
            return lab
        return warp_boxes(lab, M, image.candidate_scale / r, image.out_hw)
    M, offsets, _ = _canvas_frame(image)
    parts = []
    for t, (ox, oy) in zip(image.tiles, offsets):
        h, w = t.src_hw
        lab = np.asarray(labels[t.src], np.float64).reshape(-1, 5).copy()
        if lab.size:
            lab[:, 1:] = xywhn2xyxy(lab[:, 1:], w, h, ox, oy)
            x0, y0, x1, y1 = t.crop
            lab[:, [1, 3]] = lab[:, [1, 3]].clip(x0 + ox, x1 + ox)
            lab[:, [2, 4]] = lab[:, [2, 4]].clip(y0 + oy, y1 + oy)
        parts.append(lab)
    lab = np.concatenate(parts, 0) if parts else np.zeros((0, 5))
    return warp_boxes(lab, M, image.candidate_scale, image.out_hw)


def labels_record(params: Any, labels: Sequence[np.ndarray]) -> np.ndarray:
    """Stock labels (float32 [n, 5] xywhn) of a SampleParams record."""
    lab = _image_labels_record(params.image, labels, params.mosaic)
    if params.mixup is not None:
        lab = np.concatenate((lab, _image_labels_record(params.mixup, labels, True)), 0)
    return finish_labels(lab, params.image.out_hw, params.flip_ud, params.flip_lr)
