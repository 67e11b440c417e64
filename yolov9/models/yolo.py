"""YAML model definitions (official YOLOv9 schema) -> ``DetectionModel``; PGI re-parameterisation; fusion; size.

Schema: ``nc``, ``depth_multiple``, ``width_multiple``, ``backbone`` and ``head`` lists of
``[from, number, module, args]``. ``from`` is ``-1`` (previous layer), a negative offset, an absolute layer
index, or a list of those. Layer 0 sees the input image. Optional ``cls_width``: the class-tower width of the
detection head (default: see :mod:`yolov9.models.heads`). Other top-level keys (``anchors``) are ignored.
"""
from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import yaml

from . import common as C
from .heads import DDetect, DualDDetect

__all__ = ["CFG_DIR", "resolve_cfg", "load_cfg", "DetectionModel", "reparameterize", "count_params",
           "count_flops", "build_model"]

CFG_DIR = Path(__file__).resolve().parents[1] / "cfg"


def resolve_cfg(cfg: str | Path) -> Path:
    """A path that exists, or a bare name (``yolov9-s``, ``yolov9-s.yaml``) of a bundled config."""
    p = Path(cfg)
    if p.is_file():
        return p
    name = p.name if p.suffix in (".yaml", ".yml") else p.name + ".yaml"
    bundled = CFG_DIR / name
    if bundled.is_file():
        return bundled
    known = ", ".join(sorted(q.stem for q in CFG_DIR.glob("*.yaml")))
    raise FileNotFoundError(f"model config {cfg!s} not found (not a file, not a bundled config; bundled: {known})")


def load_cfg(cfg: str | Path | dict) -> dict:
    """Read a model YAML (or copy a dict) and check the keys the parser needs."""
    if isinstance(cfg, dict):
        d = copy.deepcopy(cfg)
        src = "<dict>"
    else:
        path = resolve_cfg(cfg)
        src = str(path)
        with open(path, encoding="utf-8") as f:
            d = yaml.safe_load(f)
        if not isinstance(d, dict):
            raise ValueError(f"{src}: model config must be a YAML mapping")
        d.setdefault("yaml_file", path.name)
    for key in ("backbone", "head"):
        if not isinstance(d.get(key), list):
            raise ValueError(f"{src}: model config needs a '{key}' list of [from, number, module, args]")
    d.setdefault("depth_multiple", 1.0)
    d.setdefault("width_multiple", 1.0)
    return d


def _make_divisible(x: float, divisor: int = 8) -> int:
    return int(math.ceil(x / divisor) * divisor)


# Modules whose first argument is an output width (scaled by width_multiple like the official parser).
_WIDTH_FIRST = {"Conv", "AConv", "ADown", "RepNCSPELAN4", "ELAN1", "SPPELAN", "RepConvN"}
# Trailing hidden-width arguments; scaled only when width_multiple != 1 so that official configs
# with widths that are not multiples of 8 (yolov9-m: 180) build exactly.
_HIDDEN_WIDTHS = {"RepNCSPELAN4": 2, "ELAN1": 2, "SPPELAN": 1}
_MODULES: dict[str, type[nn.Module]] = {
    "Conv": C.Conv, "RepConvN": C.RepConvN, "RepNCSPELAN4": C.RepNCSPELAN4, "ELAN1": C.ELAN1,
    "AConv": C.AConv, "ADown": C.ADown, "SPPELAN": C.SPPELAN, "CBLinear": C.CBLinear, "CBFuse": C.CBFuse,
    "Concat": C.Concat, "Silence": C.Silence, "Upsample": nn.Upsample, "nn.Upsample": nn.Upsample,
    "DDetect": DDetect, "DualDDetect": DualDDetect,
}


_NAMED_ARGS = {"None": None, "True": True, "False": False}


def _resolve_arg(a: Any, nc: int) -> Any:
    """Official configs write Python names as YAML strings (``None``, ``nc``); resolve those, keep the rest."""
    if isinstance(a, str):
        if a == "nc":
            return nc
        return _NAMED_ARGS.get(a, a)
    return a


def _parse(d: dict, ch_in: int) -> tuple[nn.Sequential, set[int]]:
    """Build the layer list; each layer gets ``.i`` (index), ``.f`` (from) and ``.type`` (YAML name)."""
    nc, gd, gw = d["nc"], float(d["depth_multiple"]), float(d["width_multiple"])
    wscale = (lambda c: int(c)) if gw == 1.0 else (lambda c: _make_divisible(c * gw, 8))
    layers, save, ch = [], set(), []  # ch[j]: output channels of layer j
    for i, row in enumerate(d["backbone"] + d["head"]):
        if not (isinstance(row, (list, tuple)) and len(row) == 4):
            raise ValueError(f"layer {i}: expected [from, number, module, args], got {row!r}")
        f, n, name, args = row
        if name not in _MODULES:
            raise ValueError(f"layer {i}: unknown module {name!r} (supported: {', '.join(sorted(_MODULES))})")
        args = [_resolve_arg(a, nc) for a in (args or [])]
        froms = [f] if isinstance(f, int) else list(f)
        abs_from = [x if x >= 0 else i + x for x in froms]
        for x in abs_from:
            if not (-1 <= x < i) or (x == -1 and i != 0):
                raise ValueError(f"layer {i}: 'from' {f!r} refers to a layer that does not exist yet")
        cin = [ch_in if x == -1 else ch[x] for x in abs_from]  # -1 only at layer 0: the image
        n = max(round(n * gd), 1) if n > 1 else n
        if name in _WIDTH_FIRST:
            c2 = _make_divisible(args[0] * gw, 8)
            rest = list(args[1:])
            for k in range(_HIDDEN_WIDTHS.get(name, 0)):
                rest[k] = wscale(rest[k])
            if name == "RepNCSPELAN4" and len(rest) > 2 and gd != 1.0:
                rest[2] = max(round(rest[2] * gd), 1)
            args = [cin[0], c2, *rest]
        elif name == "CBLinear":
            c2 = [wscale(c) for c in args[0]]  # a list: CBFuse picks chunks by position
            args = [cin[0], c2, *args[1:]]
        elif name == "CBFuse":
            c2 = cin[-1]
        elif name == "Concat":
            c2 = sum(cin)
        elif name in ("DDetect", "DualDDetect"):
            args = [args[0] if args else nc, cin, d.get("cls_width")]
            c2 = None
        else:  # Silence, Upsample keep the channel count
            c2 = cin[0]
        cls = _MODULES[name]
        m = nn.Sequential(*(cls(*args) for _ in range(n))) if n > 1 else cls(*args)
        m.i, m.f, m.type = i, (abs_from[0] if isinstance(f, int) else abs_from), name
        save.update(x for x in abs_from if x != i - 1 and x >= 0)
        layers.append(m)
        ch.append(c2)
    return nn.Sequential(*layers), save


class DetectionModel(nn.Module):
    """A YOLOv9/GELAN detector built from a YAML config (path, bundled name or dict)."""

    def __init__(self, cfg: str | Path | dict = "yolov9-s.yaml", ch: int = 3, nc: int | None = None) -> None:
        super().__init__()
        self.yaml = load_cfg(cfg)
        if nc is not None:
            self.yaml["nc"] = int(nc)
        if "nc" not in self.yaml:
            raise ValueError("model config has no 'nc' and none was given")
        self.yaml["ch"] = ch
        self.model, self.save = _parse(self.yaml, ch)
        self.names = [str(k) for k in range(self.yaml["nc"])]
        head = self.model[-1]
        if not isinstance(head, DDetect):
            raise ValueError("the last layer of a model config must be DDetect or DualDDetect")
        self._init_strides(ch)
        self._init_weights()
        head.bias_init()

    @property
    def head(self) -> DDetect:
        return self.model[-1]

    @property
    def nc(self) -> int:
        return self.head.nc

    @property
    def stride(self) -> torch.Tensor:
        return self.head.stride

    @property
    def is_dual(self) -> bool:
        return isinstance(self.head, DualDDetect)

    def _init_strides(self, ch: int) -> None:
        # The official model finds its strides with one train-mode forward pass of a 256 x 256 zero image before
        # its BN layers get momentum 0.03: that pass leaves running_var at 0.9 (0.1 x the batch variance, 0, plus
        # 0.9 x 1) and, behind biased convs (CBLinear), non-zero running means. The same pass here (same size,
        # momentum 0.1) starts every BN buffer where the official one starts.
        s = 256
        bns = [m for m in self.modules() if isinstance(m, nn.BatchNorm2d)]
        momenta = [m.momentum for m in bns]
        was = self.training
        self.train()
        for m in bns:
            m.momentum = 0.1  # PyTorch's default, which the official layers have at that moment
        with torch.no_grad():
            out = self.forward(torch.zeros(1, ch, s, s))
        for m, mom in zip(bns, momenta):
            m.momentum = mom
        feats = out[0] if self.is_dual else out
        self.head.stride.copy_(torch.tensor([s / f.shape[-2] for f in feats]))
        self.train(was)

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.SiLU):
                m.inplace = True

    def forward(self, x: torch.Tensor) -> Any:
        outs: list[Any] = []
        for m in self.model:
            if isinstance(m.f, list):
                inp = [x if j == m.i - 1 else outs[j] for j in m.f]
            elif m.f != m.i - 1:
                inp = outs[m.f]
            else:
                inp = x
            x = m(inp)
            outs.append(x if m.i in self.save else None)
        return x

    def fuse(self) -> "DetectionModel":
        """Fold BN into convs and merge RepConvN branches (inference only; call after ``eval()``)."""
        for m in self.modules():
            if isinstance(m, (C.RepConvN, C.Conv)) and hasattr(m, "fuse"):
                m.fuse()
        return self


def _needed_layers(model: DetectionModel, heads_from: list[int]) -> set[int]:
    need, stack = set(), list(heads_from)
    while stack:
        j = stack.pop()
        if j < 0 or j in need:
            continue
        need.add(j)
        m = model.model[j]
        stack.extend(m.f if isinstance(m.f, list) else [m.f])
    return need


def reparameterize(model: DetectionModel) -> DetectionModel:
    """Drop the PGI auxiliary branch: a plain DDetect model with the main branch's weights.

    The kept layers are those the main head inputs depend on; they are re-indexed in order, the new config
    is recorded in ``.yaml`` (so the result saves and reloads like any GELAN model). Non-dual models are
    returned as a copy.
    """
    if not model.is_dual:
        return copy.deepcopy(model)
    dual: DualDDetect = model.head
    main_from = dual.f[dual.nl:] if isinstance(dual.f, list) else [dual.f]
    keep = sorted(_needed_layers(model, main_from))
    remap = {old: new for new, old in enumerate(keep)}
    rows = model.yaml["backbone"] + model.yaml["head"]

    def relink(f, old_i):  # absolute indices in the new numbering; -1 (the image) stays -1
        fs = [f] if isinstance(f, int) else list(f)
        out = [-1 if (x if x >= 0 else old_i + x) == -1 else remap[x if x >= 0 else old_i + x] for x in fs]
        return out[0] if isinstance(f, int) else out

    new_rows = []
    for old in keep:
        f, n, name, args = rows[old]
        new_rows.append([relink(f, old), n, name, args])
    heads_new = [remap[x] for x in main_from]
    new_rows.append([heads_new, 1, "DDetect", ["nc"]])
    cfg = {k: v for k, v in model.yaml.items() if k not in ("backbone", "head")}
    cfg["backbone"], cfg["head"] = new_rows, []
    cfg["yaml_file"] = f"{Path(str(model.yaml.get('yaml_file', 'model'))).stem}-converted"
    single = DetectionModel(cfg, ch=model.yaml.get("ch", 3))
    single.names = list(model.names)
    src = model.state_dict()
    dst = single.state_dict()
    for k in dst:
        parts = k.split(".")
        new_i = int(parts[1])
        if new_i < len(keep):
            parts[1] = str(keep[new_i])
        else:  # head: cv2/cv3/dfl <- cv4/cv5/dfl2 of the dual head
            parts[1] = str(len(rows) - 1)
            parts[2] = {"cv2": "cv4", "cv3": "cv5", "dfl": "dfl2"}.get(parts[2], parts[2])
        dst[k] = src[".".join(parts)]
    single.load_state_dict(dst)
    return single.train(model.training)


def count_params(model: nn.Module) -> int:
    """Number of parameters (DFL's fixed bin weights included, as the published figures do)."""
    return sum(p.numel() for p in model.parameters())


def count_flops(model: nn.Module, imgsz: int = 640) -> float:
    """GFLOPs (2 x multiply-adds) of one forward pass at ``imgsz`` x ``imgsz``, counted on the meta device."""
    from torch.utils.flop_counter import FlopCounterMode

    # Train mode: the head returns its raw maps (decoding is negligible and needs real stride values).
    m = copy.deepcopy(model).train().to("meta")
    x = torch.zeros(1, 3, imgsz, imgsz, device="meta")
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        m(x)
    return counter.get_total_flops() / 1e9


def build_model(cfg: str | Path | dict, nc: int | None = None) -> DetectionModel:
    """Convenience factory: ``DetectionModel(cfg, nc=nc)``."""
    return DetectionModel(cfg, nc=nc)
