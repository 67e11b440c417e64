"""Anchor-free decoupled detection heads: DDetect (one branch) and DualDDetect (PGI: auxiliary + main branch).

Training mode returns the raw per-level maps ``[B, 4*reg_max + nc, H, W]`` (a list for DDetect, a pair of lists
``[aux, main]`` for DualDDetect). Eval mode returns ``(y, raw)`` where ``y`` is the *main* branch decoded to
``[B, 4 + nc, A]`` (xywh in input pixels, class probabilities), so that inference code never needs to know
whether the auxiliary branch is present.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn as nn

from .common import DFL, Conv

__all__ = ["DDetect", "DualDDetect", "make_anchors", "dist2bbox", "REG_MAX"]

REG_MAX = 16


def make_anchors(feats: Sequence[torch.Tensor], strides: torch.Tensor, offset: float = 0.5
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Grid-cell centres of every level (in grid units) ``[A, 2]`` and their strides ``[A, 1]``."""
    points, stride_list = [], []
    for f, s in zip(feats, strides):
        h, w = f.shape[2:]
        sy = torch.arange(h, device=f.device, dtype=f.dtype) + offset
        sx = torch.arange(w, device=f.device, dtype=f.dtype) + offset
        yy, xx = torch.meshgrid(sy, sx, indexing="ij")
        points.append(torch.stack((xx, yy), -1).view(-1, 2))
        stride_list.append(torch.full((h * w, 1), float(s), dtype=f.dtype, device=f.device))
    return torch.cat(points), torch.cat(stride_list)


def dist2bbox(distance: torch.Tensor, anchor_points: torch.Tensor, xywh: bool = True, dim: int = -1) -> torch.Tensor:
    """(left, top, right, bottom) distances from anchor points to boxes (xywh or xyxy)."""
    lt, rb = distance.chunk(2, dim)
    x1y1 = anchor_points - lt
    x2y2 = anchor_points + rb
    if xywh:
        return torch.cat(((x1y1 + x2y2) / 2, x2y2 - x1y1), dim)
    return torch.cat((x1y1, x2y2), dim)


def _make_divisible(x: float, divisor: int) -> int:
    return int(math.ceil(x / divisor) * divisor)


def class_tower_width(ch0: int, nc: int) -> int:
    """Default class-tower width of a head whose first level has ``ch0`` channels."""
    return max(ch0, min(nc, 100))


def _branch(ch: Sequence[int], nc: int, reg_max: int, c_cls: int | None = None) -> tuple[nn.ModuleList, nn.ModuleList]:
    """Box and class towers for each level; widths follow from the first level's channels.

    Class-tower width ``max(ch[0], min(nc, 100))`` unless ``c_cls`` is given: with it the converted T/S/M/C/E
    models reproduce all five published sizes (T 2.0M / 7.7 GFLOPs). The official code at the pinned commit
    uses ``max(ch[0], min(2 * nc, 128))``, which differs only for T with more than 32 classes (T at 80 classes:
    2.4M / 9.8G); a model config's ``cls_width`` key builds that (or any) width.
    """
    c_box = _make_divisible(max(ch[0] // 4, reg_max * 4, 16), 4)
    c_cls = c_cls or class_tower_width(ch[0], nc)
    box = nn.ModuleList(
        nn.Sequential(Conv(c, c_box, 3), Conv(c_box, c_box, 3, g=4), nn.Conv2d(c_box, 4 * reg_max, 1, groups=4))
        for c in ch)
    cls = nn.ModuleList(
        nn.Sequential(Conv(c, c_cls, 3), Conv(c_cls, c_cls, 3), nn.Conv2d(c_cls, nc, 1)) for c in ch)
    return box, cls


def _init_bias(box: nn.ModuleList, cls: nn.ModuleList, strides: torch.Tensor, nc: int) -> None:
    # Box logits start flat; class logits start at the prior "about 5 objects per 640x640 image".
    for b, c, s in zip(box, cls, strides):
        b[-1].bias.data.fill_(1.0)
        c[-1].bias.data[:nc] = math.log(5 / nc / (640 / float(s)) ** 2)


class DDetect(nn.Module):
    """Single-branch head over ``len(ch)`` levels."""

    n_branches = 1

    def __init__(self, nc: int = 80, ch: Sequence[int] = (), cls_width: int | None = None) -> None:
        super().__init__()
        if len(ch) % self.n_branches:
            raise ValueError(f"{type(self).__name__} needs {self.n_branches} equal groups of inputs, got {len(ch)}")
        self.nc = nc
        self.nl = len(ch) // self.n_branches
        self.reg_max = REG_MAX
        self.no = nc + 4 * self.reg_max
        self.register_buffer("stride", torch.zeros(self.nl), persistent=True)
        # Creation order as in the official heads (all towers, then the DFL integrals): each module's default
        # initialisation draws from the global RNG, so the order decides which weights a given seed gives.
        self.cv2, self.cv3 = _branch(ch[:self.nl], nc, self.reg_max, cls_width)
        if self.n_branches == 2:
            self.cv4, self.cv5 = _branch(ch[self.nl:], nc, self.reg_max, cls_width)
        self.dfl = DFL(self.reg_max)
        if self.n_branches == 2:
            self.dfl2 = DFL(self.reg_max)
        self._anchor_key: tuple | None = None

    def _run(self, xs: Sequence[torch.Tensor], box: nn.ModuleList, cls: nn.ModuleList) -> list[torch.Tensor]:
        return [torch.cat((box[i](xs[i]), cls[i](xs[i])), 1) for i in range(self.nl)]

    def decode(self, feats: Sequence[torch.Tensor], dfl: DFL) -> torch.Tensor:
        """Raw maps -> ``[B, 4 + nc, A]`` (xywh pixels, sigmoid scores)."""
        b = feats[0].shape[0]
        key = tuple(f.shape[2:] for f in feats) + (feats[0].device, feats[0].dtype)
        if key != self._anchor_key:
            pts, st = make_anchors(feats, self.stride, 0.5)
            self.anchors, self.strides = pts.transpose(0, 1), st.transpose(0, 1)
            self._anchor_key = key
        x = torch.cat([f.view(b, self.no, -1) for f in feats], 2)
        box, cls = x.split((4 * self.reg_max, self.nc), 1)
        dbox = dist2bbox(dfl(box), self.anchors.unsqueeze(0), xywh=True, dim=1) * self.strides
        return torch.cat((dbox, cls.sigmoid()), 1)

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        feats = self._run(xs, self.cv2, self.cv3)
        if self.training:
            return feats
        return self.decode(feats, self.dfl), feats

    def bias_init(self) -> None:
        _init_bias(self.cv2, self.cv3, self.stride, self.nc)


class DualDDetect(DDetect):
    """PGI head: inputs ``[aux P3, aux P4, aux P5, main P3, main P4, main P5]``.

    ``cv2/cv3`` serve the auxiliary (reversible) branch, ``cv4/cv5`` the main branch. Only the main branch is
    used for inference; :func:`yolov9.models.yolo.reparameterize` turns the model into a plain DDetect one.
    """

    n_branches = 2

    def forward(  # type: ignore[override]
        self, xs: list[torch.Tensor]
    ) -> list[list[torch.Tensor]] | tuple[torch.Tensor, list[list[torch.Tensor]]]:
        aux = self._run(xs[:self.nl], self.cv2, self.cv3)
        main = self._run(xs[self.nl:], self.cv4, self.cv5)
        if self.training:
            return [aux, main]
        return self.decode(main, self.dfl2), [aux, main]

    def bias_init(self) -> None:
        _init_bias(self.cv2, self.cv3, self.stride, self.nc)
        _init_bias(self.cv4, self.cv5, self.stride, self.nc)
