"""The decoded-image cache for encoded stores (files, lmdb): one per machine, used by the CPU engine's
workers and by the Ray engine's actors (one cache per node).

Mosaic and mixup read several images per output image, and every epoch reads every image again, so
a loader that decodes JPEGs on every read spends most of its time in the decoder. This cache keeps
the *loaded* image (long side = imgsz, RGB HWC uint8) of every image it has room for in one
shared-memory segment per machine: whichever worker of whichever rank (or of another training run
on the same data) decodes an image first writes it, every other process reads it without decoding.
It is a ram store built during the first epoch, without a separate ``fastload convert``.

Segment: a folder ``fastload-dcache-<name>-<digest>-<imgsz>`` under the shm root
(:func:`fastload.store.kinds.shm_root`) holding ``cache.bin`` (a flag byte per image, then the
pixels) and ``meta.json`` (its layout, the commit marker). The digest covers the store's identity
(kind, path, file list, original shapes), ``imgsz`` and the recipe of loaded pixels (decode scale,
resize filters), so different datasets, sizes or decoders never share one. Its lifetime follows the
ram store's rules (:mod:`fastload.store.shm`): every user process registers its PID in the
holders file, the last one out removes the segment, and a segment whose holders are all dead (a
crash, SIGKILL) is removed by the next process that opens any decoded cache, by
``fastload unstage --stale``, or listed by ``fastload info --shm``.

Budget policy (when the dataset does not fit): the layout is fixed when the segment is created:
images ``0 .. k-1`` of the store (store order), as many as fit the budget, each own a byte range;
the others are decoded on every read. ``stats()`` says how many images have a place
(``decode_cache_slots``) and how many are held now (``decode_cache_filled``). The whole
segment is reserved up front (``posix_fallocate``), so a full ``/dev/shm`` shows at start (the
engine then runs without the cache, with a warning) rather than as a SIGBUS in a worker.

Publication (correct on weakly ordered CPUs such as aarch64, not only on x86; the reasoning is in
docs/design.md, "Shared memory and CPU memory order"): every image's byte range is known in advance
(its loaded shape is a function of the original shape and imgsz); a process writes an image only
while it holds an exclusive open-file-description lock (``F_OFD_SETLK``) on that image's flag byte
of ``cache.bin`` and the flag, read under that lock, is still 0: it writes the pixels, sets the flag,
and closes the lock's descriptor. A process trusts an image's pixels only after it has seen its
flag set while holding a lock on that byte (shared for a reader); the kernel's lock hand-over orders
the writer's stores before the reader's loads. Each process remembers which images it has seen
published, so the common read is one byte test, no system call; a published image is never written
again, so that memory stays true. Nobody waits for a lock: an image whose lock another process holds
is decoded by the reader for itself (not cached), and a writer that dies mid-image loses its lock
with its descriptors, its flag still 0, so the next process rewrites the image from scratch.
Platforms without OFD locks (macOS) get no cache (a warning; every read decodes).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import mmap
import os
import re
import struct
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import psutil

from fastload.data.images import LoadRule, ShrinkFilter, loaded_shapes
from fastload.data.paths import joined
from fastload.store import shm
from fastload.store.base import Store
from fastload.store.kinds import SHM_PREFIX, shm_root
from fastload.store.space import fmt_bytes, free_bytes, size_bytes
from fastload.store.view import StoreView

PREFIX = SHM_PREFIX + "dcache-"
LAYOUT_VERSION = 1
_PAGE = 4096
_DATA = "cache.bin"
_META = shm.COMMIT_FILE
POLICY = "first images of the store (store order) that fit the budget are cached; the others are decoded on every read"
# the entry locks: open-file-description byte-range locks (Linux >= 3.15), whose ``struct flock`` (type,
# whence, start, len, pid) is packed here for 64-bit Linux (x86_64 and aarch64 share the layout)
ENTRY_LOCKS = sys.platform.startswith("linux") and hasattr(fcntl, "F_OFD_SETLK") and struct.calcsize("l") == 8
_FLOCK = struct.Struct("hh4xqqi4x")


def _root_store(store: Store) -> tuple[Store, np.ndarray]:
    """The store underneath any views, and the base index of every index of ``store``."""
    idx = np.arange(len(store), dtype=np.int64)
    while isinstance(store, StoreView):
        idx = store.base_indices[idx]
        store = store.base
    return store, idx


def segment_path(store: Store, imgsz: int, recipe: str) -> Path:
    """The segment of ``store``'s decoded images at ``imgsz`` made by ``recipe`` (same store, size and
    recipe -> same path, on every rank and in every run)."""
    base, _ = _root_store(store)
    h = hashlib.sha1()
    path = os.path.realpath(base.path) if base.path else None
    h.update(json.dumps([LAYOUT_VERSION, base.kind, path, len(base), int(imgsz), recipe]).encode())
    h.update(joined(base.im_files, "\n"))
    h.update(np.ascontiguousarray(base.shapes, np.int64).tobytes())
    slug = re.sub(r"[^A-Za-z0-9_.]+", "_", Path(base.path or "data").name)[:32]
    return shm_root() / f"{PREFIX}{slug}-{h.hexdigest()[:12]}-{int(imgsz)}"


def auto_decode_cache_bytes() -> int:
    """Default bound of a machine's decoded-image cache: 1/8 of its physical memory (one cache per
    machine, shared by every process that reads the store there)."""
    return int(psutil.virtual_memory().total // 8)


def _budget_bytes(budget_mb: int | None) -> int:
    """The bound an engine option asks for (None: :func:`auto_decode_cache_bytes`; 0: no cache)."""
    return auto_decode_cache_bytes() if budget_mb is None else int(budget_mb) << 20


def planned_cache_bytes(budget_mb: int | None) -> int:
    """The most pixels a decoded cache made with the option ``budget_mb`` can hold on this machine: the bound
    (:func:`_budget_bytes`) within 9/10 of the shared-memory filesystem's size. Its size, not its free space:
    the same figure for every process of the machine whenever it asks, so loaders that plan by it (the default
    mosaic partners, :func:`fastload.loader`) plan alike on every rank."""
    return max(0, min(_budget_bytes(budget_mb), int(size_bytes(shm_root()) * 0.9)))


def decoded_set_bytes(store: Store, imgsz: int, load_rule: LoadRule) -> int:
    """Bytes of the loaded pixels of every image of ``store``'s root store at ``imgsz``: what a decoded cache
    needs to hold the whole dataset (its layout covers the root store, whatever the view)."""
    hw = loaded_shapes(_root_store(store)[0].shapes, imgsz, load_rule)
    return int((hw[:, 0] * hw[:, 1] * 3).sum())


def open_decode_cache(store: Store, imgsz: int, load_rule: LoadRule, *, decode_scale: str, shrink: ShrinkFilter,
                      budget_mb: int | None, jpeg_decoder: str | None = None) -> "SharedDecodeCache | None":
    """This machine's decoded cache of a loader's store, as an engine option asks for it.

    Args:
        store: the loader's store (view); a decoded store needs no cache (None).
        imgsz: the long side of loaded images.
        load_rule, decode_scale, shrink, jpeg_decoder: how the loaded pixels are made (the loaded-image rule's sizes
            and filter, ``"full"``/``"reduced"``, the shrink filter, the JPEG decoder an engine option chose, None:
            the process's): part of the segment's name, so loaders that make other pixels never share one.
        budget_mb: bound of the segment, if this process creates it (None: :func:`auto_decode_cache_bytes`;
            0: no cache, None is returned).
    """
    if store.decoded:
        return None
    budget = _budget_bytes(budget_mb)
    if budget <= 0:
        return None
    # what decides the loaded pixels besides the store and imgsz (see Store.load)
    recipe = (f"decode={decode_scale};shrink={shrink};enlarge=linear" + (f";jpeg={jpeg_decoder}" if jpeg_decoder else "")
              + ("" if load_rule == "yolov9" else f";rule={load_rule}"))  # YOLOv9's keeps the names it had
    return SharedDecodeCache.open(store, imgsz, recipe, budget, load_rule)


def _layout(hw: np.ndarray, capacity: int) -> tuple[int, np.ndarray, int]:
    """``(slots, pixel offsets of every image, pixel bytes)``: images ``0 .. slots-1`` fit ``capacity``."""
    sizes = hw[:, 0] * hw[:, 1] * 3
    ends = np.cumsum(sizes)
    slots = int(np.searchsorted(ends, max(int(capacity), 0), side="right"))
    offsets = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    return slots, offsets, int(ends[slots - 1]) if slots else 0


class SharedDecodeCache:
    """The machine's decoded-image cache of one store at one imgsz; open it with :meth:`open`.

    ``get(i, load)`` takes loader (view) indices; the segment is laid out by the store's own indices,
    so loaders with different views of one store (``min_items``, ``single_cls``) share it.

    Attributes:
        segment: the segment folder.
        slots: how many images have a place (images ``0 .. slots-1`` of the store).
        n: images in the store.
        nbytes: bytes reserved for pixels.
        hits, misses: reads of this process served from the cache / decoded (misses include the
            images without a place).
    """

    def __init__(self, segment: Path, base_hw: np.ndarray, base_idx: np.ndarray) -> None:
        self.segment = Path(segment)
        meta = json.loads((self.segment / _META).read_text())
        self.n = len(base_hw)
        self.slots, self._offsets, self.nbytes = _layout(base_hw, int(meta["capacity"]))
        if meta.get("layout") != LAYOUT_VERSION or meta.get("n") != self.n or meta.get("slots") != self.slots:
            raise RuntimeError(f"decoded cache {self.segment} was laid out for another store ({meta}); "
                               f"remove it with `fastload unstage --stale` once no loader uses it")
        self._hw = base_hw
        self._base_idx = base_idx
        self._pix_start = int(meta["pixels_at"])
        self._data = self.segment / _DATA
        fd = os.open(self._data, os.O_RDWR)
        try:
            self._map: mmap.mmap | None = mmap.mmap(fd, self._pix_start + self.nbytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self._buf = np.frombuffer(self._map, np.uint8)
        self._flags = self._buf[: self.n]
        # images this process has seen published (flag set, read under the image's lock): read without a lock
        self._known = bytearray(self.n)
        self.hits = 0
        self.misses = 0
        self._open = True

    # -- opening ------------------------------------------------------------------------------------------
    @classmethod
    def open(cls, store: Store, imgsz: int, recipe: str, budget: int,
             load_rule: LoadRule = "yolov9") -> "SharedDecodeCache | None":
        """Join the machine's cache of ``store`` (``imgsz``, ``recipe``), creating it with room for
        ``budget`` bytes of pixels (at most what the whole store needs) when no process has it yet.

        Segments left by dead processes are removed first. Returns None (after a warning) when the
        shared-memory filesystem cannot hold even one image, or on a platform without the entry locks.
        """
        if not ENTRY_LOCKS:
            warnings.warn(f"fastload: no decoded-image cache on {sys.platform}: it needs open-file-description locks "
                          f"(Linux); the loader decodes every read (decode_cache_mb=0 silences this)")
            return None
        shm.cleanup_stale(prefix=PREFIX)
        base, base_idx = _root_store(store)
        base_hw = loaded_shapes(base.shapes, imgsz, load_rule)
        segment = segment_path(store, imgsz, recipe)
        try:
            shm.acquire(segment, lambda seg: _build(seg, base_hw, int(budget), imgsz, recipe),
                        info={"what": "decoded-image cache", "images": len(base_hw), "imgsz": int(imgsz)})
        except _NoRoom as e:
            warnings.warn(f"fastload: {e}; the loader decodes every read (decode_cache_mb=0 silences this)")
            return None
        try:
            return cls(segment, base_hw, base_idx)
        except BaseException:
            shm.release(segment)
            raise

    # -- reads --------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Images held now, machine-wide (written by any process)."""
        return int(np.count_nonzero(self._flags[: self.slots])) if self._open else 0

    def _view(self, b: int) -> np.ndarray:
        h, w = (int(v) for v in self._hw[b])
        off = self._pix_start + int(self._offsets[b])
        return self._buf[off : off + h * w * 3].reshape(h, w, 3)

    def get(self, i: int, load: Callable[[int], np.ndarray]) -> np.ndarray:
        """The loaded image of loader index ``i``: from the cache, else ``load(i)`` (kept when it has a place
        and no other process is writing it).

        Cached images are returned as read-only views of the shared segment.
        """
        b = int(self._base_idx[i])
        if b >= self.slots:
            self.misses += 1
            return load(i)
        if self._known[b] or self._confirm(b):
            self.hits += 1
            return self._readonly(b)
        fd = self._lock_entry(b, exclusive=True)
        if fd is None:  # another process is writing or confirming it: decode a copy rather than wait
            self.misses += 1
            return load(i)
        try:
            if self._flags[b]:  # published since our first look (its writer held this lock to set the flag)
                self.hits += 1
            else:
                img = load(i)
                view = self._view(b)
                if img.shape != view.shape:
                    raise ValueError(f"image {i}: loaded shape {img.shape} differs from the planned {view.shape}")
                view[...] = img
                self._flags[b] = 1
                self.misses += 1
        finally:
            os.close(fd)  # releases the lock: the stores above happen before any later lock of this image
        self._known[b] = 1
        return self._readonly(b)

    def _confirm(self, b: int) -> bool:
        """Whether image ``b`` is published, its flag read under a shared lock of its byte (remembered)."""
        if not self._flags[b]:  # a plain read: a stale 0 only sends us to the writer's path
            return False
        fd = self._lock_entry(b, exclusive=False)
        if fd is None:
            return False
        try:
            published = bool(self._flags[b])
        finally:
            os.close(fd)
        self._known[b] = published
        return published

    def _lock_entry(self, b: int, *, exclusive: bool) -> int | None:
        """A new descriptor of ``cache.bin`` holding a lock on image ``b``'s flag byte, or None when another
        process holds a conflicting one (never waits). Closing the descriptor releases the lock, and so does
        the death of the process.

        OFD locks belong to the open file description, not to the process, so two descriptors of one process
        (two threads, two caches of one segment) exclude each other too, and closing an unrelated descriptor
        of the file (as mmap's opening does) releases nothing.
        """
        fd = os.open(self._data, os.O_RDWR | os.O_CLOEXEC)
        kind = fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, b, 1, 0))
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return None
            raise
        return fd

    def _readonly(self, b: int) -> np.ndarray:
        out = self._view(b)
        out.flags.writeable = False
        return out

    def stats(self) -> dict[str, Any]:
        """The machine-wide state: ``decode_cache_segment``, ``_slots`` (images with a place),
        ``_filled`` (images held now), ``_images`` (in the store), ``_bytes`` (reserved), ``_policy``."""
        return {"decode_cache_segment": str(self.segment), "decode_cache_slots": self.slots,
                "decode_cache_filled": len(self), "decode_cache_images": self.n,
                "decode_cache_bytes": self.nbytes, "decode_cache_policy": POLICY}

    def close(self) -> None:
        """Unmap (once no view is in use) and drop this process's hold; the last holder removes the segment."""
        if not self._open:
            return
        self._open = False
        self._flags = self._buf = np.zeros(0, np.uint8)
        self._map = None  # unmapped when the last view of it is gone
        shm.release(self.segment)


class _NoRoom(OSError):
    """The shared-memory filesystem cannot hold the cache."""


def _build(segment: Path, hw: np.ndarray, budget: int, imgsz: int, recipe: str) -> None:
    """Create the segment (under the holders lock)."""
    n = len(hw)
    pixels_at = -(-max(n, 1) // _PAGE) * _PAGE
    total = int((hw[:, 0] * hw[:, 1] * 3).sum())
    capacity = min(int(budget), total)
    room = int(free_bytes(segment.parent) * 0.9) - pixels_at  # leave a tenth of the filesystem to others
    if capacity > room:
        smallest = int((hw[:, 0] * hw[:, 1] * 3).min()) if n else 0
        if room < smallest:
            raise _NoRoom(f"{segment.parent} has {fmt_bytes(max(room, 0))} free, too little for a decoded-image cache")
        warnings.warn(f"fastload: {segment.parent} has {fmt_bytes(room)} free: the decoded-image cache gets that instead "
                      f"of {fmt_bytes(capacity)} and holds only part of the dataset (raise the size of {segment.parent}, "
                      f"e.g. docker --shm-size)")
        capacity = room
    slots, _, nbytes = _layout(hw, capacity)
    meta = {"layout": LAYOUT_VERSION, "n": n, "imgsz": int(imgsz), "recipe": recipe, "capacity": capacity,
            "slots": slots, "pixels_at": pixels_at, "pixel_bytes": nbytes, "policy": POLICY}
    try:
        shm.build_reserved(segment, _DATA, pixels_at + nbytes, meta)
    except OSError as e:
        raise _NoRoom(f"cannot reserve {fmt_bytes(pixels_at + nbytes)} for a decoded-image cache in "
                      f"{segment.parent}: {e.strerror or e}") from e
