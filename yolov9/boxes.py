"""Box maths shared by the loss, NMS, validation and drawing (torch tensors, last dim = 4)."""
from __future__ import annotations

import math

import torch

__all__ = ["xywh2xyxy", "xyxy2xywh", "box_iou", "bbox_iou", "bbox2dist", "clip_boxes", "scale_boxes_to_original"]


def xywh2xyxy(x: torch.Tensor) -> torch.Tensor:
    """(cx, cy, w, h) -> (x1, y1, x2, y2)."""
    c, wh = x[..., :2], x[..., 2:4] / 2
    return torch.cat((c - wh, c + wh), -1)


def xyxy2xywh(x: torch.Tensor) -> torch.Tensor:
    """(x1, y1, x2, y2) -> (cx, cy, w, h)."""
    return torch.cat(((x[..., :2] + x[..., 2:4]) / 2, x[..., 2:4] - x[..., :2]), -1)


def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pairwise IoU of xyxy boxes ``[N, 4]`` x ``[M, 4]`` -> ``[N, M]``."""
    lt = torch.max(a[:, None, :2], b[None, :, :2])
    rb = torch.min(a[:, None, 2:], b[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    area_a = (a[:, 2:] - a[:, :2]).clamp(min=0).prod(-1)
    area_b = (b[:, 2:] - b[:, :2]).clamp(min=0).prod(-1)
    return inter / (area_a[:, None] + area_b[None, :] - inter + 1e-9)


def bbox_iou(a: torch.Tensor, b: torch.Tensor, ciou: bool = False, eps: float = 1e-7) -> torch.Tensor:
    """Element-wise (broadcast) IoU or Complete-IoU of xyxy boxes; returns ``[..., 1]``.

    CIoU = IoU - centre distance^2 / enclosing diagonal^2 - alpha * v, v = 4/pi^2 (atan(w2/h2) - atan(w1/h1))^2.
    """
    ax1, ay1, ax2, ay2 = a.chunk(4, -1)
    bx1, by1, bx2, by2 = b.chunk(4, -1)
    w1, h1 = ax2 - ax1, (ay2 - ay1).clamp(min=eps)
    w2, h2 = bx2 - bx1, (by2 - by1).clamp(min=eps)
    inter = (torch.min(ax2, bx2) - torch.max(ax1, bx1)).clamp(min=0) * \
            (torch.min(ay2, by2) - torch.max(ay1, by1)).clamp(min=0)
    union = w1 * h1 + w2 * h2 - inter + eps
    iou = inter / union
    if not ciou:
        return iou
    cw = torch.max(ax2, bx2) - torch.min(ax1, bx1)
    ch = torch.max(ay2, by2) - torch.min(ay1, by1)
    c2 = cw ** 2 + ch ** 2 + eps
    rho2 = ((bx1 + bx2 - ax1 - ax2) ** 2 + (by1 + by2 - ay1 - ay2) ** 2) / 4
    v = (4 / math.pi ** 2) * (torch.atan(w2 / h2) - torch.atan(w1 / h1)) ** 2
    with torch.no_grad():
        alpha = v / (v - iou + (1 + eps))
    return iou - (rho2 / c2 + v * alpha)


def bbox2dist(anchor_points: torch.Tensor, bbox: torch.Tensor, reg_max: float) -> torch.Tensor:
    """xyxy boxes -> (left, top, right, bottom) distances from anchor points, clamped below ``reg_max``."""
    x1y1, x2y2 = bbox.chunk(2, -1)
    return torch.cat((anchor_points - x1y1, x2y2 - anchor_points), -1).clamp(0, reg_max - 0.01)


def clip_boxes(boxes: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
    """Clip xyxy boxes in place to an image of ``(h, w)``."""
    boxes[..., 0].clamp_(0, hw[1])
    boxes[..., 1].clamp_(0, hw[0])
    boxes[..., 2].clamp_(0, hw[1])
    boxes[..., 3].clamp_(0, hw[0])
    return boxes


def scale_boxes_to_original(boxes: torch.Tensor, shape: tuple, input_hw: tuple[int, int] | None = None) -> torch.Tensor:
    """Map xyxy boxes from the letterboxed network input back to the original image, in place.

    ``shape`` is the loader's per-image YOLOv9 tuple ``((h0, w0), ((gain_h, gain_w), (padw, padh)))``; when its
    second part is missing the gain and padding are derived from ``input_hw`` (letterbox, centred).
    """
    (h0, w0), rest = shape[0], (shape[1] if len(shape) > 1 else None)
    if rest is not None:
        (gh, gw), (pw, ph) = rest
    else:
        if input_hw is None:
            raise ValueError("shape lacks letterbox parameters and no input size was given")
        g = min(input_hw[0] / h0, input_hw[1] / w0)
        gh = gw = g
        pw, ph = (input_hw[1] - w0 * g) / 2, (input_hw[0] - h0 * g) / 2
    boxes[..., [0, 2]] -= pw
    boxes[..., [1, 3]] -= ph
    boxes[..., [0, 2]] /= gw
    boxes[..., [1, 3]] /= gh
    return clip_boxes(boxes, (h0, w0))
