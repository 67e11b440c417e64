"""Reusable per-thread scratch buffers for the pixel kernels.

A 640x640 mosaic makes several short-lived megabyte-sized temporaries (a padded source crop, a
resized tile, the HSV image, the mixup partner). Fresh allocations of that size come from
``mmap`` or a trimmed heap, so every one costs page faults on zeroed pages, about as much as the
arithmetic itself (``benchmarks/augment_kernels.py`` times the kernels). The kernels instead borrow views of a few named,
growing buffers that live as long as the thread; a worker renders one sample at a time, so a name
is never in use twice at once (each name is used by exactly one step of a sample).
"""
from __future__ import annotations

import threading

import numpy as np

__all__ = ["scratch"]

_local = threading.local()


def scratch(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A C-contiguous uint8 array of ``shape`` backed by this thread's buffer ``name``.

    The content is undefined; the array stays valid until the next ``scratch(name, ...)`` call of
    the same thread.
    """
    pool: dict[str, np.ndarray] | None = getattr(_local, "pool", None)
    if pool is None:
        pool = _local.pool = {}
    n = 1
    for v in shape:
        n *= int(v)
    buf = pool.get(name)
    if buf is None or buf.size < n:
        buf = pool[name] = np.empty(max(n, 1), np.uint8)
    return buf[:n].reshape(shape)
