"""crc32, the checksum that every store record and every staged file carries.

Computed by ISA-L (the ``isal`` package, a dependency) when it imports: the same polynomial and the same
values as :func:`zlib.crc32`, from SIMD code many times faster, which is what lets a decoded store check
every record on its first read without slowing a first epoch much (``python benchmarks/store_read.py
--check-cost`` measures it). Where ISA-L is missing (no wheel for the platform, an install with
``--no-deps``) zlib computes the same numbers, slower; stores written either way read either way.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from fastload.data.labels import ImageLabels

try:
    from isal.isal_zlib import crc32 as _crc32
    CRC32_IMPLEMENTATION = "isal"
except ImportError:  # no ISA-L for this platform: zlib's crc32 gives identical values
    from zlib import crc32 as _crc32
    CRC32_IMPLEMENTATION = "zlib"


def crc32(data: Any, value: int = 0) -> int:
    """crc32 of ``data`` (any contiguous buffer: bytes, memoryview, C-contiguous numpy array) continuing
    from ``value``, as :func:`zlib.crc32`."""
    return _crc32(data, value)


def record_checksum(payload: bytes | memoryview | np.ndarray, labels: np.ndarray | ImageLabels) -> int:
    """A store record's checksum: crc32 of its payload (encoded image bytes, or decoded pixels) followed by
    its labels as float32 bytes, then, for labels with points (:class:`~fastload.data.labels.ImageLabels`), each
    row's point count as int32 bytes and the points as float32 bytes (without points: the same value as before
    label points existed)."""
    if isinstance(payload, np.ndarray):
        payload = memoryview(np.ascontiguousarray(payload)).cast("B")
    rows, points, point_offsets = labels if isinstance(labels, ImageLabels) else (labels, None, None)
    value = _crc32(np.ascontiguousarray(rows, np.float32).tobytes(), _crc32(payload))
    if points is None or point_offsets is None:
        return value
    value = _crc32(np.diff(point_offsets).astype(np.int32).tobytes(), value)
    return _crc32(np.ascontiguousarray(points, np.float32).tobytes(), value)


def file_crc32(path: str | os.PathLike, chunk: int = 8 << 20) -> tuple[int, int]:
    """(size, crc32) of the file at ``path``, read in ``chunk``-byte pieces."""
    value, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            value = _crc32(block, value)
            size += len(block)
    return size, value
