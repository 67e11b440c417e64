"""fastload under Ultralytics' trainer (``pip install "fastload[ultralytics]"``)::

    from ultralytics import YOLO
    from fastload.compat.ultralytics import FastloadTrainer

    YOLO("yolov9t.yaml").train(data="data.yaml", trainer=FastloadTrainer, cache="ram",
                               fastload_engine="cpu")  # Ultralytics' own recipe by default

:class:`FastloadTrainer` (and :class:`FastloadValidator` for ``model.val(validator=...)``) build their
loaders with :func:`fastload.loader`, delivering Ultralytics' batch dict; each becomes the trainer (validator) of
the model's task: detect, segment, pose or obb (``classify`` is refused). Options:
:data:`~fastload.compat.ultralytics.options.OPTIONS`. User guide: ``docs/ultralytics.md``.
"""
from __future__ import annotations

from typing import Any

from fastload.compat.ultralytics.loader import UnsupportedArgument
from fastload.compat.ultralytics.options import OPTIONS, UltralyticsOptions

__all__ = ["FastloadTrainer", "FastloadValidator", "OPTIONS", "UltralyticsOptions", "UnsupportedArgument"]


def __getattr__(name: str) -> Any:
    if name in ("FastloadTrainer", "FastloadValidator"):
        try:
            # ultralytics is an optional dependency (the "ultralytics" extra)
            from fastload.compat.ultralytics import trainer
        except ModuleNotFoundError as e:
            if e.name != "ultralytics":
                raise
            raise ImportError(f"fastload.compat.ultralytics.{name} needs Ultralytics: "
                              'pip install "fastload[ultralytics]"') from None
        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
