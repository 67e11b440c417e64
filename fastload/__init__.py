"""fastload: object-detection data loading that keeps the GPU busy.

The public entry is :func:`fastload.loader` (defined in :mod:`fastload.fastloader`); see
``docs/design.md`` for the package map.
"""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["loader", "__version__"]


def __getattr__(name: str) -> Any:
    # `fastload.loader` resolves on first use, so `import fastload` (and the CLI's --help) does not import torch.
    if name == "loader":
        from fastload.fastloader import loader

        return loader
    raise AttributeError(f"module 'fastload' has no attribute {name!r}")
