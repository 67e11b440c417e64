"""fastload: object-detection data loading that keeps the GPU busy.

The public entry is :func:`fastload.loader`; see ``docs/design.md`` for the package map.
"""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["loader", "__version__"]


def loader(*args: Any, **kwargs: Any):
    """Build the YOLOv9-compatible training/validation loader; see :func:`fastload.loader.loader`."""
    from fastload.loader import loader as _loader

    return _loader(*args, **kwargs)
