"""The options fastload adds to Ultralytics' trainer, in one table.

Each option is a trainer override ``fastload_<name>=...`` (``model.train(..., fastload_engine="cpu")``,
taken out before Ultralytics checks its own arguments) and a ``FASTLOAD_*`` environment variable, the
fallback (and what DDP worker processes, which Ultralytics starts with its own arguments only, read).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from fastload.augment.params import RECIPES
from fastload.compat.options import Option, parse_choice, parse_optional_int, resolve_options
from fastload.compat.yolov9.options import OPTIONS as YOLOV9_OPTIONS
from fastload.compat.yolov9.options import CompatOptions

OWNER = "fastload.compat.ultralytics"
_SHARED = {o.name: o for o in YOLOV9_OPTIONS}


def _seed(value: Any) -> int | None:
    return None if value is None or str(value).strip().lower() in ("", "auto", "none") else int(value)


OPTIONS: tuple[Option, ...] = (
    _SHARED["engine"],
    Option("store", str, "auto",
           "auto | files | lmdb | disk | ram, or the data.yaml (or output folder) `fastload convert` wrote: its store "
           "for the split whose images the trainer asks for. auto: the trainer's cache decides (ram: a shared ram "
           "store; disk: the recorded disk store; False: the fastest recorded store, else the image files)"),
    _SHARED["hsv"],
    Option("seed", _seed, None, "seed of the order and of every augmentation draw (default: the trainer's seed)"),
    Option("num_workers", parse_optional_int, None,
           "loader worker processes; default: Ultralytics' rule min(CPUs / CUDA devices, workers, batches per epoch) "
           "(engine gpu: none, its host side is one thread)",
           short="workers"),
    _SHARED["device"],
    _SHARED["reduced_decode"],
    _SHARED["partners"],
    _SHARED["strict"],
    _SHARED["batch_log"],
    Option("recipe", parse_choice(RECIPES), "ultralytics",
           f"the augmentation recipe of training batches ({', '.join(RECIPES)}), drawn with the trainer's "
           "hyperparameter values: ultralytics: Ultralytics' loaded image, mosaic (partners from its buffer of recent "
           "images, or the dataset with cache='ram'), perspective, mixup, additive-hue HSV and flips; yolov9: YOLOv9's"),
)


def override_key(opt: Option) -> str:
    """The trainer override of ``opt``: ``fastload_`` and the name its environment variable has."""
    return "fastload_" + (opt.short or opt.name)


@dataclasses.dataclass(frozen=True)
class UltralyticsOptions(CompatOptions):
    """The resolved options of one trainer or validator (see :data:`OPTIONS`): the YOLOv9 layer's, with the
    trainer's seed as the default seed and the augmentation ``recipe``."""

    seed: int | None = None  # type: ignore[assignment]  # None: the trainer's seed
    recipe: str = "ultralytics"

    @classmethod
    def resolve(cls, overrides: Mapping[str, Any],  # type: ignore[override]
                environ: Mapping[str, str] | None = None) -> "UltralyticsOptions":
        """Override (``fastload_<name>``) > ``FASTLOAD_*`` environment variable > default, each value checked."""
        by_key = {override_key(o): o.name for o in OPTIONS}
        strays = sorted(k for k in overrides if k not in by_key)
        if strays:
            raise TypeError(f"{OWNER}: unknown fastload override(s) {', '.join(strays)}; known: {', '.join(by_key)}")
        keywords = {by_key[k]: v for k, v in overrides.items()}
        return cls(**resolve_options(OPTIONS, keywords, environ, owner=OWNER, unknown=f"{OWNER}: unknown option(s)"))


def override_environment(overrides: Mapping[str, Any]) -> dict[str, str]:
    """The ``FASTLOAD_*`` variables that carry the fastload ``overrides`` to another process (a DDP worker)."""
    by_key = {override_key(o): o for o in OPTIONS}
    return {by_key[k].env: str(v) for k, v in overrides.items() if k in by_key and v is not None}
