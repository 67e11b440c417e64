"""Copy-paste pixels: the canvas mirrored left-right, drawn where the pasted instances' mask lands.

The references paste on their canvas (the mosaic, or Ultralytics' loaded image) before its random perspective warps
it: pixels inside a mask filled from the pasted instances' polygons are replaced by the canvas flipped left-right
(``cv2.flip``: canvas column ``x`` from column ``w - 1 - x``). fastload has no canvas: it draws the mirrored tiles
(matrix: the canvas's warp, the flip, the tile's canvas offset) into the output rectangle the warped mask covers,
and blends them in by the mask warped like the pixels (bilinear): inside the mask the mirrored pixels as they are,
along its outline a mix of both sides, as the references' bilinear warp of the pasted canvas mixes them there.
"""
from __future__ import annotations

from typing import Callable, Sequence

import cv2
import numpy as np

from fastload.augment.functional.scratch import scratch
from fastload.augment.functional.tiles import render_image_bbox, warp_rect
from fastload.augment.params import ImageParams, Rect, TileParams, translation

__all__ = ["paste_mirrored"]


def _canvas_mask(outlines: Sequence[np.ndarray], canvas_hw: tuple[int, int], flip_fill: bool
                 ) -> tuple[np.ndarray, Rect] | None:
    """uint8 255 inside the filled ``outlines`` (canvas px, truncated to int32 and filled one by one, as both
    references draw each contour), in the rectangle of the canvas that holds them; mirrored with ``flip_fill``."""
    ch, cw = canvas_hw
    pts = [np.asarray(p).astype(np.int32).reshape(-1, 2) for p in outlines if len(p)]
    if not pts:
        return None
    x, y, w, h = cv2.boundingRect(np.concatenate(pts))  # their extent (canvas px: no int overflow)
    x0, y0 = max(x, 0), max(y, 0)
    x1, y1 = min(x + w, cw), min(y + h, ch)
    if x1 <= x0 or y1 <= y0:
        return None
    # reused buffers: a fresh array of up to a whole 2s x 2s canvas costs its page faults on every paste
    mask = scratch("paste_mask", (y1 - y0, x1 - x0))
    mask.fill(0)
    for p in pts:
        cv2.fillPoly(mask, [p], 255, offset=(-x0, -y0))
    if flip_fill:
        return cv2.flip(mask, 1, dst=scratch("paste_mask_flip", mask.shape)), Rect(cw - x1, y0, cw - x0, y1)
    return mask, Rect(x0, y0, x1, y1)


def paste_mirrored(out: np.ndarray, image: ImageParams, outlines: Sequence[np.ndarray], flip_fill: bool,
                   get_image: Callable[[int], np.ndarray], *, axis_kernel: str | None = None) -> Rect | None:
    """Paste ``image``'s mirrored canvas into its rendered pixels ``out`` (in place) under the mask the ``outlines``
    fill (:func:`fastload.augment.geometry.paste_outlines`); returns the output rectangle it changed (None: none)."""
    paste = image.copy_paste
    if paste is None:
        raise ValueError("paste_mirrored: the image has no copy-paste")
    found = _canvas_mask(outlines, paste.canvas_hw, flip_fill)
    if found is None:
        return None
    mask, region = found
    ref = image.tiles[0]
    warp = ref.matrix @ translation(-ref.offset[0], -ref.offset[1])  # type: ignore[index]  # canvas px -> output px
    rect = warp_rect(TileParams(ref.src, region, warp), out.shape[:2])
    if rect is None:
        return None
    size = (rect.x1 - rect.x0, rect.y1 - rect.y0)
    to_rect = translation(-rect.x0, -rect.y0)
    local = to_rect @ warp @ translation(region.x0, region.y0)
    alpha = scratch("paste_alpha", (size[1], size[0]))
    if ref.is_affine:
        cv2.warpAffine(mask, local[:2], size, dst=alpha, flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_CONSTANT)
    else:
        cv2.warpPerspective(mask, local, size, dst=alpha, flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_CONSTANT)
    if not cv2.hasNonZero(alpha):
        return None
    # The mirrored tiles are drawn flipped back (x -> width - 1 - x on both sides of the canvas flip), so that an
    # axis-aligned warp keeps the fast axis-aligned kernels; the drawing is then read mirrored.
    canvas_flip = _flip_x(paste.canvas_hw[1] - 1.0)
    back = _flip_x(size[0] - 1.0) @ to_rect @ warp @ canvas_flip
    unflipped = ImageParams(tuple(TileParams(t.src, t.crop, back @ translation(*t.offset), t.src_hw)  # type: ignore[misc]
                                  for t in image.tiles), (size[1], size[0]), image.fill)
    # only the tiles under the mask are drawn: drawn column x is read at flipped column size[0] - 1 - x
    drawn, _ = render_image_bbox(unflipped, get_image, scratch("paste", (size[1], size[0], 3)), axis_kernel=axis_kernel,
                                 unread=lambda r: not cv2.hasNonZero(alpha[r.y0:r.y1, size[0] - r.x1:size[0] - r.x0]))
    flipped = cv2.flip(drawn, 1, dst=scratch("paste_flip", drawn.shape))
    roi = out[rect.y0:rect.y1, rect.x0:rect.x1]
    # along the outline, a blend (a thin band, pixel by pixel) of the pixels there before the copy below
    edge = cv2.findNonZero(cv2.inRange(alpha, 1, 254, dst=scratch("paste_edge", alpha.shape)))
    if edge is not None:
        cols, rows = edge.reshape(-1, 2).T
        under = roi[rows, cols]
    cv2.copyTo(flipped, alpha, roi)  # wherever the mask is not 0: the band is blended over it next
    if edge is not None:
        a = alpha[rows, cols][:, None].astype(np.uint16)
        roi[rows, cols] = ((under * (255 - a) + flipped[rows, cols] * a + 127) // 255).astype(np.uint8)
    return rect


def _flip_x(width: float) -> np.ndarray:
    """3x3 ``x -> width - x``."""
    return np.array([[-1.0, 0.0, width], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
