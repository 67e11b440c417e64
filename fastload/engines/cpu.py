"""The CPU engine: persistent forked workers render whole batches into a shared-memory ring.

Per batch the consumer sends a worker ``(epoch, batch number, slot, indices)``; the worker samples
each record, draws every sample straight into the slot and answers with the targets only (and the task's masks,
keypoints or oriented boxes beside them: :class:`~fastload.augment.task_labels.TaskLabels`). The
consumer wraps the slot in a tensor view (no collate copy), optionally moves it to ``device`` and
hands the HSV gains (``hsv_on="consumer"`` or ``"defer"``) to the shared finishing step. With ``workers=0`` the same renderer runs in the
calling process. Results are identical for any worker count: records depend only on
``(seed, epoch, index)``.

Batch ownership: a yielded batch is the caller's for as long as any tensor of it lives (``imgs``, a slice of
it, a view); its slot is rendered into again only after that. The caller may hold ``CPUOptions.keep``
(default 2) batches at once that share a slot; a batch delivered while the caller holds that many
already is a copy, and its slot is free at once (``stats()["batches_copied"]`` counts them). The common
loop holds two at the moment of delivery (the one in its variables and the new one): no copies.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, Generator, Sequence

import numpy as np
import torch

from fastload.augment.params import ParamSampler, shapes_from_array
from fastload.engines.base import (TASKS, Engine, EngineSettings, HostRenderOptions, Rendered, chunks, task_batch,
                                   task_labels)
from fastload.engines.cpu_render import BatchRenderer
from fastload.engines.cpu_workers import WorkerPool, array_from_fields, default_start_method_ok
from fastload.engines.inflight import InFlightWindow
from fastload.engines.shm_batch import SlotRing
from fastload.engines.shm_cache import open_decode_cache
from fastload.store.base import Store


@dataclass(frozen=True)
class CPUOptions(HostRenderOptions):
    """Options of ``engine="cpu"`` (``loader(..., engine_options=CPUOptions(...))`` or a dict of them).

    Attributes:
        keep: spare slots of the ring for the batches the caller holds (>= 1): that many delivered
            batches may be held at once as views of their slots; one delivered while the caller holds
            ``keep`` already is a copy (``stats()["batches_copied"]``). Not needed for correctness (a
            held batch never changes, copied or not): raise it for code that holds more batches (gradient
            accumulation, a plotting thread) to keep them zero-copy, at one batch of memory per slot. The
            common loop holds 2 when a batch is delivered (the previous one, still in its variables, and
            the new one), so ``keep=1`` copies every batch there.
        timeout: seconds to wait for one batch before raising (0: as long as the worker lives; a
            dead worker always raises at once).
        decode_cache_mb: encoded stores (files, lmdb): bound of the machine's decoded-image cache, one
            shared-memory segment per store and imgsz that every worker of every rank fills and reads
            (:mod:`~fastload.engines.shm_cache`), so mosaic partners and later epochs skip decoding.
            ``None``: 1/8 of physical memory; ``0``: off. Set by the process that creates the segment;
            later processes join it as it is. When the dataset does not fit, the first images of the
            store that fit are cached and the others decoded on every read (``stats()`` says how many), unless
            the cache turns over (``decode_cache_keep``).
        decode_cache_keep: what the decoded cache keeps of a dataset larger than it, when this loader creates it:
            ``"first"``: the first images of the store that fit; ``"latest"``: the latest decoded, the cache
            turning over in epoch order (a hit holds its slot, an OFD lock, until the sample is drawn), for
            ``partners="recent"``, whose partners are the epoch order's recent images. ``None``: planned by
            :func:`fastload.loader` (:class:`fastload.fastloader.CachePlan`, in ``repr(loader)``).
        decode_scale: encoded stores: ``"full"`` (every JPEG decoded at its stored size, as YOLOv9
            does) or ``"reduced"`` (a JPEG whose long side is at least twice ``imgsz`` is decoded at
            1/2, 1/4 or 1/8 scale by the DCT, then resized as usual: cheaper; loaded pixels differ
            by a few grey levels, boxes and shapes not at all; ``benchmarks/reduced_decode.py``
            measures both).
        axis_kernel: how tiles with a scale + translation matrix (every scratch-high mosaic tile)
            are drawn: ``"warp"`` (``cv2.warpAffine`` with the exact matrix, YOLOv9's own sampling)
            or ``"resize"`` (one ``cv2.resize`` per tile, sampling positions within 0.05 px).
            ``None``: the faster for the installed OpenCV
            (:func:`~fastload.augment.functional.tiles.default_axis_kernel`;
            ``benchmarks/augment_kernels.py`` measures both). Letterboxes are bit-identical to
            YOLOv9 either way.
        jpeg_decoder: encoded stores: the JPEG decoder of the workers (``"cv2"``, ``"torchvision"`` or
            ``"pil"``; ``fastload bench --stages decode`` compares them on your data). ``None``: the process's
            choice (:func:`fastload.data.images.set_jpeg_decoder`, else ``$FASTLOAD_JPEG_DECODER``, else cv2).
    """

    engine: ClassVar[str] = "cpu"
    keep: int = 2

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise self.bad(f"keep must be >= 1, got {self.keep}")
        super().__post_init__()


class _WorkerTransport:
    """The CPU engine's :class:`~fastload.engines.inflight.Transport`: a task is ``(task id, slot)``, sent to
    the worker pool, rendered into the ring's slot."""

    def __init__(self, engine: CPUEngine) -> None:
        self.engine = engine

    def submit(self, epoch: int, indices: np.ndarray, mosaic_closed: bool, pending: Sequence[tuple[int, int]]
               ) -> tuple[int, int] | None:
        eng = self.engine
        slot = eng.ring.acquire()
        if slot is None:
            return None
        task = eng._task
        try:
            eng.pool.submit(task, epoch, slot, indices, mosaic_closed)
        except BaseException:
            eng.ring.release(slot)
            raise
        eng._task += 1
        return task, slot

    def receive(self, task: tuple[int, int], seq: int, pending: Sequence[tuple[int, int]]) -> Rendered:
        eng, (task_id, slot) = self.engine, task
        pool = eng.pool
        msg = pool.receive(task_id)
        eng._worker_stats[task_id % pool.n] = msg["c"]
        eng._cache_stats = [sum(v[k] for v in eng._worker_stats.values()) for k in range(3)]
        eng.decodes = eng._cache_stats[2]
        targets = np.frombuffer(bytearray(msg["t"]), np.float32).reshape(-1, 6)
        shapes = [shapes_from_array(a) for a in np.frombuffer(msg["sh"], np.float64).reshape(-1, 6)]
        gains = None if msg["g"] is None else np.frombuffer(bytearray(msg["g"]), np.float32).reshape(-1, 3)
        eng._note_damage(msg["d"], msg["rp"])
        images = np.frombuffer(msg["ix"], np.int64)
        extra = None if msg["x"] is None else array_from_fields(msg["x"])
        return eng._rendered(slot, images, tuple(msg["hw"]), targets, extra, shapes, gains)

    def drop(self, tasks: Sequence[tuple[int, int]]) -> None:
        # a worker answers in task order: collect every outstanding result so the next epoch starts clean
        self.engine._drain_pool()
        for _, slot in tasks:
            self.engine.ring.release(slot)


class CPUEngine(Engine):
    """Batches rendered by CPU worker processes (options: :class:`CPUOptions`).

    Settings: ``workers`` render processes (0: in the calling process); ``prefetch`` batches each
    worker may have in flight (the ring holds ``workers * prefetch + keep`` slots, ``1 + keep`` with
    ``workers=0``); ``device``:
    each finished batch is copied there; ``hsv_on="worker"`` applies HSV in the workers;
    ``layout="nhwc"`` (workers render HWC, ``imgs`` is a channels-last view of the slot, which
    ``.to(device)`` copies as one block) or ``"nchw"`` (workers transpose every sample into a
    contiguous CHW slot).

    :meth:`stats` adds ``decode_cache_hits`` and ``decode_cache_misses`` (this loader's reads, summed
    over the workers' latest reports), the machine-wide state of the decoded cache when there is one
    (``decode_cache_segment``, ``decode_cache_slots``, ``decode_cache_filled``, ``decode_cache_images``,
    ``decode_cache_bytes``, ``decode_cache_reserved``, ``decode_cache_policy``) and ``early_batches_used`` /
    ``early_batches_dropped`` (batches of the next epoch rendered before it was asked for: used, or
    dropped after a wrong guess). ``batches_copied`` (every engine has it) counts the batches delivered as
    copies because the caller held ``keep`` batches already.

    Default ``partners="dataset"`` (YOLOv9's own draw): this engine's decoded-image cache is one per
    machine, so once the dataset fits in it every image is decoded once per machine in the first
    epoch and mosaic partners cost no decode after that. When the decoded dataset does not fit the
    cache, ``loader(partners=None)`` plans ``"batch"`` instead (:class:`fastload.fastloader.PartnerPlan`):
    each batch then decodes its own images once.
    """

    name = "cpu"
    Options = CPUOptions
    default_workers = 8
    default_partners = "dataset"
    takes_sample_ids = True
    tasks = TASKS

    def __init__(self, store: Store, sampler: ParamSampler, settings: EngineSettings, options: CPUOptions | None = None) -> None:
        super().__init__(store, sampler, settings, options)
        opts: CPUOptions = self.options
        if self.workers > 0 and not default_start_method_ok():
            warnings.warn("fastload: no 'fork' start method on this platform; rendering in the main process")
            self.workers = 0
        self.max_hw = sampler.max_out_hw
        self.layout = settings.layout
        self.keep = int(opts.keep)
        self.prefetch = int(settings.prefetch)
        self.cache = cache = open_decode_cache(store, sampler.imgsz, sampler.load_rule, decode_scale=opts.decode_scale,
                                               shrink=self.shrink,
                                               budget_mb=opts.decode_cache_mb, jpeg_decoder=opts.jpeg_decoder,
                                               keep=opts.decode_cache_keep)
        self.renderer = BatchRenderer(
            store, sampler, cache=cache, hsv_in_worker=(settings.hsv_on == "worker"), layout=self.layout,
            reduced_decode=opts.decode_scale == "reduced", axis_kernel=opts.axis_kernel, shrink=self.shrink,
            strict=settings.strict, jpeg_decoder=opts.jpeg_decoder, task_labels=task_labels(store, settings),
        )
        # slots being rendered into (in flight to the workers, or the one being drawn in-process) plus `keep`
        # for the caller: one delivered while the caller holds `keep` is copied, so one is always left to render
        n_slots = (self.workers * self.prefetch if self.workers else 1) + self.keep
        self.ring = SlotRing(n_slots, self.batch_size * self.max_hw[0] * self.max_hw[1] * 3)
        self.pool: WorkerPool | None = None
        self._cache_stats = [0, 0, 0]  # [hits, misses, decodes] summed over the workers' last reports
        self._worker_stats: dict[int, list[int]] = {}
        self.timeout = float(opts.timeout)
        self._active: Generator[Rendered, None, None] | None = None
        # task ids run on across epochs: a worker answers in the order it was sent tasks, so batches
        # of the next epoch sent early are received after this epoch's
        self._task = 0
        self._window: InFlightWindow[tuple[int, int]] = InFlightWindow()

    # -- consumer-side state ------------------------------------------------------------------------------
    def close_mosaic(self) -> None:
        """Turn mosaic (and with it mixup) off from the next batch on, in every worker (each batch's task carries
        :attr:`mosaic_closed`)."""
        super().close_mosaic()
        self.renderer.sync(True)  # the in-process renderer shares this sampler; workers sync from each task

    def expect_next(self, epoch: int, indices: np.ndarray) -> None:
        self._window.expect_next(epoch, indices)

    def _start(self) -> WorkerPool:
        self._check_open()
        if self.pool is None or not self.pool.alive():
            if self.pool is not None:
                self.pool.close(timeout=1.0)
                self.pool = None
            self._window.drop_ahead(_WorkerTransport(self))  # they were sent to the workers just stopped
            self.pool = WorkerPool(self.workers, self.renderer, self.ring, timeout=self.timeout)
        return self.pool

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out["worker_pids"] = self.pool.pids if self.pool is not None else []
        out["decode_cache_hits"], out["decode_cache_misses"] = self._cache_stats[:2]
        if self.cache is not None:
            out.update(self.cache.stats())
        out["early_batches_used"], out["early_batches_dropped"] = self._window.early_used, self._window.early_dropped
        return out

    # -- batches --------------------------------------------------------------------------------------------
    def _render_batches(self, epoch: int, indices: np.ndarray) -> Generator[Rendered, None, None]:
        if self._active is not None:  # an abandoned iteration still holds slots and in-flight tasks
            self._active.close()
            self._active = None
        gen = self._iter_workers(epoch, indices) if self.workers else self._iter_inline(epoch, indices)
        self._active = gen
        return gen

    def _rendered(self, slot: int, images: np.ndarray, hw: tuple[int, int], targets: np.ndarray,
                  extra: np.ndarray | None, shapes: list[Any], gains: np.ndarray | None) -> Rendered:
        """The batch in ``slot``; ``images``: the image each sample shows (a replacement's for a damaged one)."""
        h, w = hw
        to_device = self.device is not None and self.device.type != "cpu"
        if to_device or self.ring.n_lent < self.keep:  # (the view given to .to() dies here, freeing its slot)
            imgs = self.ring.lend(slot, len(images), h, w, self.layout)
        else:  # the caller holds `keep` batches: this one gets memory of its own, so a slot is left to render into
            imgs = self.ring.copy(slot, len(images), h, w, self.layout)
            self.copied += 1
        if to_device:
            imgs = imgs.to(self.device, non_blocking=False)
        paths = tuple(self.store.im_files[i] for i in images.tolist())
        batch = task_batch(self.settings.task, imgs, torch.from_numpy(targets), paths, tuple(shapes),
                           None if extra is None else torch.from_numpy(extra))
        return Rendered(batch, None if gains is None else torch.from_numpy(gains))

    def _iter_inline(self, epoch: int, indices: np.ndarray) -> Generator[Rendered, None, None]:
        for idx in chunks(indices, self.batch_size):
            slot = self.ring.acquire()
            if slot is None:  # cannot happen: at most `keep` of the 1 + keep slots are lent (see _rendered)
                raise RuntimeError(f"fastload: no free batch slot in-process ({self.ring.n_lent} lent, keep={self.keep})")
            try:
                out = self.renderer.render(epoch, idx, lambda b, h, w: self.ring.array(slot, b, h, w, self.layout))
            except BaseException:  # a failed render must not leak its slot into the next epoch
                self.ring.release(slot)
                raise
            cache = self.renderer.cache
            self._cache_stats = [cache.hits if cache is not None else 0, cache.misses if cache is not None else 0,
                                 self.renderer.decodes]
            self.decodes = self.renderer.decodes
            self._note_damage(out.damaged, out.replaced)
            yield self._rendered(slot, out.images, out.hw, out.targets, out.extra, out.shapes, out.gains)

    def _iter_workers(self, epoch: int, indices: np.ndarray) -> Generator[Rendered, None, None]:
        self._start()
        # at most `keep` slots are lent (see _rendered): the others are in flight or free, so the batch wanted
        # next is in flight already or gets a slot when the window fills
        yield from self._window.batches(_WorkerTransport(self), epoch, indices, self.batch_size, lambda: self.mosaic_closed)

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
        self._window.forget()  # the workers stop below; their early batches are not wanted
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
