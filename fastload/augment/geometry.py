"""Moving polygons, keypoints and oriented boxes with augmentation records (segment, pose and obb tasks).

:func:`transform_geometry` moves every instance of a batch of :class:`~fastload.augment.params.SampleParams`
records: its box (the ``targets`` of :func:`~fastload.augment.boxes.batch_targets`, same per-sample order:
main image tiles, then the mixup partner's) and its points (a segment's polygon, a pose row's keypoints, an
oriented box's corners). It reads labels through a callable ``index -> (rows, points, point_offsets)``:
``rows`` float32 [n, 5] ``(cls, xc, yc, w, h)`` normalised, ``points`` float32 [p, D] normalised to the image
(D = 2: polygon points; D = 3: keypoints ``x, y, visibility``), ``point_offsets`` int64 [n + 1] (row ``r`` owns
``points[point_offsets[r]:point_offsets[r + 1]]``).

Each task follows its reference's semantics, because masks are compared with the reference's masks pixel by
pixel (a 0.5 px shift of a polygon costs a 40 px-wide instance about 1 % of its mask IoU at ``mask_ratio=4``):

* points move with the tile's matrix applied to their coordinates as both references apply theirs (pixel
  coordinate ``u * w`` of the loaded image straight through the matrix; detection boxes instead follow the
  pixels exactly, :mod:`fastload.augment.boxes`); validation letterboxes move them with the tile's
  ``box_matrix`` in the reference's own float32 arithmetic, so they are the reference's bit for bit; YOLOv9's
  training sample without mosaic moves them by its letterbox's float pad, as YOLOv9 does;
* ``"yolov9"`` (``utils/segment``: segment only): a mosaic tile clips its polygons to what it shows (YOLOv9
  clips to its canvas: the same region for points inside the image), then each polygon is resampled to
  1000 points along its closed outline (``resample_segments``), warped, and its box re-derived from the warped
  points that lie inside the output (``segment2box``); the polygon itself is not clipped. Candidates as
  YOLOv9's with ``area_thr=0.01``;
* ``"ultralytics"`` (8.4): polygons are resampled when loaded (1000 points, 100 for oriented boxes, the
  original vertices kept), clipped to the tile, warped; a segment's box is its polygon's extent inside the
  output, the polygon is then clipped to that box; oriented boxes keep their direction when cut by an edge
  (``preserve_obb``: the part inside, as a rectangle in the box's own orientation); keypoints leaving the tile
  or the output get visibility 0 and are clipped; pose boxes move as Ultralytics moves them (corners through the
  matrix, candidate filter with its detection threshold), not as the detection boxes (pixel-exact, up to 0.5 px
  away: enough to move a box across the filter's thresholds).

A row without points (an image whose label file has box rows only) in a segment or obb task: both references fail
on it except YOLOv9's validation with one mask per instance, which keeps its box with an empty mask (so does this
module there; elsewhere it refuses such a row, and ``fastload.loader`` refuses the set up front).

Copy-paste (segment, both recipes: :class:`~fastload.augment.params.CopyPaste`) appends the instances
:func:`paste_selection` picks, mirrored across the canvas, before the warp; the polygons its pixel mask is filled from
are found on the way (:func:`move_record` moves a record's labels before its pixels are drawn and keeps them;
:func:`paste_outlines` moves one image's for them alone).
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterator, Literal, Sequence, get_args

import cv2
import numpy as np

from fastload.augment.boxes import batch_images, box_candidates, moved_boxes, xyxy_to_xywhn
from fastload.augment.params import CopyPaste, ImageParams, Recipe, SampleParams, TileParams, letterbox_fit, translation

__all__ = [
    "GeometryLabels",
    "LoadedPolygons",
    "Task",
    "TASKS",
    "Geometry",
    "transform_geometry",
    "RecordGeometry",
    "move_record",
    "move_records",
    "resample_polygons",
    "resample_polygon",
    "obb_xywhr",
    "paste_selection",
    "paste_outlines",
]

#: ``index -> (rows float32 [n, 5], points float32 [p, D], point_offsets int64 [n + 1])``, normalised.
GeometryLabels = Callable[[int], tuple[np.ndarray, np.ndarray, np.ndarray]]

#: The tasks with points: ``"segment"`` (polygons), ``"pose"`` (keypoints), ``"obb"`` (oriented boxes).
Task = Literal["segment", "pose", "obb"]
TASKS: tuple[str, ...] = get_args(Task)

#: Points per polygon after resampling (YOLOv9 ``resample_segments``; Ultralytics ``segment_resamples``).
SEGMENT_POINTS = 1000
OBB_POINTS = 100
#: The candidate filter's area threshold when boxes come from polygons (both references).
SEGMENT_AREA_THR = 0.01

_EDGE_IN = translation(-0.5, -0.5)
_EDGE_OUT = translation(0.5, 0.5)


@dataclass(frozen=True)
class Geometry:
    """The moved labels of a batch, one entry per instance, in :func:`batch_targets` order.

    Attributes:
        targets: float32 [N, 6] ``(position in the batch, cls, xc, yc, w, h)`` normalised to the output, flips
            applied (YOLOv9 ``targets``).
        points: float64 [P, D] output pixels *before* the flips (YOLOv9 rasterises its masks unflipped and flips
            the rasters: :mod:`fastload.augment.masks`); :meth:`flipped_points` gives them after.
        offsets: int64 [N + 1]: instance ``i`` owns ``points[offsets[i]:offsets[i + 1]]``.
        flip_ud / flip_lr: bool [N], the flips of each instance's sample.
        out_hw: the output ``(h, w)``.
        task / recipe: what moved them.
    """

    targets: np.ndarray
    points: np.ndarray
    offsets: np.ndarray
    flip_ud: np.ndarray
    flip_lr: np.ndarray
    out_hw: tuple[int, int]
    task: Task
    recipe: Recipe

    def __len__(self) -> int:
        return len(self.targets)

    def polygons(self, flipped: bool = False) -> list[np.ndarray]:
        """Instance ``i``'s points as an array ``[k_i, D]`` (after the flips with ``flipped``)."""
        pts = self.flipped_points() if flipped else self.points
        return [pts[a:b] for a, b in zip(self.offsets[:-1].tolist(), self.offsets[1:].tolist())]

    def flipped_points(self, flip_idx: Sequence[int] | None = None) -> np.ndarray:
        """``points`` after the flips (``x -> w - x``, ``y -> h - y``, Ultralytics' ``Instances.fliplr/flipud``);
        keypoints of a flipped instance are reordered through ``flip_idx`` for each flip, as Ultralytics'
        ``RandomFlip`` does (pass it for pose: left and right joints swap)."""
        out = self.points.copy()
        h, w = self.out_hw
        counts = np.diff(self.offsets)
        for flag, axis, size in ((self.flip_ud, 1, h), (self.flip_lr, 0, w)):
            if flag.any():  # in place where flipped (boolean indexing would gather and scatter: five times the cost)
                coord = out[:, axis]
                np.subtract(size, coord, out=coord, where=np.repeat(flag, counts))
        if self.task == "pose" and flip_idx is not None and len(self):
            k = int(counts[0])
            if len(flip_idx) != k:
                raise ValueError(f"flip_idx has {len(flip_idx)} entries for {k} keypoints per instance")
            kp = out.reshape(len(self), k, -1)
            perm = np.asarray(flip_idx, np.intp)
            for flag in (self.flip_ud, self.flip_lr):
                kp[flag] = kp[flag][:, perm]
        return out


# ----------------------------------------------------------------------------------------- polygons
@functools.lru_cache(maxsize=4096)
def _spacing(vertices: int, n: int, keep_vertices: bool) -> tuple[np.ndarray, np.ndarray, int]:
    """How the ``n`` resampled points of a polygon of ``vertices`` vertices are interpolated: how many of them start
    from each vertex (in order: each point starts from a vertex and moves towards the next, the first after the last),
    the fraction of the way for each, and how many trailing points sit on the closing point (the first vertex again,
    as ``np.interp`` returns it there).

    The positions (in vertex index along the closed outline) are ``linspace(0, vertices, n)``, or with
    ``keep_vertices`` the integers ``0..vertices`` merged into ``linspace(0, vertices, n - vertices - 1)`` while
    that leaves room."""
    if keep_vertices and vertices + 1 < n:
        t = np.linspace(0, vertices, n - vertices - 1)
        xp = np.arange(vertices + 1)
        t = np.insert(t, np.searchsorted(t, xp), xp)
    else:
        t = np.linspace(0, vertices, n)
    start = np.minimum(np.floor(t).astype(np.int64), vertices - 1)  # non-decreasing: runs of each vertex
    runs = np.bincount(start, minlength=vertices)
    frac = t - start
    for a in (runs, frac):
        a.setflags(write=False)
    return runs, frac, int(np.count_nonzero(t >= vertices))


def resample_polygons(points: np.ndarray, offsets: np.ndarray, n: int, keep_vertices: bool) -> np.ndarray:
    """[k, n, 2]: each polygon ``points[offsets[i]:offsets[i + 1]]`` resampled to ``n`` points along its closed
    outline, evenly in vertex index, by linear interpolation (``np.interp``'s arithmetic, bit for bit, in one
    pass for all).

    ``keep_vertices=False``: YOLOv9's ``resample_segments`` (float64; a vertex is kept only where it falls on the
    spacing). ``True``: Ultralytics' (float32; every vertex kept, the other points spaced between; a polygon of
    ``n`` points is returned unchanged)."""
    offsets = np.asarray(offsets, np.int64)
    counts = np.diff(offsets)
    out = np.stack(_resampled_planes(points, offsets, n, keep_vertices), -1)
    if not keep_vertices:
        return out
    out = out.astype(np.float32)
    same = np.flatnonzero(counts == n)
    if len(same):  # left as they are
        out[same] = np.asarray(points, np.float32)[offsets[:-1, None][same] + np.arange(n)]
    return out


def _resampled_planes(points: np.ndarray, offsets: np.ndarray, n: int, keep_vertices: bool
                      ) -> tuple[np.ndarray, np.ndarray]:
    """float64 ``(x, y)`` [k, n] of :func:`resample_polygons` (``offsets`` int64), each a contiguous plane (numpy
    reads a coordinate of [k, n, 2] points several times slower)."""
    counts = np.diff(offsets)
    if len(counts) and counts.min() < 1:
        raise ValueError("resample_polygons: every polygon needs at least one point")
    if not len(counts):
        return np.empty((0, n)), np.empty((0, n))
    plans = [_spacing(c, n, keep_vertices) for c in counts.tolist()]
    tails = [p[2] for p in plans]
    runs = np.concatenate([p[0] for p in plans])  # each vertex repeated for the points starting from it
    frac = np.stack([p[1] for p in plans])
    following = np.arange(1, len(runs) + 1)  # each vertex's next one, the polygon's first after its last
    following[offsets[1:] - 1] = offsets[:-1]
    points = np.asarray(points)
    planes = []
    for axis in range(2):
        coord = np.ascontiguousarray(points[:, axis], dtype=np.float64)
        base = np.repeat(coord, runs).reshape(-1, n)
        step = np.repeat(coord.take(following), runs).reshape(-1, n)
        step -= base
        step *= frac
        step += base  # np.interp: slope * (x - xp[j]) + fp[j], the slope over a unit step
        if len(set(tails)) == 1:  # the usual case: every polygon ends on the same number of closing points
            step[:, n - tails[0]:] = coord[offsets[:-1], None]
        else:
            for i, tail in enumerate(tails):
                step[i, n - tail:] = coord[offsets[i]]
        planes.append(step)
    return planes[0], planes[1]


def resample_polygon(poly: np.ndarray, n: int, keep_vertices: bool) -> np.ndarray:
    """One polygon ``[k, 2]`` through :func:`resample_polygons`: ``[n, 2]``."""
    return resample_polygons(poly, np.array([0, len(poly)]), n, keep_vertices)[0]


class LoadedPolygons:
    """A bounded memo of each image's polygons resampled as Ultralytics' dataset resamples them when loaded
    (:func:`resample_polygons` with ``keep_vertices``), for ONE labels source: a pure function of an image's labels
    and the point count, which every tile the image fills (a mosaic draws each image about four times an epoch)
    would otherwise compute again; with it, each image's labels checked once (:meth:`longest`, both recipes). Least
    recently used images go beyond ``max_bytes`` (their arrays, and :data:`_IMAGE_BYTES` for each image's entry).
    Ultralytics' segment training images are resampled whole and kept while the memo is under its bound; beyond it
    (a set whose polygons exceed it: COCO's hold about 7 GB), only their instances that stay are resampled, and
    nothing more is kept (:meth:`keeps`)."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[int, _LoadedImage] = OrderedDict()
        self._bytes = 0

    def longest(self, src: int, rows: np.ndarray, points: np.ndarray, offsets: np.ndarray) -> int:
        """The most points of one of image ``src``'s polygons (its labels ``rows``, ``points``, ``offsets``, checked
        as :func:`_tile_polygons` checks a training image's the first time, then remembered)."""
        entry = self._image(int(src))
        if entry.longest < 0:
            _, off = _tile_polygons(rows, points, offsets, src, False)
            entry.longest = int(np.diff(off).max())
        return entry.longest

    def resampled(self, src: int, points: np.ndarray, offsets: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``(points float32 [k * n, 2], extent float32 [k, 4])``: image ``src``'s polygons ``points`` / ``offsets``
        resampled to ``n`` points each, and each one's ``(x0, y0, x1, y1)`` (read-only: shared between calls)."""
        entry = self._image(int(src))
        got = entry.counts.get(int(n))
        if got is not None:
            return got
        poly = resample_polygons(np.asarray(points, np.float32), np.asarray(offsets, np.int64), n, True)
        got = entry.counts[int(n)] = (poly.reshape(-1, 2), np.concatenate(_extent(poly), 1))
        for a in got:
            a.setflags(write=False)
        self._grow(got[0].nbytes + got[1].nbytes)
        return got

    def keeps(self, src: int, n: int) -> bool:
        """Whether :meth:`resampled` of image ``src`` at ``n`` points is served from the memo or kept in it: it has
        them, or room for more (under its bound: beyond it, a caller that needs few of an image's polygons had better
        resample those alone)."""
        entry = self._entries.get(int(src))
        return (entry is not None and int(n) in entry.counts) or self._bytes < self.max_bytes

    def _image(self, src: int) -> _LoadedImage:
        entry = self._entries.get(src)
        if entry is not None:
            self._entries.move_to_end(src)
            return entry
        entry = self._entries[src] = _LoadedImage()
        self._grow(_IMAGE_BYTES)
        return entry

    def _grow(self, nbytes: int) -> None:
        """Count ``nbytes`` more; drop the least recently used images beyond the bound (never the newest)."""
        self._bytes += nbytes
        while self._bytes > self.max_bytes and len(self._entries) > 1:
            old = self._entries.popitem(last=False)[1]
            self._bytes -= _IMAGE_BYTES + sum(a.nbytes + b.nbytes for a, b in old.counts.values())


#: what one image's entry in :class:`LoadedPolygons` costs beside its arrays (the entry, its dict, its key), about
_IMAGE_BYTES = 400


@dataclass
class _LoadedImage:
    """What :class:`LoadedPolygons` keeps of one image: its longest polygon's point count (-1: not checked yet) and
    its polygons resampled, by point count."""

    longest: int = -1
    counts: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


def _extent(poly: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(lo, hi)`` [k, 2]: each polygon's smallest and largest x and y (``poly`` [k, n, 2]; one reduction per
    coordinate: numpy reduces the middle axis of a [k, n, 2] array some fifty times slower)."""
    return _plane_extent(poly[..., 0], poly[..., 1])


def _plane_extent(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_extent` of polygons given as their coordinate planes ``x``, ``y`` [k, n]."""
    return np.stack((x.min(1), y.min(1)), 1), np.stack((x.max(1), y.max(1)), 1)


def _masked_extent(x: np.ndarray, y: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """[k, 4] extent ``(x0, y0, x1, y1)`` of the ``valid`` points of each row of ``x``, ``y`` [k, m]
    (``(inf, inf, -inf, -inf)`` for a row without one)."""
    return np.stack([np.where(valid, x, np.inf).min(1), np.where(valid, y, np.inf).min(1),
                     np.where(valid, x, -np.inf).max(1), np.where(valid, y, -np.inf).max(1)], 1)


def _inside_vertex_boxes(x: np.ndarray, y: np.ndarray, w: float, h: float) -> np.ndarray:
    """YOLOv9 ``segment2box`` of each polygon of points ``x``, ``y`` [k, n]: the extent of its points inside
    ``[0, w] x [0, h]``; zeros when none is, or when every inside x is 0 (its ``any(x)`` test)."""
    box = np.concatenate(_plane_extent(x, y), 1)
    box[box[:, 2] == 0] = 0.0  # a polygon inside: its x are >= 0, all 0 when the largest is
    crossing = np.flatnonzero((box[:, 0] < 0) | (box[:, 1] < 0) | (box[:, 2] > w) | (box[:, 3] > h))
    if len(crossing):  # only these have points outside
        x, y = x[crossing], y[crossing]
        inside = (x >= 0) & (y >= 0) & (x <= w) & (y <= h)
        part = _masked_extent(x, y, inside)
        part[~(inside & (x != 0)).any(1)] = 0.0  # also every row without an inside point
        box[crossing] = part
    return box


def _contains(x: np.ndarray, y: np.ndarray, px: float, py: float) -> np.ndarray:
    """bool [k]: whether ``(px, py)`` lies inside each closed polygon of points ``x``, ``y`` [k, n] (even-odd rule)."""
    xn, yn = np.roll(x, -1, 1), np.roll(y, -1, 1)
    spans = (y > py) != (yn > py)
    with np.errstate(divide="ignore", invalid="ignore"):
        at = (xn - x) * (py - y) / (yn - y) + x
    return ((spans & (px < at)).sum(1) % 2).astype(bool)


def _clipped_extent_boxes(x: np.ndarray, y: np.ndarray, w: float, h: float) -> np.ndarray:
    """Ultralytics 8.4 ``segment2box`` of each polygon of points ``x``, ``y`` [k, n] (coordinate planes: numpy reduces
    a contiguous plane several times faster than a coordinate of [k, n, 2] points): the extent of its part inside
    ``[0, w] x [0, h]`` (inside vertices, crossings of its edges with the border, image corners inside it); zeros
    when nothing is inside."""
    lo, hi = _plane_extent(x, y)
    box = np.concatenate((lo, hi), 1)
    outside = (hi[:, 0] < 0) | (hi[:, 1] < 0) | (lo[:, 0] > w) | (lo[:, 1] > h)
    box[outside] = 0.0
    crossing = np.flatnonzero(~outside & ((lo < 0).any(1) | (hi[:, 0] > w) | (hi[:, 1] > h)))
    if not len(crossing):
        return box
    planes = (x[crossing], y[crossing])
    px, py = planes
    ext = _masked_extent(px, py, (px >= 0) & (py >= 0) & (px <= w) & (py <= h))
    c_lo, c_hi = lo[crossing], hi[crossing]
    n = px.shape[1]
    for axis, bound, lim, reach in ((0, 0.0, h, c_lo[:, 0] <= 0), (0, w, h, c_hi[:, 0] >= w),
                                    (1, 0.0, w, c_lo[:, 1] <= 0), (1, h, w, c_hi[:, 1] >= h)):
        # only the polygons reaching the border line have edges with it between their ends, and only those edges
        # can cross it (the others fail the t test below)
        sub = np.flatnonzero(reach)
        a = planes[axis][sub]
        below, above = a <= bound, a >= bound
        row, k = np.nonzero((below | np.roll(below, -1, 1)) & (above | np.roll(above, -1, 1)))
        r, k_next = sub[row], (k + 1) % n
        start = [plane[r, k] for plane in planes]
        delta = [plane[r, k_next] - s for plane, s in zip(planes, start)]
        with np.errstate(divide="ignore", invalid="ignore"):  # an edge along the border crosses nowhere
            t = (bound - start[axis]) / delta[axis]
            cross = np.stack([s + t * d for s, d in zip(start, delta)], 1)
        other = cross[:, 1 - axis]
        ok = (t >= 0) & (t <= 1) & (other >= 0) & (other <= lim)
        _extend(ext, r[ok], cross[ok])
    for corner in ((0.0, 0.0), (w, 0.0), (0.0, h), (w, h)):
        near = np.flatnonzero(((c_lo <= corner) & (c_hi >= corner)).all(1))
        inside = near[_contains(px[near], py[near], *corner)]
        _extend(ext, inside, np.broadcast_to(np.array(corner), (len(inside), 2)))
    ext[np.isinf(ext).any(1)] = 0.0
    box[crossing] = ext
    return box


def _extend(ext: np.ndarray, rows: np.ndarray, pts: np.ndarray) -> None:
    """Grow the extents ``ext`` [k, 4] of ``rows`` by the points ``pts`` [m, 2] (a row may repeat)."""
    for axis in range(2):
        np.minimum.at(ext[:, axis], rows, pts[:, axis])
        np.maximum.at(ext[:, axis + 2], rows, pts[:, axis])


def _aligned_visible(poly: np.ndarray, rect: tuple[float, float, float, float], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Ultralytics' ``preserve_obb`` clip of one oriented box crossing ``rect`` ``(x0, y0, x1, y1)``: the extent
    of its visible part, and that part's bounding rectangle in the box's own orientation as ``n`` points (both
    zero when nothing is visible)."""
    x0, y0, x1, y1 = rect
    canvas = np.array(((x0, y0), (x1, y0), (x1, y1), (x0, y1)), np.float32)
    area, visible = cv2.intersectConvexConvex(cv2.convexHull(poly.astype(np.float32)), canvas)
    if visible is None or area <= 0:
        return np.zeros(4), np.zeros((n, 2))
    visible = visible.reshape(-1, 2)
    box = np.concatenate((visible.min(0), visible.max(0))).astype(np.float64)
    (_, _), (bw, bh), angle = cv2.minAreaRect(poly.astype(np.float32))
    if bw < bh:
        angle += 90
    angle = np.deg2rad(angle)
    cos, sin = np.cos(angle), np.sin(angle)
    basis = np.array(((cos, -sin), (sin, cos)), np.float32)
    aligned = visible @ basis
    (u1, v1), (u2, v2) = aligned.min(0), aligned.max(0)
    corners = np.array(((u2, v2), (u2, v1), (u1, v1), (u1, v2)), np.float32)
    return box, resample_polygon(corners @ basis.T, n, True).astype(np.float64)


def _scaled(pts: np.ndarray, w: float | np.ndarray, h: float | np.ndarray) -> np.ndarray:
    """float64 ``pts * (w, h)`` for points [..., 2], one coordinate at a time (numpy runs element-wise operations
    against a trailing axis of 2 several times slower); ``w``, ``h``: a loaded shape's Python ints (float32 points
    give float32 products), or float32 arrays broadcasting against ``pts[..., 0]`` (a shape per row: the same
    products)."""
    out = np.empty(pts.shape)
    np.multiply(pts[..., 0], w, out=out[..., 0])
    np.multiply(pts[..., 1], h, out=out[..., 1])
    return out


def _clip_points(pts: np.ndarray, lo: np.ndarray | Sequence[float], hi: np.ndarray | Sequence[float]) -> None:
    """Clip points [..., 2] in place to ``[lo, hi]`` per coordinate (``lo``, ``hi``: ``(x, y)`` pairs, or arrays
    [..., 2] broadcasting against the points), one coordinate at a time (:func:`_scaled`)."""
    lo, hi = np.asarray(lo, np.float64), np.asarray(hi, np.float64)
    for axis in range(2):
        np.maximum(pts[..., axis], lo[..., axis], out=pts[..., axis])
        np.minimum(pts[..., axis], hi[..., axis], out=pts[..., axis])


def _apply_planes(m: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Points ``x``, ``y`` [k, n], row ``i`` through the 3x3 matrix ``m[i]`` (perspective divide for the matrices
    with a perspective row), as the planes ``(x, y)``; written out per coordinate, several times faster than a
    matrix product with an inner dimension of 2, and for all rows at once."""
    out = []
    for axis in range(2):  # (x * a + y * b) + c, summed in place: two temporaries fewer
        plane = x * m[:, axis, 0, None]
        plane += y * m[:, axis, 1, None]
        plane += m[:, axis, 2, None]
        out.append(plane)
    projective = np.flatnonzero((m[:, 2, 0] != 0.0) | (m[:, 2, 1] != 0.0) | (m[:, 2, 2] != 1.0))
    if len(projective):
        p = m[projective]
        depth = x[projective] * p[:, 2, 0, None] + y[projective] * p[:, 2, 1, None] + p[:, 2, 2, None]
        for plane in out:
            plane[projective] /= depth
    return out[0], out[1]


def _letterbox_points(pts32: np.ndarray, hw: tuple[int, int], e: np.ndarray, recipe: Recipe) -> np.ndarray:
    """Normalised float32 points of a validation letterbox tile in output pixels, in the reference's own float32
    arithmetic (``e``: the edge-convention letterbox, scale ``r`` and pad): YOLOv9 ``xyn2xy(x, r * w, r * h,
    padw, padh)``, Ultralytics ``denormalize``, ``scale(r)``, ``add_padding(left, top)``."""
    h, w = hw
    out = np.empty(pts32.shape, np.float32)
    for axis, size in ((0, w), (1, h)):
        r, pad = e[axis, axis], e[axis, 2]
        if recipe == "yolov9":
            out[:, axis] = pts32[:, axis] * np.float32(r * size) + np.float32(pad)
        else:
            out[:, axis] = pts32[:, axis] * np.float32(size) * np.float32(r) + np.float32(round(pad))
    return out.astype(np.float64)


def _tile_polygons(rows: np.ndarray, points: np.ndarray, offsets: np.ndarray, src: int, pointless: bool
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The normalised float32 polygons of an image's rows as ``(points [p, 2], offsets [n + 1])``. ``pointless``:
    rows without points may be there (they keep none: an empty mask); else such a row is refused, as both references
    fail on it (module docstring)."""
    if points.ndim != 2 or points.shape[1] != 2:
        raise ValueError(f"labels of image {src}: polygon points must be [p, 2], got {points.shape}")
    offsets = np.asarray(offsets, np.int64)
    counts = np.diff(offsets)
    if len(counts) != len(rows) or (len(counts) and offsets[-1] != len(points)):
        raise ValueError(f"labels of image {src}: {len(rows)} rows but point offsets {offsets.tolist()[:8]} for "
                         f"{len(points)} points")
    if not pointless and not (counts > 0).all():
        raise ValueError(f"labels of image {src}: a row without points (box rows only) moved with augmentation or "
                         f"Ultralytics' recipe; only YOLOv9's validation with one mask per instance keeps it")
    return points.astype(np.float32, copy=False), offsets


def _edge_matrix(tile: TileParams) -> np.ndarray:
    """The matrix boxes move with in edge coordinates (:mod:`fastload.augment.boxes`)."""
    return _EDGE_OUT @ (tile.matrix if tile.box_matrix is None else tile.box_matrix) @ _EDGE_IN


def _loaded_boxes(rows: np.ndarray, hw: tuple[int, int] | np.ndarray, crop: Sequence[int] | np.ndarray
                  ) -> np.ndarray:
    """[n, 4] xyxy label boxes in loaded pixels clipped to the crop (the candidate filter's boxes before); ``hw``
    and ``crop``: the loaded shape ``(h, w)`` and crop ``(x0, y0, x1, y1)`` of the rows' tile, or float64 arrays
    [n, 2] and [n, 4] of each row's (the same arithmetic)."""
    if isinstance(hw, np.ndarray):
        scale, lo, hi = hw[:, [1, 0, 1, 0]], crop[:, [0, 1, 0, 1]], crop[:, [2, 3, 2, 3]]  # type: ignore[call-overload]
    else:  # one tile's (the cheaper small arrays)
        h, w = hw
        scale = np.array((w, h, w, h), np.float64)
        lo, hi = np.array(crop[:2] * 2, np.float64), np.array(crop[2:] * 2, np.float64)
    centre, half = rows[:, 1:3], rows[:, 3:5] / 2
    xy = np.empty((len(rows), 4))  # the corners in the rows' dtype, then float64
    np.subtract(centre, half, out=xy[:, :2])
    np.add(centre, half, out=xy[:, 2:])
    xy *= scale
    np.maximum(xy, lo, out=xy)  # np.clip's values, without its wrapper's cost
    return np.minimum(xy, hi, out=xy)


# ----------------------------------------------------------------------------------------- per image
def _labelled_tiles(image: ImageParams, get: GeometryLabels) -> Iterator[tuple[TileParams, np.ndarray, np.ndarray, np.ndarray]]:
    """``(tile, rows, points, offsets)`` of each tile of ``image`` whose image has labels, in tile order."""
    for tile in image.tiles:
        rows, points, offsets = get(tile.src)
        if not len(rows):
            continue
        if tile.src_hw is None:
            raise ValueError(f"TileParams of image {tile.src} has no src_hw (loaded shape); records must come from ParamSampler")
        yield tile, rows, points, np.asarray(offsets, np.int64)


@dataclass
class _Moved:
    """One composed image's instances: boxes xyxy output px, classes, points output px [p, D], points per instance;
    ``pasted``: copy-paste's outlines (:func:`_pasted_outlines`), found on the way."""

    boxes: np.ndarray
    cls: np.ndarray
    points: np.ndarray
    counts: np.ndarray
    pasted: tuple[np.ndarray, ...] = ()

    @staticmethod
    def empty(dims: int = 2) -> "_Moved":
        """An image without instances (points of ``dims`` coordinates)."""
        return _Moved(np.zeros((0, 4)), np.zeros(0), np.zeros((0, dims)), np.zeros(0, np.int64))


def _point_matrix(tile: TileParams, out_hw: tuple[int, int], letterboxed: bool) -> np.ndarray:
    """The matrix a training tile's points move with: the tile's own, except for YOLOv9's letterbox (then its random
    perspective), which moves labels by the float pad where the pixels move by the integer border."""
    if not letterboxed:
        return tile.matrix
    fit = letterbox_fit(tile.src_hw, out_hw, scaleup=True)  # type: ignore[arg-type]  # checked by the caller
    perspective = tile.matrix @ np.linalg.inv(fit.matrix)
    return perspective @ np.array([[fit.r, 0.0, fit.pad[0]], [0.0, fit.r, fit.pad[1]], [0.0, 0.0, 1.0]])


def _image_tiles(image: ImageParams, get: GeometryLabels, recipe: Recipe, task: Task, loaded: LoadedPolygons
                 ) -> tuple[list[tuple[TileParams, np.ndarray, np.ndarray, np.ndarray]], list[np.ndarray | None]]:
    """``(tile, rows, points, offsets)`` of each labelled tile of ``image``, normalised (a row without points keeps
    none: YOLOv9's validation only), and each one's polygon extents ``[n, 4]`` (None: ``"yolov9"``);
    ``"ultralytics"``: every polygon resampled as its dataset resamples it when loaded (through ``loaded``, which
    checks each image's labels once)."""
    if recipe == "ultralytics":
        n, loaded_tiles = _loaded_tiles(image, get, loaded, task, lazy=False)
        return ([(t.tile, t.rows, t.polygons.reshape(-1, 2), np.arange(len(t.rows) + 1) * n)  # type: ignore[union-attr]
                 for t in loaded_tiles], [t.extent for t in loaded_tiles])
    labelled = list(_labelled_tiles(image, get))
    if image.candidate_scale is None:  # YOLOv9's validation keeps rows without points
        tiles = [(tile, rows, *_tile_polygons(rows, points, offsets, tile.src, True))
                 for tile, rows, points, offsets in labelled]
    else:  # each image's labels checked once (by the memo), then taken as they are
        for tile, rows, points, offsets in labelled:
            loaded.longest(tile.src, rows, points, offsets)
        tiles = [(tile, rows, np.asarray(points, np.float32), offsets) for tile, rows, points, offsets in labelled]
    return tiles, [None] * len(tiles)


def _loaded_points(longest: int, task: Task) -> int:
    """The points per polygon of an ``"ultralytics"`` image, resampled when loaded (its dataset), whose tiles' longest
    polygon has ``longest`` points: a longer polygon sets its image's count to its length + 1; a mosaic's images then
    meet at the longest (Instances.concatenate)."""
    base = OBB_POINTS if task == "obb" else SEGMENT_POINTS
    return longest + 1 if task != "obb" and longest > base else base


def paste_selection(boxes: np.ndarray, paste: CopyPaste) -> np.ndarray:
    """The instances copy-paste pastes, in paste order, from their label boxes ``boxes`` [n, 4] (xyxy on the canvas,
    clipped to their tiles, in tile order): the candidates are those whose box mirrored across the canvas overlaps
    every box by less than 0.3 of that box's area (both references' ``bbox_ioa < 0.3``, in their float32), of which
    ``round(fraction * candidates)`` are pasted: ``"yolov9"`` those with the smallest keys (``random.sample``),
    ``"ultralytics"`` those of least largest overlap (its ``argsort``; boxes without area take no part: its mosaic
    removed them)."""
    n = len(boxes)
    index = np.arange(n)
    yolov9 = paste.recipe == "yolov9"
    if yolov9:
        if paste.keys is None or len(paste.keys) != n:
            raise ValueError(f"copy-paste keys for {0 if paste.keys is None else len(paste.keys)} instances, the tiles' "
                             f"labels have {n} rows: build the sampler with the instances of the labels it is applied with")
    else:
        index = index[_shown(boxes)]
    b = np.asarray(boxes, np.float32)[index]
    w = np.float32(paste.canvas_hw[1])
    mirrored = np.stack((w - b[:, 2], b[:, 1], w - b[:, 0], b[:, 3]), 1)
    inter = ((np.minimum(mirrored[:, None, 2], b[:, 2]) - np.maximum(mirrored[:, None, 0], b[:, 0])).clip(0)
             * (np.minimum(mirrored[:, None, 3], b[:, 3]) - np.maximum(mirrored[:, None, 1], b[:, 1])).clip(0))
    ioa = inter / ((b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1]) + np.float32(1e-7))
    candidates = np.flatnonzero((ioa < 0.3).all(1))
    k = round(paste.fraction * len(candidates))
    if yolov9:
        order = np.argsort(np.asarray(paste.keys)[candidates], kind="stable")
    else:  # Ultralytics' own sort, ties (no overlap at all is common) broken as numpy breaks them there
        order = np.argsort(ioa.max(1)[candidates]) if len(candidates) else candidates
    return index[candidates[order[:k]]]


def _canvas_boxes(tiles: Sequence[TileParams], counts: Sequence[int], boxes: np.ndarray) -> np.ndarray:
    """[n, 4] the label boxes ``boxes`` (loaded px, the rows of ``tiles`` of ``counts`` rows each, in tile order) of a
    copy-paste image on its canvas."""
    return boxes + np.repeat(np.array([tile.offset * 2 for tile in tiles]), counts, 0)  # type: ignore[operator]


def _mirror(tile: TileParams, canvas_w: float) -> np.ndarray:
    """The matrix a tile's points move with once mirrored across the canvas (``x -> canvas_w - x`` between the
    tile's canvas offset and the canvas's warp)."""
    ox, oy = tile.offset  # type: ignore[misc]  # set with copy_paste
    flip = np.array([[-1.0, 0.0, canvas_w], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    return tile.matrix @ translation(-ox, -oy) @ flip @ translation(ox, oy)


def paste_outlines(image: ImageParams, get: GeometryLabels) -> tuple[list[np.ndarray], bool]:
    """The polygons, in canvas px, whose fill is the pixel mask of ``image``'s copy-paste (pixels inside it come from
    the canvas mirrored left-right), and whether that fill is mirrored after: YOLOv9 fills the pasted instances'
    clipped polygons and flips the fill (True); Ultralytics fills their mirrored resampled polygons (False). Found by
    moving the image's labels (:func:`move_record` gives them with the rest of a record's labels, at no extra cost)."""
    paste = image.copy_paste
    if paste is None:
        return [], False
    moved = _polygon_image(image, get, paste.recipe, "segment", False, LoadedPolygons())
    return list(moved.pasted), paste.recipe == "yolov9"


def _per_row(values: Sequence, counts: Sequence[int]) -> np.ndarray:
    """float64 ``values`` (one per tile) repeated for each of the tile's ``counts`` rows."""
    return np.repeat(np.asarray(values, np.float64), counts, axis=0)


def _tile_rows(tiles: Sequence[tuple[TileParams, np.ndarray]]
               ) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(counts, hw [n, 2], crop [n, 4], matrix [n, 3, 3], rows [n, ...])`` of labelled ``(tile, rows)`` pairs moved
    in one pass: the rows of all, each with its tile's loaded shape, crop and matrix (float64; ``counts``: per tile)."""
    counts = [len(rows) for _, rows in tiles]
    return (counts, _per_row([tile.src_hw for tile, _ in tiles], counts), _per_row([tile.crop for tile, _ in tiles], counts),
            _per_row([tile.matrix for tile, _ in tiles], counts), np.concatenate([rows for _, rows in tiles], 0))


def _scaled_rows(pts: np.ndarray, hw: np.ndarray) -> np.ndarray:
    """:func:`_scaled` of normalised points ``pts`` [n, k, 2] by each row's loaded shape ``hw`` [n, 2] (float32
    products, as one tile's Python ints give)."""
    size = hw[:, :, None].astype(np.float32)  # [n, (h, w), 1]
    return _scaled(pts, size[:, 1], size[:, 0])


def _may_reach(extent: np.ndarray, hw: np.ndarray, crop: np.ndarray, m: np.ndarray, out_hw: tuple[int, int]
               ) -> np.ndarray:
    """bool [n]: the polygons of normalised ``extent`` [n, 4] (loaded shape ``hw``, crop and matrix ``m`` per row)
    whose points clipped to the crop may land in the output: the warped corners of their clipped extent reach it,
    with a pixel to spare for rounding (any, through a matrix with a perspective row). The others lie wholly outside:
    Ultralytics gives them an empty box, which its candidate filter drops."""
    return _box_may_reach(np.clip(extent * hw[:, [1, 0, 1, 0]], crop[:, [0, 1, 0, 1]], crop[:, [2, 3, 2, 3]]), m, out_hw)


def _box_may_reach(box: np.ndarray, m: np.ndarray, out_hw: tuple[int, int]) -> np.ndarray:
    """bool [n]: the boxes ``box`` [n, 4] (xyxy, px before the matrices ``m`` [n, 3, 3]) whose warped corners reach the
    output, with a pixel to spare for rounding (any, through a matrix with a perspective row): a polygon inside its
    box (its resampled points too: they lie on its edges) whose box does not reach it lies wholly outside it."""
    wx, wy = _apply_planes(m, box[:, [0, 2, 2, 0]], box[:, [1, 1, 3, 3]])
    oh, ow = out_hw
    perspective = (m[:, 2, 0] != 0.0) | (m[:, 2, 1] != 0.0) | (m[:, 2, 2] != 1.0)
    return perspective | ((wx.max(1) >= -1) & (wy.max(1) >= -1) & (wx.min(1) <= ow + 1) & (wy.min(1) <= oh + 1))


def _ultralytics_segments(images: Sequence[ImageParams], get: GeometryLabels, loaded: LoadedPolygons
                          ) -> list[_Moved | _Warped]:
    """:func:`_polygon_image` of ``"ultralytics"`` segment training images without copy-paste (one output size), in one
    pass for all their tiles (each row with its tile's loaded shape, crop and matrix, and its image's candidate scale:
    the same arithmetic; the per-call cost of many small array operations is most of an image's); only the instances
    that can stay are moved: the others, without area in their tile or warped wholly out of the output, are dropped
    by its filters whatever their points (the same batch, less work). An image the memo neither has nor keeps (a set
    whose polygons exceed it) has only those instances resampled (:func:`_loaded_tiles`)."""
    out: list[_Moved | _Warped] = [_Moved.empty()] * len(images)
    groups: dict[int, list[tuple[int, list[_LoadedTile]]]] = {}  # by points per polygon: one per image
    for i, image in enumerate(images):
        n, tiles = _loaded_tiles(image, get, loaded, "segment", lazy=True)
        if tiles:
            groups.setdefault(n, []).append((i, tiles))
    for n, members in groups.items():
        tiles = [t for _, image_tiles in members for t in image_tiles]
        _, hw, crop, m, rows = _tile_rows([(t.tile, t.rows) for t in tiles])
        rows_of = [sum(len(t.rows) for t in image_tiles) for _, image_tiles in members]
        pre = _loaded_boxes(rows, hw, crop)
        stay = _shown(pre) & _may_reach(np.concatenate([t.extent for t in tiles], 0), hw, crop, m,
                                        images[members[0][0]].out_hw)
        chosen = np.flatnonzero(stay)
        px = _scaled_rows(_chosen_polygons(tiles, stay, n), hw[chosen])
        _clip_points(px, crop[chosen, None, :2], crop[chosen, None, 2:])
        x, y = _apply_planes(m[chosen], px[..., 0], px[..., 1])
        scale = np.repeat(np.array([images[i].candidate_scale for i, _ in members], np.float64), rows_of)[chosen]
        before = pre[chosen] * scale[:, None]
        cls = rows[chosen, 0].astype(np.float64)
        first_rows = np.cumsum([0] + rows_of[:-1])
        ends = np.cumsum(np.add.reduceat(stay.astype(np.int64), first_rows)).tolist()  # past each image's chosen rows
        for (i, _), a, b in zip(members, [0] + ends[:-1], ends):
            out[i] = _Warped(x[a:b], y[a:b], before[a:b], cls[a:b])
    return out


@dataclass(frozen=True)
class _LoadedTile:
    """One labelled tile of an ``"ultralytics"`` image: its rows; ``polygons`` float32 [k, n, 2] resampled
    (from the memo), or None: ``points`` / ``offsets`` (its labels) to resample the rows that stay; ``extent`` [k, 4]
    of each polygon (without resampling: its vertices' own, which the resampled points do not leave but by rounding,
    far inside :func:`_may_reach`'s pixel to spare)."""

    tile: TileParams
    rows: np.ndarray
    polygons: np.ndarray | None
    points: np.ndarray
    offsets: np.ndarray
    extent: np.ndarray


def _loaded_tiles(image: ImageParams, get: GeometryLabels, loaded: LoadedPolygons, task: Task, lazy: bool
                  ) -> tuple[int, list[_LoadedTile]]:
    """The points per polygon of an ``"ultralytics"`` ``image`` (:func:`_loaded_points`) and its labelled tiles, their
    polygons resampled through the memo; ``lazy``: only where it keeps them (:meth:`LoadedPolygons.keeps`)."""
    labelled = list(_labelled_tiles(image, get))
    if not labelled:
        return 0, []
    n = _loaded_points(max(loaded.longest(tile.src, rows, points, offsets) for tile, rows, points, offsets in labelled),
                       task)
    tiles = []
    for tile, rows, points, offsets in labelled:
        points = np.asarray(points, np.float32)  # as the memo resamples them
        if not lazy or loaded.keeps(tile.src, n):
            poly, extent = loaded.resampled(tile.src, points, offsets, n)
            tiles.append(_LoadedTile(tile, rows, poly.reshape(-1, n, 2), points, offsets, extent))
        else:
            tiles.append(_LoadedTile(tile, rows, None, points, offsets, _row_extents(points, offsets)))
    return n, tiles


def _chosen_polygons(tiles: Sequence[_LoadedTile], chosen: np.ndarray, n: int) -> np.ndarray:
    """float32 [c, n, 2]: the resampled polygons of the rows ``chosen`` (bool, over all the tiles' rows in order),
    from the memo or resampled here, those of all the tiles the memo lacks in one pass."""
    out = np.empty((int(chosen.sum()), n, 2), np.float32)
    row, at = 0, 0
    fresh_at, fresh_points, fresh_counts = [], [], []
    for t in tiles:
        mine = np.flatnonzero(chosen[row:row + len(t.rows)])
        row += len(t.rows)
        if t.polygons is not None:
            out[at:at + len(mine)] = t.polygons[mine]
        elif len(mine):
            fresh_at.append(np.arange(at, at + len(mine)))
            fresh_points += [t.points[t.offsets[j]:t.offsets[j + 1]] for j in mine.tolist()]
            fresh_counts.append(np.diff(t.offsets)[mine])
        at += len(mine)
    if fresh_points:
        offsets = np.concatenate(([0], np.cumsum(np.concatenate(fresh_counts))))
        out[np.concatenate(fresh_at)] = resample_polygons(np.concatenate(fresh_points), offsets, n, True)
    return out


def _polygon_image(image: ImageParams, get: GeometryLabels, recipe: Recipe, task: Task, letterboxed: bool,
                   loaded: LoadedPolygons) -> _Moved | _Warped:
    """Segments or oriented boxes of one composed image through its tiles (module docstring); ``letterboxed``:
    the image is a YOLOv9 letterbox (a training sample without mosaic). Copy-paste: the pasted instances, mirrored
    across the canvas, follow the image's own (YOLOv9 appends them to its labels before its random perspective,
    Ultralytics to its instances). An ``"ultralytics"`` training image's instances come back warped, for
    :func:`_boxed`."""
    train = image.candidate_scale is not None
    ultralytics = recipe == "ultralytics"
    if image.copy_paste is not None and (task != "segment" or image.copy_paste.recipe != recipe):
        raise ValueError(f"a record with {image.copy_paste.recipe}'s copy-paste moved as {recipe}'s {task} labels: "
                         f"copy-paste applies to the segment task of the sampler's own recipe")
    tiles, _ = _image_tiles(image, get, recipe, task, loaded)
    if not tiles:
        return _Moved.empty()
    cls = np.concatenate([rows[:, 0] for _, rows, _, _ in tiles]).astype(np.float64)
    if not train:  # validation letterbox: the reference's arithmetic, nothing clipped or filtered
        pts = np.concatenate([_letterbox_points(pts, tile.src_hw, _edge_matrix(tile), recipe)
                              for tile, _, pts, _ in tiles])
        counts = np.concatenate([np.diff(off) for _, _, _, off in tiles])
        boxes = moved_boxes([image], [0], lambda i: get(i)[0])[0][:, 1:5]
        return _Moved(boxes, cls, pts, counts)
    counts = [len(rows) for _, rows, _, _ in tiles]
    pre_all, px = _clipped_tiles(tiles, task)
    row_at = np.concatenate(([0], np.cumsum(np.concatenate([np.diff(off) for _, _, _, off in tiles]))))  # row r's points
    matrices = [_point_matrix(tile, image.out_hw, letterboxed and not ultralytics) for tile, _, _, _ in tiles]
    matrix = np.repeat(np.stack(matrices), counts, 0)
    src = np.arange(len(cls))  # the row each instance moves: the tiles' rows, then the pasted copies
    if image.copy_paste is not None:
        chosen = paste_selection(_canvas_boxes([tile for tile, _, _, _ in tiles], counts, pre_all), image.copy_paste)
        canvas_w = float(image.copy_paste.canvas_hw[1])
        owner = np.repeat(np.arange(len(tiles)), counts)[chosen].tolist()  # the tile of each pasted row
        mirror = {k: _mirror(tiles[k][0], canvas_w) for k in set(owner)}  # one per tile
        src = np.concatenate((src, chosen))
        matrix = np.concatenate([matrix] + [mirror[k][None] for k in owner])
        pasted = _pasted_outlines([tiles[k][0] for k in owner], px, row_at, chosen, image.copy_paste)
    else:
        pasted = ()
    if task == "segment":  # an instance warped wholly out of the output gets no box, which every filter drops: unmoved
        reach = _box_may_reach(_row_extents(px, row_at)[src], matrix, image.out_hw)
        src, matrix = src[reach], matrix[reach]
    if ultralytics:  # resampled when loaded: one point count per image
        poly = px.reshape(len(row_at) - 1, -1, 2)[src]
        x, y = poly[..., 0], poly[..., 1]
    else:  # the polygons moved, each once (a pasted copy's too), resampled in one pass
        rows = np.unique(src)
        x, y = _resampled_planes(*_rows_points(px, row_at, rows), SEGMENT_POINTS, False)
        at = np.searchsorted(rows, src)
        x, y = x[at], y[at]
    x, y = _apply_planes(matrix, x, y)
    before = pre_all[src] * image.candidate_scale
    cls = cls[src]
    if ultralytics:
        return _Warped(x, y, before, cls, pasted)
    # YOLOv9's polygons boxed image by image, while their 1000-point planes are in cache (batch-wide costs more)
    boxes, poly, keep = _boxes_kept(x, y, before, image.out_hw, recipe, task)
    kept = poly[keep]
    return _Moved(boxes[keep], cls[keep], kept.reshape(-1, 2), np.full(len(kept), poly.shape[1], np.int64), pasted)


def _clipped_tiles(tiles: Sequence[tuple[TileParams, np.ndarray, np.ndarray, np.ndarray]], task: Task
                   ) -> tuple[np.ndarray, np.ndarray]:
    """``(boxes [n, 4], points [p, 2])`` of a training image's labelled tiles: the rows' label boxes clipped to their
    tile's crop (the candidate filter's boxes before) and their points in tile px clipped to it (oriented boxes:
    Ultralytics' preserve_obb clip), all tiles' in one pass (each row and point with its own tile's shape and crop: the
    same arithmetic), in row order."""
    if task == "obb":  # Ultralytics' preserve_obb clip (its mosaic canvas: the tile's crop for these points), per tile
        before, clipped = [], []
        for tile, rows, pts, _ in tiles:
            h, w = tile.src_hw  # type: ignore[misc]  # checked by _labelled_tiles
            crop = tile.crop
            pre = _loaded_boxes(rows, (h, w), crop)
            poly = _scaled(pts, w, h).reshape(len(rows), -1, 2)
            lo, hi = _extent(poly)
            for i in np.flatnonzero((lo < crop[:2]).any(1) | (hi > crop[2:]).any(1)).tolist():
                pre[i], poly[i] = _aligned_visible(poly[i], crop, poly.shape[1])
            before.append(pre)
            clipped.append(poly.reshape(-1, 2))
        px = np.concatenate(clipped)
        pre_all = np.concatenate(before, 0)
    else:
        _, hw, crop, _, rows = _tile_rows([(tile, rows) for tile, rows, _, _ in tiles])
        pre_all = _loaded_boxes(rows, hw, crop)
        sizes = [len(pts) for _, _, pts, _ in tiles]
        size = np.repeat(np.array([tile.src_hw for tile, _, _, _ in tiles], np.float32), sizes, 0)  # [p, (h, w)]
        px = _scaled(np.concatenate([pts for _, _, pts, _ in tiles]), size[:, 1], size[:, 0])
        box = np.repeat(np.array([tile.crop for tile, _, _, _ in tiles], np.float64), sizes, 0)
        _clip_points(px, box[:, :2], box[:, 2:])
    return pre_all, px


def _row_extents(px: np.ndarray, row_at: np.ndarray) -> np.ndarray:
    """[n, 4] ``(x0, y0, x1, y1)`` of each row's points ``px[row_at[r]:row_at[r + 1]]`` (every row has one)."""
    first = row_at[:-1]
    x, y = px[:, 0], px[:, 1]
    return np.stack((np.minimum.reduceat(x, first), np.minimum.reduceat(y, first),
                     np.maximum.reduceat(x, first), np.maximum.reduceat(y, first)), 1)


def _rows_points(px: np.ndarray, row_at: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(points, offsets)`` of the rows ``rows`` (sorted) of the points ``px`` (row ``r``'s from ``row_at[r]``)."""
    sizes = row_at[rows + 1] - row_at[rows]
    offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    index = np.repeat(row_at[rows] - offsets[:-1], sizes) + np.arange(offsets[-1])
    return px[index], offsets


def _pasted_outlines(owners: Sequence[TileParams], px: np.ndarray, row_at: np.ndarray, chosen: np.ndarray,
                     paste: CopyPaste) -> tuple[np.ndarray, ...]:
    """The polygons, in canvas px, whose fill is the pixel mask of an image's copy-paste (pixels inside it come from
    the canvas mirrored left-right): the pasted rows ``chosen``' points clipped to their tiles (``px``, tile px, row
    ``r``'s from ``row_at[r]``: :func:`_clipped_tiles`), moved by their tiles ``owners``' canvas offsets: YOLOv9 fills
    the pasted instances' clipped polygons and flips the fill; Ultralytics fills their mirrored (resampled) polygons."""
    outlines = []
    for r, tile in zip(chosen.tolist(), owners):
        outline = px[row_at[r]:row_at[r + 1]].copy()
        outline += tile.offset  # type: ignore[arg-type]  # set with copy_paste
        if paste.recipe != "yolov9":
            outline[:, 0] = paste.canvas_hw[1] - outline[:, 0]
        outlines.append(outline)
    return tuple(outlines)


def _boxes_kept(x: np.ndarray, y: np.ndarray, before: np.ndarray, out_hw: tuple[int, int], recipe: Recipe, task: Task
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(boxes [k, 4], polygons [k, n, 2], keep bool [k])`` of polygons warped to the output (points ``x``, ``y``
    [k, n], label boxes ``before`` scaled for the candidate filter): their boxes (module docstring), the polygons as
    the recipe leaves them, and the instances its filters keep."""
    oh, ow = out_hw
    if recipe == "yolov9":
        boxes = _inside_vertex_boxes(x, y, ow, oh)
        poly = np.stack((x, y), -1)
    else:
        boxes = _clipped_extent_boxes(x, y, ow, oh)
        if task == "obb":  # preserve_obb: a box crossing the border becomes its visible part, in its direction
            poly = np.stack((x, y), -1)
            lo, hi = _extent(poly)
            for i in np.flatnonzero((lo < 0).any(1) | (hi[:, 0] > ow) | (hi[:, 1] > oh)).tolist():
                boxes[i], poly[i] = _aligned_visible(poly[i], (0, 0, ow, oh), poly.shape[1])
        else:  # the polygon clipped to its box (inside the output: Instances.clip then changes nothing), plane by plane
            poly = np.empty(x.shape + (2,))
            for axis, plane in enumerate((x, y)):
                np.clip(plane, boxes[:, axis, None], boxes[:, axis + 2, None], out=poly[..., axis])
    keep = box_candidates(before, boxes, area_thr=SEGMENT_AREA_THR)
    if recipe == "ultralytics":
        keep &= _shown(before)
    return boxes, poly, keep


@dataclass
class _Warped:
    """One composed ``"ultralytics"`` training image's polygons warped to the output, before their boxes and the
    candidate filter: the points' output px as planes ``x``, ``y`` [k, n], the label boxes before (xyxy, scaled for
    the filter), the classes."""

    x: np.ndarray
    y: np.ndarray
    before: np.ndarray
    cls: np.ndarray
    pasted: tuple[np.ndarray, ...] = ()


def _boxed(images: Sequence[_Moved | _Warped], out_hw: tuple[int, int], recipe: Recipe, task: Task) -> list[_Moved]:
    """``images`` with each :class:`_Warped` one given its boxes and filtered (:func:`_boxes_kept`), in one pass for
    all the images of a batch with as many points per instance (the per-call cost of the many small array
    operations is most of it for Ultralytics' polygons)."""
    out = [image if isinstance(image, _Moved) else None for image in images]
    groups: dict[int, list[tuple[int, _Warped]]] = {}
    for i, image in enumerate(images):
        if isinstance(image, _Warped):
            groups.setdefault(image.x.shape[1], []).append((i, image))
    for n, members in groups.items():
        boxes, poly, keep = _boxes_kept(np.concatenate([w.x for _, w in members], 0),
                                        np.concatenate([w.y for _, w in members], 0),
                                        np.concatenate([w.before for _, w in members], 0), out_hw, recipe, task)
        ends = np.cumsum([len(w.x) for _, w in members]).tolist()
        for (i, w), a, b in zip(members, [0] + ends[:-1], ends):
            k = keep[a:b]
            out[i] = _Moved(boxes[a:b][k], w.cls[k], poly[a:b][k].reshape(-1, 2), np.full(int(k.sum()), n, np.int64))
    return [m for m in out if m is not None]


def _shown(boxes: np.ndarray) -> np.ndarray:
    """bool [n]: the label boxes (xyxy, clipped to their tile) that keep an area: Ultralytics' mosaic drops the
    others before its random perspective (``remove_zero_area_boxes``), where YOLOv9 keeps them (a box squeezed
    onto a tile's edge can pass the candidate filter once rotated: its area before is 0)."""
    return (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])


def _one_keypoint_count(counts: set[int]) -> None:
    if len(counts) > 1:
        raise ValueError(f"keypoints per instance differ between the images of a batch: {sorted(counts)} (kpt_shape is "
                         f"one per dataset)")


def _keypoint_tiles(image: ImageParams, get: GeometryLabels) -> list[tuple[TileParams, np.ndarray, np.ndarray]]:
    """``(tile, rows, keypoints [n, K, 3])`` of each labelled tile of ``image``."""
    tiles = []
    for tile, rows, points, offsets in _labelled_tiles(image, get):
        counts = np.diff(offsets)
        if points.ndim != 2 or points.shape[1] != 3 or len(set(counts.tolist())) != 1 or counts[0] < 1:
            raise ValueError(f"labels of image {tile.src}: keypoints must be [n * K, 3] with K per row, got "
                             f"{points.shape} for rows of {sorted(set(counts.tolist()))} points")
        tiles.append((tile, rows, points.reshape(len(rows), int(counts[0]), 3)))
    return tiles


def _keypoint_letterbox(image: ImageParams, get: GeometryLabels) -> _Moved:
    """Pose instances of one validation letterbox, in Ultralytics' float32 arithmetic."""
    tiles = _keypoint_tiles(image, get)
    if not tiles:
        return _Moved.empty(3)
    _one_keypoint_count({kp.shape[1] for _, _, kp in tiles})
    kps = []
    for tile, _, kp in tiles:
        xy = _letterbox_points(kp[..., :2].reshape(-1, 2).astype(np.float32), tile.src_hw,  # type: ignore[arg-type]
                               _edge_matrix(tile), "ultralytics").reshape(kp.shape[:2] + (2,))
        kps.append(np.concatenate((xy, kp[..., 2:].astype(np.float64)), -1))
    kp_all = np.concatenate(kps, 0)
    cls = np.concatenate([rows[:, 0] for _, rows, _ in tiles]).astype(np.float64)
    boxes = moved_boxes([image], [0], lambda i: get(i)[0])[0][:, 1:5]
    return _Moved(boxes, cls, kp_all.reshape(-1, 3), np.full(len(kp_all), kp_all.shape[1], np.int64))


def _keypoint_images(images: Sequence[ImageParams], get: GeometryLabels) -> list[_Moved]:
    """Pose instances of composed images of one output size through their tiles: boxes as Ultralytics moves them
    (corners clipped to the tile, through the matrix, their extent clipped to the output, its candidate filter with
    ``area_thr=0.1``), keypoints through the same matrix; leaving the tile or the output hides a keypoint
    (visibility 0), which is then clipped (``Instances.clip``). Training images in one pass for all their tiles, each
    row with its tile's loaded shape, crop and matrix (the per-call cost of many small array operations is most of a
    tile's; the same arithmetic); validation: the letterbox only (:func:`_keypoint_letterbox`)."""
    empty = _Moved.empty(3)
    out = [empty if image.candidate_scale is not None else _keypoint_letterbox(image, get) for image in images]
    tiles = [(i, *t) for i, image in enumerate(images) if image.candidate_scale is not None
             for t in _keypoint_tiles(image, get)]
    if not tiles:
        return out
    _one_keypoint_count({kp.shape[1] for *_, kp in tiles})
    oh, ow = images[0].out_hw
    counts, hw, crop, m, rows = _tile_rows([(tile, rows) for _, tile, rows, _ in tiles])
    kp = np.concatenate([k for *_, k in tiles], 0)
    vis = kp[..., 2].astype(np.float64)
    xy = _scaled_rows(kp[..., :2], hw)
    lo, hi = crop[:, None, :2], crop[:, None, 2:]
    vis[(xy < lo).any(-1) | (xy > hi).any(-1)] = 0.0
    _clip_points(xy, lo, hi)
    x, y = _apply_planes(m, xy[..., 0], xy[..., 1])
    vis[(x < 0) | (x > ow) | (y < 0) | (y > oh)] = 0.0
    np.clip(x, 0, ow, out=x)
    np.clip(y, 0, oh, out=y)
    kp_all = np.stack((x, y, vis), -1)
    pre = _loaded_boxes(rows, hw, crop)
    cx, cy = _apply_planes(m, pre[:, [0, 2, 2, 0]], pre[:, [1, 1, 3, 3]])  # the box's corners
    moved = np.clip(np.stack((cx.min(1), cy.min(1), cx.max(1), cy.max(1)), 1), 0, (ow, oh, ow, oh))
    scale = _per_row([images[i].candidate_scale for i, *_ in tiles], counts)
    keep = box_candidates(pre * scale[:, None], moved) & _shown(pre)
    cls = rows[:, 0].astype(np.float64)
    owner = np.repeat([i for i, *_ in tiles], counts)
    k = kp_all.shape[1]
    for i in dict.fromkeys(i for i, *_ in tiles):
        mine = keep & (owner == i)
        out[i] = _Moved(moved[mine], cls[mine], kp_all[mine].reshape(-1, 3), np.full(int(mine.sum()), k, np.int64))
    return out


# ----------------------------------------------------------------------------------------- the batch
@dataclass(frozen=True)
class RecordGeometry:
    """One record's segments or oriented boxes moved image by image (its image, then its mixup partner's), before
    the batch's boxes are assembled: what :func:`move_record` gives a renderer before it draws the sample, since the
    copy-paste pixel mask is filled from outlines found on the way (:meth:`paste_outlines`), and what
    :func:`transform_geometry` then assembles without moving anything again."""

    images: tuple[_Moved | _Warped, ...]
    recipe: Recipe

    def paste_outlines(self, k: int) -> tuple[list[np.ndarray], bool]:
        """:func:`paste_outlines` of the record's image ``k`` (0: its image, 1: its mixup partner)."""
        return list(self.images[k].pasted), self.recipe == "yolov9"


def move_record(record: SampleParams, get_geometry: GeometryLabels, recipe: Recipe, task: Task,
                loaded: LoadedPolygons) -> RecordGeometry:
    """The segments or oriented boxes of ``record``'s images moved (:class:`RecordGeometry`); arguments as
    :func:`transform_geometry`'s (``loaded`` required)."""
    return move_records([record], get_geometry, recipe, task, loaded)[0]


def move_records(records: Sequence[SampleParams], get_geometry: GeometryLabels, recipe: Recipe, task: Task,
                 loaded: LoadedPolygons) -> list[RecordGeometry]:
    """:func:`move_record` of each of ``records`` (one output size), Ultralytics' segment training images without
    copy-paste in one pass for all of them (:func:`_ultralytics_segments`)."""
    if task not in ("segment", "obb"):
        raise ValueError(f"move_record moves segments or oriented boxes, got task {task!r}")
    images = [(record.image,) if record.mixup is None else (record.image, record.mixup) for record in records]

    def together(image: ImageParams) -> bool:  # an Ultralytics segment training image without copy-paste
        return recipe == "ultralytics" and task == "segment" and image.candidate_scale is not None \
            and image.copy_paste is None

    moved = iter(_ultralytics_segments([image for pair in images for image in pair if together(image)], get_geometry,
                                       loaded))
    # a YOLOv9 record without mosaic is a letterbox (its mixup partner, when it has one, is a mosaic)
    return [RecordGeometry(tuple(
        next(moved) if together(image)
        else _polygon_image(image, get_geometry, recipe, task, not record.mosaic and k == 0, loaded)
        for k, image in enumerate(pair)), recipe) for record, pair in zip(records, images)]


def transform_geometry(records: Sequence[SampleParams], get_geometry: GeometryLabels, recipe: Recipe,
                       task: Task, loaded: LoadedPolygons | None = None,
                       moved_records: Sequence[RecordGeometry | None] | None = None) -> Geometry:
    """The boxes and points of a batch of records (one output size) for ``task`` with ``recipe``'s semantics
    (module docstring). ``"yolov9"`` has only the segment task (its repository has no pose or obb loader).
    ``loaded``: a memo of ``get_geometry``'s resampled polygons kept between batches (None: one for this call).
    ``moved_records``: segment or obb: each record's :func:`move_record` where already found (None, for all of them
    or for one: moved here, together)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if recipe == "yolov9" and task != "segment":
        raise ValueError(f"recipe='yolov9' has no {task} task (the official YOLOv9 repository trains detection and "
                         f"segmentation only); use recipe='ultralytics'")
    if not records:
        return Geometry(np.zeros((0, 6), np.float32), np.zeros((0, 3 if task == "pose" else 2)), np.zeros(1, np.int64),
                        np.zeros(0, bool), np.zeros(0, bool), (0, 0), task, recipe)
    images, owners = batch_images(records)
    out_hw = images[0].out_hw
    if task == "pose":
        moved = _keypoint_images(images, get_geometry)
        _one_keypoint_count({int(m.counts[0]) for m in moved if len(m.counts)})
    else:
        if moved_records is None:
            moved_records = [None] * len(records)
        elif len(moved_records) != len(records):
            raise ValueError(f"{len(moved_records)} moved records for a batch of {len(records)}")
        pending = [k for k, r in enumerate(moved_records) if r is None]
        if pending:  # moved here, all in one call
            found = dict(zip(pending, move_records([records[k] for k in pending], get_geometry, recipe, task,
                                                   LoadedPolygons() if loaded is None else loaded)))
            moved_records = [found.get(k, r) for k, r in enumerate(moved_records)]
        moved = _boxed([m for r in moved_records for m in r.images], out_hw, recipe, task)
    owner = np.repeat(np.asarray(owners, np.intp), [len(m.cls) for m in moved])
    xyxy = np.concatenate([m.boxes for m in moved], 0)
    cls = np.concatenate([m.cls for m in moved])
    points = np.concatenate([m.points for m in moved], 0)
    offsets = np.concatenate(([0], np.cumsum(np.concatenate([m.counts for m in moved])))).astype(np.int64)
    targets = np.empty((len(cls), 6), np.float32)
    targets[:, 0] = owner
    targets[:, 1:] = xyxy_to_xywhn(np.concatenate((cls[:, None], xyxy), 1), out_hw)
    flip_ud = np.array([p.flip_ud for p in records], bool)[owner]
    flip_lr = np.array([p.flip_lr for p in records], bool)[owner]
    targets[flip_ud, 3] = 1 - targets[flip_ud, 3]
    targets[flip_lr, 2] = 1 - targets[flip_lr, 2]
    return Geometry(targets, points, offsets, flip_ud, flip_lr, out_hw, task, recipe)


def obb_xywhr(geometry: Geometry) -> np.ndarray:
    """float32 [N, 5] ``(xc, yc, w, h, angle)`` of an obb batch after the flips, normalised to the output
    (Ultralytics ``Format(return_obb=True)``: the minimum-area rectangle of each instance's points, ``w`` the
    longer side, angle in radians in ``[-pi/4, 3pi/4)``)."""
    if geometry.task != "obb":
        raise ValueError(f"obb_xywhr needs an obb Geometry, got task {geometry.task!r}")
    h, w = geometry.out_hw
    out = np.zeros((len(geometry), 5), np.float64)
    for i, poly in enumerate(geometry.polygons(flipped=True)):
        (cx, cy), (bw, bh), angle = cv2.minAreaRect(poly.astype(np.float32))
        theta = angle / 180 * np.pi
        if bw < bh:
            bw, bh = bh, bw
            theta += np.pi / 2
        while theta >= 3 * np.pi / 4:
            theta -= np.pi
        while theta < -np.pi / 4:
            theta += np.pi
        out[i] = (cx / w, cy / h, bw / w, bh / h, theta)
    return out.astype(np.float32)
