"""``BatchLog``: the ``batch_log`` option of the compat layers (YOLOv9's and Ultralytics'), one JSON line per
batch a trainer received, and ``LoaderWrapper``, the loader seen through a wrapper."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from fastload.engines.base import SegmentBatch


class LoaderWrapper:
    """A loader seen through a wrapper: ``len()`` and every attribute (``dataset``, ``sampler``,
    ``num_workers``...) are the wrapped loader's; subclasses redefine ``__iter__``."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __iter__(self) -> Iterator[Any]:
        return iter(self._loader)

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_loader":
            raise AttributeError(name)
        return getattr(self._loader, name)


class BatchLog(LoaderWrapper):
    """The loader, appending one JSON line per batch it yields to ``path`` (``batch_log`` option).

    Each line: ``split`` (the official prefix, e.g. ``train``), ``pid``, ``rank``, ``augment``, ``epoch``,
    ``batch``, ``hw`` (the batch's height and width), ``n`` (images), ``mosaic`` (how many samples are
    mosaics: their ``shapes`` entry is None), ``images`` (file names, in order) and ``device``; a segment batch's line
    also has ``masks`` (the masks' shape) and ``mask_pixels`` (how many of their pixels are set). Written in the
    process that iterates, so it shows what the trainer received. Everything else is the loader's.
    """

    def __init__(self, loader: Any, path: str, *, prefix: str = "") -> None:
        super().__init__(loader)
        self.path = str(path)
        self.prefix = prefix

    def __iter__(self) -> Iterator[Any]:
        fl = self._loader
        epoch = fl.epoch
        fields = {"split": self.prefix, "pid": os.getpid(), "rank": int(os.environ.get("RANK", -1)),
                  "augment": bool(fl.dataset.augment), "epoch": epoch}
        with open(self.path, "a", buffering=1) as f:
            for k, batch in enumerate(fl):
                imgs, paths, shapes = batch[0], batch[2], batch[3]
                line = dict(fields, batch=k, hw=[int(imgs.shape[2]), int(imgs.shape[3])], n=len(paths),
                            mosaic=sum(s is None for s in shapes), images=[Path(p).name for p in paths],
                            device=str(imgs.device))
                if isinstance(batch, SegmentBatch):
                    line.update(masks=list(batch.masks.shape), mask_pixels=int(batch.masks.count_nonzero()))
                f.write(json.dumps(line) + "\n")
                yield batch
