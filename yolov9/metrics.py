"""Detection metrics: COCO-style greedy matching and 101-point interpolated AP, plus P/R at the best-F1 threshold.

The matching and the AP follow the COCO evaluation protocol (detections taken by descending score per image and
class, each matched to the unmatched ground truth of highest IoU >= threshold; precision envelope sampled at 101
recall points), so that mAP agrees with pycocotools on the same boxes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["IOU_THRESHOLDS", "match_detections", "DetectionMetrics", "ap_per_class", "box_iou_np"]

IOU_THRESHOLDS = np.linspace(0.5, 0.95, 10)
RECALL_POINTS = np.linspace(0.0, 1.0, 101)


def box_iou_np(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pairwise IoU of xyxy boxes ``[N, 4]`` x ``[M, 4]``."""
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.clip(rb - lt, 0, None).prod(-1)
    area_a = np.clip(a[:, 2:] - a[:, :2], 0, None).prod(-1)
    area_b = np.clip(b[:, 2:] - b[:, :2], 0, None).prod(-1)
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


def match_detections(det_boxes: np.ndarray, det_scores: np.ndarray, det_cls: np.ndarray, gt_boxes: np.ndarray,
                     gt_cls: np.ndarray, iouv: np.ndarray = IOU_THRESHOLDS) -> np.ndarray:
    """True-positive flags ``[n_det, n_iou]`` for one image (COCO greedy matching, per class, by score)."""
    n, t = len(det_boxes), len(iouv)
    correct = np.zeros((n, t), dtype=bool)
    if n == 0 or len(gt_boxes) == 0:
        return correct
    iou = box_iou_np(det_boxes, gt_boxes)
    iou = np.where(det_cls[:, None] == gt_cls[None, :], iou, -1.0)  # other classes never match
    matched = np.zeros((t, len(gt_boxes)), dtype=bool)
    for d in np.argsort(-det_scores, kind="mergesort"):
        cand = np.where((iou[d][None, :] >= iouv[:, None]) & ~matched, iou[d][None, :], -1.0)  # [T, G]
        best = cand.argmax(1)
        ok = cand[np.arange(t), best] >= 0
        matched[np.arange(t)[ok], best[ok]] = True
        correct[d] = ok
    return correct


def _coco_ap(tp: np.ndarray, conf: np.ndarray, n_gt: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """AP per IoU threshold for one class; also returns recall and precision at each detection (IoU 0.5)."""
    order = np.argsort(-conf, kind="mergesort")
    tp = tp[order]
    tpc = np.cumsum(tp, 0).astype(np.float64)
    fpc = np.cumsum(~tp, 0).astype(np.float64)
    recall = tpc / max(n_gt, 1)
    precision = tpc / np.maximum(tpc + fpc, np.finfo(np.float64).eps)
    ap = np.zeros(tp.shape[1])
    for j in range(tp.shape[1]):
        pr = precision[:, j].copy()
        for k in range(len(pr) - 1, 0, -1):  # precision envelope (monotone non-increasing)
            pr[k - 1] = max(pr[k - 1], pr[k])
        idx = np.searchsorted(recall[:, j], RECALL_POINTS, side="left")
        q = np.where(idx < len(pr), pr[np.minimum(idx, len(pr) - 1)], 0.0)
        ap[j] = q.mean()
    return ap, recall[:, 0], precision[:, 0]


def ap_per_class(tp: np.ndarray, conf: np.ndarray, pred_cls: np.ndarray, gt_cls: np.ndarray, eps: float = 1e-16
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-class COCO AP ``[C, T]`` over classes that have ground truth, and P/R at the best mean-F1 confidence.

    Returns ``(classes, ap, p, r)`` with ``p``/``r`` ``[C]`` at IoU 0.5.
    """
    classes, n_gt = np.unique(gt_cls.astype(np.int64), return_counts=True)
    t = tp.shape[1] if tp.ndim == 2 else len(IOU_THRESHOLDS)
    ap = np.zeros((len(classes), t))
    px = np.linspace(0, 1, 1000)
    p_curve = np.zeros((len(classes), px.size))
    r_curve = np.zeros((len(classes), px.size))
    for ci, (c, ng) in enumerate(zip(classes, n_gt)):
        sel = pred_cls.astype(np.int64) == c
        if not sel.any():
            continue
        ap[ci], rec, prec = _coco_ap(tp[sel], conf[sel], int(ng))
        cs = -np.sort(-conf[sel], kind="mergesort")
        # Recall/precision as functions of the confidence threshold (for P and R at the best F1).
        r_curve[ci] = np.interp(-px, -cs, rec, left=0)
        p_curve[ci] = np.interp(-px, -cs, prec, left=1)
    f1 = 2 * p_curve * r_curve / (p_curve + r_curve + eps)
    best = int(f1.mean(0).argmax()) if len(classes) else 0
    return classes, ap, p_curve[:, best] if len(classes) else np.zeros(0), r_curve[:, best] if len(classes) else np.zeros(0)


@dataclass
class DetectionMetrics:
    """Accumulates per-image matches; :meth:`compute` gives P, R, mAP@0.5, mAP@0.5:0.95 (means over classes with GT)."""

    iouv: np.ndarray = field(default_factory=lambda: IOU_THRESHOLDS.copy())
    _tp: list = field(default_factory=list)
    _conf: list = field(default_factory=list)
    _pcls: list = field(default_factory=list)
    _gcls: list = field(default_factory=list)

    def update(self, det: np.ndarray, gt_boxes: np.ndarray, gt_cls: np.ndarray) -> None:
        """``det [n, 6]`` (x1, y1, x2, y2, score, cls) and the image's ground truth, same coordinate frame."""
        det = np.asarray(det, dtype=np.float64).reshape(-1, 6)
        gt_boxes = np.asarray(gt_boxes, dtype=np.float64).reshape(-1, 4)
        gt_cls = np.asarray(gt_cls).reshape(-1)
        self._tp.append(match_detections(det[:, :4], det[:, 4], det[:, 5], gt_boxes, gt_cls, self.iouv))
        self._conf.append(det[:, 4])
        self._pcls.append(det[:, 5])
        self._gcls.append(gt_cls)

    def compute(self) -> dict[str, float]:
        t = len(self.iouv)
        tp = np.concatenate(self._tp, 0) if self._tp else np.zeros((0, t), bool)
        conf = np.concatenate(self._conf) if self._conf else np.zeros(0)
        pcls = np.concatenate(self._pcls) if self._pcls else np.zeros(0)
        gcls = np.concatenate(self._gcls) if self._gcls else np.zeros(0)
        classes, ap, p, r = ap_per_class(tp, conf, pcls, gcls)
        if len(classes) == 0:
            return {"precision": 0.0, "recall": 0.0, "mAP50": 0.0, "mAP50-95": 0.0}
        return {"precision": float(p.mean()), "recall": float(r.mean()), "mAP50": float(ap[:, 0].mean()),
                "mAP50-95": float(ap.mean())}
