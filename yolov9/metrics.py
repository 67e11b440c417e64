"""Detection metrics: P, R, mAP@0.5 and mAP@0.5:0.95 under one of two protocols.

``protocol="yolo"`` (the default) scores the way the official YOLOv9 ``val.py`` / ``val_dual.py`` do, so that
numbers from ``python -m yolov9.val`` and from training compare directly with theirs:

- matching, per image and IoU threshold: among same-class pairs with IoU >= threshold, each detection keeps
  its best-IoU ground truth, then each ground truth keeps the earliest detection (NMS output order, i.e.
  highest score) among those that kept it;
- AP: precision envelope over the recall curve with sentinels (recall 0, precision 1) and (recall 1,
  precision 0), linearly interpolated at 101 recall points and integrated with the trapezoid rule;
- P and R: per class as functions of the confidence threshold on a 1000-point grid, taken where the mean F1
  over classes, box-smoothed over a tenth of the grid, is highest.

``protocol="coco"`` follows the COCO evaluation (detections matched greedily by descending score to the
unmatched ground truth of highest IoU; precision envelope sampled as a step function at 101 recall points and
averaged), so that mAP agrees with pycocotools on the same boxes; P and R are taken at the best unsmoothed F1.

The two differ most when a class's recall curve stops short of 1: the official curve then falls linearly from
its last precision to 0 at recall 1, which adds area that COCO does not count.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

__all__ = ["IOU_THRESHOLDS", "PROTOCOLS", "Protocol", "match_detections", "DetectionMetrics", "ap_per_class",
           "box_iou_np"]

IOU_THRESHOLDS = np.linspace(0.5, 0.95, 10)
RECALL_POINTS = np.linspace(0.0, 1.0, 101)
CONF_GRID = np.linspace(0.0, 1.0, 1000)  # confidence thresholds at which P and R are read
Protocol = Literal["yolo", "coco"]
PROTOCOLS: tuple[str, ...] = ("yolo", "coco")


def _check_protocol(protocol: str) -> None:
    if protocol not in PROTOCOLS:
        raise ValueError(f"metric protocol {protocol!r}: choose one of {', '.join(PROTOCOLS)}")


def box_iou_np(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pairwise IoU of xyxy boxes ``[N, 4]`` x ``[M, 4]``."""
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.clip(rb - lt, 0, None).prod(-1)
    area_a = np.clip(a[:, 2:] - a[:, :2], 0, None).prod(-1)
    area_b = np.clip(b[:, 2:] - b[:, :2], 0, None).prod(-1)
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


def _match_coco(iou: np.ndarray, det_scores: np.ndarray, iouv: np.ndarray) -> np.ndarray:
    n, t = iou.shape[0], len(iouv)
    correct = np.zeros((n, t), dtype=bool)
    matched = np.zeros((t, iou.shape[1]), dtype=bool)
    for d in np.argsort(-det_scores, kind="mergesort"):
        cand = np.where((iou[d][None, :] >= iouv[:, None]) & ~matched, iou[d][None, :], -1.0)  # [T, G]
        best = cand.argmax(1)
        ok = cand[np.arange(t), best] >= 0
        matched[np.arange(t)[ok], best[ok]] = True
        correct[d] = ok
    return correct


def _match_yolo(iou: np.ndarray, iouv: np.ndarray) -> np.ndarray:
    n, t = iou.shape[0], len(iouv)
    correct = np.zeros((n, t), dtype=bool)
    for k, thr in enumerate(iouv):
        ok = iou >= thr  # [N, G]; other classes carry IoU -1
        if not ok.any():
            continue
        best_gt = np.where(ok, iou, -np.inf).argmax(1)  # each detection's best-IoU ground truth
        has = ok.any(1)
        taken = np.zeros(iou.shape[1], dtype=bool)
        for d in np.flatnonzero(has):  # in detection order: the earliest claimant keeps the ground truth
            g = best_gt[d]
            if not taken[g]:
                taken[g] = True
                correct[d, k] = True
    return correct


def match_detections(det_boxes: np.ndarray, det_scores: np.ndarray, det_cls: np.ndarray, gt_boxes: np.ndarray,
                     gt_cls: np.ndarray, iouv: np.ndarray = IOU_THRESHOLDS, protocol: Protocol = "yolo") -> np.ndarray:
    """True-positive flags ``[n_det, n_iou]`` for one image under ``protocol`` (see the module docstring).

    ``"yolo"`` reads the detections in the given order (NMS output: descending score); ``"coco"`` sorts by score.
    """
    _check_protocol(protocol)
    if len(det_boxes) == 0 or len(gt_boxes) == 0:
        return np.zeros((len(det_boxes), len(iouv)), dtype=bool)
    iou = box_iou_np(det_boxes, gt_boxes)
    iou = np.where(det_cls[:, None] == gt_cls[None, :], iou, -1.0)  # other classes never match
    return _match_yolo(iou, iouv) if protocol == "yolo" else _match_coco(iou, det_scores, iouv)


def _pr_curves(tp: np.ndarray, n_gt: int) -> tuple[np.ndarray, np.ndarray]:
    """Recall and precision after each detection (``tp`` sorted by descending score), per IoU threshold."""
    tpc = np.cumsum(tp, 0, dtype=np.float64)
    fpc = np.cumsum(~tp, 0, dtype=np.float64)
    return tpc / max(n_gt, 1), tpc / np.maximum(tpc + fpc, np.finfo(np.float64).eps)


def _ap_coco(recall: np.ndarray, precision: np.ndarray) -> float:
    pr = np.maximum.accumulate(precision[::-1])[::-1]  # envelope: best precision at any higher recall
    idx = np.searchsorted(recall, RECALL_POINTS, side="left")
    return float(np.where(idx < len(pr), pr[np.minimum(idx, len(pr) - 1)], 0.0).mean())


def _ap_yolo(recall: np.ndarray, precision: np.ndarray) -> float:
    rec = np.concatenate(([0.0], recall, [1.0]))
    pre = np.concatenate(([1.0], precision, [0.0]))
    pre = np.maximum.accumulate(pre[::-1])[::-1]
    curve = np.interp(RECALL_POINTS, rec, pre)
    return float(((curve[1:] + curve[:-1]) / 2 * np.diff(RECALL_POINTS)).sum())  # trapezoid rule


def _box_smooth(y: np.ndarray, frac: float) -> np.ndarray:
    """Moving average over an odd window of about ``2 * frac * len(y)`` points, edges padded with end values."""
    n = round(len(y) * frac * 2) // 2 + 1
    padded = np.concatenate((np.full(n // 2, y[0]), y, np.full(n // 2, y[-1])))
    return np.convolve(padded, np.ones(n) / n, mode="valid")


def ap_per_class(tp: np.ndarray, conf: np.ndarray, pred_cls: np.ndarray, gt_cls: np.ndarray, eps: float = 1e-16,
                 protocol: Protocol = "yolo") -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-class AP ``[C, T]`` over the classes that have ground truth, and P/R ``[C]`` at IoU 0.5.

    Returns ``(classes, ap, p, r)``; a class without detections scores 0 everywhere.
    """
    _check_protocol(protocol)
    classes, n_gt = np.unique(gt_cls.astype(np.int64), return_counts=True)
    t = tp.shape[1] if tp.ndim == 2 else len(IOU_THRESHOLDS)
    ap = np.zeros((len(classes), t))
    p_curve = np.zeros((len(classes), CONF_GRID.size))
    r_curve = np.zeros((len(classes), CONF_GRID.size))
    ap_fn = _ap_yolo if protocol == "yolo" else _ap_coco
    for ci, (c, ng) in enumerate(zip(classes, n_gt)):
        sel = np.flatnonzero(pred_cls.astype(np.int64) == c)
        if not len(sel):
            continue
        sel = sel[np.argsort(-conf[sel], kind="mergesort")]
        recall, precision = _pr_curves(tp[sel], int(ng))
        ap[ci] = [ap_fn(recall[:, j], precision[:, j]) for j in range(t)]
        # Recall / precision as functions of the confidence threshold (scores decrease along `sel`).
        r_curve[ci] = np.interp(-CONF_GRID, -conf[sel], recall[:, 0], left=0)
        p_curve[ci] = np.interp(-CONF_GRID, -conf[sel], precision[:, 0], left=1)
    if not len(classes):
        return classes, ap, np.zeros(0), np.zeros(0)
    f1 = (2 * p_curve * r_curve / (p_curve + r_curve + eps)).mean(0)
    best = int((_box_smooth(f1, 0.1) if protocol == "yolo" else f1).argmax())
    return classes, ap, p_curve[:, best], r_curve[:, best]


@dataclass
class DetectionMetrics:
    """Accumulates per-image matches; :meth:`compute` gives P, R, mAP@0.5, mAP@0.5:0.95 (means over classes with GT).

    ``protocol``: ``"yolo"`` (official YOLOv9 ``val.py``) or ``"coco"`` (pycocotools); see the module docstring.
    """

    iouv: np.ndarray = field(default_factory=lambda: IOU_THRESHOLDS.copy())
    protocol: Protocol = "yolo"
    _tp: list = field(default_factory=list)
    _conf: list = field(default_factory=list)
    _pcls: list = field(default_factory=list)
    _gcls: list = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_protocol(self.protocol)

    def update(self, det: np.ndarray, gt_boxes: np.ndarray, gt_cls: np.ndarray) -> None:
        """``det [n, 6]`` (x1, y1, x2, y2, score, cls) in NMS output order, and the image's ground truth, in
        the same coordinate frame."""
        det = np.asarray(det, dtype=np.float64).reshape(-1, 6)
        gt_boxes = np.asarray(gt_boxes, dtype=np.float64).reshape(-1, 4)
        gt_cls = np.asarray(gt_cls).reshape(-1)
        self._tp.append(match_detections(det[:, :4], det[:, 4], det[:, 5], gt_boxes, gt_cls, self.iouv,
                                         self.protocol))
        self._conf.append(det[:, 4])
        self._pcls.append(det[:, 5])
        self._gcls.append(gt_cls)

    def compute(self) -> dict[str, float]:
        t = len(self.iouv)
        tp = np.concatenate(self._tp, 0) if self._tp else np.zeros((0, t), bool)
        conf = np.concatenate(self._conf) if self._conf else np.zeros(0)
        pcls = np.concatenate(self._pcls) if self._pcls else np.zeros(0)
        gcls = np.concatenate(self._gcls) if self._gcls else np.zeros(0)
        zeros = {"precision": 0.0, "recall": 0.0, "mAP50": 0.0, "mAP50-95": 0.0}
        if self.protocol == "yolo" and not tp.any():
            return zeros  # the official evaluator reports zeros when nothing matched at any threshold
        classes, ap, p, r = ap_per_class(tp, conf, pcls, gcls, protocol=self.protocol)
        if len(classes) == 0:
            return zeros
        return {"precision": float(p.mean()), "recall": float(r.mean()), "mAP50": float(ap[:, 0].mean()),
                "mAP50-95": float(ap.mean())}
