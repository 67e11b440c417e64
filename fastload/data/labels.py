"""YOLO label files: the ``/images/`` -> ``/labels/`` path rule, parsing and row validation.

A row is a box ``class xc yc w h`` (normalised), a polygon ``class x1 y1 x2 y2 x3 y3 ...`` (a segment; an OBB
is a 4-point one) whose box spans its points, or, with ``kpt_shape`` from the data yaml, a pose row ``class xc yc
w h`` + keypoints (:func:`parse_labels`). Points are kept beside the box rows (:class:`FlatLabels`). Bad rows
are dropped one by one and reported as :class:`Problem` records with their line number; good rows are kept.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple, Sequence, overload

import numpy as np

__all__ = ["Problem", "LabelResult", "FlatLabels", "ImageLabels", "img2label_path", "label_paths", "parse_labels",
           "read_label_file", "COORD_TOL", "POINT_DIMS"]

# Coordinates this far outside [0, 1] are clipped (rounding in converters); further out the row is rejected.
COORD_TOL = 1e-2
# The dimension of label points: 2 for polygon vertices (segments, OBB corners), 3 for keypoints (x, y, visibility).
POINT_DIMS = (2, 3)


@dataclass(frozen=True)
class Problem:
    """One finding of a dataset scan: the file, a short machine-readable kind, and a message."""

    path: str
    kind: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: [{self.kind}] {self.message}"


@dataclass
class LabelResult:
    """Parsed labels (``float32 [n, 5]``), the problems found, the rows dropped as duplicates / invalid, and the
    rows' points where the file has geometry (``float32 [p, D]`` with per-row ``int64 [n + 1]`` offsets from 0, as
    :meth:`FlatLabels.image` gives them; None for box rows)."""

    labels: np.ndarray
    problems: list[Problem] = field(default_factory=list)
    duplicates: int = 0
    rows_dropped: int = 0
    points: np.ndarray | None = None
    point_offsets: np.ndarray | None = None


def img2label_path(im_file: str) -> str:
    """Label path of an image: the last ``/images/`` becomes ``/labels/``, suffix ``.txt`` (YOLOv5 rule)."""
    sa, sb = f"{os.sep}images{os.sep}", f"{os.sep}labels{os.sep}"
    if sa in im_file:
        head, tail = im_file.rsplit(sa, 1)
        im_file = head + sb + tail
    return os.path.splitext(im_file)[0] + ".txt"


def label_paths(im_files: Sequence[str]) -> list[str]:
    """:func:`img2label_path` of every image, each folder's label folder worked out once."""
    folders: dict[str, str] = {}
    out = []
    for f in im_files:
        folder, sep, name = f.rpartition(os.sep)
        prefix = folders.get(folder)
        if prefix is None:  # the last /images/ of a path lies in its folder part (a name holds no separator)
            prefix = folders[folder] = img2label_path(folder + sep + "x")[: -len("x.txt")] if sep else ""
        out.append(prefix + os.path.splitext(name)[0] + ".txt")
    return out


def _span(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float, float]:
    """(xc, yc, w, h) of the box spanning the points ``(xs[k], ys[k])``."""
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    return (x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0


def _clip(values: Sequence[float]) -> list[float]:
    return [min(1.0, max(0.0, c)) for c in values]


def _outside(values: Sequence[float]) -> float:
    """How far the farthest of ``values`` lies outside [0, 1] (<= 0: none does)."""
    return max(max(-c for c in values), max(c - 1.0 for c in values))


def parse_labels(text: str, nc: int, path: str = "<labels>", tol: float = COORD_TOL,
                 kpt_shape: Sequence[int] | None = None) -> LabelResult:
    """Parse and validate YOLO label text against ``nc`` classes (and ``kpt_shape`` ``(K, D)`` for pose labels).

    Which rows a file holds is decided per file, as YOLOv9's and Ultralytics' ``verify_image_label`` decide it:

    * with ``kpt_shape``, every row is a pose row ``class xc yc w h`` + K keypoints of D values (D=2: x y, whose
      visibility is 0 where x or y is negative, else 1, as Ultralytics derives it; D=3: x y visibility); points
      are ``float32 [K, 3]`` per row;
    * else a file with a row of more than 6 columns is a polygon file: each of its rows is ``class x1 y1 x2 y2 ...``
      and its box spans its points (points ``float32 [k, 2]`` per row; an OBB row is a 4-point polygon). A
      5-column row there is read as YOLOv9 reads it, the 2-point polygon ``(x1 y1) (x2 y2)``, and noted
      (``box_row_in_polygon_file``; Ultralytics rejects such a file whole);
    * else every row is a box ``class xc yc w h`` (no points).

    Rejected rows (reported with their line number, dropped, counted): a wrong column count (an odd coordinate
    count, keypoints that do not match ``kpt_shape``), non-numeric values, a class id that is negative,
    non-integer or >= ``nc``, a coordinate more than ``tol`` outside [0, 1] (a visibility below ``-tol``), zero
    or negative width/height. Coordinates within ``tol`` are clipped. Exact duplicate rows (box and points) are
    dropped and counted.
    """
    problems: list[Problem] = []
    rows: list[tuple[float, float, float, float, float]] = []
    shapes: list[list[float]] = []  # each kept row's points, flattened, when the file has geometry
    dropped = 0

    def bad(line_no: int, kind: str, message: str) -> None:
        nonlocal dropped
        dropped += 1
        problems.append(Problem(path, kind, f"line {line_no}: {message}"))

    lines = [(line_no, parts) for line_no, parts in ((k, line.split()) for k, line in enumerate(text.splitlines(), 1))
             if parts]
    n_kpt, kpt_dim = (int(kpt_shape[0]), int(kpt_shape[1])) if kpt_shape is not None else (0, 0)
    pose_columns = 5 + n_kpt * kpt_dim
    polygons = kpt_shape is None and any(len(parts) > 6 for _, parts in lines)
    for line_no, parts in lines:
        n = len(parts)
        if kpt_shape is not None and n != pose_columns:
            bad(line_no, "bad_keypoints", f"{n} columns (want {pose_columns}: class xc yc w h and {n_kpt} keypoints of "
                                          f"{kpt_dim} values, kpt_shape {[n_kpt, kpt_dim]} in the data yaml)")
            continue
        if polygons and (n < 5 or n % 2 == 0):
            what = "an odd number of coordinates" if n % 2 == 0 else "fewer than 2 points"
            bad(line_no, "bad_columns", f"{n} columns: {what} (want class + x y pairs)")
            continue
        if kpt_shape is None and not polygons and n != 5:
            bad(line_no, "bad_columns", f"{n} columns (want 5: class xc yc w h, or class + >=3 x y pairs)")
            continue
        try:
            values = [float(v) for v in parts]
        except ValueError:
            bad(line_no, "non_numeric", f"non-numeric value in {' '.join(parts)[:60]!r}")
            continue
        if not all(np.isfinite(values)):
            bad(line_no, "non_numeric", f"non-finite value in {' '.join(parts)[:60]!r}")
            continue
        cls = values[0]
        if cls != int(cls) or cls < 0 or cls >= nc:
            bad(line_no, "bad_class", f"class {parts[0]} not an integer in 0..{nc - 1}")
            continue
        points: list[float] = []
        if kpt_shape is not None:
            kpts = values[5:]
            xy = [c for k, c in enumerate(kpts) if k % kpt_dim < 2]
            if _outside(values[1:5] + xy) > tol:
                bad(line_no, "out_of_range", f"coordinate outside [0, 1] in {' '.join(parts)[:60]!r}")
                continue
            if kpt_dim == 3 and min(kpts[2::3]) < -tol:
                bad(line_no, "out_of_range", f"negative keypoint visibility in {' '.join(parts)[:60]!r}")
                continue
            for k in range(n_kpt):
                x, y = kpts[k * kpt_dim], kpts[k * kpt_dim + 1]
                # Ultralytics: a D=2 keypoint is visible unless a coordinate is negative (read before clipping)
                v = max(0.0, kpts[k * kpt_dim + 2]) if kpt_dim == 3 else (0.0 if x < 0 or y < 0 else 1.0)
                points += [min(1.0, max(0.0, x)), min(1.0, max(0.0, y)), v]
            xc, yc, w, h = _clip(values[1:5])
        else:
            coords = values[1:]
            if _outside(coords) > tol:
                bad(line_no, "out_of_range", f"coordinate outside [0, 1] in {' '.join(parts)[:60]!r}")
                continue
            coords = _clip(coords)
            if polygons:
                points = coords
                xc, yc, w, h = _span(coords[0::2], coords[1::2])
            else:
                xc, yc, w, h = coords
        if w <= 0 or h <= 0:
            bad(line_no, "bad_size", f"zero or negative box size (w={w:g}, h={h:g})")
            continue
        if polygons and n == 5:
            problems.append(Problem(path, "box_row_in_polygon_file", f"line {line_no}: a 5-column row in a file of "
                                    f"polygon rows, read as the 2-point polygon (x1 y1) (x2 y2) as YOLOv9 reads it"))
        rows.append((float(int(cls)), xc, yc, w, h))
        shapes.append(points)

    labels = np.asarray(rows, dtype=np.float32).reshape(-1, 5)
    point_dim = 3 if kpt_shape is not None else 2
    geometry = kpt_shape is not None or polygons
    flat = [np.asarray(p, np.float32).reshape(-1, point_dim) for p in shapes] if geometry else []
    keep = _first_of_each(labels, flat)
    duplicates = len(labels) - len(keep)
    if duplicates:
        labels = labels[keep]
        flat = [flat[k] for k in keep] if geometry else flat
        problems.append(Problem(path, "duplicate_row", f"{duplicates} duplicate row(s) removed"))
    if not geometry:
        return LabelResult(np.ascontiguousarray(labels), problems, duplicates, dropped)
    counts = np.fromiter((len(p) for p in flat), np.int64, len(flat))
    points_arr = np.concatenate(flat) if flat else np.zeros((0, point_dim), np.float32)
    return LabelResult(np.ascontiguousarray(labels), problems, duplicates, dropped, points_arr,
                       np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))


def _first_of_each(labels: np.ndarray, points: list[np.ndarray]) -> np.ndarray:
    """Positions of the first of each set of equal rows (box and points), in order."""
    if len(labels) < 2:
        return np.arange(len(labels))
    if not points:
        _, first = np.unique(labels, axis=0, return_index=True)
        return np.sort(first)
    # distinct polygons can share a class and box (Ultralytics compares the points too)
    seen: dict[bytes, int] = {}
    for k, (row, pts) in enumerate(zip(labels, points)):
        seen.setdefault(row.tobytes() + pts.tobytes(), k)
    return np.fromiter(seen.values(), np.int64, len(seen))



def read_label_file(path: str | os.PathLike, nc: int, kpt_shape: Sequence[int] | None = None) -> LabelResult:
    """Read and validate one label file (:func:`parse_labels`); an unreadable file gives no labels and a
    ``label_unreadable`` problem."""
    p = str(path)
    try:
        with open(p, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        return LabelResult(np.zeros((0, 5), np.float32), [Problem(p, "label_unreadable", str(exc))])
    return parse_labels(text, nc, p, kpt_shape=kpt_shape)



class ImageLabels(NamedTuple):
    """One image's labels: its rows and, where the labels carry geometry, its points (:class:`FlatLabels`)."""

    rows: np.ndarray  # float32 [n, 5]: class xc yc w h
    points: np.ndarray | None  # float32 [p, D]; None: no geometry
    point_offsets: np.ndarray | None  # int64 [n + 1] from 0: row r owns points[point_offsets[r]:point_offsets[r + 1]]


def _point_dim(points: np.ndarray) -> int:
    if points.ndim != 2 or points.shape[1] not in POINT_DIMS:
        raise ValueError(f"label points must be [P, D] with D in {POINT_DIMS}, got shape {points.shape}")
    return int(points.shape[1])


def _pack_points(row_counts: Sequence[int], points: Sequence[np.ndarray | None],
                 point_offsets: Sequence[np.ndarray | None]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The points of consecutive parts (each ``row_counts[k]`` rows, its ``points[k]`` with per-row
    ``point_offsets[k]`` from 0, or None: rows without points) as one ``(points, point_offsets)``; (None, None)
    when no part has points."""
    given = [np.asarray(p, np.float32) for p in points if p is not None]
    if not given:
        return None, None
    dims = {_point_dim(p) for p in given}
    if len(dims) > 1:
        raise ValueError(f"label points of different dimensions {sorted(dims)} cannot share one container")
    counts = [np.diff(np.asarray(o, np.int64)) if p is not None else np.zeros(n, np.int64)
              for n, p, o in zip(row_counts, points, point_offsets)]
    per_row = np.concatenate(counts) if counts else np.zeros(0, np.int64)
    return np.concatenate(given), np.concatenate([[0], np.cumsum(per_row)]).astype(np.int64)


def _runs(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The positions ``starts[k] .. starts[k] + counts[k]`` of every run ``k``, in order."""
    ends = np.cumsum(counts)
    owner = np.repeat(np.arange(len(counts)), counts)
    return starts[owner] + np.arange(int(ends[-1]) if len(ends) else 0) - (ends - counts)[owner]


class FlatLabels(Sequence[np.ndarray]):
    """Every image's labels in one ``float32 [M, 5]`` array: image ``i`` owns rows ``offsets[i]:offsets[i + 1]``.

    A sequence of per-image arrays to its readers (``labels[i]`` is a read-only view), without one Python object
    per image: two arrays whatever the number of images, which worker processes share with their parent.

    Segment, pose and OBB labels add their geometry in two more arrays (None for detection labels): ``points``
    ``float32 [P, D]``, normalised to the image (D=2: polygon vertices, of segments and of OBB corners; D=3:
    keypoints x, y, visibility), and ``point_offsets`` ``int64 [M + 1]``: row ``r`` owns
    ``points[point_offsets[r]:point_offsets[r + 1]]`` (none for a box row). A row's box spans its polygon.
    :meth:`image` gives one image's rows with its points.
    """

    def __init__(self, rows: np.ndarray, offsets: np.ndarray, points: np.ndarray | None = None,
                 point_offsets: np.ndarray | None = None) -> None:
        self.rows = np.ascontiguousarray(rows, np.float32).reshape(-1, 5)
        self.offsets = np.ascontiguousarray(offsets, np.int64)
        if self.offsets.ndim != 1 or not len(self.offsets) or self.offsets[0] != 0 or self.offsets[-1] != len(self.rows):
            raise ValueError(f"label offsets must run from 0 to {len(self.rows)}")
        self.rows.flags.writeable = False
        self.points: np.ndarray | None = None
        self.point_offsets: np.ndarray | None = None
        if (points is None) != (point_offsets is None):
            raise ValueError("label points and point_offsets go together (both or neither)")
        if points is not None and point_offsets is not None:
            self.points = np.ascontiguousarray(points, np.float32)
            _point_dim(self.points)
            self.point_offsets = np.ascontiguousarray(point_offsets, np.int64)
            po = self.point_offsets
            if po.shape != (len(self.rows) + 1,) or po[0] != 0 or po[-1] != len(self.points) or (np.diff(po) < 0).any():
                raise ValueError(f"point offsets must run from 0 to {len(self.points)} over {len(self.rows)} rows")
            self.points.flags.writeable = False

    @classmethod
    def from_arrays(cls, labels: Sequence[np.ndarray], points: Sequence[np.ndarray | None] | None = None,
                    point_offsets: Sequence[np.ndarray | None] | None = None) -> "FlatLabels":
        """Pack per-image ``[n, 5]`` arrays, with each image's ``[p, D]`` points and ``[n + 1]`` per-row point
        offsets from 0 (as :meth:`image` gives them; None for an image, or for all: no points)."""
        if isinstance(labels, FlatLabels) and points is None:
            return labels
        arrays = [np.asarray(lb, np.float32).reshape(-1, 5) for lb in labels]
        counts = np.fromiter((len(a) for a in arrays), np.int64, len(arrays))
        rows = np.concatenate(arrays) if arrays else np.zeros((0, 5), np.float32)
        if points is None:
            return cls(rows, np.concatenate([[0], np.cumsum(counts)]))
        if point_offsets is None or len(points) != len(arrays) or len(point_offsets) != len(arrays):
            raise ValueError(f"{len(arrays)} label arrays need as many points and point offsets")
        flat_points, flat_offsets = _pack_points(counts.tolist(), points, point_offsets)
        return cls(rows, np.concatenate([[0], np.cumsum(counts)]), flat_points, flat_offsets)

    @classmethod
    def concatenate(cls, parts: Sequence["FlatLabels"]) -> "FlatLabels":
        """The images of ``parts``, one after the other (rows without points where a part has none)."""
        counts = np.concatenate([p.counts for p in parts]) if parts else np.zeros(0, np.int64)
        rows = np.concatenate([p.rows for p in parts]) if parts else np.zeros((0, 5), np.float32)
        points, point_offsets = _pack_points([len(p.rows) for p in parts], [p.points for p in parts],
                                             [p.point_offsets for p in parts])
        return cls(rows, np.concatenate([[0], np.cumsum(counts)]), points, point_offsets)

    @property
    def counts(self) -> np.ndarray:
        """``int64 [n]``: the number of labels of each image."""
        return np.diff(self.offsets)

    @property
    def point_counts(self) -> np.ndarray | None:
        """``int64 [M]``: the number of points of each row (None: no geometry)."""
        return None if self.point_offsets is None else np.diff(self.point_offsets)

    def image(self, i: int) -> ImageLabels:
        """Image ``i``'s rows, points and per-row point offsets from 0 (views, no copy; points None without
        geometry)."""
        rows = self[i]
        k = int(i) + len(self) if int(i) < 0 else int(i)
        if self.points is None or self.point_offsets is None:
            return ImageLabels(rows, None, None)
        po = self.point_offsets[self.offsets[k] : self.offsets[k + 1] + 1]
        return ImageLabels(rows, self.points[po[0] : po[-1]], po - po[0])

    def subset(self, indices: np.ndarray) -> "FlatLabels":
        """The labels of ``indices`` (in that order), packed again."""
        indices = np.asarray(indices, np.int64)
        counts = self.counts[indices]
        offsets = np.concatenate([[0], np.cumsum(counts)])
        take = _runs(self.offsets[indices], counts)
        if self.points is None or self.point_offsets is None:
            return FlatLabels(self.rows[take], offsets)
        point_counts = np.diff(self.point_offsets)[take]
        points = self.points[_runs(self.point_offsets[take], point_counts)]
        return FlatLabels(self.rows[take], offsets, points, np.concatenate([[0], np.cumsum(point_counts)]))

    def keep_rows(self, wanted: np.ndarray) -> "FlatLabels":
        """The same images with only the rows where ``wanted`` (bool ``[M]``) holds, their points with them."""
        wanted = np.asarray(wanted, bool)
        if wanted.shape != (len(self.rows),):
            raise ValueError(f"keep_rows needs one flag per row ({len(self.rows)}), got shape {wanted.shape}")
        kept_before = np.concatenate([[0], np.cumsum(wanted)])  # rows kept before each row: the new offsets
        take = np.flatnonzero(wanted)
        if self.points is None or self.point_offsets is None:
            return FlatLabels(self.rows[take], kept_before[self.offsets])
        point_counts = np.diff(self.point_offsets)[take]
        points = self.points[_runs(self.point_offsets[take], point_counts)]
        return FlatLabels(self.rows[take], kept_before[self.offsets], points,
                          np.concatenate([[0], np.cumsum(point_counts)]))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, i: int) -> np.ndarray: ...

    @overload
    def __getitem__(self, i: slice) -> list[np.ndarray]: ...

    def __getitem__(self, i: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self)
        k = int(i) + n if int(i) < 0 else int(i)
        if not 0 <= k < n:
            raise IndexError(f"label index {i} out of range for {n} images")
        return self.rows[self.offsets[k] : self.offsets[k + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        rows, bounds = self.rows, self.offsets.tolist()
        return (rows[a:b] for a, b in zip(bounds[:-1], bounds[1:]))
