"""Augmentation / training hyper-parameters (the YOLOv9 ``hyp`` dictionary).

:func:`load_hyp` accepts a yaml path, a dict or ``None`` and always returns a complete dict:
keys missing from the input are filled from YOLOv9's ``hyp.scratch-high.yaml`` defaults and
unknown keys are kept (the trainer reads loss and optimiser keys from the same dict).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import yaml

__all__ = ["HYP_SCRATCH_HIGH", "AUGMENT_KEYS", "load_hyp"]

#: YOLOv9 ``data/hyps/hyp.scratch-high.yaml`` (the official file repeats ``dfl``; one copy here).
HYP_SCRATCH_HIGH: dict[str, float] = {
    "lr0": 0.01,
    "lrf": 0.01,
    "momentum": 0.937,
    "weight_decay": 0.0005,
    "warmup_epochs": 3.0,
    "warmup_momentum": 0.8,
    "warmup_bias_lr": 0.1,
    "box": 7.5,
    "cls": 0.5,
    "cls_pw": 1.0,
    "obj": 0.7,
    "obj_pw": 1.0,
    "dfl": 1.5,
    "iou_t": 0.20,
    "anchor_t": 5.0,
    "fl_gamma": 0.0,
    "hsv_h": 0.015,
    "hsv_s": 0.7,
    "hsv_v": 0.4,
    "degrees": 0.0,
    "translate": 0.1,
    "scale": 0.9,
    "shear": 0.0,
    "perspective": 0.0,
    "flipud": 0.0,
    "fliplr": 0.5,
    "mosaic": 1.0,
    "mixup": 0.15,
    "copy_paste": 0.3,
}

#: The keys the augmentation sampler reads (all must be numbers).
AUGMENT_KEYS: tuple[str, ...] = (
    "hsv_h", "hsv_s", "hsv_v", "degrees", "translate", "scale", "shear", "perspective",
    "flipud", "fliplr", "mosaic", "mixup",
)


def load_hyp(hyp: str | Path | Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A complete hyp dict from a yaml file, a mapping or ``None`` (scratch-high defaults).

    Raises:
        FileNotFoundError: the yaml file does not exist (the message names it).
        ValueError: the yaml is not a mapping, or an augmentation key is not a number.
    """
    source = "<dict>"
    if hyp is None:
        given: Mapping[str, Any] = {}
    elif isinstance(hyp, (str, Path)):
        path = Path(hyp)
        source = str(path)
        if not path.is_file():
            raise FileNotFoundError(f"hyp file not found: {path}")
        try:
            # PyYAML keeps the last value of a repeated key (the official file repeats ``dfl``).
            given = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid yaml ({exc})") from None
        if not isinstance(given, Mapping):
            raise ValueError(f"{path}: a hyp file must hold a mapping, got {type(given).__name__}")
    elif isinstance(hyp, Mapping):
        given = hyp
    else:
        raise TypeError(f"hyp must be a path, a mapping or None, got {type(hyp).__name__}")
    out: dict[str, Any] = dict(HYP_SCRATCH_HIGH)
    out.update(given)
    for key in AUGMENT_KEYS:
        value = out[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{source}: hyp[{key!r}] must be a number, got {value!r}")
        out[key] = float(value)
    return out
