"""Many file paths in one bytes blob: :class:`PathList`, a ``Sequence[str]`` without one Python object per path.

A split of a million images has a million paths; as Python strings they cost ~100 bytes each in the main process,
and every worker that touches them (a refcount write) copies the pages they sit on. A :class:`PathList` keeps
them as one ``bytes`` (each path NUL-terminated, UTF-8, names that are not UTF-8 kept byte for byte) and an
``int64`` array of offsets: two objects whatever the number of paths, which forked workers share with their
parent, and which the index cache stores and loads as they are.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Sequence, overload

import numpy as np

__all__ = ["PathList", "encode_path", "joined"]

_CHUNK = 1 << 16  # paths decoded at a time when iterating


def encode_path(path: str) -> bytes:
    """A path as the bytes the file system has for it (``os.fsencode`` on POSIX, the same on every platform)."""
    return path.encode("utf-8", "surrogateescape")


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


class PathList(Sequence[str]):
    """Paths ``blob[offsets[i]:offsets[i + 1] - 1]`` (each followed by one NUL), read as ``str``.

    Compares equal to any sequence of the same strings (``index.im_files == [...]``); slicing and
    :meth:`subset` give a :class:`PathList`.
    """

    def __init__(self, blob: bytes, offsets: np.ndarray | None = None) -> None:
        if blob and not blob.endswith(b"\0"):
            raise ValueError("a PathList blob ends each path with a NUL byte")
        self.blob = bytes(blob)
        if offsets is None:  # every NUL ends a path: the next one starts after it
            ends = np.flatnonzero(np.frombuffer(self.blob, np.uint8) == 0)
            offsets = np.concatenate([[0], ends + 1])
        self.offsets = np.ascontiguousarray(offsets, np.int64)
        if self.offsets.ndim != 1 or not len(self.offsets) or self.offsets[0] != 0 or self.offsets[-1] != len(self.blob):
            raise ValueError(f"path offsets must run from 0 to {len(self.blob)}")
        self.offsets.flags.writeable = False

    @classmethod
    def from_paths(cls, paths: Iterable[str]) -> "PathList":
        """Pack strings (a :class:`PathList` is returned as it is)."""
        if isinstance(paths, PathList):
            return paths
        return cls(b"".join(encode_path(p) + b"\0" for p in paths))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> "PathList": ...

    def __getitem__(self, i: int | slice) -> "str | PathList":
        if isinstance(i, slice):
            return self.subset(np.arange(len(self))[i])
        n = len(self)
        k = int(i) + n if int(i) < 0 else int(i)
        if not 0 <= k < n:
            raise IndexError(f"path index {i} out of range for {n} paths")
        return _decode(self.blob[self.offsets[k] : self.offsets[k + 1] - 1])

    def __iter__(self) -> Iterator[str]:
        for a in range(0, len(self), _CHUNK):
            b = min(a + _CHUNK, len(self))
            # one decode and split per chunk of paths: C speed, no slice per path
            yield from _decode(self.blob[self.offsets[a] : self.offsets[b] - 1]).split("\0")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PathList):
            return self.blob == other.blob
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which are unhashable

    def encoded(self) -> list[bytes]:
        """Every path as ``bytes`` (what ``os.stat`` takes), made by one split of the blob."""
        return self.blob.split(b"\0")[:-1] if self.blob else []

    def subset(self, indices: np.ndarray | Sequence[int]) -> "PathList":
        """The paths at ``indices`` (in that order), packed again."""
        idx = np.asarray(indices, np.int64).reshape(-1)
        if len(idx) and (idx.min() < -len(self) or idx.max() >= len(self)):
            raise IndexError(f"path indices out of range for {len(self)} paths")
        idx = idx % max(len(self), 1)
        starts, ends = self.offsets[idx], self.offsets[idx + 1]
        blob = b"".join(map(self.blob.__getitem__, map(slice, starts.tolist(), ends.tolist())))
        return PathList(blob, np.concatenate([[0], np.cumsum(ends - starts)]))

    def __repr__(self) -> str:
        return f"PathList({len(self)} paths, {len(self.blob)} bytes)"


def joined(paths: Sequence[str], sep: str) -> bytes:
    """``sep.join(paths)`` UTF-8 encoded; from a :class:`PathList`'s blob without a string per path."""
    if isinstance(paths, PathList):
        return paths.blob[:-1].replace(b"\0", encode_path(sep)) if len(paths) else b""
    return encode_path(sep.join(paths))
