"""YOLO label files: the ``/images/`` -> ``/labels/`` path rule, parsing and row validation.

A row is ``class xc yc w h`` (normalised) or a polygon ``class x1 y1 x2 y2 x3 y3 ...`` (at least
three points), which becomes the box spanning its points. Bad rows are dropped one by one and
reported as :class:`Problem` records with their line number; good rows are kept.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterator, Sequence, overload

import numpy as np

__all__ = ["Problem", "LabelResult", "FlatLabels", "img2label_path", "label_paths", "parse_labels", "read_label_file", "COORD_TOL"]

# Coordinates this far outside [0, 1] are clipped (rounding in converters); further out the row is rejected.
COORD_TOL = 1e-2


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
    """Parsed labels (``float32 [n, 5]``), the problems found, and the rows dropped as duplicates / invalid."""

    labels: np.ndarray
    problems: list[Problem] = field(default_factory=list)
    duplicates: int = 0
    rows_dropped: int = 0


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


def _row_box(values: list[float]) -> tuple[float, float, float, float]:
    """(xc, yc, w, h) of a box row, or of the box spanning a polygon row's points."""
    if len(values) == 4:
        return values[0], values[1], values[2], values[3]
    xs, ys = values[0::2], values[1::2]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    return (x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0


def parse_labels(text: str, nc: int, path: str = "<labels>", tol: float = COORD_TOL) -> LabelResult:
    """Parse and validate YOLO label text against ``nc`` classes.

    Rejected rows (reported, dropped): wrong column count, non-numeric values, class id that is
    negative, non-integer or >= ``nc``, a coordinate more than ``tol`` outside [0, 1], zero or
    negative width/height. Coordinates within ``tol`` are clipped. Exact duplicate rows are
    dropped and counted.
    """
    problems: list[Problem] = []
    rows: list[tuple[float, float, float, float, float]] = []
    dropped = 0

    def bad(line_no: int, kind: str, message: str) -> None:
        nonlocal dropped
        dropped += 1
        problems.append(Problem(path, kind, f"line {line_no}: {message}"))

    for line_no, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        n = len(parts)
        if not (n == 5 or (n >= 7 and n % 2 == 1)):
            bad(line_no, "bad_columns", f"{n} columns (want 5: class xc yc w h, or class + >=3 x y pairs)")
            continue
        try:
            values = [float(v) for v in parts]
        except ValueError:
            bad(line_no, "non_numeric", f"non-numeric value in {line.strip()[:60]!r}")
            continue
        if not all(np.isfinite(values)):
            bad(line_no, "non_numeric", f"non-finite value in {line.strip()[:60]!r}")
            continue
        cls = values[0]
        if cls != int(cls) or cls < 0 or cls >= nc:
            bad(line_no, "bad_class", f"class {parts[0]} not an integer in 0..{nc - 1}")
            continue
        coords = values[1:]
        worst = max(max(-c for c in coords), max(c - 1.0 for c in coords))
        if worst > tol:
            bad(line_no, "out_of_range", f"coordinate outside [0, 1] in {line.strip()[:60]!r}")
            continue
        coords = [min(1.0, max(0.0, c)) for c in coords]
        xc, yc, w, h = _row_box(coords)
        if w <= 0 or h <= 0:
            bad(line_no, "bad_size", f"zero or negative box size (w={w:g}, h={h:g})")
            continue
        rows.append((float(int(cls)), xc, yc, w, h))

    labels = np.asarray(rows, dtype=np.float32).reshape(-1, 5)
    duplicates = 0
    if len(labels) > 1:
        _, first = np.unique(labels, axis=0, return_index=True)
        if len(first) < len(labels):
            duplicates = len(labels) - len(first)
            labels = labels[np.sort(first)]
            problems.append(Problem(path, "duplicate_row", f"{duplicates} duplicate row(s) removed"))
    return LabelResult(np.ascontiguousarray(labels), problems, duplicates, dropped)


def read_label_file(path: str | os.PathLike, nc: int) -> LabelResult:
    """Read and validate one label file; an unreadable file gives no labels and a ``label_unreadable`` problem."""
    p = str(path)
    try:
        with open(p, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        return LabelResult(np.zeros((0, 5), np.float32), [Problem(p, "label_unreadable", str(exc))])
    return parse_labels(text, nc, p)


class FlatLabels(Sequence[np.ndarray]):
    """Every image's labels in one ``float32 [M, 5]`` array: image ``i`` owns rows ``offsets[i]:offsets[i + 1]``.

    A sequence of per-image arrays to its readers (``labels[i]`` is a read-only view), without one Python object
    per image: two arrays whatever the number of images, which worker processes share with their parent.
    """

    def __init__(self, rows: np.ndarray, offsets: np.ndarray) -> None:
        self.rows = np.ascontiguousarray(rows, np.float32).reshape(-1, 5)
        self.offsets = np.ascontiguousarray(offsets, np.int64)
        if self.offsets.ndim != 1 or not len(self.offsets) or self.offsets[0] != 0 or self.offsets[-1] != len(self.rows):
            raise ValueError(f"label offsets must run from 0 to {len(self.rows)}")
        self.rows.flags.writeable = False

    @classmethod
    def from_arrays(cls, labels: Sequence[np.ndarray]) -> "FlatLabels":
        """Pack per-image ``[n, 5]`` arrays."""
        if isinstance(labels, FlatLabels):
            return labels
        arrays = [np.asarray(lb, np.float32).reshape(-1, 5) for lb in labels]
        counts = np.fromiter((len(a) for a in arrays), np.int64, len(arrays))
        rows = np.concatenate(arrays) if arrays else np.zeros((0, 5), np.float32)
        return cls(rows, np.concatenate([[0], np.cumsum(counts)]))

    @property
    def counts(self) -> np.ndarray:
        """``int64 [n]``: the number of labels of each image."""
        return np.diff(self.offsets)

    def subset(self, indices: np.ndarray) -> "FlatLabels":
        """The labels of ``indices`` (in that order), packed again."""
        indices = np.asarray(indices, np.int64)
        counts = self.counts[indices]
        offsets = np.concatenate([[0], np.cumsum(counts)])
        starts = self.offsets[indices]
        # row r of the result is row starts[k] + (r - offsets[k]) of self, k the image it belongs to
        owner = np.repeat(np.arange(len(indices)), counts)
        take = starts[owner] + np.arange(int(offsets[-1])) - offsets[:-1][owner]
        return FlatLabels(self.rows[take], offsets)

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
