"""Drawing an :class:`~fastload.augment.params.ImageParams` straight into the output image.

YOLOv9 builds a 2s x 2s canvas (4 tile copies), then ``warpAffine``s it back to s x s.  Here every
tile is drawn once, directly from its loaded image into the output rectangle it owns.  An
axis-aligned matrix (scale + translation: the scratch-high default, and every letterbox) is drawn
by one of two kernels (``axis_kernel``):

* ``"warp"``: ``cv2.warpAffine`` of the source pixels the rectangle reads (copied first unless shrunk below 1/2),
  with the tile's exact matrix and ``BORDER_REPLICATE`` at the crop edges: YOLOv9's own sampling.
* ``"resize"``: ONE ``cv2.resize`` of a source sub-rectangle.  ``cv2.resize`` can only realise
  scales that are ratios of integer sizes, so the source rectangle is chosen (rounded) to best
  match the exact matrix: the sampling position is off by at most ``PHASE_MAX`` output pixel.

Which is faster depends on the OpenCV build (:func:`default_axis_kernel`).  Either way a tile
whose matrix is an exact integer-size resize (a letterbox) is drawn by ``cv2.resize``,
bit-identical to YOLOv9.  Any other matrix: ``cv2.warpAffine`` of the tile's crop into the
bounding rectangle of its image, ``BORDER_TRANSPARENT`` (pixels outside the crop keep what is
there); perspective: ``cv2.warpPerspective`` likewise.  These sample exactly like YOLOv9's warp.

Pixels near a tile seam differ from YOLOv9 where its bilinear filter mixes two neighbouring tiles
(or a tile and the grey fill) on the canvas: a band about one output pixel wide per seam.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Callable, Literal, NamedTuple, get_args

import cv2
import numpy as np

from fastload.augment.functional.scratch import scratch
from fastload.augment.params import ImageParams, Rect, TileParams, translation

__all__ = [
    "render_image", "render_image_bbox", "draw_tile", "union_rect",
    "AXIS_KERNELS", "AxisKernel", "default_axis_kernel", "check_axis_kernel",
    "tile_plan", "DrawMethod", "DrawPlan", "Span", "warp_rect",
]

_EXACT = 1e-9
_SEARCH = 64  # source-origin candidates tried per axis
# tried only when none of the first _SEARCH is within PHASE_MAX: scales near a ratio of small
# integers (a ~ 1, 1/2, 2/3 ...) drift slowly through the phases; a longer search keeps them on the
# resize path (every extra candidate costs one resized row / column, far less than a warp)
_WIDE_SEARCH = 256
# output px: take the first origin at least this well aligned. Each candidate further back costs a
# resized (and discarded) row / column, so a looser bound resizes fewer wasted pixels; 0.03 px is
# about the step of stock YOLOv9's own sampling grid (warpAffine rounds source positions to 1/32 px).
_PHASE_OK = 0.03
PHASE_MAX = 0.05  # output px: beyond this the tile is warped instead

AxisKernel = Literal["warp", "resize"]
AXIS_KERNELS: tuple[str, ...] = get_args(AxisKernel)


def default_axis_kernel() -> str:
    """The faster axis-aligned tile kernel for the installed OpenCV: ``"warp"`` from OpenCV 5,
    else ``"resize"``.

    OpenCV 5's ``warpAffine`` of a copied source beats the resize plan (no origin search, no padded
    or discarded pixels); OpenCV 4's ``warpAffine`` is several times slower per pixel than
    ``cv2.resize``, and the resize plan wins. ``benchmarks/augment_kernels.py`` prints both kernels
    side by side. A version rule, not a timing, so that the same seed gives the same pixels on
    every run of one installation.
    """
    major = int(cv2.__version__.split(".")[0])
    return "warp" if major >= 5 else "resize"


def check_axis_kernel(axis_kernel: str | None) -> str:
    """``axis_kernel`` validated; None becomes :func:`default_axis_kernel`'s choice."""
    if axis_kernel is None:
        return _DEFAULT_KERNEL
    if axis_kernel not in AXIS_KERNELS:
        raise ValueError(f"axis_kernel must be one of {AXIS_KERNELS}, got {axis_kernel!r}")
    return axis_kernel


_DEFAULT_KERNEL = default_axis_kernel()


def _check_out(out: np.ndarray | None, hw: tuple[int, int]) -> np.ndarray:
    if out is None:
        return np.empty((hw[0], hw[1], 3), np.uint8)
    if out.shape != (hw[0], hw[1], 3) or out.dtype != np.uint8:
        raise ValueError(f"out must be uint8 {(hw[0], hw[1], 3)}, got {out.dtype} {out.shape}")
    return out


def render_image(
    image: ImageParams, get_image: Callable[[int], np.ndarray], out: np.ndarray | None = None, *, axis_kernel: str | None = None
) -> np.ndarray:
    """Draw every tile of ``image`` into ``out`` (allocated when None); returns the HWC uint8 output.

    ``get_image(i)`` returns the *loaded* RGB HWC uint8 image of dataset index ``i``;
    ``axis_kernel`` is ``"warp"`` or ``"resize"`` (None: :func:`default_axis_kernel`).
    """
    return render_image_bbox(image, get_image, out, axis_kernel=axis_kernel)[0]


def render_image_bbox(
    image: ImageParams, get_image: Callable[[int], np.ndarray], out: np.ndarray | None = None, *,
    axis_kernel: str | None = None, unread: Callable[[Rect], bool] | None = None
) -> tuple[np.ndarray, Rect | None]:
    """:func:`render_image`, also returning the bounding rectangle of the pixels any tile wrote
    (None: no tile drew anything). Every pixel outside it is ``image.fill``, which lets later
    per-pixel steps (HSV) skip the uniform border.

    When every tile is axis-aligned (opaque rectangles: the scratch-high case) only the pixels
    no tile covers are filled, after drawing, instead of filling the whole output first.

    ``unread(rect)``: True when the caller never reads the output rectangle ``rect``; a tile that would
    write only there is not drawn, and its pixels are left undefined (copy-paste reads its drawing only
    under the pasted mask). Every other tile is drawn exactly as without it.
    """
    kernel = check_axis_kernel(axis_kernel)
    out = _check_out(out, image.out_hw)
    jobs = []
    opaque = True
    for tile in image.tiles:
        src = get_image(tile.src)
        if tile.src_hw is not None and src.shape[:2] != tile.src_hw:
            raise ValueError(f"image {tile.src} has shape {src.shape[:2]}, the record expects the loaded shape {tile.src_hw}")
        plan = tile_plan(tile, src.shape[:2], out.shape[:2], kernel)
        opaque = opaque and plan.method is not DrawMethod.WARP
        jobs.append((tile, src, plan))
    if not opaque:  # a warped tile only writes inside its crop's outline: fill first
        out[...] = image.fill
    box: Rect | None = None
    rects = []
    for tile, src, plan in jobs:
        if plan.rect is not None and unread is not None and unread(plan.rect):
            rect = plan.rect  # counted as drawn, so that it is not filled either
        else:
            rect = _draw(out, src, tile, plan)
        box = union_rect(box, rect)
        if rect is not None:
            rects.append(rect)
    if opaque:
        _fill_outside(out, rects, image.fill)
    return out, box


def _fill_outside(out: np.ndarray, rects: list[Rect], fill: int) -> None:
    """Set every pixel of ``out`` outside all ``rects`` to ``fill`` (horizontal bands between the
    rectangles' edges; a mosaic has at most 9 rectangles)."""
    h, w = out.shape[:2]
    if not rects:
        out[...] = fill
        return
    edges = sorted({0, h, *(r.y0 for r in rects), *(r.y1 for r in rects)})
    for a, b in zip(edges[:-1], edges[1:]):
        x = 0
        for r in sorted((r for r in rects if r.y0 <= a and r.y1 >= b), key=lambda r: r.x0):
            if r.x0 > x:
                out[a:b, x : r.x0] = fill
            x = max(x, r.x1)
        if x < w:
            out[a:b, x:w] = fill


def union_rect(a: Rect | None, b: Rect | None) -> Rect | None:
    """Bounding rectangle of two rectangles (None: empty)."""
    if a is None:
        return b
    if b is None:
        return a
    return Rect(min(a.x0, b.x0), min(a.y0, b.y0), max(a.x1, b.x1), max(a.y1, b.y1))


def draw_tile(out: np.ndarray, src: np.ndarray, tile: TileParams, *, axis_kernel: str | None = None) -> Rect | None:
    """Draw one tile of loaded image ``src`` into ``out`` (in place); returns the output rectangle
    it may have written, None when it drew nothing."""
    return _draw(out, src, tile, tile_plan(tile, src.shape[:2], out.shape[:2], check_axis_kernel(axis_kernel)))


class DrawMethod(enum.Enum):
    """How one tile is drawn (the method of a :class:`DrawPlan`)."""

    SKIP = "skip"  # no output pixel samples inside the crop: the tile draws nothing
    RESIZE = "resize"  # one exact-scale cv2.resize of a source span, phase matched (letterboxes: bit-exact)
    SCALED_WARP = "scaled_warp"  # warpAffine with the exact matrix, crop edges replicated (axis-aligned tiles)
    WARP = "warp"  # any other matrix: warped into its bounding rectangle, BORDER_TRANSPARENT


@dataclass(frozen=True)
class DrawPlan:
    """What :func:`tile_plan` decided for one tile.

    Attributes:
        method: how it is drawn.
        rect: the output rectangle it writes: every pixel of it (``RESIZE``, ``SCALED_WARP``: the
            pixels whose sampling point falls in the crop) or some (``WARP``: its bounding
            rectangle); None for ``SKIP``.
        xs, ys: ``RESIZE`` only: the horizontal and vertical plan of the resize.
    """

    method: DrawMethod
    rect: Rect | None = None
    xs: Span | None = None
    ys: Span | None = None


_SKIP = DrawPlan(DrawMethod.SKIP)


def tile_plan(tile: TileParams, src_hw: tuple[int, int], out_hw: tuple[int, int], kernel: str) -> DrawPlan:
    """How ``tile`` (of a loaded image of size ``src_hw``) is drawn into an ``out_hw`` output by the
    axis-aligned ``kernel``. The one place that decides which output pixels a tile owns and how they
    are sampled: the torch and DALI engines follow the same plan."""
    m = tile.matrix
    if not (tile.is_axis_aligned and m[0, 0] > 0 and m[1, 1] > 0):
        return _warp_plan(tile, out_hw)
    if kernel == "warp" and not _is_exact_resize(tile):
        x0, y0, x1, y1 = tile.crop
        xs = _owned_span(float(m[0, 0]), float(m[0, 2]), x0, x1, out_hw[1])
        ys = _owned_span(float(m[1, 1]), float(m[1, 2]), y0, y1, out_hw[0])
        if xs is None or ys is None:
            return _SKIP
        return DrawPlan(DrawMethod.SCALED_WARP, Rect(xs[0], ys[0], xs[1], ys[1]))
    return _resize_plan(tile, src_hw, out_hw)


def _warp_plan(tile: TileParams, out_hw: tuple[int, int]) -> DrawPlan:
    rect = warp_rect(tile, out_hw)
    return _SKIP if rect is None else DrawPlan(DrawMethod.WARP, rect)


def _draw(out: np.ndarray, src: np.ndarray, tile: TileParams, plan: DrawPlan) -> Rect | None:
    if plan.method is DrawMethod.WARP:
        return _draw_warp(out, src, tile, plan.rect)
    if plan.method is DrawMethod.SCALED_WARP:
        return _draw_scaled_warp(out, src, tile, plan.rect)
    if plan.method is DrawMethod.RESIZE:
        return _draw_planned(out, src, tile, plan.xs, plan.ys)
    return None


def _is_exact_resize(tile: TileParams) -> bool:
    """True when the (axis-aligned) tile is ``cv2.resize`` of its crop to whole output pixels at an
    integer offset (a letterbox, or unit scale): then the resize plan reproduces YOLOv9 bit for bit."""
    m = tile.matrix
    x0, y0, x1, y1 = tile.crop
    for a, t, c0, c1 in ((float(m[0, 0]), float(m[0, 2]), x0, x1), (float(m[1, 1]), float(m[1, 2]), y0, y1)):
        size, offset = a * (c1 - c0), t + a * c0 - 0.5 * (a - 1.0)  # resize output size and position
        if abs(size - round(size)) > 1e-6 or abs(offset - round(offset)) > 1e-6:
            return False
    return True


class Span(NamedTuple):
    """1-D plan of an exact-scale resize (see :func:`axis_plan`)."""

    d0: int  # output pixels [d0, d1) owned by the tile
    d1: int
    s0: int  # source origin of the resize (may be < 0: the source is padded by -s0)
    s1: int  # source end (exclusive, <= n_src)
    j0: int  # resize output index of output pixel d0
    err: float  # remaining sub-pixel phase error, output pixels


def _owned_span(a: float, t: float, c0: int, c1: int, n_out: int) -> tuple[int, int] | None:
    """Output pixels ``[d0, d1)`` whose sampling point ``(X - t) / a`` falls in the crop's pixel
    cells ``[c0 - 0.5, c1 - 0.5)`` under ``X = a * x + t`` (None: none of them)."""
    d0 = max(0, math.ceil(a * (c0 - 0.5) + t - _EXACT))
    d1 = min(n_out, math.ceil(a * (c1 - 0.5) + t - _EXACT))
    return (d0, d1) if d1 > d0 else None


def axis_plan(a: float, t: float, c0: int, c1: int, n_src: int, n_out: int) -> Span | None:
    """Plan one axis of drawing crop ``[c0, c1)`` with ``X = a * x + t`` by ``cv2.resize(fx=a)``.

    The tile owns the output pixels whose sampling point ``(X - t) / a`` falls in the crop's
    pixel cells ``[c0 - 0.5, c1 - 0.5)``.  ``cv2.resize`` with ``dsize=(0, 0), fx=a`` samples
    output ``j`` at ``s0 + (j + 0.5) / a - 0.5``: the scale is exact, but the output lands at
    ``X = t + a * s0 + 0.5 - 0.5 * a + j``, an integer only for a suitable source origin ``s0``.
    Among ``s0 = base, base - 1, ... base - 63`` the first within ``_PHASE_OK``, else the one with
    the smallest phase error is taken (``a * s0`` mod 1 spreads over [0, 1) for a generic scale);
    when that is still beyond ``PHASE_MAX`` (scales near a ratio of small integers), the same
    rule over ``base - 64 ... base - 255``. The source is padded when ``s0 < 0``.
    """
    a, t = float(a), float(t)  # Python floats: the same IEEE arithmetic, without numpy-scalar overhead
    owned = _owned_span(a, t, c0, c1, n_out)
    if owned is None:
        return None
    d0, d1 = owned
    base = math.floor((d0 - t - 0.5 + 0.5 * a) / a + _EXACT)
    s0, x_start, err = _best_origin(base, a, t, 0, _SEARCH)
    if err > PHASE_MAX:  # the wide search, same rule over the next candidates
        wide = _best_origin(base, a, t, _SEARCH, _WIDE_SEARCH)
        if wide[2] < err:
            s0, x_start, err = wide
    j0 = d0 - round(x_start)
    # source end: the crop end, the image end, or just past the last output pixel's taps
    s1 = min(n_src, c1 + 1, math.floor((d1 - 1 - t) / a) + 3)
    return Span(d0, d1, s0, s1, j0, err)


def _best_origin(base: int, a: float, t: float, first: int, stop: int) -> tuple[int, float, float]:
    """``(s0, x_start, err)`` for the first origin ``s0 = base - k``, ``first <= k < stop``, whose
    resize column 0 lands within ``_PHASE_OK`` of an integer output position ``x_start``, else for
    the best-aligned one. A plain loop: the first good origin usually comes after a few candidates,
    fewer operations than evaluating all of them as an array.
    """
    half_a = 0.5 * a
    best = (base - first, 0.0, math.inf)
    for k in range(first, stop):
        x = (base - k) * a + t + 0.5 - half_a  # the resize maps its column 0 here
        err = abs(x - round(x))
        if err < _PHASE_OK:
            return base - k, x, err
        if err < best[2]:
            best = (base - k, x, err)
    return best


def _pad_taps(scale: float) -> int:
    """Pad rows / columns next to the image that a kept output pixel can read: a kept output
    samples at or after ``-0.5 - PHASE_MAX / scale`` image pixels, two taps each."""
    return 2 + int(PHASE_MAX / scale)


def _pad_origin(part: np.ndarray, top: int, left: int, a: float, b: float) -> np.ndarray:
    """``part`` with ``top`` rows and ``left`` columns in front, in a reused scratch buffer.

    Only the few pad rows / columns next to the image that kept output pixels read are written
    (replicating the edge, like BORDER_REPLICATE), together with the copy, by one
    ``copyMakeBorder``; the rest of the pad only feeds discarded resize outputs and keeps
    whatever the buffer held (writing it cost as much as copying the crop).
    """
    h, w = part.shape[:2]
    buf = scratch("tile_pad", (h + top, w + left, 3))
    qy, qx = min(top, _pad_taps(b)), min(left, _pad_taps(a))
    cv2.copyMakeBorder(part, qy, 0, qx, 0, cv2.BORDER_REPLICATE, dst=buf[top - qy :, left - qx :])
    return buf


def _resize_plan(tile: TileParams, src_hw: tuple[int, int], out_hw: tuple[int, int]) -> DrawPlan:
    """The plan of drawing an axis-aligned, positively scaled ``tile`` by one exact-scale resize
    (``SKIP`` when it draws nothing; ``WARP`` when no source origin matches the phase within
    ``PHASE_MAX``)."""
    m = tile.matrix
    x0, y0, x1, y1 = tile.crop
    xs = axis_plan(float(m[0, 0]), float(m[0, 2]), x0, x1, src_hw[1], out_hw[1])
    ys = axis_plan(float(m[1, 1]), float(m[1, 2]), y0, y1, src_hw[0], out_hw[0])
    if xs is None or ys is None:
        return _SKIP
    if max(xs.err, ys.err) > PHASE_MAX:
        return _warp_plan(tile, out_hw)
    return DrawPlan(DrawMethod.RESIZE, Rect(xs.d0, ys.d0, xs.d1, ys.d1), xs, ys)


def _draw_planned(out: np.ndarray, src: np.ndarray, tile: TileParams, xs: Span, ys: Span) -> Rect:
    """Draw an axis-aligned tile with one exact-scale resize following the axis plans ``xs``, ``ys``;
    returns the rectangle it filled (every pixel of it is written)."""
    fx, fy = float(tile.matrix[0, 0]), float(tile.matrix[1, 1])
    part = src[max(ys.s0, 0) : ys.s1, max(xs.s0, 0) : xs.s1]
    if xs.s0 < 0 or ys.s0 < 0:  # origin before the image: pad (only feeds the seam pixels)
        part = _pad_origin(part, max(-ys.s0, 0), max(-xs.s0, 0), fx, fy)
    dst = out[ys.d0 : ys.d1, xs.d0 : xs.d1]
    rect = Rect(xs.d0, ys.d0, xs.d1, ys.d1)
    if fx == 1.0 and fy == 1.0:  # unit scale: a plain copy
        _copy_clamped(dst, part, ys.j0, xs.j0)
        return rect
    # cv2.resize's own output size for fx, fy (saturate_cast rounds half to even, as round() does)
    rw, rh = round(part.shape[1] * fx), round(part.shape[0] * fy)
    if xs.j0 == 0 and ys.j0 == 0 and rw == dst.shape[1] and rh == dst.shape[0]:
        cv2.resize(part, (0, 0), dst=dst, fx=fx, fy=fy, interpolation=cv2.INTER_LINEAR)  # straight into the output
        return rect
    full = cv2.resize(part, (0, 0), dst=scratch("tile_full", (rh, rw, 3)), fx=fx, fy=fy, interpolation=cv2.INTER_LINEAR)
    _copy_clamped(dst, full, ys.j0, xs.j0)
    return rect


def _draw_scaled_warp(out: np.ndarray, src: np.ndarray, tile: TileParams, rect: Rect) -> Rect:
    """Draw an axis-aligned tile into the rectangle it owns by ``warpAffine`` with its exact
    matrix; the crop's edge pixels repeat (``BORDER_REPLICATE``) for samples just outside it.

    The source pixels the rectangle reads are copied to a contiguous buffer first (OpenCV 5's warp
    reads its source in 2-D blocks, slower from memory than from cache) only when the tile is scaled
    by at least 1/2 on both axes together (``a * b >= 1/4``): a smaller tile reads far more source
    pixels than it writes, and copying them all cost more than it saved. Interleaved worker-less
    epochs, CPU per image: the copy at every scale cost 6 to 8 % more on a scratch-high (scale 0.9:
    factors 0.1 to 1.9) segment or detect epoch than no copy, and saved 2 % with Ultralytics' scale
    0.5 (factors 0.5 to 1.5); this rule keeps the copy there.
    """
    m = tile.matrix
    a, b, tx, ty = float(m[0, 0]), float(m[1, 1]), float(m[0, 2]), float(m[1, 2])
    x0, y0, x1, y1 = tile.crop
    # source columns / rows the owned pixels read: two taps at (X - t) / a, within the crop
    sx0, sx1 = max(x0, math.floor((rect.x0 - tx) / a)), min(x1, math.floor((rect.x1 - 1 - tx) / a) + 2)
    sy0, sy1 = max(y0, math.floor((rect.y0 - ty) / b)), min(y1, math.floor((rect.y1 - 1 - ty) / b) + 2)
    part = src[sy0:sy1, sx0:sx1]
    if a * b >= 0.25:
        part = scratch("tile_src", part.shape)
        np.copyto(part, src[sy0:sy1, sx0:sx1])
    local = np.array([[a, 0.0, a * sx0 + tx - rect.x0], [0.0, b, b * sy0 + ty - rect.y0]])
    dst = out[rect.y0 : rect.y1, rect.x0 : rect.x1]
    cv2.warpAffine(part, local, (rect.x1 - rect.x0, rect.y1 - rect.y0), dst=dst, flags=cv2.INTER_LINEAR,
                   borderMode=cv2.BORDER_REPLICATE)
    return rect


def _copy_clamped(dst: np.ndarray, full: np.ndarray, j0: int, i0: int) -> None:
    """``dst = full[j0:, i0:]``; a last row / column the resize did not produce (the crop ends at
    the image edge and the phase rounding lost it: a seam pixel) repeats its neighbour."""
    h = min(dst.shape[0], full.shape[0] - j0)
    w = min(dst.shape[1], full.shape[1] - i0)
    if h <= 0 or w <= 0:  # a sliver whose resize ends before the offset: every pixel repeats the nearest edge
        rows = np.minimum(np.arange(j0, j0 + dst.shape[0]), full.shape[0] - 1)
        cols = np.minimum(np.arange(i0, i0 + dst.shape[1]), full.shape[1] - 1)
        dst[:] = full[rows[:, None], cols[None, :]]
        return
    dst[:h, :w] = full[j0 : j0 + h, i0 : i0 + w]
    if w < dst.shape[1]:
        dst[:h, w:] = dst[:h, w - 1 : w]
    if h < dst.shape[0]:
        dst[h:] = dst[h - 1 : h]


def warp_rect(tile: TileParams, out_hw: tuple[int, int]) -> Rect | None:
    """The output rectangle a warped (rotated/sheared/perspective) tile can touch, or None."""
    m = tile.matrix
    x0, y0, x1, y1 = tile.crop
    oh, ow = out_hw
    corners = np.array([[x0 - 0.5, y0 - 0.5, 1], [x1 - 0.5, y0 - 0.5, 1], [x0 - 0.5, y1 - 0.5, 1], [x1 - 0.5, y1 - 0.5, 1]])
    p = corners @ m.T
    if not tile.is_affine:
        if (p[:, 2] <= 0).any():  # part of the crop goes to infinity: draw onto the whole output
            p = np.array([[0, 0, 1], [ow, oh, 1]], np.float64)
        else:
            p = p / p[:, 2:3]
    dx0 = max(0, math.floor(p[:, 0].min()))
    dy0 = max(0, math.floor(p[:, 1].min()))
    dx1 = min(ow, math.ceil(p[:, 0].max()) + 1)
    dy1 = min(oh, math.ceil(p[:, 1].max()) + 1)
    if dx1 <= dx0 or dy1 <= dy0:
        return None
    return Rect(dx0, dy0, dx1, dy1)


def _draw_warp(out: np.ndarray, src: np.ndarray, tile: TileParams, rect: Rect) -> Rect:
    dx0, dy0, dx1, dy1 = rect
    m = tile.matrix
    x0, y0, x1, y1 = tile.crop
    local = translation(-dx0, -dy0) @ m @ translation(x0, y0)  # crop px -> ROI px
    part = src[y0:y1, x0:x1]
    dst = out[dy0:dy1, dx0:dx1]
    size = (dx1 - dx0, dy1 - dy0)
    if tile.is_affine:
        cv2.warpAffine(part, local[:2], size, dst=dst, flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_TRANSPARENT)
    else:
        cv2.warpPerspective(part, local, size, dst=dst, flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_TRANSPARENT)
    return rect
