"""``create_dataloader`` with the official signature, backed by :func:`fastload.loader`."""
from __future__ import annotations

import logging
import os
import re
from typing import Any

import torch

from fastload.compat.batch_log import BatchLog
from fastload.compat.ranks import shard_of
from fastload.compat.stores import open_split_store, split_config
from fastload.compat.yolov9.options import CompatOptions
from fastload.data.device import resolve_device
from fastload.engines.factory import SAMPLE_ID_ENGINES, engine_class
from fastload.fastloader import loader as make_loader

LOG = logging.getLogger(__name__)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
OWNER = "fastload.compat.yolov9"


def _device(opts: CompatOptions) -> torch.device | None:
    """Where batches go: a CUDA device when there is one (``auto``), the CPU without a copy (None), or as asked."""
    if opts.device is None:
        return None
    if opts.device == "auto":
        # called after the official select_device(), which hides CUDA for --device cpu
        dev = resolve_device(None, "fastload.compat.yolov9")
        return dev if dev.type == "cuda" else None
    return resolve_device(opts.device, "fastload.compat.yolov9", instead="device='cpu'")


def create_dataloader(
    path: Any,
    imgsz: int,
    batch_size: int,
    stride: int,
    single_cls: bool = False,
    hyp: Any = None,
    augment: bool = False,
    cache: Any = False,
    pad: float = 0.0,
    rect: bool = False,
    rank: int = -1,
    workers: int = 8,
    image_weights: bool = False,
    close_mosaic: bool = False,
    quad: bool = False,
    min_items: int = 0,
    prefix: str = "",
    shuffle: bool = False,
    **fastload_options: Any,
) -> tuple[Any, Any]:
    """YOLOv9's ``utils.dataloaders.create_dataloader`` backed by :func:`fastload.loader`.

    Returns ``(loader, dataset)``. The official arguments keep their meaning: ``path`` is the
    split's image folder or ``.txt`` list; ``rank`` is YOLOv9's ``LOCAL_RANK`` (sharding follows the
    environment's ``RANK``/``WORLD_SIZE``, as ``DistributedSampler``); ``workers`` bounds the worker
    count as upstream; ``cache='ram'``/``True`` serves a shared-memory ram store (one copy per
    machine for all ranks and workers), other values the fastest store available plus the decoded-image
    cache (no ``.npy`` files); ``image_weights`` works through ``dataset.indices``
    (:meth:`fastload.fastloader.FastLoader.set_image_table`); ``close_mosaic`` only chose the
    DataLoader class upstream (``dataset.mosaic = False`` closes mosaic). ``quad=True`` is refused.

    What the trainer touches works: ``len(loader)``, ``loader.num_workers``,
    ``loader.sampler.set_epoch(epoch)``, ``dataset.labels``/``shapes``/``n``/``im_files``/``indices``,
    ``dataset.mosaic = False``.

    ``fastload_options`` (each also a ``FASTLOAD_*`` environment variable, used when the keyword is
    absent; see :data:`fastload.compat.yolov9.options.OPTIONS`): ``engine``, ``store``, ``hsv``,
    ``seed``, ``num_workers``, ``device``, ``reduced_decode``, ``partners``, ``strict``, ``batch_log``. By default, when CUDA is
    available, batches are delivered on the current CUDA device with HSV applied there (the CPU
    workers do the geometry only): the official trainer never applies HSV itself.
    """
    return build(path, imgsz, batch_size, stride, single_cls=single_cls, hyp=hyp, augment=augment, cache=cache, pad=pad,
                 rect=rect, rank=rank, workers=workers, image_weights=image_weights, quad=quad, min_items=min_items,
                 prefix=prefix, shuffle=shuffle, fastload_options=fastload_options)


def build(path: Any, imgsz: int, batch_size: int, stride: int, *, single_cls: bool, hyp: Any, augment: bool, cache: Any,
          pad: float, rect: bool, rank: int, workers: int, image_weights: bool, quad: bool, min_items: int, prefix: str,
          shuffle: bool, fastload_options: dict[str, Any], task_keywords: dict[str, Any] | None = None
          ) -> tuple[Any, Any]:
    """The ``(loader, dataset)`` of an official ``create_dataloader`` (detection's, or with ``task_keywords``
    the segment one's: :mod:`fastload.compat.yolov9.segment`)."""
    task_keywords = task_keywords or {}
    opts = CompatOptions.resolve(fastload_options)
    if quad:
        raise ValueError("fastload.compat.yolov9: --quad (quad=True) is not supported; drop the flag")
    engine = engine_class(opts.engine)
    if image_weights and not engine.takes_sample_ids:  # dataset.indices would refuse it later
        able = " or ".join(map(repr, SAMPLE_ID_ENGINES))
        raise ValueError(f"fastload.compat.yolov9: --image-weights needs engine={able} (engine={opts.engine!r})")
    if rect and shuffle:
        LOG.warning("%s--rect is incompatible with shuffle, setting shuffle=False", prefix)
        shuffle = False
    device = _device(opts)
    chosen = opts.loader_keywords(augment=augment, rect=rect, device=device)
    ram = cache is True or str(cache).lower() == "ram"
    store = open_split_store(split_config(path, owner=OWNER), kind="ram" if ram else "auto", imgsz=imgsz,
                             store=opts.store, owner=OWNER)
    try:
        n = len(store)
        batch_size = max(1, min(batch_size, n))
        nd = torch.cuda.device_count()
        nw = opts.num_workers
        if nw is None and engine.renderers == "workers":  # the official rule, for engines that have worker processes
            nw = min((os.cpu_count() or 1) // max(nd, 1), batch_size if batch_size > 1 else 0, workers)
        global_rank, world = shard_of(rank)
        fl = make_loader(
            store,
            imgsz=imgsz,
            batch_size=batch_size,
            hyp=hyp,
            augment=augment,
            workers=nw,
            shuffle=shuffle,
            rect=rect,
            stride=int(stride),
            pad=pad if rect else None,  # the official loader pads rect batch shapes only
            seed=opts.seed,
            rank=global_rank,
            world_size=world,
            min_items=min_items,
            single_cls=single_cls,
            **task_keywords,
            **chosen,
        )
    except BaseException:
        store.close()
        raise
    ds = fl.dataset
    if not ds.names or single_cls:
        top = max((int(lb[:, 0].max()) for lb in ds.labels if len(lb)), default=0)
        ds.names = ["item"] if single_cls else [str(i) for i in range(top + 1)]
    task = task_keywords.get("task", "detect")
    LOG.info("%sfastload: %s%d images, %d batches of %d, %d workers, %s store, %s engine, HSV %s, batches on %s",
             prefix, "" if task == "detect" else f"{task}, ", ds.n, len(fl), batch_size, fl.num_workers, store.kind, opts.engine,
             (chosen["hsv_on"] or engine.hsv_modes[0]) if augment else "off",
             device if device is not None else "cpu")
    if opts.batch_log:
        return BatchLog(fl, opts.batch_log, prefix=_ANSI.sub("", prefix).strip().rstrip(":")), ds
    return fl, ds
