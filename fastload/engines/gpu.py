"""The PyTorch GPU engine (``engine="gpu"``): decode and augment on the device, batched.

Per batch the CPU does only what cannot be batched on the device: sample the records
(:class:`~fastload.augment.params.ParamSampler`), read the encoded bytes (or loaded arrays) of every
image the batch draws from, move the boxes (:func:`fastload.augment.boxes.batch_targets`) and
plan the tiles (a few numbers per tile). The device then

1. decodes the batch's unique source images at once (with ``partners="batch"``: exactly the
   batch's own images; ``torchvision.io.decode_jpeg`` on a list:
   nvJPEG on CUDA, libjpeg on CPU; non-JPEG files are decoded on the CPU and uploaded) and resizes
   them to their loaded shape (:func:`fastload.data.torch_images.decode_on_device`) - or uploads loaded
   arrays from a ram/disk store through pinned memory - or, with ``store="gpu"``, reads the
   resident images in place;
2. draws mosaics / letterboxes, mixup and flips with :func:`~fastload.augment.functional.torch_tiles.render_batch`
   (a constant number of kernels per batch) and, with ``hsv_on="worker"``, the HSV gains with
   :func:`~fastload.augment.functional.torch_ops.apply_hsv_batch`.

Overlap: a background thread prepares batch ``k + 1 .. k + prefetch`` while the training step runs
on batch ``k``. On CUDA its device work is issued on a side stream; each finished batch carries an
event that the consumer's stream waits on (``Stream.wait_event``: no host synchronisation in the
training step), and the batch tensors are marked as used by the consumer's stream
(``record_stream``) so their memory is not recycled early.

The same code runs unchanged on CPU tensors (``device="cpu"``), which is how CI checks it against
the CPU reference.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Generator, Literal, NamedTuple

import numpy as np
import torch

from fastload.augment.boxes import batch_targets
from fastload.augment.functional.torch_ops import apply_hsv_batch
from fastload.augment.functional.torch_tiles import ImageBank, chw_to_rows, render_batch
from fastload.augment.params import ParamSampler, SampleParams
from fastload.data.device import resolve_device
from fastload.data.torch_images import decode_on_device
from fastload.engines.base import Batch, Engine, EngineOptionError, EngineSettings, Rendered, chunks
from fastload.store.base import DamagedRecords, Store

__all__ = ["GPUEngine", "TorchGPUOptions"]

_STOP = object()


@dataclass(frozen=True)
class TorchGPUOptions:
    """Options of ``engine="gpu"`` (``loader(..., engine_options=TorchGPUOptions(...))`` or a dict of them).

    Attributes:
        decode_on: ``"device"`` (JPEGs of encoded stores decoded by ``torchvision.io.decode_jpeg`` on
            the engine's device, other formats on the CPU) or ``"cpu"`` (every image decoded by the CPU
            decoder in the background thread, then uploaded).
        max_elements: output pixels enumerated per drawing step (bounds temporary memory, about
            200 bytes per pixel). ``None``: 4M on CUDA, 1M on the CPU.
    """

    decode_on: Literal["device", "cpu"] = "device"
    max_elements: int | None = None

    def __post_init__(self) -> None:
        if self.decode_on not in ("device", "cpu"):
            raise EngineOptionError(f"engine 'gpu': decode_on must be 'device' or 'cpu', got {self.decode_on!r}")
        if self.max_elements is not None and self.max_elements < 1:
            raise EngineOptionError(f"engine 'gpu': max_elements must be None or >= 1, got {self.max_elements}")


class _Report(NamedTuple):
    """What one batch's rendering counted, taken in by the engine when the batch is delivered: the images
    decoded for it, the damaged records met first there (their errors' fields) and its samples drawn again."""

    decodes: int
    damaged: list[list[Any]]
    replaced: int


@dataclass
class _Ready:
    """A finished batch, its unapplied HSV gains, the event its device work recorded (None on CPU) and
    its counts (:class:`_Report`)."""

    rendered: Rendered
    event: torch.cuda.Event | None
    report: _Report


class GPUEngine(Engine):
    """Batches decoded and augmented on ``device`` with PyTorch (options: :class:`TorchGPUOptions`).

    Settings: ``workers`` must be 0 (the host side is one background thread); ``prefetch``
    batches are prepared ahead by that thread (0: everything in the caller's thread, no overlap;
    handy for debugging); ``hsv_on="worker"`` applies HSV in the background thread, on the side
    stream; ``layout="nhwc"`` delivers the drawn HWC pixels as a channels-last view (no copy),
    ``"nchw"`` makes them contiguous. Batches are fresh tensors, the caller's to keep (``batches_copied`` stays 0).

    Default ``partners="dataset"`` (YOLOv9's own draw): this engine is built to draw from decoded
    images (``store="gpu"`` resident in device memory, or ram/disk stores), where partners cost no
    decode, and the records it draws stay the stock ones. From an encoded store (files, lmdb) every
    batch decodes its distinct sources (about 4.3 per output image with scratch-high) on every epoch;
    there ``partners="batch"`` makes it one batched decode of the batch's own images (at most one per
    output image).
    """

    name = "gpu"
    Options = TorchGPUOptions
    renderers = None  # its host side is one background thread
    renders_on = "device"
    accepts_gpu_store = True
    default_workers = 0
    default_partners = "dataset"

    def __init__(self, store: Store, sampler: ParamSampler, settings: EngineSettings,
                 options: TorchGPUOptions | None = None) -> None:
        super().__init__(store, sampler, settings, options)
        opts: TorchGPUOptions = self.options
        self.device = resolve_device(settings.device, "engine='gpu'", instead="device='cpu' or engine='cpu'")
        self.decode_on = opts.decode_on
        self.prefetch = int(settings.prefetch)
        self.cuda = self.device.type == "cuda"
        self.max_elements = int(opts.max_elements or ((1 << 22) if self.cuda else (1 << 20)))
        self.imgsz = int(sampler.imgsz)
        self.loaded_hw = np.asarray(sampler.loaded_shapes, np.int64).reshape(-1, 2)
        self.resident = self._resident_images(store)
        self.damaged = DamagedRecords(settings.strict)
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._worker: threading.Thread | None = None
        self._stop = threading.Event()

    # -- sources ------------------------------------------------------------------------------------
    def _resident_images(self, store: Store) -> ImageBank | None:
        """The store's device-resident images (``store="gpu"``) as a bank indexed by loader index."""
        res = store.resident_images()
        if res is None:
            return None
        if torch.device(res.device) != self.device:
            raise ValueError(f"store='gpu' holds its images on {res.device}, the engine renders on {self.device}; "
                             f"open the store with device={str(self.device)!r}")
        if store.imgsz != self.imgsz:
            raise ValueError(f"store='gpu' holds images at imgsz={store.imgsz}, the loader asks for {self.imgsz}")
        return ImageBank(res.pixels, res.offsets, res.hw)

    def _fetch(self, i: int) -> np.ndarray | bytes:
        """What the bank is built from for loader index ``i``: its loaded image (decoded stores, or
        ``decode_on="cpu"``) or its checked encoded bytes (decoded on the device); raises
        :class:`~fastload.store.base.DamagedRecordError` for a damaged record."""
        if self.store.decoded or self.decode_on == "cpu":
            return np.asarray(self.store.load(i, self.imgsz, shrink=self.shrink, rule=self.sampler.load_rule))
        return self.store.read_encoded(i)

    def _records(self, epoch: int, idx: np.ndarray) -> tuple[list[SampleParams], dict[int, Any]]:
        """The batch's records, each the first usable draw (see ``strict`` in :class:`EngineSettings`), and
        what :meth:`_fetch` gave for each of their sources (nothing for resident images: checked when loaded)."""
        records = self.sampler.sample_batch(epoch, idx)
        fetched: dict[int, Any] = {}
        if self.resident is not None:
            return records, fetched
        by_batch = self.sampler.partners == "batch"
        if by_batch:
            for i in dict.fromkeys(int(v) for v in idx):
                self.damaged.load_into(i, fetched, self._fetch)

        def usable(record: SampleParams) -> bool:
            return self.damaged.load_all(record.sources, fetched, self._fetch)

        records = [self.sampler.first_usable(epoch, int(i), usable, idx if by_batch else None, record=r)
                   for i, r in zip(idx.tolist(), records)]
        return records, fetched

    def _bank(self, srcs: list[int], fetched: dict[int, Any]) -> tuple[ImageBank, dict[int, int]]:
        """An ImageBank holding the loaded images ``srcs`` (loader indices, each fetched already) and the
        index -> slot map."""
        if self.resident is not None:
            return self.resident, {i: i for i in srcs}
        slot = {s: k for k, s in enumerate(srcs)}
        hw = self.loaded_hw[srcs]
        if self.store.decoded or self.decode_on == "cpu":
            arrays = [fetched[i] for i in srcs]
            for i, a in zip(srcs, arrays):
                if a.shape[:2] != tuple(self.loaded_hw[i]):
                    raise ValueError(f"{self.store.im_files[i]}: loaded image is {a.shape[:2]}, expected {tuple(self.loaded_hw[i])}")
            sizes = np.array([a.size for a in arrays], np.int64)
            stage = torch.empty(int(sizes.sum()), dtype=torch.uint8, pin_memory=self.cuda)
            view = stage.numpy()
            o = 0
            for a in arrays:
                view[o : o + a.size] = a.reshape(-1)
                o += a.size
            pixels = stage.to(self.device, non_blocking=True).view(-1, 3)
            offsets = np.concatenate(([0], np.cumsum(sizes // 3)[:-1])).astype(np.int64)
            return ImageBank(pixels, offsets, hw), slot
        bufs = [fetched[i] for i in srcs]
        imgs = decode_on_device(bufs, [self.store.im_files[i] for i in srcs], [tuple(v) for v in hw], self.device,
                                shrink=self.shrink)
        pixels = torch.cat([chw_to_rows(im) for im in imgs], 0)
        sizes = hw[:, 0] * hw[:, 1]
        offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
        return ImageBank(pixels, offsets, hw), slot

    # -- one batch ------------------------------------------------------------------------------------
    def _render(self, epoch: int, idx: np.ndarray) -> tuple[Rendered, _Report]:
        """Everything for one batch (device work goes to the current stream), and its counts."""
        records, fetched = self._records(epoch, idx)
        # every source a record reads (with partners="batch" the batch's own images, one decode each, plus
        # the images of replacement draws)
        srcs = sorted({s for r in records for s in r.sources})
        bank, slot = self._bank(srcs, fetched)
        if self.resident is not None or self.store.decoded:
            decodes = 0
        else:  # on the CPU every image fetched, on the device the sources the records kept
            decodes = len(fetched) if self.decode_on == "cpu" else len(srcs)
        hwc = render_batch(records, bank, slot.__getitem__, max_elements=self.max_elements)
        imgs = hwc.permute(0, 3, 1, 2)
        gains: torch.Tensor | None = torch.tensor([r.hsv_gain for r in records], dtype=torch.float32)
        if self.settings.hsv_on == "worker":
            if bool((gains != 1).any()):
                imgs = apply_hsv_batch(imgs, gains, rule=self.sampler.recipe)
            gains = None
        if self.settings.layout == "nchw":
            imgs = imgs.contiguous()
        targets_np = batch_targets(records, self.store.labels)
        targets = torch.from_numpy(targets_np)
        if self.cuda:
            targets = targets.pin_memory().to(self.device, non_blocking=True)
        paths = tuple(self.store.im_files[r.index] for r in records)
        shapes = tuple(r.shapes for r in records)
        return Rendered(Batch(imgs, targets, paths, shapes), gains), _Report(decodes, self.damaged.take_found(),
                                                                             sum(r.attempt > 0 for r in records))

    def _produce(self, epoch: int, batches: list[np.ndarray], out: "queue.Queue[Any]", stop: threading.Event) -> None:
        """Background thread: render batches in order onto the side stream, hand them over with events."""

        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        try:
            # OpenMP teams are per thread: carry the caller's intra-op thread count over
            torch.set_num_threads(self._threads)
            if self.cuda:
                torch.cuda.set_device(self.device)
            with torch.cuda.stream(self._stream) if self.cuda else contextlib.nullcontext():
                for idx in batches:
                    if stop.is_set():
                        return
                    rendered, report = self._render(epoch, idx)
                    event = None
                    if self.cuda:
                        event = torch.cuda.Event()
                        event.record(self._stream)
                    if not put(_Ready(rendered, event, report)):
                        return
        except BaseException as exc:  # handed to the consumer, which re-raises it
            put(exc)
        finally:
            put(_STOP)

    def _count(self, report: _Report) -> None:
        self.decodes += report.decodes
        self._note_damage(report.damaged, report.replaced)

    def _deliver(self, ready: _Ready) -> Rendered:
        """Make the consumer's stream wait for the batch (no host sync) and keep its memory alive."""
        self._count(ready.report)
        if ready.event is not None:
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_event(ready.event)
            ready.rendered.batch.imgs.record_stream(consumer)
            ready.rendered.batch.targets.record_stream(consumer)
        return ready.rendered

    # -- Engine interface -------------------------------------------------------------------------------
    def _render_batches(self, epoch: int, indices: np.ndarray) -> Generator[Rendered, None, None]:
        self._halt()
        batches = chunks(indices, self.batch_size)
        if self.prefetch == 0:
            return self._iter_inline(epoch, batches)
        return self._iter_thread(epoch, batches)

    def _iter_inline(self, epoch: int, batches: list[np.ndarray]) -> Generator[Rendered, None, None]:
        for idx in batches:
            rendered, report = self._render(epoch, idx)
            self._count(report)
            yield rendered

    def _iter_thread(self, epoch: int, batches: list[np.ndarray]) -> Generator[Rendered, None, None]:
        q: queue.Queue[Any] = queue.Queue(maxsize=self.prefetch)
        self._threads = torch.get_num_threads()
        self._stop = stop = threading.Event()
        worker = threading.Thread(target=self._produce, args=(epoch, batches, q, stop), name="fastload-gpu", daemon=True)
        self._worker = worker
        worker.start()
        try:
            while True:
                item = q.get()
                if item is _STOP:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield self._deliver(item)
        finally:
            self._halt()

    def _halt(self) -> None:
        """Stop the background thread of an abandoned or finished epoch."""
        worker, self._worker = self._worker, None
        if worker is not None and worker.is_alive():
            self._stop.set()
            worker.join(timeout=30)
            if worker.is_alive():
                warnings.warn("fastload: the GPU engine's background thread did not stop within 30 s")

    def _release(self) -> None:
        self._halt()
        self.resident = None  # the resident pixels are the store's: keep no reference to them
