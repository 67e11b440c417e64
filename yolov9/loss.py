"""YOLOv9 detection loss: task-aligned assignment, BCE classification, CIoU box loss and distribution focal loss,
summed over both PGI branches (auxiliary weighted 0.25, main 1.0) for dual-head models.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .assigner import TaskAlignedAssigner
from .boxes import bbox2dist, bbox_iou, xywh2xyxy
from .models.heads import dist2bbox, make_anchors

__all__ = ["DetectionLoss", "AUX_WEIGHT"]

AUX_WEIGHT = 0.25  # weight of the auxiliary (PGI) branch relative to the main branch


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") else model


class DetectionLoss:
    """``loss(preds, targets) -> (total * batch_size, tensor([box, cls, dfl]))``.

    ``preds`` is the training-mode output of the model (a list of level maps, or ``[aux, main]`` for dual heads),
    or the eval-mode ``(y, raw)`` tuple. ``targets`` is the loader's ``[N, 6]`` ``(image, cls, xc, yc, w, h)``
    normalised. Gains come from the hyp dict (``box``, ``cls``, ``dfl``; defaults 7.5, 0.5, 1.5).
    """

    def __init__(self, model: nn.Module, hyp: dict | None = None, topk: int = 10) -> None:
        m = _unwrap(model)
        head = m.model[-1]
        hyp = hyp or {}
        self.nc, self.reg_max = head.nc, head.reg_max
        self.stride = head.stride
        self.gains = (float(hyp.get("box", 7.5)), float(hyp.get("cls", 0.5)), float(hyp.get("dfl", 1.5)))
        eps = float(hyp.get("label_smoothing", 0.0))
        self.cls_pos, self.cls_neg = 1.0 - 0.5 * eps, 0.5 * eps  # label smoothing of BCE targets
        self.assigner = TaskAlignedAssigner(self.nc, topk=topk, alpha=0.5, beta=6.0)
        self.dual = head.n_branches == 2

    def __call__(self, preds, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(preds, tuple):  # eval-mode output (y, raw)
            preds = preds[1]
        branches: Sequence = preds if self.dual else [preds]
        weights = [AUX_WEIGHT, 1.0] if self.dual else [1.0]
        batch = branches[0][0].shape[0]
        total = torch.zeros(3, device=branches[0][0].device)
        for w, feats in zip(weights, branches):
            total = total + w * self._branch(feats, targets)
        gains = torch.tensor(self.gains, device=total.device)
        total = total * gains
        return total.sum() * batch, total.detach()

    def _targets(self, targets: torch.Tensor, batch: int, hw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[N, 6]`` -> labels ``[B, M, 1]`` and xyxy pixel boxes ``[B, M, 4]`` (zero-padded to the max count)."""
        dev = hw.device
        if targets.shape[0] == 0:
            return torch.zeros(batch, 0, 1, device=dev), torch.zeros(batch, 0, 4, device=dev)
        idx = targets[:, 0].long()
        counts = torch.bincount(idx, minlength=batch)
        m = int(counts.max())
        labels = torch.zeros(batch, m, 1, device=dev)
        boxes = torch.zeros(batch, m, 4, device=dev)
        order = torch.argsort(idx, stable=True)
        idx_sorted = idx[order]
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(len(idx), device=dev) - starts[idx_sorted]
        t = targets[order].to(dev)
        labels[idx_sorted, slot, 0] = t[:, 1]
        scale = torch.stack((hw[1], hw[0], hw[1], hw[0]))
        boxes[idx_sorted, slot] = xywh2xyxy(t[:, 2:6] * scale)
        return labels, boxes

    def _branch(self, feats: Sequence[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        b = feats[0].shape[0]
        x = torch.cat([f.float().view(b, self.nc + 4 * self.reg_max, -1) for f in feats], 2)
        pred_dist, pred_cls = x.split((4 * self.reg_max, self.nc), 1)
        pred_dist = pred_dist.permute(0, 2, 1).contiguous()  # [B, A, 4*reg_max]
        pred_cls = pred_cls.permute(0, 2, 1).contiguous()  # [B, A, nc]
        stride = self.stride.to(x.device)
        anchors, strides = make_anchors(feats, stride, 0.5)
        anchors, strides = anchors.float(), strides.float()
        hw = torch.tensor(feats[0].shape[2:], device=x.device, dtype=torch.float32) * stride[0]
        gt_labels, gt_boxes = self._targets(targets, b, hw)
        mask_gt = (gt_boxes.sum(2, keepdim=True) > 0).float()

        bins = torch.arange(self.reg_max, device=x.device, dtype=torch.float32)
        dist = pred_dist.view(b, -1, 4, self.reg_max).softmax(3) @ bins  # [B, A, 4] in grid units
        pred_boxes = dist2bbox(dist, anchors, xywh=False)  # grid units, xyxy

        _, t_boxes, t_scores, fg, _ = self.assigner(
            pred_cls.detach().sigmoid(), pred_boxes.detach() * strides, anchors * strides,
            gt_labels, gt_boxes, mask_gt)
        t_boxes = t_boxes / strides
        score_sum = t_scores.sum().clamp(min=1.0)

        cls_target = t_scores * (self.cls_pos - self.cls_neg) + self.cls_neg  # == t_scores without smoothing
        loss_cls = F.binary_cross_entropy_with_logits(pred_cls, cls_target, reduction="sum") / score_sum

        loss_box = torch.zeros((), device=x.device)
        loss_dfl = torch.zeros((), device=x.device)
        if fg.any():
            weight = t_scores.sum(-1)[fg].unsqueeze(-1)
            iou = bbox_iou(pred_boxes[fg], t_boxes[fg], ciou=True)
            loss_box = ((1.0 - iou) * weight).sum() / score_sum
            target_ltrb = bbox2dist(anchors.expand(b, -1, -1)[fg], t_boxes[fg], self.reg_max - 1)
            dfl = self._dfl(pred_dist[fg].view(-1, self.reg_max), target_ltrb) * weight
            loss_dfl = dfl.sum() / score_sum
        return torch.stack((loss_box, loss_cls, loss_dfl))

    def _dfl(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Distribution focal loss: cross-entropy to the two bins around each continuous target, linearly weighted."""
        left = target.long()
        right = left + 1
        w_left = right.float() - target
        w_right = 1.0 - w_left
        ce_l = F.cross_entropy(pred, left.view(-1), reduction="none").view(left.shape)
        ce_r = F.cross_entropy(pred, right.view(-1), reduction="none").view(left.shape)
        return (ce_l * w_left + ce_r * w_right).mean(-1, keepdim=True)
