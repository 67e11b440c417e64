"""fastload: object-detection data loading that keeps the GPU busy.

The public API, by name (``docs/design.md`` maps the packages behind it):

* :func:`loader` builds a YOLOv9-compatible loader and returns a :class:`FastLoader`;
* :class:`CPUOptions`, :class:`TorchGPUOptions`, :class:`DALIOptions`, :class:`RayOptions`: each engine's own options
  (``loader(..., engine_options=...)``);
* :class:`Batch`, :class:`SegmentBatch`, :class:`PoseBatch`, :class:`OBBBatch`: what a loader yields, by ``task``;
* :func:`apply_hsv_batch`: the HSV finishing step of ``hsv_on="defer"``;
* :func:`open_store` opens a store, :func:`convert` builds stores (``fastload convert``);
* the exceptions: :class:`StoreError`, :class:`IncompleteStoreError`, :class:`CorruptImageError`,
  :class:`DataConfigError`, :class:`EngineOptionError`, :class:`WorkerError`.

Each name is imported on first use, so ``import fastload`` (and the CLI's ``--help``) does not
import torch or OpenCV.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fastload._version import __version__

# public name -> the module that defines it
_EXPORTS = {
    "loader": "fastload.fastloader",
    "FastLoader": "fastload.fastloader",
    "CPUOptions": "fastload.engines.cpu",
    "TorchGPUOptions": "fastload.engines.gpu",
    "DALIOptions": "fastload.engines.dali",
    "RayOptions": "fastload.engines.ray_engine",
    "Batch": "fastload.engines.base",
    "SegmentBatch": "fastload.engines.base",
    "PoseBatch": "fastload.engines.base",
    "OBBBatch": "fastload.engines.base",
    "apply_hsv_batch": "fastload.augment.functional.torch_ops",
    "open_store": "fastload.store.factory",
    "convert": "fastload.store.convert",
    "StoreError": "fastload.store.base",
    "IncompleteStoreError": "fastload.store.base",
    "DamagedRecordError": "fastload.store.base",
    "CorruptImageError": "fastload.data.images",
    "DataConfigError": "fastload.data.config",
    "EngineOptionError": "fastload.engines.base",
    "WorkerError": "fastload.engines.base",
}
__all__ = [
    "__version__", "loader", "FastLoader", "CPUOptions", "TorchGPUOptions", "DALIOptions", "RayOptions", "Batch",
    "SegmentBatch", "PoseBatch", "OBBBatch", "apply_hsv_batch", "open_store", "convert", "StoreError", "IncompleteStoreError", "DamagedRecordError", "CorruptImageError",
    "DataConfigError", "EngineOptionError", "WorkerError",
]

if TYPE_CHECKING:  # what static tools see; at run time __getattr__ imports each name when first used
    from fastload.augment.functional.torch_ops import apply_hsv_batch
    from fastload.data.config import DataConfigError
    from fastload.data.images import CorruptImageError
    from fastload.engines.base import Batch, EngineOptionError, OBBBatch, PoseBatch, SegmentBatch, WorkerError
    from fastload.engines.cpu import CPUOptions
    from fastload.engines.dali import DALIOptions
    from fastload.engines.gpu import TorchGPUOptions
    from fastload.engines.ray_engine import RayOptions
    from fastload.fastloader import FastLoader, loader
    from fastload.store.base import DamagedRecordError, IncompleteStoreError, StoreError
    from fastload.store.convert import convert
    from fastload.store.factory import open_store


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fastload' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
