"""YOLOv9 / GELAN models: YAML parser, blocks, heads, re-parameterisation."""
from .heads import DDetect, DualDDetect
from .yolo import (CFG_DIR, DetectionModel, build_model, count_flops, count_params, load_cfg, reparameterize,
                   resolve_cfg)

__all__ = ["CFG_DIR", "DetectionModel", "DDetect", "DualDDetect", "build_model", "count_flops", "count_params",
           "load_cfg", "reparameterize", "resolve_cfg"]
