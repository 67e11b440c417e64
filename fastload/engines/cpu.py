"""The CPU engine: persistent forked workers render whole batches into a shared-memory ring.

Per batch the consumer sends a worker ``(epoch, batch number, slot, indices)``; the worker samples
each record, draws every sample straight into the slot and answers with the targets only. The
consumer wraps the slot in a tensor view (no collate copy), optionally moves it to ``device`` and
applies the HSV gains there (``hsv="consumer"``). With ``workers=0`` the same renderer runs in the
calling process. Results are identical for any worker count: records depend only on
``(seed, epoch, index)``.

Slot lifetime: a yielded batch's ``imgs`` stays valid until ``keep`` further batches have been
requested (default 2: the current and the previous batch); clone it to keep it longer.
"""
from __future__ import annotations

import collections
import warnings
from typing import Any, Iterator, NamedTuple

import numpy as np
import psutil
import torch

from fastload.augment.params import image_of
from fastload.engines.base import Batch, Engine, chunks, shapes_to_tuple
from fastload.engines.cpu_render import BatchRenderer
from fastload.engines.cpu_workers import WorkerPool, default_start_method_ok
from fastload.engines.shm_batch import SlotRing
from fastload.engines.shm_cache import SharedDecodeCache
from fastload.store.base import Store


def auto_decode_cache_bytes(world_size: int = 1) -> int:
    """Default decoded-cache bound: 1/8 of physical memory, split between the ranks of one machine."""
    return int(psutil.virtual_memory().total // 8 // max(1, world_size))


class _EarlyTasks(NamedTuple):
    """Batches of an expected epoch sent to the workers before that epoch was asked for."""

    pool: WorkerPool
    epoch: int
    indices: np.ndarray
    mosaic_closed: bool  # the workers' mosaic state when they were sent
    tasks: list[tuple[int, int]]  # (task, slot) of its first batches, in order


class CPUEngine(Engine):
    """Batches rendered by CPU worker processes.

    Options (beyond :class:`~fastload.engines.base.Engine`'s):
        max_hw: the largest output ``(h, w)`` any batch can have (sizes the slots).
        layout: ``"nhwc"`` (default: workers render HWC, ``imgs`` is a channels-last ``[B,3,H,W]``
            view, which ``.to(device)`` copies as one block and convolutions accept as is) or
            ``"nchw"`` (workers transpose each sample into a contiguous CHW slot; costs ~0.3 ms per
            640x640 image in the workers).
        prefetch: batches each worker may have in flight (ring = workers * prefetch + keep slots).
        keep: how many of the latest yielded batches stay valid (>= 1).
        decode_cache_bytes: bound of the shared decoded-image cache for encoded stores (files,
            lmdb); ``None`` = :func:`auto_decode_cache_bytes`, ``0`` = decode on every read.
        loaded_hw: ``int [N, 2]`` loaded shape of every sample (needed for the cache).
        timeout: seconds to wait for one batch before raising (0 = wait while the worker lives).
        world_size: ranks on this machine (splits the automatic cache bound).
        reduced_decode: decode JPEGs at least twice ``imgsz`` at a reduced DCT scale (encoded stores).
        axis_kernel: how axis-aligned tiles are drawn, ``"warp"`` or ``"resize"`` (None: the faster for
            the installed OpenCV).
        shrink: filter for shrinking encoded images to their loaded size, ``"area"`` or ``"linear"``.
    """

    name = "cpu"

    def __init__(
        self,
        store: Store,
        sampler: Any,
        *,
        batch_size: int,
        workers: int = 0,
        device: str | torch.device | None = None,
        hsv: str = "worker",
        max_hw: tuple[int, int] | None = None,
        layout: str = "nhwc",
        prefetch: int = 2,
        keep: int = 2,
        decode_cache_bytes: int | None = None,
        loaded_hw: np.ndarray | None = None,
        timeout: float = 0.0,
        world_size: int = 1,
        reduced_decode: bool = False,
        axis_kernel: str | None = None,
        shrink: str = "area",
    ) -> None:
        super().__init__(store, sampler, batch_size=batch_size, workers=workers, device=device, hsv=hsv)
        if workers > 0 and not default_start_method_ok():
            warnings.warn("fastload: no 'fork' start method on this platform; rendering in the main process")
            self.workers = 0
        if keep < 1 or prefetch < 1:
            raise ValueError(f"keep and prefetch must be >= 1, got keep={keep}, prefetch={prefetch}")
        imgsz = int(getattr(sampler, "imgsz", 0) or (max(max_hw) if max_hw else 640))
        self.max_hw = tuple(max_hw) if max_hw else (imgsz, imgsz)
        self.layout = layout
        self.keep = int(keep)
        self.prefetch = int(prefetch)
        cache = None
        if not store.decoded and loaded_hw is not None:
            cap = auto_decode_cache_bytes(world_size) if decode_cache_bytes is None else int(decode_cache_bytes)
            if cap > 0:
                cache = SharedDecodeCache(loaded_hw, cap)
        self.cache = cache
        self.renderer = BatchRenderer(
            store, sampler, imgsz=imgsz, cache=cache, hsv_in_worker=(hsv == "worker"), layout=layout,
            reduced_decode=reduced_decode, axis_kernel=axis_kernel, shrink=shrink,
        )
        n_slots = self.workers * self.prefetch + self.keep if self.workers else self.keep
        self.ring = SlotRing(n_slots, self.batch_size * self.max_hw[0] * self.max_hw[1] * 3)
        self.pool: WorkerPool | None = None
        self.cache_stats = [0, 0]  # [hits, misses] summed over the workers' last reports
        self._worker_stats: dict[int, list[int]] = {}
        self.timeout = float(timeout)
        self._held: collections.deque[int] = collections.deque()  # slots of the latest yielded batches
        self._active: Iterator[Batch] | None = None
        # task ids run on across epochs: a worker answers in the order it was sent tasks, so batches
        # of the next epoch sent early are received after this epoch's
        self._task = 0
        self._hint: tuple[int, np.ndarray] | None = None  # expect_next(): the epoch after the current one
        self._ahead: _EarlyTasks | None = None  # that epoch's first batches, sent before it began
        self.early_stats = [0, 0]  # batches sent before their epoch began: [used, dropped (wrong guess)]

    # -- consumer-side state ------------------------------------------------------------------------------
    def close_mosaic(self) -> None:
        """Turn mosaic (and with it mixup) off from the next batch on, in every worker (each batch's task carries
        :attr:`mosaic_closed`)."""
        super().close_mosaic()
        self.renderer.sync(True)  # the in-process renderer shares this sampler; workers sync from each task

    def expect_next(self, epoch: int, indices: np.ndarray) -> None:
        self._hint = (int(epoch), np.asarray(indices, np.int64))

    def _start(self) -> WorkerPool:
        self._check_open()
        if self.pool is None or not self.pool.alive():
            if self.pool is not None:
                self.pool.close(timeout=1.0)
            self.pool = WorkerPool(self.workers, self.renderer, self.ring, timeout=self.timeout)
        return self.pool

    @property
    def worker_pids(self) -> list[int]:
        return self.pool.pids if self.pool is not None else []

    # -- batches --------------------------------------------------------------------------------------------
    def iter_batches(self, epoch: int, indices: np.ndarray) -> Iterator[Batch]:
        self._check_open()
        if self._active is not None:  # an abandoned iteration still holds slots and in-flight tasks
            self._active.close()
            self._active = None
        gen = self._iter_workers(epoch, indices) if self.workers else self._iter_inline(epoch, indices)
        self._active = gen
        return gen

    def _make_batch(self, slot: int, idx: np.ndarray, hw, targets: np.ndarray, shapes, gains) -> Batch:
        h, w = hw
        imgs = self.ring.tensor(slot, len(idx), h, w, self.layout)
        if self.device is not None and self.device.type != "cpu":
            imgs = imgs.to(self.device, non_blocking=False)
        if gains is not None:
            g = torch.from_numpy(gains).to(imgs.device)
            if self.hsv == "consumer":
                from fastload.augment.functional.torch_ops import apply_hsv_batch

                imgs = apply_hsv_batch(imgs, g)
            else:  # "defer": the caller applies them
                self.last_gains = g
        paths = tuple(self.store.im_files[i] for i in image_of(idx, len(self.store)).tolist())
        return Batch(imgs, torch.from_numpy(targets), paths, tuple(shapes_to_tuple(s) for s in shapes))

    def _release_old(self) -> None:
        """Free the slots of batches older than the ``keep`` latest (the consumer moved on)."""
        while len(self._held) >= self.keep:
            self.ring.release(self._held.popleft())

    def _iter_inline(self, epoch: int, indices: np.ndarray) -> Iterator[Batch]:
        held = self._held
        for idx in chunks(indices, self.batch_size):
            self._release_old()
            slot = self.ring.acquire()
            if slot is None:  # every slot is held by a yielded batch: `keep` was not honoured
                raise RuntimeError("fastload: no free batch slot in-process; was a batch kept beyond keep=%d?" % self.keep)
            try:
                out = self.renderer.render(epoch, idx, lambda b, h, w: self.ring.array(slot, b, h, w, self.layout))
            except BaseException:  # a failed render must not leak its slot into the next epoch
                self.ring.release(slot)
                raise
            held.append(slot)
            yield self._make_batch(slot, idx, out.hw, out.targets, out.shapes, out.gains)
        if self.cache is not None:
            self.cache_stats = [self.cache.hits, self.cache.misses]

    def _iter_workers(self, epoch: int, indices: np.ndarray) -> Iterator[Batch]:
        pool = self._start()
        batches = chunks(indices, self.batch_size)
        sent = self._adopt_early(pool, epoch, indices)  # (task, slot) per batch sent, in batch order
        hint, self._hint = self._hint, None
        early_batches = chunks(hint[1], self.batch_size) if hint is not None else []
        early: list[tuple[int, int]] = []  # (task, slot) of the next epoch's first batches
        early_mosaic_closed = self.mosaic_closed  # the state the first of them was rendered with
        held = self._held
        received = 0
        finished = False
        try:
            for seq, idx in enumerate(batches):
                self._release_old()
                while True:  # fill the free slots: this epoch's batches first, then the next epoch's
                    if len(sent) < len(batches):
                        todo, e, out = batches[len(sent)], epoch, sent
                    elif hint is not None and len(early) < len(early_batches):
                        todo, e, out = early_batches[len(early)], hint[0], early
                    else:
                        break
                    slot = self.ring.acquire()
                    if slot is None:
                        break
                    if out is early and not early:
                        early_mosaic_closed = self.mosaic_closed
                    pool.submit(self._task, e, slot, todo, self.mosaic_closed)
                    out.append((self._task, slot))
                    self._task += 1
                task, slot = sent[seq]
                msg = pool.receive(task)
                received += 1
                held.append(slot)
                self._worker_stats[task % pool.n] = msg["c"]
                self.cache_stats = [sum(v[0] for v in self._worker_stats.values()), sum(v[1] for v in self._worker_stats.values())]
                targets = np.frombuffer(bytearray(msg["t"]), np.float32).reshape(-1, 6)
                gains = None if msg["g"] is None else np.frombuffer(bytearray(msg["g"]), np.float32).reshape(-1, 3)
                yield self._make_batch(slot, idx, msg["hw"], targets, msg["sh"], gains)
            finished = True
        finally:
            if finished and early and hint is not None:
                self._ahead = _EarlyTasks(pool, hint[0], hint[1], early_mosaic_closed, early)
            else:
                # abandoned or failed epoch: collect what is still being rendered so the next epoch starts clean
                self._drain_pool()
                for _, slot in sent[received:] + early:
                    self.ring.release(slot)

    def _adopt_early(self, pool: WorkerPool, epoch: int, indices: np.ndarray) -> list[tuple[int, int]]:
        """The tasks sent early for this epoch when the guess was right; otherwise drop them."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return []
        if ahead.pool is pool and ahead.epoch == epoch and ahead.mosaic_closed == self.mosaic_closed \
                and np.array_equal(ahead.indices, indices):
            self.early_stats[0] += len(ahead.tasks)
            return list(ahead.tasks)
        self.early_stats[1] += len(ahead.tasks)
        if ahead.pool is pool:
            self._drain_pool()
        for _, slot in ahead.tasks:
            self.ring.release(slot)
        return []

    def _drain_pool(self) -> None:
        if self.pool is not None:
            try:
                self.pool.drain()
            except Exception:
                self.pool.close(timeout=1.0)
                self.pool = None

    def _release(self) -> None:
        if self._active is not None:
            self._active.close()
            self._active = None
        self._ahead = None  # the workers stop below; their early batches are not wanted
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        self.ring.close()
        if self.cache is not None:
            self.cache.close()

    def __del__(self) -> None:  # best effort: never leave workers behind
        try:
            if not self._closed and self.pool is not None:
                self.pool.close(timeout=1.0)
        except Exception:
            pass
