"""Rebuilding a ram store that vanished from shared memory (a reboot), for :func:`fastload.store.factory.open_store`:
a copy of the disk store recorded beside it, else the source images decoded again when that is cheap."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from fastload.data.config import DataConfig
from fastload.data.images import LoadRule
from fastload.data.index import build_index
from fastload.store.kinds import WriteJob, store_imgsz, store_load_rule
from fastload.store.origin import source_fingerprint
from fastload.store.packed import META, copy_packed, write_ram_from_source
from fastload.store.writing import default_workers

# Rebuilding a missing ram store straight from the source images decodes every image once; do it
# silently only for sets up to this size (override with FASTLOAD_RAM_REBUILD_MAX).
RAM_REBUILD_MAX = 20000


def ram_builder(cfg: DataConfig, split: str, imgsz: int, recorded: dict[str, Path], *,
                allow_decode: bool, load_rule: LoadRule = "yolov9") -> Callable[[Path], Any] | None:
    """How to (re)build a missing ram store of ``load_rule``'s images: copy the disk store (of the same imgsz
    and rule), else decode the source if cheap (or ``allow_decode``); None when neither applies."""
    disk = recorded.get("disk")
    if disk is not None and (disk / META).is_file() and store_imgsz(disk) == imgsz and store_load_rule(disk) == load_rule:
        return lambda seg: copy_packed(disk, seg)
    if split not in cfg.splits:
        return None
    workers = default_workers()
    index = build_index(cfg, split, workers=workers, progress=False)  # cached by the data package
    limit = int(os.environ.get("FASTLOAD_RAM_REBUILD_MAX", RAM_REBUILD_MAX))
    if not allow_decode and len(index) > limit:
        return None
    job = WriteJob(cfg=cfg, name=split, index=index, source_hash=source_fingerprint(index.im_files),
                   out_dir=Path(), imgsz=imgsz, workers=workers, progress=False, load_rule=load_rule)
    return lambda seg: write_ram_from_source(job, seg)
