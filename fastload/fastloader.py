"""``fastload.loader()``: a YOLOv9-compatible training and validation loader in one call.

It ties the packages together: a store (``fastload.store.open_store``), the augmentation sampler
(``fastload.augment.params.ParamSampler``), the epoch order (:mod:`fastload.order`) and an engine
(``cpu``, ``gpu`` or ``dali``) that renders the batches.
"""
from __future__ import annotations

import importlib
import logging
import os
import warnings
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from fastload import order as _order
from fastload.augment.params import image_of, visit_ids
from fastload.engines.base import HSV_MODES, Batch, Engine, StoreView
from fastload.store.base import Store

LOG = logging.getLogger(__name__)

ENGINES = {
    "cpu": ("fastload.engines.cpu", "CPUEngine"),
    "gpu": ("fastload.engines.gpu", "GPUEngine"),
    "dali": ("fastload.engines.dali", "DALIEngine"),
}


class LoaderDataset:
    """What the YOLOv9 trainer reads from ``dataset`` (``loader.dataset``); no ``__getitem__`` pixels.

    Attributes:
        labels: ``float32 [n, 5]`` (cls, xc, yc, w, h) per image, after ``min_items`` / ``single_cls``.
        shapes: ``int [N, 2]`` original image sizes as **(w, h)**, YOLOv9's order (``hw`` has (h, w)).
        im_files, label_files: source image and label path per image.
        n: number of images; names: class names.
        indices: YOLOv9's image table, ``range(n)`` unless set: ``dataset.indices = table`` (what
            ``--image-weights`` does before every epoch) draws image ``table[p]`` at every position ``p``
            of the epochs that follow (see :meth:`FastLoader.set_image_table`).
        batch_shapes: rect mode's ``int [nb, 2]`` (h, w) per batch, else None.
        mosaic: YOLOv9's switch; ``dataset.mosaic = False`` closes mosaic (as ``--close-mosaic`` does).
    """

    def __init__(self, owner: "FastLoader", view: StoreView, *, img_size: int, augment: bool, hyp: dict,
                 rect: bool, stride: int, pad: float, batch_shapes: np.ndarray | None) -> None:
        self._owner = owner
        self.labels = view.labels
        self.hw = np.asarray(view.shapes, np.int64)
        self.shapes = self.hw[:, ::-1].copy()
        self.im_files = list(view.im_files)
        from fastload.data.labels import img2label_path

        self.label_files = [img2label_path(f) for f in self.im_files]
        self.n = len(self.im_files)
        self.names = list(view.names)
        self.img_size = img_size
        self.augment = augment
        self.hyp = hyp
        self.rect = rect
        self.stride = stride
        self.pad = pad
        self.batch_shapes = batch_shapes
        self.segments = tuple([] for _ in range(self.n))  # detection only

    def __len__(self) -> int:
        return self.n

    @property
    def indices(self) -> Sequence[int]:
        table = self._owner.image_table
        return range(self.n) if table is None else table.tolist()

    @indices.setter
    def indices(self, value: Sequence[int] | np.ndarray | None) -> None:
        self._owner.set_image_table(value)

    @property
    def mosaic(self) -> bool:
        return not self._owner.mosaic_closed and self.augment and not self.rect

    @mosaic.setter
    def mosaic(self, value: bool) -> None:
        if not value:
            self._owner.close_mosaic()
        elif self._owner.mosaic_closed:
            raise ValueError("mosaic cannot be switched back on once closed; build a new loader")

    def __getitem__(self, i: int) -> Any:
        raise TypeError(
            "fastload renders whole batches; iterate the loader instead of indexing its dataset "
            "(dataset exposes labels, shapes, im_files, label_files, n, names)"
        )


class _EpochSampler:
    """``loader.sampler``: YOLOv9 calls ``train_loader.sampler.set_epoch(epoch)`` under DDP."""

    def __init__(self, owner: "FastLoader") -> None:
        self._owner = owner

    def set_epoch(self, epoch: int) -> None:
        self._owner.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self._owner._indices(self._owner.epoch))

    def __iter__(self) -> Iterator[int]:
        """The image indices of the current epoch, in order (this rank's part)."""
        return iter(image_of(self._owner._indices(self._owner.epoch), self._owner.n).tolist())


class FastLoader:
    """Iterable of YOLOv9 batches ``(imgs, targets, paths, shapes)``; build it with :func:`loader`.

    ``len(loader)`` is the number of batches per epoch for this rank. Iterating runs the current
    epoch; when an iteration ends the epoch advances by one unless :meth:`set_epoch` is called
    (as the YOLOv9 trainer does under DDP). Use as a context manager or call :meth:`close` to stop
    the workers (they also stop with the process).
    """

    def __init__(self, *, engine: Engine, dataset: LoaderDataset, store: Store, n: int, batch_size: int,
                 seed: int, shuffle: bool, rank: int, world_size: int, drop_last: bool,
                 rect_batches: list[np.ndarray] | None, close_mosaic_epochs: int, epochs: int | None,
                 owns_store: bool = True) -> None:
        self.engine = engine
        self.dataset = dataset
        self.store = store
        # a store the caller passed in stays open (a ram store's shared-memory hold is theirs)
        self._owns_store = bool(owns_store)
        self.n = n
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self._rect_batches = rect_batches
        self.close_mosaic_epochs = close_mosaic_epochs
        self.epochs = epochs
        self.epoch = 0
        self.mosaic_closed = False
        self.image_table: np.ndarray | None = None  # set_image_table()
        self.sampler = _EpochSampler(self)
        self._epoch_set = False
        self._closed = False

    # -- order --------------------------------------------------------------------------------------------
    def _indices(self, epoch: int) -> np.ndarray:
        """What the engine renders in ``epoch``: image indices, or sample ids when an image table repeats images."""
        if self._rect_batches is not None:
            return np.concatenate(self._rect_batches) if self._rect_batches else np.zeros(0, np.int64)
        idx = _order.epoch_indices(self.n, epoch, seed=self.seed, shuffle=self.shuffle, rank=self.rank,
                                   world_size=self.world_size, drop_last=self.drop_last)
        if self.drop_last:
            idx = idx[: len(idx) // self.batch_size * self.batch_size]
        if self.image_table is not None:  # positions -> the images drawn there, each visit its own draws
            idx = visit_ids(self.image_table[idx], self.n)
        return idx

    def set_image_table(self, images: Sequence[int] | np.ndarray | None) -> None:
        """Draw image ``images[p]`` wherever position ``p`` comes up, from the next iteration on.

        This is YOLOv9's ``dataset.indices``, which ``--image-weights`` replaces before every epoch with
        ``random.choices(range(n), weights, k=n)``: the order (shuffle, DDP shards) still runs over the
        ``n`` positions and each position shows the image the table holds there. An image that appears
        several times gets its own augmentation draws each time (:func:`~fastload.augment.params.visit_ids`),
        so batches stay a function of the seed, the epoch and the table, for any number of workers.
        Mosaic partners are drawn from all images, as without a table (YOLOv9 draws them from the
        table). ``None`` or ``range(n)`` restores the plain order. CPU engine only; not with ``rect``
        (YOLOv9's own loader cannot collate rect images taken out of their batches either).
        """
        if images is None:
            self.image_table = None
            return
        table = np.asarray(images, np.int64).reshape(-1)
        if len(table) != self.n:
            raise ValueError(f"dataset.indices needs one image index per position ({self.n}), got {len(table)}")
        if len(table) and (table.min() < 0 or table.max() >= self.n):
            raise ValueError(f"dataset.indices holds indices outside [0, {self.n})")
        if np.array_equal(table, np.arange(self.n)):
            self.image_table = None
            return
        if self._rect_batches is not None:
            raise ValueError("dataset.indices (--image-weights) cannot reorder rect batches; drop --rect or the weights")
        if self.engine.name != "cpu":
            raise ValueError(f"dataset.indices (--image-weights) needs engine='cpu', this loader uses {self.engine.name!r}")
        self.image_table = table

    def __len__(self) -> int:
        if self._rect_batches is not None:
            return len(self._rect_batches)
        ws = self.world_size
        m = (self.n // ws if self.drop_last else -(-self.n // ws)) if ws > 1 else self.n
        return m // self.batch_size if self.drop_last else -(-m // self.batch_size)

    # -- epoch state ----------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration runs (its shuffle, its augmentation draws).

        Every rank must call it with the same value. With ``close_mosaic=N`` and ``epochs=E`` given
        to :func:`loader`, mosaic closes automatically from epoch ``E - N`` on.
        """
        self.epoch = int(epoch)
        self._epoch_set = True
        if self.close_mosaic_epochs and self.epochs is not None and self.epoch >= self.epochs - self.close_mosaic_epochs:
            self.close_mosaic()

    def close_mosaic(self) -> None:
        """Switch mosaic and mixup off for all following batches (YOLOv9 ``--close-mosaic``)."""
        if self.mosaic_closed:
            return
        self.mosaic_closed = True
        self.engine.close_mosaic()

    @property
    def num_workers(self) -> int:
        """Worker processes rendering batches (0: the calling process); DataLoader's name, read by YOLOv9."""
        return int(self.engine.workers)

    # -- iteration ------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        if self._closed:
            raise RuntimeError("this loader was closed")
        epoch = self.epoch
        if self.close_mosaic_epochs and self.epochs is not None and epoch >= self.epochs - self.close_mosaic_epochs:
            self.close_mosaic()
        self._epoch_set = False
        # workers that finish this epoch's last batches may start the next one (small datasets:
        # otherwise they idle while the consumer finishes the epoch and asks for the next)
        self.engine.expect_next(epoch + 1, self._indices(epoch + 1))
        yield from self.engine.iter_batches(epoch, self._indices(epoch))
        if not self._epoch_set:  # plain `for epoch: for batch in loader` loops get a new shuffle each time
            self.epoch = epoch + 1

    @property
    def hsv_gains(self) -> torch.Tensor | None:
        """``hsv_on="defer"``: the ``float32 [B, 3]`` HSV gains of the latest batch (None before)."""
        return self.engine.last_gains

    def stats(self) -> dict[str, Any]:
        """Counters for benchmarks: decoded-cache hits/misses and batches of the next epoch rendered early
        (used / dropped after a wrong guess; CPU engine), worker PIDs."""
        out: dict[str, Any] = {"engine": self.engine.name, "store": self.store.kind}
        if hasattr(self.engine, "cache_stats"):
            out["decode_cache_hits"], out["decode_cache_misses"] = self.engine.cache_stats
        if hasattr(self.engine, "early_stats"):
            out["early_batches_used"], out["early_batches_dropped"] = self.engine.early_stats
        out["worker_pids"] = list(getattr(self.engine, "worker_pids", []))
        return out

    def close(self) -> None:
        """Stop workers and release buffers, and the store if :func:`loader` opened it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.engine.close()
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> "FastLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"FastLoader(engine={self.engine.name}, store={self.store.kind}, n={self.n}, "
                f"batch_size={self.batch_size}, batches={len(self)}, rank={self.rank}/{self.world_size})")


def _resolve_world(rank: int, world_size: int | None) -> tuple[int, int]:
    if world_size is None:
        if rank < 0:
            return -1, 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return rank, torch.distributed.get_world_size()
        return rank, int(os.environ.get("WORLD_SIZE", "1"))
    return rank, int(world_size)


def _filter(labels: list[np.ndarray], min_items: int, single_cls: bool) -> tuple[np.ndarray, list[np.ndarray]]:
    keep = np.array([i for i, lb in enumerate(labels) if len(lb) >= min_items], np.int64) if min_items > 0 \
        else np.arange(len(labels), dtype=np.int64)
    out = [labels[i] for i in keep.tolist()]
    if single_cls:
        out = [np.concatenate([np.zeros((len(lb), 1), np.float32), lb[:, 1:]], 1) for lb in out]
    return keep, out


def _engine_class(name: str) -> type:
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
    module, cls = ENGINES[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise ImportError(f"engine {name!r} is not available here: {e}") from e


def loader(
    data: Any,
    split: str = "train",
    imgsz: int = 640,
    batch_size: int = 16,
    *,
    hyp: Any = None,
    augment: bool = True,
    store: str | Store = "auto",
    engine: str = "cpu",
    workers: int = 8,
    shuffle: bool = True,
    rect: bool = False,
    stride: int = 32,
    pad: float = 0.0,
    seed: int = 0,
    rank: int = -1,
    world_size: int | None = None,
    close_mosaic: int = 0,
    epochs: int | None = None,
    min_items: int = 0,
    single_cls: bool = False,
    drop_last: bool = False,
    device: str | torch.device | None = None,
    hsv_on: str = "worker",
    layout: str = "nhwc",
    decode_cache_mb: int | None = None,
    reduced_decode: bool = False,
    axis_kernel: str | None = None,
    prefetch: int = 2,
    keep: int = 2,
    timeout: float = 0.0,
    **engine_options: Any,
) -> FastLoader:
    """Build a YOLOv9-compatible loader.

    Iterating yields YOLOv9 batches ``(imgs, targets, paths, shapes)``: ``imgs`` uint8
    ``[B, 3, H, W]`` RGB, ``targets`` float32 ``[N, 6]`` (index in batch, cls, xc, yc, w, h)
    normalised, ``paths`` tuple of str, ``shapes`` tuple (None for mosaic samples, else
    ``((h0, w0), ((h / h0, w / w0), (padw, padh)))``).

    Args:
        data: a ``data.yaml`` path, a dict with the same keys, a ``DataConfig`` or an open ``Store``
            (then ``split`` and ``store`` are ignored). A ``Store`` passed in (here or as ``store``)
            stays open when the loader closes: it is the caller's to close.
        split: ``train``, ``val`` or ``test``.
        imgsz: output size (long side of loaded images; training batches are imgsz x imgsz).
        batch_size: images per batch (per rank).
        hyp: augmentation hyper-parameters: yaml path, dict or None (YOLOv9 ``hyp.scratch-high``).
        augment: apply training augmentation (mosaic, mixup, perspective, HSV, flips). False:
            letterbox only (validation). As in YOLOv9's ``load_image``, the CPU engine shrinks images
            from encoded stores with INTER_LINEAR in training and INTER_AREA in validation (decoded
            disk/ram stores hold images shrunk once, with INTER_AREA: ``store.meta["shrink"]``).
        store: ``auto`` (the fastest store ``fastload convert`` recorded for this split and imgsz:
            ram > disk > lmdb > files), one of ``files | lmdb | disk | ram``, ``gpu`` (decoded images
            resident on ``device``; ``engine="gpu"`` only), or a ``Store``.
        engine: ``cpu`` (worker processes), ``gpu`` (PyTorch on ``device``) or ``dali``.
        workers: CPU worker processes (0: render in the calling process). Persistent across epochs.
        shuffle: new permutation every epoch (a function of ``seed`` and the epoch). Ignored in rect mode.
        rect: validation-style rectangular batches: images sorted by aspect ratio, each batch
            letterboxed to its own ``stride``-multiple shape, no shuffle, no mosaic.
        stride: model stride for rect batch shapes.
        pad: rect shape padding in strides (YOLOv9 validation uses 0.5).
        seed: seed of the order and of every augmentation draw; the same seed gives the same batches
            whatever the number of workers.
        rank, world_size: DDP sharding like ``DistributedSampler``: each rank gets a disjoint, equally
            sized part of every epoch. ``rank=-1``: not distributed. ``world_size=None``: taken from
            ``torch.distributed`` (or ``$WORLD_SIZE``) when ``rank >= 0``.
        close_mosaic: switch mosaic/mixup off for the last ``close_mosaic`` epochs; needs ``epochs``
            and works through :meth:`FastLoader.set_epoch` (or call ``loader.close_mosaic()`` yourself).
        epochs: total epochs of the run (only used by ``close_mosaic``).
        min_items: drop images with fewer labels than this.
        single_cls: map every class to 0.
        drop_last: drop the last incomplete batch (and, under DDP, the tail instead of padding).
        device: where batches are delivered (``None``: CPU). The CPU engine copies each batch there
            and applies consumer-side HSV there.
        hsv_on: ``"worker"`` (HSV applied while rendering, on the CPU workers), ``"consumer"`` (gains
            applied to the whole batch on ``device`` by ``apply_hsv_batch``; the trainer uses it on
            GPU, where it is nearly free) or ``"defer"`` (not applied: after each batch,
            ``loader.hsv_gains`` holds its ``float32 [B, 3]`` gains for the caller to apply, e.g.
            ``apply_hsv_batch(imgs.to(dev), loader.hsv_gains.to(dev))``). HSV costs ~1.3-1.5 ms per
            640x640 image on a CPU core, against ~1.2-1.5 ms for all the rest of a mosaic sample
            (OpenCV 5, warp kernel).
        layout: CPU engine: ``"nhwc"`` (``imgs`` is a channels-last view of the shared slot, no copy)
            or ``"nchw"`` (contiguous ``imgs``, one transposing copy per image in the workers).
        decode_cache_mb: CPU engine, encoded stores (files, lmdb): bound of the decoded-image cache
            shared by all workers, so mosaic partners and later epochs skip decoding. ``None``: 1/8 of
            physical memory divided by ``world_size``; ``0``: off.
        reduced_decode: CPU engine, encoded stores: decode a JPEG whose long side is at least twice
            ``imgsz`` at 1/2, 1/4 or 1/8 scale by the DCT, then resize as usual (coco128 at imgsz 320 /
            160: 1.2x / 1.3x cheaper reads, 1.3x / 1.5x faster uncached loading; loaded pixels differ by
            1.3 / 1.7 grey levels on average, boxes and shapes not at all). Off by default: the full
            decode is what stock YOLOv9 does.
        axis_kernel: CPU engine: how tiles with a scale + translation matrix (every scratch-high mosaic
            tile) are drawn: ``"warp"`` (``cv2.warpAffine`` with the exact matrix, YOLOv9's own
            sampling) or ``"resize"`` (one ``cv2.resize`` per tile, sampling positions within 0.05
            px). None: the faster for the installed OpenCV (``warp`` from OpenCV 5, else ``resize``;
            coco128 scratch-high tiles drawn in 0.71-0.73x the time on OpenCV 5.1). Letterboxes are
            bit-identical to YOLOv9 either way.
        prefetch: batches each worker renders ahead.
        keep: how many of the latest yielded batches stay valid (their buffers are then reused);
            clone ``imgs`` to keep a batch longer.
        timeout: seconds to wait for one batch before raising (0: as long as the worker lives; a
            dead worker always raises at once).
        engine_options: passed to the engine.

    Returns a :class:`FastLoader`; ``loader.dataset`` exposes ``labels``, ``shapes``, ``im_files``,
    ``label_files``, ``n``, ``names`` for the trainer.
    """
    from fastload.augment.hyp import load_hyp
    from fastload.augment.params import ParamSampler, per_index_shapes, rect_batch_shapes
    from fastload.data.images import loaded_shape, shrink_filter

    if hsv_on not in HSV_MODES:
        raise ValueError(f"hsv_on must be one of {', '.join(HSV_MODES)}, got {hsv_on!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if hsv_on == "consumer" and (device is None or torch.device(device).type == "cpu"):
        warnings.warn("fastload.loader: hsv_on='consumer' without a GPU device applies HSV in the main process "
                      "with torch ops (slow on a CPU); use hsv_on='worker' there")
    rank, world_size = _resolve_world(rank, world_size)
    owns_store = not isinstance(data, Store) and not isinstance(store, Store)
    if isinstance(data, Store):
        base = data
    elif isinstance(store, Store):
        base = store
    else:
        from fastload.store.factory import open_store

        base = open_store(data, split=split, kind=store, imgsz=imgsz, **({"device": device} if store == "gpu" else {}))
    try:
        keep_idx, labels = _filter(list(base.labels), int(min_items), bool(single_cls))
        if len(keep_idx) == 0:
            raise ValueError(f"no images left in {base!r} (min_items={min_items})")
        view = StoreView(base, keep_idx, labels)
        if single_cls:
            view.names = ["item"]
        hyp_d = load_hyp(hyp)
        loaded_hw = np.array([loaded_shape(int(h), int(w), imgsz) for h, w in view.shapes], np.int64).reshape(-1, 2)

        rect_batches = batch_shapes = rect_shapes = None
        if rect:
            if shuffle and split == "train":
                LOG.info("rect batches are not shuffled")
            order_idx, batch_shapes = rect_batch_shapes(view.shapes, batch_size, imgsz, stride=stride, pad=pad)
            rect_shapes = per_index_shapes(order_idx, batch_shapes, batch_size)
            rect_batches = _order.rect_order(order_idx, batch_size, rank=rank, world_size=world_size)
            max_hw = (int(batch_shapes[:, 0].max()), int(batch_shapes[:, 1].max()))
        else:
            max_hw = (imgsz, imgsz)
        sampler = ParamSampler(loaded_hw, hyp_d, imgsz, augment=augment, seed=seed, rect_shapes=rect_shapes,
                               pad=pad, stride=stride, orig_shapes=view.shapes)

        cls = _engine_class(engine)
        # YOLOv9's load_image shrinks with INTER_LINEAR in training, INTER_AREA in validation
        opts: dict[str, Any] = dict(engine_options, prefetch=prefetch, shrink=shrink_filter(augment))
        if engine == "cpu":
            opts.update(max_hw=max_hw, layout=layout, keep=keep, loaded_hw=loaded_hw,
                        decode_cache_bytes=None if decode_cache_mb is None else int(decode_cache_mb) << 20,
                        timeout=timeout, world_size=world_size, reduced_decode=reduced_decode, axis_kernel=axis_kernel)
        elif reduced_decode:
            raise ValueError(f"reduced_decode is a CPU-engine option (engine={engine!r} decodes on its own)")
        elif axis_kernel is not None:
            raise ValueError(f"axis_kernel is a CPU-engine option (engine={engine!r} follows the default kernel's tile plan)")
        eng = cls(view, sampler, batch_size=batch_size, workers=workers, device=device, hsv=hsv_on, **opts)
    except BaseException:
        if owns_store:
            base.close()
        raise
    ds = LoaderDataset(None, view, img_size=imgsz, augment=augment, hyp=hyp_d, rect=rect,  # type: ignore[arg-type]
                       stride=stride, pad=pad, batch_shapes=batch_shapes)
    fl = FastLoader(engine=eng, dataset=ds, store=base, n=len(view), batch_size=batch_size, seed=seed,
                    shuffle=shuffle and not rect, rank=rank, world_size=world_size, drop_last=drop_last,
                    rect_batches=rect_batches, close_mosaic_epochs=int(close_mosaic), epochs=epochs,
                    owns_store=owns_store)
    ds._owner = fl
    if close_mosaic and epochs is None:
        warnings.warn("fastload.loader: close_mosaic needs epochs=...; call loader.close_mosaic() yourself")
    return fl
