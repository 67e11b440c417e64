"""Checkpoints: plain tensors/state_dicts plus JSON-able metadata, loadable with ``torch.load(weights_only=True)``.

Layout::

    {"model": state_dict, "ema": state_dict | None, "optimizer": state_dict | None, "scaler": state_dict | None,
     "rng": [per-rank generator states, yolov9.torch_utils.rng_state()] | None,
     "meta": {"epoch": int, "best_fitness": float, "ema_updates": int, "cfg": <model yaml dict>, "nc": int,
              "names": [str], "opt": {...}, "hyp": {...}, "date": str, "format": "fastload-yolov9/1",
              "progress": {...}}}

``meta["epoch"]`` is the last finished epoch (-1: none); ``meta["progress"]`` (written by ``yolov9.train``) is
where the run continues: the epoch, the batches of it done, the optimizer-step counters, the running loss
and the fastload loader's ``state_dict()`` for a checkpoint taken mid-epoch.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from .models.yolo import DetectionModel

__all__ = ["FORMAT", "jsonable", "save_checkpoint", "read_checkpoint", "load_model", "nc_of_state_dict"]

FORMAT = "fastload-yolov9/1"


def jsonable(obj: Any) -> Any:
    """Recursively turn Paths/tuples/numpy scalars into JSON types; fails loudly on anything else."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalar
        return obj.item()
    raise TypeError(f"cannot store {type(obj).__name__} in checkpoint metadata")


def save_checkpoint(path: str | Path, *, model: torch.nn.Module, ema: Any = None, optimizer: torch.optim.Optimizer | None = None,
                    scaler: Any = None, rng: list[dict] | None = None, meta: dict) -> None:
    """Write atomically: into ``<name>.tmp`` in the same folder, flushed to disk, then renamed over ``path``.

    A writer killed at any point leaves ``path`` as it was (the previous checkpoint, or none) and at most a
    partial ``<name>.tmp``, which nothing reads (``--resume`` looks for ``last.pt``) and the next save replaces.
    The rename is preceded by an fsync of the file and followed by one of the folder, so that a machine that
    goes down after the rename finds the new checkpoint whole, not a renamed file whose data never reached disk.
    """
    meta = jsonable(dict(meta, format=FORMAT, date=_dt.datetime.now().isoformat(timespec="seconds")))
    json.dumps(meta)  # proves the metadata is JSON-able
    ckpt = {
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "ema": None if ema is None else {k: v.detach().cpu() for k, v in ema.state_dict().items()},
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "scaler": None if scaler is None else scaler.state_dict(),
        "rng": rng,
        "meta": meta,
    }
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(ckpt, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def read_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict:
    """``torch.load(weights_only=True)`` with a clear error for missing, truncated and foreign (pickled-model) files."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {path} not found")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip whose directory comes last: a cut file has none
        raise ValueError(f"{path}: not a whole checkpoint file (truncated, or a write that was interrupted)")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise ValueError(f"{path}: not a weights_only checkpoint (pickled model objects, e.g. the official "
                         f"YOLOv9 .pt files, are not loaded; convert them to a state_dict first): {e}") from e
    if isinstance(ckpt, dict) and "meta" not in ckpt and all(isinstance(v, torch.Tensor) for v in ckpt.values()):
        ckpt = {"model": ckpt, "ema": None, "optimizer": None, "scaler": None, "rng": None, "meta": {}}  # bare state_dict
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise ValueError(f"{path}: expected a checkpoint dict with a 'model' state_dict")
    return ckpt


def nc_of_state_dict(sd: dict[str, torch.Tensor]) -> int | None:
    """Number of classes of a detector's state_dict: the output width of the head's first class conv."""
    heads = [k for k in sd if re.fullmatch(r"model\.\d+\.cv3\.0\.2\.bias", k)]
    if not heads:
        return None
    last = max(heads, key=lambda k: int(k.split(".")[1]))
    return int(sd[last].shape[0])


def load_model(weights: str | Path, cfg: str | Path | dict | None = None, nc: int | None = None,
               prefer_ema: bool = True) -> tuple[DetectionModel, dict]:
    """Build the model recorded in a checkpoint (or ``cfg`` for bare state_dicts) and load its weights.

    The number of classes is ``nc``, else the one recorded in the checkpoint, else the one the weights have.
    """
    ckpt = read_checkpoint(weights)
    meta = ckpt.get("meta") or {}
    model_cfg = cfg if cfg is not None else meta.get("cfg")
    if model_cfg is None:
        raise ValueError(f"{weights}: no model config recorded; pass --cfg")
    sd = ckpt["ema"] if prefer_ema and ckpt.get("ema") is not None else ckpt["model"]
    if nc is None:
        nc = meta.get("nc") or nc_of_state_dict(sd)
    model = DetectionModel(model_cfg, nc=nc)
    width = int(model.head.cv3[0][0].conv.weight.shape[0])
    saved = sd.get(f"model.{len(model.model) - 1}.cv3.0.0.conv.weight")
    if saved is not None and int(saved.shape[0]) != width:  # weights made with another class-tower rule
        model_cfg = dict(model.yaml, cls_width=int(saved.shape[0]))
        model = DetectionModel(model_cfg, nc=nc)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k != f"model.{len(model.model) - 1}.stride"]  # official weights lack it; the
    if missing or unexpected:                                                     # build computed it already
        raise ValueError(f"{weights}: weights do not fit the model config "
                         f"(missing {list(missing)[:5]}..., unexpected {list(unexpected)[:5]}...)")
    if meta.get("names"):
        model.names = list(meta["names"])
    return model, ckpt
