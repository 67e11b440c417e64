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

Budget policy (when the dataset does not fit), one of two, chosen when the segment is created (``keep``, part
of its name): ``"first"`` (:class:`SharedDecodeCache`): the layout is fixed: images ``0 .. k-1`` of the store
(store order), as many as fit the budget, each own a byte range; the others are decoded on every read.
``"latest"`` (:class:`TurnoverDecodeCache`): the cache turns over in the order images are decoded, which is the
epoch order: once full, a new image takes the entry of the one decoded longest ago, so the images of the
recent part of the epoch order are held (what ``partners="recent"`` draws from). ``stats()`` says how many
images have a place (``decode_cache_slots``) and how many are held now (``decode_cache_filled``). The whole
segment's bytes are reserved (``posix_fallocate``) before any process writes them, so a full ``/dev/shm`` shows as
a warning rather than as a SIGBUS in a worker: the bookkeeping and the first ``RESERVE_NOW`` bytes of pixels when
the segment is made (a filesystem without room for them: the engine runs without the cache, with a warning), the
rest by a thread of the process that made it, in parts of ``RESERVE_NOW``, so that a loader does not wait for
gigabytes of pages to be zeroed when it opens. A file ``reserved`` in the segment (an int64, mapped by every user)
says how far ``cache.bin`` is reserved; a process writes an image only into bytes below it (one beyond it is
decoded and not kept, as one without a place). Another process filling the filesystem meanwhile stops the
reservation (a warning): the cache keeps the images of the part reserved; so does the maker's close before the
reservation is done (its users go on with the part reserved).

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

The turnover cache (``keep="latest"``) rewrites entries, so it cannot trust what a process saw once: its entries
are fixed-size slots (the largest loaded image) in a ring, each with a header (the image it holds, 0: none) and a
lock byte; a table says in which slot each image was last written. A read locks the slot the table names
(shared, never waiting), checks under the lock that its header names the image, and returns a read-only view of
the slot, keeping the lock until the caller says it is done with its images (``release()``: the renderer calls it
after each sample, or each batch with ``partners="batch"``): a slot is never overwritten while a process uses
it. A miss decodes without any lock, takes the next ring position (a counter, under a lock held for a few
instructions), and writes the slot only if its exclusive lock is free (a process using it: the image stays
uncached): header cleared, pixels, header set. A writer that dies mid-slot leaves the header 0, and a process
that dies drops its holds with its descriptors.
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
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Literal, get_args

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
_RESERVED = "reserved"  # int64: bytes of cache.bin reserved so far (written only by the reserving thread)
#: pixel bytes reserved when a segment is made, and the part the reserving thread reserves at a time
RESERVE_NOW = 64 << 20
#: What a decoded cache keeps when the dataset does not fit (:mod:`fastload.engines.shm_cache`): ``"first"``: the first
#: images of the store that fit; ``"latest"``: the latest decoded, turning over in epoch order.
CacheKeep = Literal["first", "latest"]
CACHE_KEEPS: tuple[str, ...] = get_args(CacheKeep)
POLICY = "first images of the store (store order) that fit the budget are cached; the others are decoded on every read"
TURNOVER_POLICY = ("the latest decoded images are cached: once full, a new image takes the slot of the one decoded "
                   "longest ago (the cache turns over in epoch order)")
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


def segment_path(store: Store, imgsz: int, recipe: str, keep: CacheKeep = "first") -> Path:
    """The segment of ``store``'s decoded images at ``imgsz`` made by ``recipe``, with the budget policy ``keep``
    (same store, size, recipe and policy -> same path, on every rank and in every run)."""
    base, _ = _root_store(store)
    h = hashlib.sha1()
    path = os.path.realpath(base.path) if base.path else None
    key = [LAYOUT_VERSION, base.kind, path, len(base), int(imgsz), recipe] + ([] if keep == "first" else [keep])
    h.update(json.dumps(key).encode())
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


def planned_turnover_slots(store: Store, imgsz: int, load_rule: LoadRule, budget: int) -> int:
    """Slots of a turnover cache (``keep="latest"``) of ``budget`` bytes over ``store``'s root store at ``imgsz``."""
    return turnover_slots(loaded_shapes(_root_store(store)[0].shapes, imgsz, load_rule), budget)[0]


def open_decode_cache(store: Store, imgsz: int, load_rule: LoadRule, *, decode_scale: str, shrink: ShrinkFilter,
                      budget_mb: int | None, jpeg_decoder: str | None = None,
                      keep: CacheKeep | None = None) -> "DecodeCache | None":
    """This machine's decoded cache of a loader's store, as an engine option asks for it.

    Args:
        store: the loader's store (view); a decoded store needs no cache (None).
        imgsz: the long side of loaded images.
        load_rule, decode_scale, shrink, jpeg_decoder: how the loaded pixels are made (the loaded-image rule's sizes
            and filter, ``"full"``/``"reduced"``, the shrink filter, the JPEG decoder an engine option chose, None:
            the process's): part of the segment's name, so loaders that make other pixels never share one.
        budget_mb: bound of the segment, if this process creates it (None: :func:`auto_decode_cache_bytes`;
            0: no cache, None is returned).
        keep: the budget policy (:data:`CacheKeep`; None: ``"first"``).
    """
    if store.decoded:
        return None
    budget = _budget_bytes(budget_mb)
    if budget <= 0:
        return None
    # what decides the loaded pixels besides the store and imgsz (see Store.load)
    recipe = (f"decode={decode_scale};shrink={shrink};enlarge=linear" + (f";jpeg={jpeg_decoder}" if jpeg_decoder else "")
              + ("" if load_rule == "yolov9" else f";rule={load_rule}"))  # YOLOv9's keeps the names it had
    cls = TurnoverDecodeCache if keep == "latest" else SharedDecodeCache
    return cls.open(store, imgsz, recipe, budget, load_rule)


def _layout(hw: np.ndarray, capacity: int) -> tuple[int, np.ndarray, int]:
    """``(slots, pixel offsets of every image, pixel bytes)``: images ``0 .. slots-1`` fit ``capacity``."""
    sizes = hw[:, 0] * hw[:, 1] * 3
    ends = np.cumsum(sizes)
    slots = int(np.searchsorted(ends, max(int(capacity), 0), side="right"))
    offsets = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    return slots, offsets, int(ends[slots - 1]) if slots else 0


class DecodeCache:
    """A machine's decoded-image cache of one store at one imgsz. What both budget policies share: joining the machine's segment of a store (:meth:`open`), the entry locks,
    the read counters and the release (:meth:`close`). A subclass lays out ``cache.bin`` (``_build``, its
    ``__init__``) and reads it (``get``)."""

    KEEP: str = "first"  # the budget policy this class implements (:data:`CacheKeep`), part of the segment's name
    POLICY: str  # what the policy keeps, in words (``stats()``'s ``decode_cache_policy``)

    def _map(self, segment: Path, size: int) -> None:
        self.segment = Path(segment)
        self._data = self.segment / _DATA
        fd = os.open(self._data, os.O_RDWR)
        try:
            self._mmap: mmap.mmap | None = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self._buf = np.frombuffer(self._mmap, np.uint8)
        fd = os.open(self.segment / _RESERVED, os.O_RDWR)
        try:
            self._reserved_map: mmap.mmap | None = mmap.mmap(fd, 8, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self._reserved_to = np.frombuffer(self._reserved_map, np.int64)
        self._size = size
        self._reserving: tuple[threading.Thread, threading.Event] | None = None
        self.hits = 0
        self.misses = 0
        self._open = True

    @classmethod
    def open(cls, store: Store, imgsz: int, recipe: str, budget: int, load_rule: LoadRule = "yolov9") -> Any:
        """Join the machine's cache of ``store`` (``imgsz``, ``recipe``, this class's policy), creating it with room
        for ``budget`` bytes of pixels (at most what the whole store needs) when no process has it yet.

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
        segment = segment_path(store, imgsz, recipe, cls.KEEP)
        built = []

        def build(seg: Path) -> None:
            cls._build(seg, base_hw, int(budget), imgsz, recipe)
            built.append(seg)

        try:
            shm.acquire(segment, build,
                        info={"what": "decoded-image cache", "images": len(base_hw), "imgsz": int(imgsz)})
        except _NoRoom as e:
            warnings.warn(f"fastload: {e}; the loader decodes every read (decode_cache_mb=0 silences this)")
            return None
        try:
            cache = cls(segment, base_hw, base_idx)
        except BaseException:
            shm.release(segment)
            raise
        if built and cache._reserved_to[0] < cache._size:
            stop = threading.Event()
            thread = threading.Thread(target=cache._reserve_rest, args=(stop,), name="fastload-reserve", daemon=True)
            thread.start()
            cache._reserving = (thread, stop)
        return cache

    def _reserve_rest(self, stop: threading.Event) -> None:
        """Reserve the rest of ``cache.bin`` in parts of :data:`RESERVE_NOW`, raising ``reserved`` after each (the
        thread of the process that made the segment; ``stop``: it is being closed)."""
        fd = os.open(self._data, os.O_RDWR | os.O_CLOEXEC)
        try:
            at = int(self._reserved_to[0])
            while at < self._size and not stop.is_set():
                part = min(RESERVE_NOW, self._size - at)
                try:
                    os.posix_fallocate(fd, at, part)
                except OSError as e:
                    warnings.warn(f"fastload: cannot reserve the rest of the decoded-image cache {self.segment} "
                                  f"({fmt_bytes(self._size - at)}: {e.strerror or e}); it keeps the images of the "
                                  f"{fmt_bytes(at)} reserved")
                    return
                at += part
                self._reserved_to[0] = at  # after the reservation: a writer that sees it writes reserved pages
        finally:
            os.close(fd)

    def _reserved(self, end: int) -> bool:
        """Whether ``cache.bin`` is reserved up to byte ``end`` (a writer writes only below that)."""
        return end <= self._reserved_to[0]

    @staticmethod
    def _build(segment: Path, hw: np.ndarray, budget: int, imgsz: int, recipe: str) -> None:
        """Create the segment (under the holders lock) for images of loaded shapes ``hw``."""
        raise NotImplementedError

    def get(self, i: int, load: Callable[[int], np.ndarray]) -> np.ndarray:
        """The loaded image of loader index ``i``: from the cache, else ``load(i)``."""
        raise NotImplementedError

    def release(self) -> None:
        """The caller is done with the images :meth:`get` returned so far (a cache whose entries are rewritten
        keeps them until then)."""

    def stats(self) -> dict[str, Any]:
        """The machine-wide state: ``decode_cache_segment``, ``_slots`` (images with a place; the ring's slots),
        ``_filled`` (images held now; slots holding an image), ``_images`` (in the store), ``_bytes`` (of pixels),
        ``_reserved`` (of those reserved so far), ``_policy`` (the subclass's :attr:`POLICY`)."""
        return {"decode_cache_segment": str(self.segment), "decode_cache_slots": self.slots,
                "decode_cache_filled": len(self), "decode_cache_images": self.n,
                "decode_cache_bytes": self.nbytes, "decode_cache_reserved": self._reserved_bytes(),
                "decode_cache_policy": self.POLICY}

    def _check_meta(self, meta: dict[str, Any], **expected: Any) -> None:
        if meta.get("layout") != LAYOUT_VERSION or any(meta.get(k) != v for k, v in expected.items()):
            raise RuntimeError(f"decoded cache {self.segment} was laid out for another store ({meta}); "
                               f"remove it with `fastload unstage --stale` once no loader uses it")

    def _lock_entry(self, at: int, *, exclusive: bool, wait: bool = False) -> int | None:
        """A new descriptor of ``cache.bin`` holding a lock on its byte ``at`` (an entry's lock byte), or None when
        another process holds a conflicting one (``wait``: wait for it instead; only for locks held a few
        instructions). Closing the descriptor releases the lock, and so does the death of the process.

        OFD locks belong to the open file description, not to the process, so two descriptors of one process
        (two threads, two caches of one segment) exclude each other too, and closing an unrelated descriptor
        of the file (as mmap's opening does) releases nothing.
        """
        fd = os.open(self._data, os.O_RDWR | os.O_CLOEXEC)
        kind = fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, at, 1, 0))
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return None
            raise
        return fd

    def close(self) -> None:
        """Unmap (once no view is in use) and drop this process's hold; the last holder removes the segment."""
        if not self._open:
            return
        self._open = False
        if self._reserving is not None:
            thread, stop = self._reserving
            stop.set()
            thread.join()
        self._release_views()
        self._buf = np.zeros(0, np.uint8)
        self._mmap = None  # unmapped when the last view of it is gone
        self._reserved_to = np.zeros(1, np.int64)
        self._reserved_map = None
        shm.release(self.segment)

    def _release_views(self) -> None:
        """Drop this object's numpy views of the mapping (before it is unmapped)."""

    def _reserved_bytes(self) -> int:
        """Pixel bytes reserved so far (all of ``nbytes`` once the reservation is done)."""
        return max(0, int(self._reserved_to[0]) - self._pix_start) if self._open else 0


def _capacity(segment: Path, budget: int, need: int, head: int, smallest: int) -> int:
    """The pixel bytes a new segment gets: ``budget``, at most ``need`` (the whole store), within what the
    shared-memory filesystem has free beside ``head`` bytes of bookkeeping (a warning when that is less)."""
    capacity = min(int(budget), need)
    room = int(free_bytes(segment.parent) * 0.9) - head  # leave a tenth of the filesystem to others
    if capacity > room:
        if room < smallest:
            raise _NoRoom(f"{segment.parent} has {fmt_bytes(max(room, 0))} free, too little for a decoded-image cache")
        warnings.warn(f"fastload: {segment.parent} has {fmt_bytes(room)} free: the decoded-image cache gets that instead "
                      f"of {fmt_bytes(capacity)} and holds only part of the dataset (raise the size of {segment.parent}, "
                      f"e.g. docker --shm-size)")
        capacity = room
    return capacity


def _reserve(segment: Path, nbytes: int, pixels_at: int, meta: dict[str, Any]) -> None:
    """Make the segment's ``cache.bin`` of ``nbytes`` with its bookkeeping (``pixels_at`` bytes) and the first
    :data:`RESERVE_NOW` bytes of pixels reserved (all of it where the platform cannot reserve), and ``reserved``."""
    now = min(nbytes, pixels_at + RESERVE_NOW) if hasattr(os, "posix_fallocate") else nbytes
    try:
        shm.build_reserved(segment, _DATA, nbytes, meta, reserve=now,
                           files={_RESERVED: np.array([now], np.int64).tobytes()})
    except OSError as e:
        raise _NoRoom(f"cannot reserve {fmt_bytes(now)} for a decoded-image cache in "
                      f"{segment.parent}: {e.strerror or e}") from e


class SharedDecodeCache(DecodeCache):
    """The machine's decoded-image cache of one store at one imgsz that keeps the store's first images that fit
    (``keep="first"``); open it with :meth:`open`.

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

    KEEP = "first"
    POLICY = POLICY

    def __init__(self, segment: Path, base_hw: np.ndarray, base_idx: np.ndarray) -> None:
        self.segment = Path(segment)
        meta = json.loads((self.segment / _META).read_text())
        self.n = len(base_hw)
        self.slots, self._offsets, self.nbytes = _layout(base_hw, int(meta["capacity"]))
        self._check_meta(meta, n=self.n, slots=self.slots)
        self._hw = base_hw
        self._base_idx = base_idx
        self._pix_start = int(meta["pixels_at"])
        self._map(self.segment, self._pix_start + self.nbytes)
        self._flags = self._buf[: self.n]
        # images this process has seen published (flag set, read under the image's lock): read without a lock
        self._known = bytearray(self.n)

    @staticmethod
    def _build(segment: Path, hw: np.ndarray, budget: int, imgsz: int, recipe: str) -> None:
        """Create the segment (under the holders lock): a flag byte per image, then the pixels of those that fit."""
        n = len(hw)
        pixels_at = -(-max(n, 1) // _PAGE) * _PAGE
        sizes = hw[:, 0] * hw[:, 1] * 3
        capacity = _capacity(segment, budget, int(sizes.sum()), pixels_at, int(sizes.min()) if n else 0)
        slots, _, nbytes = _layout(hw, capacity)
        _reserve(segment, pixels_at + nbytes, pixels_at, {
            "layout": LAYOUT_VERSION, "n": n, "imgsz": int(imgsz), "recipe": recipe, "capacity": capacity,
            "slots": slots, "pixels_at": pixels_at, "pixel_bytes": nbytes, "policy": POLICY})

    # -- reads --------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Images held now, machine-wide (written by any process)."""
        return int(np.count_nonzero(self._flags[: self.slots])) if self._open else 0

    def _span(self, b: int) -> tuple[int, int, int, int]:
        """``(start, end, h, w)``: image ``b``'s bytes in ``cache.bin`` and its loaded shape."""
        h, w = (int(v) for v in self._hw[b])
        start = self._pix_start + int(self._offsets[b])
        return start, start + h * w * 3, h, w

    def _view(self, b: int) -> np.ndarray:
        start, end, h, w = self._span(b)
        return self._buf[start:end].reshape(h, w, 3)

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
        if not self._reserved(self._span(b)[1]):  # not yet: decoded, not kept
            self.misses += 1
            return load(i)
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

    def _readonly(self, b: int) -> np.ndarray:
        out = self._view(b)
        out.flags.writeable = False
        return out

    def _release_views(self) -> None:
        self._flags = np.zeros(0, np.uint8)


_COUNTER_AT = 0  # the turnover cache's ring counter (int64) and its lock byte
_HEADERS_AT = 64  # then one int32 header per slot (the image it holds + 1; 0: none), whose first byte is its lock


def turnover_slots(hw: np.ndarray, capacity: int) -> tuple[int, int]:
    """``(slots, bytes per slot)`` of a turnover cache of ``capacity`` pixel bytes over images of loaded shapes
    ``hw``: a slot holds the largest of them."""
    slot_bytes = int((hw[:, 0] * hw[:, 1]).max()) * 3 if len(hw) else 0
    return (min(len(hw), max(int(capacity), 0) // slot_bytes) if slot_bytes else 0), slot_bytes


class TurnoverDecodeCache(DecodeCache):
    """The machine's decoded-image cache of one store at one imgsz that turns over in epoch order
    (``keep="latest"``): a ring of ``slots`` fixed-size slots; an image decoded takes the next one, whose image
    (decoded longest ago) is dropped. For ``partners="recent"`` on a dataset larger than the cache: partners are
    drawn from the images of the last positions of the epoch order, which this cache holds.

    A hit is a read-only view of its slot, held (a shared lock) until :meth:`release`; more than ``MAX_HELD`` held
    at once (``partners="batch"`` with large batches) and hits are copied instead, so a process never holds many
    descriptors. The protocol is in the module docstring. Attributes as :class:`SharedDecodeCache`'s (``slots``:
    slots of the ring).
    """

    MAX_HELD = 64

    KEEP = "latest"
    POLICY = TURNOVER_POLICY

    def __init__(self, segment: Path, base_hw: np.ndarray, base_idx: np.ndarray) -> None:
        self.segment = Path(segment)
        meta = json.loads((self.segment / _META).read_text())
        self.n = len(base_hw)
        self.slots, self.slot_bytes = turnover_slots(base_hw, int(meta["capacity"]))
        self._check_meta(meta, n=self.n, slots=self.slots, keep=self.KEEP)
        self.nbytes = self.slots * self.slot_bytes
        self._hw = base_hw
        self._base_idx = base_idx
        self._pix_start = int(meta["pixels_at"])
        self._map(self.segment, self._pix_start + self.nbytes)
        self._counter = self._buf[_COUNTER_AT:_COUNTER_AT + 8].view(np.int64)
        self._headers = self._buf[_HEADERS_AT:_HEADERS_AT + 4 * self.slots].view(np.int32)
        table_at = _HEADERS_AT + 4 * self.slots
        self._table = self._buf[table_at:table_at + 4 * self.n].view(np.int32)  # image -> slot last written (+1)
        self._held: list[int] = []  # descriptors holding the slots of the views returned since the last release()

    @staticmethod
    def _build(segment: Path, hw: np.ndarray, budget: int, imgsz: int, recipe: str) -> None:
        """Create the segment (under the holders lock): the counter, a header per slot, the image -> slot table,
        then the slots."""
        n = len(hw)
        slots, slot_bytes = turnover_slots(hw, budget)
        pixels_at = -(-(_HEADERS_AT + 4 * (slots + n)) // _PAGE) * _PAGE
        capacity = _capacity(segment, budget, n * slot_bytes, pixels_at, slot_bytes)
        slots = turnover_slots(hw, capacity)[0]
        _reserve(segment, pixels_at + slots * slot_bytes, pixels_at, {
            "layout": LAYOUT_VERSION, "keep": TurnoverDecodeCache.KEEP, "n": n, "imgsz": int(imgsz), "recipe": recipe,
            "capacity": capacity, "slots": slots, "slot_bytes": slot_bytes, "pixels_at": pixels_at,
            "policy": TURNOVER_POLICY})

    def __len__(self) -> int:
        """Slots holding an image now, machine-wide."""
        return int(np.count_nonzero(self._headers)) if self._open else 0

    def _slot_view(self, s: int, b: int) -> np.ndarray:
        h, w = (int(v) for v in self._hw[b])
        off = self._pix_start + s * self.slot_bytes
        return self._buf[off : off + h * w * 3].reshape(h, w, 3)

    def get(self, i: int, load: Callable[[int], np.ndarray]) -> np.ndarray:
        """The loaded image of loader index ``i``: a read-only view of the slot that holds it (held until
        :meth:`release`), else ``load(i)``, then written into the next slot of the ring when no process uses
        that one."""
        b = int(self._base_idx[i])
        s = int(self._table[b]) - 1  # a plain read: a stale slot fails the header check under its lock
        if 0 <= s < self.slots:
            fd = self._lock_entry(_HEADERS_AT + 4 * s, exclusive=False)
            if fd is not None and self._headers[s] != b + 1:  # the slot went to another image since the table said
                os.close(fd)
            elif fd is not None:
                self.hits += 1
                view = self._slot_view(s, b)
                if len(self._held) < self.MAX_HELD:
                    view.flags.writeable = False
                    self._held.append(fd)
                    return view
                try:
                    return view.copy()
                finally:
                    os.close(fd)
        img = load(i)
        self.misses += 1
        if self.slots:
            s = self._next_slot()
            if self._reserved(self._pix_start + (s + 1) * self.slot_bytes):  # not yet: decoded, not kept
                self._put(s, b, img)
        return img

    def _next_slot(self) -> int:
        """The next slot of the ring, machine-wide (the counter is read and advanced under its lock)."""
        fd = self._lock_entry(_COUNTER_AT, exclusive=True, wait=True)
        try:
            turn = int(self._counter[0])
            self._counter[0] = turn + 1
        finally:
            os.close(fd)  # type: ignore[arg-type]  # waits, so never None
        return turn % self.slots

    def _put(self, s: int, b: int, img: np.ndarray) -> None:
        """Write image ``b`` into slot ``s`` unless another process holds the slot's lock (it stays uncached)."""
        h, w = (int(v) for v in self._hw[b])
        if img.shape != (h, w, 3):
            raise ValueError(f"image {b}: loaded shape {img.shape} differs from the planned {(h, w, 3)}")
        fd = self._lock_entry(_HEADERS_AT + 4 * s, exclusive=True)
        if fd is None:
            return
        try:
            self._headers[s] = 0  # a writer that dies below leaves the slot empty, never another image's name
            self._slot_view(s, b)[...] = img
            self._headers[s] = b + 1
            self._table[b] = s + 1
        finally:
            os.close(fd)  # releases the lock: the stores above happen before any later lock of this slot

    def release(self) -> None:
        """Drop the holds on the slots of the views :meth:`get` returned: the caller no longer reads them."""
        held, self._held = self._held, []
        for fd in held:
            os.close(fd)

    def _release_views(self) -> None:
        self.release()
        self._counter = np.zeros(0, np.int64)
        self._headers = self._table = np.zeros(0, np.int32)


class _NoRoom(OSError):
    """The shared-memory filesystem cannot hold the cache."""
