"""Non-maximum suppression of decoded head outputs (torchvision.ops.batched_nms)."""
from __future__ import annotations

import torch

from .boxes import xywh2xyxy

__all__ = ["non_max_suppression"]


def non_max_suppression(pred: torch.Tensor, conf_thres: float = 0.001, iou_thres: float = 0.7, max_det: int = 300,
                        multi_label: bool = True, agnostic: bool = False, classes: list[int] | None = None,
                        max_candidates: int = 30000) -> list[torch.Tensor]:
    """``pred [B, 4 + nc, A]`` (xywh pixels, class probabilities) -> per image ``[n, 6]`` (x1, y1, x2, y2, score, cls).

    ``multi_label``: an anchor may yield one detection per class above ``conf_thres`` (validation); otherwise only
    its best class. ``agnostic``: suppress across classes. At most ``max_candidates`` boxes enter NMS per image.
    """
    if not 0 <= conf_thres <= 1 or not 0 <= iou_thres <= 1:
        raise ValueError(f"conf_thres and iou_thres must be in [0, 1], got {conf_thres}, {iou_thres}")
    if isinstance(pred, (list, tuple)):  # eval output (y, raw)
        pred = pred[0]
    # torchvision loads its model zoo and torch._dynamo on import (1-2 s of CPU): only a process that validates
    # pays it, not every DDP rank the trainer starts
    from torchvision.ops import batched_nms

    nc = pred.shape[1] - 4
    out = []
    for x in pred.transpose(1, 2):  # [A, 4 + nc]
        boxes = xywh2xyxy(x[:, :4])
        scores = x[:, 4:]
        if multi_label and nc > 1:
            i, j = (scores > conf_thres).nonzero(as_tuple=True)
            det = torch.cat((boxes[i], scores[i, j, None], j[:, None].float()), 1)
        else:
            conf, j = scores.max(1, keepdim=True)
            keep = conf.view(-1) > conf_thres
            det = torch.cat((boxes, conf, j.float()), 1)[keep]
        if classes is not None:
            det = det[(det[:, 5:6] == torch.tensor(classes, device=det.device)).any(1)]
        if det.shape[0] > max_candidates:
            det = det[det[:, 4].topk(max_candidates).indices]
        if det.shape[0]:
            groups = torch.zeros_like(det[:, 5]) if agnostic else det[:, 5]
            keep = batched_nms(det[:, :4].float(), det[:, 4].float(), groups, iou_thres)[:max_det]
            det = det[keep]
        out.append(det)
    return out
