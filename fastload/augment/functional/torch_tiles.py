"""Batched torch kernels that draw augmentation records: tiles, mixup, flips (any device).

The GPU engines apply the same :class:`~fastload.augment.params.SampleParams` records as the CPU
reference (:func:`fastload.augment.pipeline.render_sample`), with a constant number of tensor
operations per *batch* (not per tile), so that a batch of 64 mosaics costs a few dozen kernel
launches:

1. :func:`plan_tiles` (host, numpy) turns every tile of every record into a :class:`TileRow` of numbers
   the output rectangle it may write, where its source pixels live in an :class:`ImageBank`, and
   how an output pixel maps back to them.  The rectangle and sampling rule are the reference's
   (:func:`fastload.augment.functional.tiles.tile_plan`, same ``axis_kernel``): axis-aligned
   tiles own the output pixels whose sampling point falls in the crop and are sampled either
   like ``cv2.warpAffine`` with ``BORDER_REPLICATE`` at the crop edges (kernel ``"warp"``) or the
   way ``cv2.resize`` samples the rounded source span (kernel ``"resize"``: coordinate
   ``(x + 0.5) * scale - 0.5``, clamped to the span, 11-bit weights); other tiles are sampled
   like ``cv2.warpAffine`` / ``warpPerspective`` with ``BORDER_TRANSPARENT`` (1/32-pixel
   sub-pixel grid; a pixel is written only when all four bilinear taps lie inside the crop).
2. :func:`render_images` enumerates every (tile, output pixel of its rectangle) pair as one flat
   tensor, computes source coordinates, gathers the four taps from the bank (one flat ``[P, 3]``
   uint8 tensor of HWC pixels) and scatters the results.  Tiles are painted in rounds (the k-th
   tile of every image in round k: contiguous element ranges, so no device sync), so that where
   tiles overlap the later one wins and a warped tile's edge blends with what is already there,
   as in the reference's paint order.  Flips are folded into the scatter index (they commute
   with HSV, which the caller applies afterwards).
3. :func:`render_batch` draws the main images and the mixup partners and blends them with
   YOLOv9's truncation (``floor(a * r + b * (1 - r))``).

Decoding and the *loaded* resize on the device live in :mod:`fastload.data.torch_images` (the GPU
store needs them too).

Tolerance against the CPU reference (same loaded images, same ``axis_kernel``): identical
geometry (every output pixel is owned by the same tile); values differ by at most 1 grey level
(OpenCV's fixed-point rounding) in axis-aligned tiles, 2 with rotation / shear; letterboxes are
identical (``tests/test_engine_gpu.py`` asserts these bounds and a small mean); mixup truncation can turn a 1-level difference into 1 more level.  Boxes are not computed here (see
:func:`fastload.augment.boxes.transform_labels`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch

from fastload.augment.functional import tiles
from fastload.augment.functional.tiles import DrawMethod, Span
from fastload.augment.params import ImageParams, Rect, SampleParams, TileParams, translation

__all__ = [
    "ImageBank",
    "TileRow",
    "TileTable",
    "chw_to_rows",
    "plan_tiles",
    "render_images",
    "render_batch",
    "mixup_blend_",
]

_RESIZE_COEF = 2048.0  # OpenCV INTER_RESIZE_COEF_SCALE (11-bit bilinear weights in cv2.resize)
_WARP_GRID = 32.0  # OpenCV INTER_TAB_SIZE: warps sample on a 1/32-pixel grid
_MIX_BIAS = 1e-4  # same tiny bias the CPU blend uses so that float noise truncates the same way


# ------------------------------------------------------------------------------------------- the bank
@dataclass
class ImageBank:
    """Loaded RGB images packed as HWC pixel rows in one tensor.

    Attributes:
        pixels: ``uint8 [P, 3]``; image ``k`` is rows ``offsets[k] : offsets[k] + h_k * w_k``.
        offsets: ``int64 [U]`` first row of every image (host array).
        hw: ``int64 [U, 2]`` loaded ``(h, w)`` of every image (host array).
    """

    pixels: torch.Tensor
    offsets: np.ndarray
    hw: np.ndarray

    @classmethod
    def from_images(cls, images: Sequence[torch.Tensor], device: torch.device | str | None = None) -> "ImageBank":
        """Pack CHW (``[3, h, w]``) or HWC-row (``[h*w, 3]`` with ``hw`` unknown: not allowed) uint8 tensors."""
        rows, hw = [], []
        for img in images:
            if img.dim() != 3 or img.shape[0] != 3:
                raise ValueError(f"ImageBank.from_images wants CHW uint8 tensors, got shape {tuple(img.shape)}")
            hw.append((int(img.shape[1]), int(img.shape[2])))
            rows.append(chw_to_rows(img))
        sizes = np.array([h * w for h, w in hw], np.int64)
        offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64) if len(sizes) else sizes
        pixels = torch.cat(rows, 0) if rows else torch.zeros((0, 3), dtype=torch.uint8, device=device)
        if device is not None:
            pixels = pixels.to(device, non_blocking=True)
        return cls(pixels, offsets, np.asarray(hw, np.int64).reshape(-1, 2))

    def __len__(self) -> int:
        return len(self.offsets)


def chw_to_rows(img: torch.Tensor) -> torch.Tensor:
    """``[3, h, w]`` -> ``[h * w, 3]`` contiguous HWC pixel rows (one copy)."""
    return img.permute(1, 2, 0).reshape(-1, 3).contiguous()


# ------------------------------------------------------------------------------------------- planning
class TileRow(NamedTuple):
    """One tile to draw, as :func:`plan_tiles` describes it (a row of :class:`TileTable`).

    Resize tiles sample output pixel ``X`` of their rectangle at part position
    ``(j + 0.5) * scale - 0.5`` with ``j = min(X - x0 + j0, full - 1)`` (``cv2.resize(fx=1/scale)``
    of the part, read from offset ``j0``, last row/column repeated), taps clamped to the part
    ``[0, part)`` and then to the image (the reference pads a part that starts before the image by
    replicating its edge). Warp tiles map rect-local pixels through ``inv`` into the crop.
    """

    image: int  # output image the tile belongs to
    round: int  # paint position of the tile within its output image
    rect: Rect  # output rectangle the tile may write
    warp: bool  # True: warp sampling; False: resize sampling
    clamp: bool  # warp: taps outside the crop repeat its edge and every pixel is written
    #              (BORDER_REPLICATE); False: BORDER_TRANSPARENT
    base: int  # bank row of the source image's pixel (0, 0)
    stride: int  # row stride of the source image (its loaded width)
    origin: tuple[int, int]  # source pixel (x, y) of part position 0; may be < 0 (resize)
    part: tuple[int, int]  # part size (x, y) in source pixels
    j0: tuple[int, int]  # resize: index of the rect's first pixel in the resized part
    full: tuple[int, int]  # resize: size of the resized part (later indices repeat the last)
    scale: tuple[float, float]  # resize: source pixels per output pixel
    inv: np.ndarray  # float64 [3, 3] warp: rect-local output pixel -> crop pixel


@dataclass
class TileTable:
    """Every tile to draw, one :class:`TileRow` per tile, as host arrays by field (see :func:`plan_tiles`)."""

    image: np.ndarray  # int64 [T]
    round: np.ndarray  # int64 [T]
    rect: np.ndarray  # int64 [T, 4]  (x0, y0, x1, y1)
    warp: np.ndarray  # bool  [T]
    clamp: np.ndarray  # bool [T]
    base: np.ndarray  # int64 [T]
    stride: np.ndarray  # int64 [T]
    origin: np.ndarray  # int64 [T, 2]
    part: np.ndarray  # int64 [T, 2]
    j0: np.ndarray  # int64 [T, 2]
    full: np.ndarray  # int64 [T, 2]
    scale: np.ndarray  # float64 [T, 2]
    inv: np.ndarray  # float64 [T, 3, 3]

    @classmethod
    def from_rows(cls, rows: Sequence[TileRow]) -> "TileTable":
        t = len(rows)

        def column(name: str, dtype: type, *shape: int) -> np.ndarray:
            return np.array([getattr(r, name) for r in rows], dtype).reshape(t, *shape)

        return cls(
            image=column("image", np.int64), round=column("round", np.int64), rect=column("rect", np.int64, 4),
            warp=column("warp", bool), clamp=column("clamp", bool), base=column("base", np.int64),
            stride=column("stride", np.int64), origin=column("origin", np.int64, 2), part=column("part", np.int64, 2),
            j0=column("j0", np.int64, 2), full=column("full", np.int64, 2), scale=column("scale", np.float64, 2),
            inv=column("inv", np.float64, 3, 3),
        )

    def __len__(self) -> int:
        return len(self.image)

    @property
    def elements(self) -> np.ndarray:
        """Output pixels each tile enumerates (``int64 [T]``)."""
        return (self.rect[:, 2] - self.rect[:, 0]) * (self.rect[:, 3] - self.rect[:, 1])


def _resize_row(k: int, order: int, tile: TileParams, off: int, sw: int, xs: Span, ys: Span) -> TileRow:
    """Row of an axis-aligned tile drawn by the reference's exact-scale resize (axis plans ``xs``, ``ys``)."""
    fx, fy = float(tile.matrix[0, 0]), float(tile.matrix[1, 1])
    nx, ny = xs.s1 - xs.s0, ys.s1 - ys.s0
    # cv2.resize(dsize=(0, 0), fx, fy): output size round(n * f), sampling scale exactly 1 / f
    full = (int(round(nx * fx)), int(round(ny * fy)))
    return TileRow(k, order, Rect(xs.d0, ys.d0, xs.d1, ys.d1), False, False, off, sw, (xs.s0, ys.s0), (nx, ny),
                   (xs.j0, ys.j0), full, (1.0 / fx, 1.0 / fy), np.eye(3))


def _warp_row(k: int, order: int, tile: TileParams, off: int, sw: int, rect: Rect, clamp: bool) -> TileRow:
    """Row of a tile warped into output rectangle ``rect``."""
    x0, y0, x1, y1 = tile.crop
    local = translation(-rect.x0, -rect.y0) @ tile.matrix @ translation(x0, y0)  # crop px -> rect px
    big = 1 << 40
    return TileRow(k, order, rect, True, clamp, off, sw, (x0, y0), (x1 - x0, y1 - y0), (0, 0), (big, big), (1.0, 1.0),
                   np.linalg.inv(local))


def plan_tiles(
    images: Sequence[ImageParams],
    slot_of: Callable[[int], int],
    bank: ImageBank,
    *,
    axis_kernel: str | None = None,
) -> TileTable:
    """Plan every tile of ``images`` (output image ``k`` is ``images[k]``), in paint order.

    Args:
        images: the composed images to draw (all of one output size).
        slot_of: dataset index -> position of its loaded image in ``bank``.
        bank: where the loaded images are (only its host ``offsets`` / ``hw`` are read).
        axis_kernel: the reference kernel whose sampling axis-aligned tiles follow (None: the
            reference's default for the installed OpenCV). The reference
            (:func:`fastload.augment.functional.tiles.tile_plan`) owns the tile geometry: which output
            pixels a tile owns and how its exact-scale resize is phased, so both draw the same pixels.
    """
    kernel = tiles.check_axis_kernel(axis_kernel)
    rows: list[TileRow] = []
    for k, image in enumerate(images):
        out_hw = tuple(image.out_hw)
        order = 0
        for tile in image.tiles:
            slot = int(slot_of(tile.src))
            sh, sw = (int(v) for v in bank.hw[slot])
            if tile.src_hw is not None and (sh, sw) != tuple(tile.src_hw):
                raise ValueError(f"image {tile.src} is {sh}x{sw} in the bank, the record expects the loaded shape {tile.src_hw}")
            off = int(bank.offsets[slot])
            plan = tiles.tile_plan(tile, (sh, sw), out_hw, kernel)
            if plan.method is DrawMethod.SKIP:
                continue
            if plan.method is DrawMethod.RESIZE:
                rows.append(_resize_row(k, order, tile, off, sw, plan.xs, plan.ys))
            else:  # BORDER_REPLICATE at the crop edges for the scaled warp, transparent for a general warp
                rows.append(_warp_row(k, order, tile, off, sw, plan.rect, clamp=plan.method is DrawMethod.SCALED_WARP))
            order += 1
    return TileTable.from_rows(rows)


# ------------------------------------------------------------------------------------------- drawing
def _resize_axis(l: torch.Tensor, j0: torch.Tensor, full: torch.Tensor, scale: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """cv2.resize INTER_LINEAR along one axis: part taps (i0, i1) and the weight of i0 for rect index ``l``."""
    j = torch.minimum(l + j0, full - 1)
    f = ((j.to(torch.float64) + 0.5) * scale - 0.5).to(torch.float32)
    i0 = f.floor()
    frac = f - i0
    i0 = i0.to(torch.int64)
    under = i0 < 0
    last = n - 1
    over = i0 >= last
    i0 = torch.where(under, torch.zeros_like(i0), torch.where(over, last, i0))
    frac = torch.where(under | over, torch.zeros_like(frac), frac)
    w0 = torch.round((1.0 - frac) * _RESIZE_COEF) / _RESIZE_COEF
    i1 = torch.minimum(i0 + 1, last)
    return i0, i1, w0


def _warp_coords(lx: torch.Tensor, ly: torch.Tensor, inv: torch.Tensor, affine: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """warpAffine / warpPerspective sampling on OpenCV's 1/32-pixel grid: taps ``(ix, iy)`` and fractions.

    Affine tiles reproduce warpAffine's fixed-point arithmetic (row term and column term rounded
    to 1/1024 pixel separately, plus half a grid step, then truncated to the grid); perspective
    tiles round ``x / w`` to the grid as warpPerspective does.
    """
    x = lx.to(torch.float64)
    y = ly.to(torch.float64)
    ab = 1024.0  # OpenCV AB_SCALE
    shift = ab / _WARP_GRID
    ax_ = torch.floor((torch.round((inv[:, 0, 1] * y + inv[:, 0, 2]) * ab) + shift / 2 + torch.round(inv[:, 0, 0] * x * ab)) / shift)
    ay_ = torch.floor((torch.round((inv[:, 1, 1] * y + inv[:, 1, 2]) * ab) + shift / 2 + torch.round(inv[:, 1, 0] * x * ab)) / shift)
    w = inv[:, 2, 0] * x + inv[:, 2, 1] * y + inv[:, 2, 2]
    w = torch.where(w == 0, torch.full_like(w, math.inf), _WARP_GRID / w)
    big = float(2**40)
    px = torch.round(((inv[:, 0, 0] * x + inv[:, 0, 1] * y + inv[:, 0, 2]) * w).clamp(-big, big))
    py = torch.round(((inv[:, 1, 0] * x + inv[:, 1, 1] * y + inv[:, 1, 2]) * w).clamp(-big, big))
    qx = torch.where(affine, ax_, px)
    qy = torch.where(affine, ay_, py)
    ix = torch.floor(qx / _WARP_GRID)
    iy = torch.floor(qy / _WARP_GRID)
    fx = ((qx - ix * _WARP_GRID) / _WARP_GRID).to(torch.float32)
    fy = ((qy - iy * _WARP_GRID) / _WARP_GRID).to(torch.float32)
    return ix.clamp(-2, 2**31).to(torch.int64), iy.clamp(-2, 2**31).to(torch.int64), fx, fy


def _draw_tiles(
    pixels: torch.Tensor,
    plan: TileTable,
    sel: np.ndarray,
    out_rows: torch.Tensor,
    out_hw: tuple[int, int],
    flip_lr: torch.Tensor,
    flip_ud: torch.Tensor,
) -> None:
    """Draw tiles ``sel`` into ``out_rows`` (``[N * H * W + 1, 3]``: every output pixel, then a discard row).

    ``sel`` must be sorted by paint round (see :func:`render_images`) and is drawn one round at a
    time; within a round every output pixel is written by at most one tile.
    """
    dev = pixels.device
    oh, ow = out_hw
    counts_np = plan.elements[sel]
    total = int(counts_np.sum())
    if total == 0:
        return

    def col(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a[sel])).to(dev, dtype, non_blocking=True)

    counts = col(plan.elements, torch.int64)
    rect = col(plan.rect, torch.int64)
    tid = torch.repeat_interleave(torch.arange(len(counts_np), device=dev), counts, output_size=total)
    start = torch.cumsum(counts, 0) - counts
    local = torch.arange(total, device=dev) - start[tid]
    rw = (rect[:, 2] - rect[:, 0])[tid]
    lx = local % rw
    ly = torch.div(local, rw, rounding_mode="floor")
    del local, rw

    part = col(plan.part, torch.int64)
    nx, ny = part[tid, 0], part[tid, 1]
    warp = col(plan.warp, torch.bool)[tid]
    # resize sampling: always written inside its rectangle, taps clamped to the part
    scale = col(plan.scale, torch.float64)[tid]
    j0 = col(plan.j0, torch.int64)[tid]
    full = col(plan.full, torch.int64)[tid]
    rx0, rx1, rwx = _resize_axis(lx, j0[:, 0], full[:, 0], scale[:, 0], nx)
    ry0, ry1, rwy = _resize_axis(ly, j0[:, 1], full[:, 1], scale[:, 1], ny)
    del scale, j0, full
    # warp sampling: taps outside the crop take the destination's current value
    # (BORDER_TRANSPARENT); a pixel with no tap inside is not written
    inv = col(plan.inv, torch.float64)[tid]
    affine = (inv[:, 2, 0] == 0) & (inv[:, 2, 1] == 0) & (inv[:, 2, 2] == 1)
    wx0, wy0, wfx, wfy = _warp_coords(lx, ly, inv, affine)
    del inv, affine
    inx0 = (wx0 >= 0) & (wx0 < nx)
    inx1 = (wx0 + 1 >= 0) & (wx0 + 1 < nx)
    iny0 = (wy0 >= 0) & (wy0 < ny)
    iny1 = (wy0 + 1 >= 0) & (wy0 + 1 < ny)
    clamp = col(plan.clamp, torch.bool)[tid]
    # BORDER_REPLICATE warps: taps clamped to the crop (the resize taps are clamped already)
    cwx0, cwy0 = torch.minimum(wx0.clamp(min=0), nx - 1), torch.minimum(wy0.clamp(min=0), ny - 1)
    cwx1, cwy1 = torch.minimum((wx0 + 1).clamp(min=0), nx - 1), torch.minimum((wy0 + 1).clamp(min=0), ny - 1)
    x0 = torch.where(warp, torch.where(clamp, cwx0, wx0), rx0)
    x1 = torch.where(warp, torch.where(clamp, cwx1, wx0 + 1), rx1)
    y0 = torch.where(warp, torch.where(clamp, cwy0, wy0), ry0)
    y1 = torch.where(warp, torch.where(clamp, cwy1, wy0 + 1), ry1)
    del cwx0, cwy0, cwx1, cwy1
    ax = torch.where(warp, 1.0 - wfx, rwx)  # weight of the x0 tap
    ay = torch.where(warp, 1.0 - wfy, rwy)
    bx, by = 1.0 - ax, 1.0 - ay
    solid = ~warp | clamp
    weights = (ay * ax, ay * bx, by * ax, by * bx)
    inside = (
        solid | (iny0 & inx0), solid | (iny0 & inx1), solid | (iny1 & inx0), solid | (iny1 & inx1),
    )
    del rx0, rx1, ry0, ry1, wx0, wy0, wfx, wfy, rwx, rwy, inx0, inx1, iny0, iny1, nx, ny, part, ax, ay, bx, by

    base = col(plan.base, torch.int64)[tid]
    stride = col(plan.stride, torch.int64)[tid]
    origin = col(plan.origin, torch.int64)[tid]
    # part -> image coordinates; a part starting before the image repeats its edge (clamp at 0)
    x0 = (x0 + origin[:, 0]).clamp_(min=0)
    x1 = (x1 + origin[:, 0]).clamp_(min=0)
    y0 = (y0 + origin[:, 1]).clamp_(min=0)
    y1 = (y1 + origin[:, 1]).clamp_(min=0)
    del origin
    limit = pixels.shape[0] - 1
    acc = torch.zeros((total, 3), dtype=torch.float32, device=dev)
    held = torch.zeros(total, dtype=torch.float32, device=dev)  # weight left to the destination
    written = torch.zeros(total, dtype=torch.bool, device=dev)
    for (yy, xx), w, ins in zip(((y0, x0), (y0, x1), (y1, x0), (y1, x1)), weights, inside):
        # outside taps read row 0 (clamped) with weight moved to the destination
        row = (base + yy * stride + xx).clamp_(0, limit)
        w_in = torch.where(ins, w, torch.zeros_like(w))
        acc.addcmul_(pixels[row].to(torch.float32), w_in[:, None])
        held.add_(w - w_in)
        written |= ins & (w > 0)
    del base, stride, x0, x1, y0, y1, weights, inside, warp, solid, clamp

    img = col(plan.image, torch.int64)[tid]
    gx = rect[tid, 0] + lx
    gy = rect[tid, 1] + ly
    del lx, ly, rect
    gx = torch.where(flip_lr[img], ow - 1 - gx, gx)
    gy = torch.where(flip_ud[img], oh - 1 - gy, gy)
    dest = torch.where(written, (img * oh + gy) * ow + gx, torch.full_like(gx, out_rows.shape[0] - 1))
    del gx, gy, img, tid, written
    # rounds in paint order: contiguous element ranges (host arithmetic, no device sync)
    rounds = plan.round[sel]
    bounds = np.concatenate(([0], np.cumsum(counts_np)))
    edges = np.nonzero(np.diff(rounds))[0] + 1
    for a, b in zip(np.concatenate(([0], edges)), np.concatenate((edges, [len(sel)]))):
        e0, e1 = int(bounds[a]), int(bounds[b])
        d = dest[e0:e1]
        h = held[e0:e1, None]
        val = acc[e0:e1] + h * out_rows[d].to(torch.float32)
        out_rows.index_put_((d,), val.add_(0.5).floor_().clamp_(0, 255).to(torch.uint8))


def render_images(
    images: Sequence[ImageParams],
    bank: ImageBank,
    slot_of: Callable[[int], int],
    *,
    flip_lr: Sequence[bool] | None = None,
    flip_ud: Sequence[bool] | None = None,
    max_elements: int = 1 << 22,
    axis_kernel: str | None = None,
) -> torch.Tensor:
    """Draw ``images`` (one output size) from ``bank``; returns ``uint8 [N, H, W, 3]`` on the bank's device.

    ``flip_lr`` / ``flip_ud`` flip output image ``k`` (folded into where pixels are written).
    ``max_elements`` bounds the pixels enumerated per step (memory: roughly 200 bytes each);
    whole output images are never split between steps. ``axis_kernel``: see :func:`plan_tiles`.
    """
    n = len(images)
    dev = bank.pixels.device
    if n == 0:
        return torch.zeros((0, 0, 0, 3), dtype=torch.uint8, device=dev)
    hws = {tuple(im.out_hw) for im in images}
    if len(hws) != 1:
        raise ValueError(f"images of one batch must share an output size, got {sorted(hws)}")
    oh, ow = hws.pop()
    fills = torch.tensor([int(im.fill) for im in images], dtype=torch.uint8)
    out = torch.empty((n * oh * ow + 1, 3), dtype=torch.uint8, device=dev)
    out[:-1].view(n, oh * ow, 3).copy_(fills.to(dev).view(n, 1, 1).expand(n, oh * ow, 3))
    plan = plan_tiles(images, slot_of, bank, axis_kernel=axis_kernel)
    flr = torch.tensor([bool(v) for v in (flip_lr or [False] * n)], dtype=torch.bool).to(dev, non_blocking=True)
    fud = torch.tensor([bool(v) for v in (flip_ud or [False] * n)], dtype=torch.bool).to(dev, non_blocking=True)
    if len(plan):
        # groups of whole output images with at most max_elements pixels to enumerate each
        per_image = np.bincount(plan.image, weights=plan.elements, minlength=n)
        start = 0
        while start < n:
            stop, acc = start, 0.0
            while stop < n and (stop == start or acc + per_image[stop] <= max_elements):
                acc += per_image[stop]
                stop += 1
            sel = np.nonzero((plan.image >= start) & (plan.image < stop))[0]
            sel = sel[np.lexsort((plan.image[sel], plan.round[sel]))]  # by round, then image
            _draw_tiles(bank.pixels, plan, sel, out, (oh, ow), flr, fud)
            start = stop
    return out[:-1].view(n, oh, ow, 3)


def mixup_blend_(img: torch.Tensor, other: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """YOLOv9 mixup in place: ``img = floor(img * r + other * (1 - r))`` (``ratio``: float [N])."""
    r = ratio.to(img.device, torch.float32).view(-1, *([1] * (img.dim() - 1)))
    mixed = img.to(torch.float32) * r + other.to(torch.float32) * (1.0 - r)
    img.copy_(mixed.add_(_MIX_BIAS).floor_().clamp_(0, 255).to(torch.uint8))
    return img


def render_batch(
    records: Sequence[SampleParams],
    bank: ImageBank,
    slot_of: Callable[[int], int],
    *,
    max_elements: int = 1 << 22,
    axis_kernel: str | None = None,
) -> torch.Tensor:
    """Draw records into ``uint8 [B, H, W, 3]`` (tiles, mixup, flips; no HSV) on the bank's device.

    HSV is left to the caller (``apply_hsv_batch`` on the whole batch): it is per pixel, so
    applying it after the flips is exact.
    """
    flr = [r.flip_lr for r in records]
    fud = [r.flip_ud for r in records]
    out = render_images([r.image for r in records], bank, slot_of, flip_lr=flr, flip_ud=fud, max_elements=max_elements,
                        axis_kernel=axis_kernel)
    mixed = [k for k, r in enumerate(records) if r.mixup is not None]
    if mixed:
        other = render_images([records[k].mixup for k in mixed], bank, slot_of,  # type: ignore[misc]
                              flip_lr=[flr[k] for k in mixed], flip_ud=[fud[k] for k in mixed],
                              max_elements=max_elements, axis_kernel=axis_kernel)
        idx = torch.tensor(mixed, dtype=torch.int64).to(out.device, non_blocking=True)
        ratio = torch.tensor([records[k].mixup_ratio for k in mixed], dtype=torch.float32)
        out[idx] = mixup_blend_(out[idx], other, ratio)
    return out
