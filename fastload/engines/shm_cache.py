"""A decoded-image cache shared by all worker processes of one loader.

Mosaic and mixup read several images per output image (4 per mosaic, 4 more with mixup; ``fastload
bench`` reports the average as ``reads_per_sample``), so a loader that decodes
JPEGs on every read spends most of its time in the decoder. This cache keeps the *loaded* image
(long side = imgsz, RGB HWC uint8) of every sample it has room for, in one anonymous shared mapping
created before the workers fork: whichever worker decodes an image first writes it, every worker
(and every later epoch) reads it without decoding again, and the machine holds a single copy.

No locks are needed: the loaded shape of every sample is known up front
(:func:`fastload.data.images.loaded_shape`), so each cached sample owns a fixed byte range
(samples ``0..k-1`` in index order, as many as fit ``capacity``; reads of the others always
decode). A one-byte ready flag per sample is set after its pixels are written; two workers that
race on the same sample write identical bytes. Pages of the mapping are only committed when
written, so an unused capacity costs nothing.
"""
from __future__ import annotations

import mmap
from typing import Callable

import numpy as np


class SharedDecodeCache:
    """Fixed-slot cache of loaded images.

    Args:
        loaded_hw: ``int [N, 2]`` loaded ``(h, w)`` of every sample.
        capacity_bytes: memory bound for pixels; ``0`` disables the cache.
    """

    def __init__(self, loaded_hw: np.ndarray, capacity_bytes: int) -> None:
        hw = np.asarray(loaded_hw, np.int64).reshape(-1, 2)
        sizes = hw[:, 0] * hw[:, 1] * 3
        ends = np.cumsum(sizes)
        self.n_cached = int(np.searchsorted(ends, max(int(capacity_bytes), 0), side="right"))
        self.nbytes = int(ends[self.n_cached - 1]) if self.n_cached else 0
        self.hw = hw
        self.offsets = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        n = len(hw)
        # flags live in their own small mapping so the pixel pages stay untouched until written
        self._flags_map = mmap.mmap(-1, max(n, 1), flags=mmap.MAP_SHARED)
        self._flags = np.frombuffer(self._flags_map, np.uint8)
        self._pix_map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_SHARED) if self.nbytes else None
        self._pix = np.frombuffer(self._pix_map, np.uint8) if self._pix_map is not None else None
        self.hits = 0  # per process: how often a read was served from the cache
        self.misses = 0

    def __len__(self) -> int:
        return int(self._flags[: len(self.hw)].sum())

    def _view(self, i: int) -> np.ndarray:
        h, w = (int(v) for v in self.hw[i])
        off = int(self.offsets[i])
        return self._pix[off : off + h * w * 3].reshape(h, w, 3)  # type: ignore[index]

    def get(self, i: int, load: Callable[[int], np.ndarray]) -> np.ndarray:
        """The loaded image ``i``: from the cache, else ``load(i)`` (stored when there is room).

        The returned array is read-only for the caller (a view into shared memory for hits).
        """
        if i < self.n_cached:
            if self._flags[i]:
                self.hits += 1
                return self._view(i)
            img = load(i)
            view = self._view(i)
            if img.shape != view.shape:
                raise ValueError(
                    f"sample {i}: loaded shape {img.shape} differs from the planned {view.shape}"
                )
            view[...] = img
            self._flags[i] = 1  # after the pixels: readers that see the flag see the pixels
            self.misses += 1
            return view
        self.misses += 1
        return load(i)

    def close(self) -> None:
        self._pix = None
        self._flags = np.zeros(0, np.uint8)
        self._pix_map = None
        self._flags_map = None
