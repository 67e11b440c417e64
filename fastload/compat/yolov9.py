"""Drop-in replacement for the official YOLOv9 ``utils.dataloaders.create_dataloader``.

In a checkout of https://github.com/WongKinYiu/yolov9 change one import line in ``train_dual.py``
(or ``train.py``)::

    from utils.dataloaders import create_dataloader          # before
    from fastload.compat.yolov9 import create_dataloader     # after

Same arguments in the same order, same return value ``(loader, dataset)``, same batch format.
What the trainer touches keeps working: ``len(loader)``, ``loader.sampler.set_epoch(epoch)`` under
DDP, ``dataset.labels``/``shapes``/``n``/``im_files``, and ``dataset.mosaic = False`` for
``--close-mosaic``. Unsupported: ``image_weights=True`` and ``quad=True`` (clear error).
``cache='ram'``/``True`` uses a shared-memory ram store (one copy per machine for all ranks and
workers); other values use the fastest store available plus the shared decoded-image cache.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from fastload.augment.params import PARTNERS
from fastload.data.config import DataConfig
from fastload.fastloader import loader as make_loader
from fastload.store.factory import open_store

LOG = logging.getLogger(__name__)


def _data_config(path: Any) -> Any:
    """A DataConfig whose ``train`` split is the image folder / list file(s) YOLOv9 passes."""
    sources = [Path(p) for p in (path if isinstance(path, (list, tuple)) else [path])]
    for p in sources:
        if not p.exists():
            raise FileNotFoundError(f"create_dataloader: {p} does not exist (expected an image folder or a .txt list)")
    root = sources[0].parent if sources else Path.cwd()
    # the class count is unknown here (YOLOv9 checks labels against nc in the trainer): accept any class id
    return DataConfig(yaml_path=None, root=root, splits={"train": sources}, names=[], nc=2**31 - 1)


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
) -> tuple[Any, Any]:
    """YOLOv9's ``create_dataloader`` backed by :func:`fastload.loader`; returns ``(loader, dataset)``.

    ``path`` is the split's image folder or ``.txt`` list (not a data.yaml). ``rank`` is YOLOv9's
    ``LOCAL_RANK``; sharding uses the global ``RANK``/``WORLD_SIZE`` of the environment, like
    ``DistributedSampler``. ``close_mosaic`` only selected the DataLoader class upstream and is
    accepted for signature compatibility. ``prefix`` prefixes log messages. The engine, hsv mode
    and seed can be chosen with ``FASTLOAD_ENGINE`` (cpu), ``FASTLOAD_HSV`` (worker) and
    ``FASTLOAD_SEED`` (0); ``FASTLOAD_REDUCED_DECODE=1`` turns on the CPU engine's reduced JPEG
    decode (``CPUOptions(decode_scale="reduced")``); ``FASTLOAD_PARTNERS`` (``dataset`` or ``batch``;
    unset: the engine's default) sets the training loader's ``partners`` (validation loaders draw
    no partners and ignore it).
    """
    if image_weights:
        raise ValueError("fastload.compat.yolov9: image_weights=True (--image-weights) is not supported; drop the flag")
    if quad:
        raise ValueError("fastload.compat.yolov9: quad=True (--quad) is not supported; drop the flag")
    if rect and shuffle:
        LOG.warning("%s--rect is incompatible with shuffle, setting shuffle=False", prefix)
        shuffle = False
    cfg = _data_config(path)
    kind = "ram" if cache is True or str(cache).lower() == "ram" else "auto"
    store = open_store(cfg, "train", kind=kind, imgsz=imgsz)
    try:
        n = len(store)
        batch_size = max(1, min(batch_size, n))
        nd = torch.cuda.device_count()
        nw = min((os.cpu_count() or 1) // max(nd, 1), batch_size if batch_size > 1 else 0, workers)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        global_rank = int(os.environ.get("RANK", rank)) if rank != -1 else -1
        engine = os.environ.get("FASTLOAD_ENGINE", "cpu")
        partners = os.environ.get("FASTLOAD_PARTNERS") or None
        if partners is not None and partners not in PARTNERS:
            raise ValueError(f"FASTLOAD_PARTNERS={partners!r}: choose one of {', '.join(PARTNERS)} (or leave it unset)")
        fl = make_loader(
            store,
            imgsz=imgsz,
            batch_size=batch_size,
            hyp=hyp,
            augment=augment,
            engine=engine,
            workers=None if engine == "gpu" else nw,  # the gpu engine's host side is one thread: no workers
            shuffle=shuffle,
            rect=rect,
            stride=int(stride),
            pad=pad,
            seed=int(os.environ.get("FASTLOAD_SEED", "0")),
            rank=global_rank,
            world_size=world if global_rank != -1 else 1,
            min_items=min_items,
            single_cls=single_cls,
            hsv_on=os.environ.get("FASTLOAD_HSV", "worker"),
            engine_options={"decode_scale": "reduced"} if os.environ.get("FASTLOAD_REDUCED_DECODE", "0") == "1" else None,
            partners=partners if augment and not rect else None,
        )
    except BaseException:
        store.close()
        raise
    ds = fl.dataset
    if not ds.names or single_cls:
        top = max((int(lb[:, 0].max()) for lb in ds.labels if len(lb)), default=0)
        ds.names = ["item"] if single_cls else [str(i) for i in range(top + 1)]
    LOG.info("%sfastload: %d images, %d batches of %d, %d workers, %s store", prefix, ds.n, len(fl), batch_size, nw, store.kind)
    return fl, ds
