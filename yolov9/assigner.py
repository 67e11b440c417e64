"""Task-aligned label assignment (TOOD / YOLOv9): each ground truth takes the top-k anchors by
``score^alpha * IoU^beta`` among the anchors whose centre lies inside it; soft targets are rescaled so that
each ground truth's best anchor gets its best IoU.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .boxes import bbox_iou

__all__ = ["TaskAlignedAssigner"]


class TaskAlignedAssigner(nn.Module):
    """Assign ground truths to anchors. Defaults are YOLOv9's: top-k 10, alpha 0.5, beta 6.0."""

    def __init__(self, num_classes: int, topk: int = 10, alpha: float = 0.5, beta: float = 6.0,
                 eps: float = 1e-9) -> None:
        super().__init__()
        self.nc, self.topk, self.alpha, self.beta, self.eps = num_classes, topk, alpha, beta, eps

    @torch.no_grad()
    def forward(self, pd_scores: torch.Tensor, pd_bboxes: torch.Tensor, anc_points: torch.Tensor,
                gt_labels: torch.Tensor, gt_bboxes: torch.Tensor, mask_gt: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Shapes: scores ``[B, A, nc]`` (probabilities), boxes ``[B, A, 4]`` xyxy, anchors ``[A, 2]``,
        gt labels ``[B, M, 1]``, gt boxes ``[B, M, 4]`` xyxy, mask ``[B, M, 1]`` (1 = real ground truth).

        Returns ``(target_labels [B, A], target_bboxes [B, A, 4], target_scores [B, A, nc], fg_mask [B, A] bool,
        target_gt_idx [B, A])``.
        """
        b, a, _ = pd_scores.shape
        m = gt_bboxes.shape[1]
        dev = pd_scores.device
        if m == 0:
            return (torch.zeros(b, a, dtype=torch.long, device=dev), torch.zeros_like(pd_bboxes),
                    torch.zeros_like(pd_scores), torch.zeros(b, a, dtype=torch.bool, device=dev),
                    torch.zeros(b, a, dtype=torch.long, device=dev))

        in_gts = self._centres_inside(anc_points, gt_bboxes) * mask_gt  # [B, M, A]
        overlaps = bbox_iou(gt_bboxes.unsqueeze(2), pd_bboxes.unsqueeze(1), ciou=True).squeeze(-1).clamp_(0)
        overlaps = overlaps * in_gts
        labels = gt_labels.long().squeeze(-1).clamp_(0, self.nc - 1)  # [B, M]
        scores = pd_scores.gather(2, labels.unsqueeze(1).expand(b, a, m)).transpose(1, 2)  # [B, M, A]
        align = scores.pow(self.alpha) * overlaps.pow(self.beta) * in_gts

        k = min(self.topk, a)
        top_idx = align.topk(k, dim=-1).indices  # [B, M, k]
        in_topk = torch.zeros_like(align).scatter_(-1, top_idx, 1.0)
        mask_pos = in_topk * in_gts  # [B, M, A]

        # An anchor claimed by several ground truths keeps the one it overlaps most.
        fg = mask_pos.sum(1)  # [B, A]
        if (fg > 1).any():
            best = F.one_hot(overlaps.argmax(1), m).permute(0, 2, 1).to(mask_pos.dtype)  # [B, M, A]
            mask_pos = torch.where((fg > 1).unsqueeze(1), best, mask_pos)
            fg = mask_pos.sum(1)
        gt_idx = mask_pos.argmax(1)  # [B, A]
        fg_mask = fg > 0

        flat = gt_idx + torch.arange(b, device=dev).unsqueeze(1) * m
        t_labels = labels.flatten()[flat]  # [B, A]
        t_bboxes = gt_bboxes.reshape(-1, 4)[flat]  # [B, A, 4]
        t_scores = F.one_hot(t_labels, self.nc).to(pd_scores.dtype) * fg_mask.unsqueeze(-1)

        align = align * mask_pos
        best_align = align.amax(-1, keepdim=True)  # [B, M, 1]
        best_iou = (overlaps * mask_pos).amax(-1, keepdim=True)
        norm = (align * best_iou / (best_align + self.eps)).amax(1)  # [B, A]
        t_scores = t_scores * norm.unsqueeze(-1)
        return t_labels, t_bboxes, t_scores, fg_mask, gt_idx

    def _centres_inside(self, points: torch.Tensor, gt_bboxes: torch.Tensor) -> torch.Tensor:
        """``[B, M, A]`` 1.0 where anchor centre ``points[a]`` lies strictly inside ground truth ``m``."""
        lt = points.view(1, 1, -1, 2) - gt_bboxes[..., None, :2]
        rb = gt_bboxes[..., None, 2:] - points.view(1, 1, -1, 2)
        return (torch.cat((lt, rb), -1).amin(-1) > self.eps).to(gt_bboxes.dtype)
