"""mAP code against pycocotools (COCO protocol), box/NMS helpers."""
from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import torch

from yolov9.metrics import DetectionMetrics, box_iou_np, match_detections
from yolov9.nms import non_max_suppression


def _synthetic_set(seed: int = 0, n_images: int = 30, nc: int = 4):
    """Ground truth plus jittered, partly wrong detections, the way a half-trained detector looks."""
    rng = np.random.default_rng(seed)
    images = []
    for _ in range(n_images):
        n_gt = int(rng.integers(0, 8))
        xy = rng.uniform(0, 400, (n_gt, 2))
        wh = rng.uniform(10, 200, (n_gt, 2))
        gt = np.concatenate((xy, xy + wh), 1)
        gcls = rng.integers(0, nc, n_gt)
        dets = []
        for b, c in zip(gt, gcls):
            for _ in range(int(rng.integers(0, 3))):  # duplicates and misses
                jit = rng.normal(0, 0.08, 4) * np.r_[b[2:] - b[:2], b[2:] - b[:2]]
                cls = c if rng.random() > 0.15 else rng.integers(0, nc)
                dets.append([*(b + jit), rng.uniform(0.05, 1.0), cls])
        for _ in range(int(rng.integers(0, 5))):  # background false positives
            xy = rng.uniform(0, 400, 2)
            wh = rng.uniform(10, 150, 2)
            dets.append([*xy, *(xy + wh), rng.uniform(0.0, 0.6), rng.integers(0, nc)])
        det = np.array(dets, dtype=np.float64).reshape(-1, 6)
        det[:, 4] = np.round(det[:, 4], 6)
        images.append((det, gt, gcls))
    return images


def _pycocotools_map(images, nc):
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    gt_json = {"images": [], "annotations": [], "categories": [{"id": c} for c in range(nc)]}
    dt_json = []
    ann_id = 1
    for i, (det, gt, gcls) in enumerate(images):
        gt_json["images"].append({"id": i, "width": 640, "height": 640})
        for b, c in zip(gt, gcls):
            w, h = b[2] - b[0], b[3] - b[1]
            gt_json["annotations"].append({"id": ann_id, "image_id": i, "category_id": int(c), "iscrowd": 0,
                                           "bbox": [b[0], b[1], w, h], "area": w * h})
            ann_id += 1
        for d in det:
            dt_json.append({"image_id": i, "category_id": int(d[5]), "score": float(d[4]),
                            "bbox": [d[0], d[1], d[2] - d[0], d[3] - d[1]]})
    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO()
        coco.dataset = gt_json
        coco.createIndex()
        dt = coco.loadRes(dt_json)
        ev = COCOeval(coco, dt, "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return ev.stats[0], ev.stats[1]  # mAP@0.5:0.95, mAP@0.5


@pytest.mark.parametrize("seed", [0, 1])
def test_map_matches_pycocotools(seed):
    pytest.importorskip("pycocotools")
    nc = 4
    images = _synthetic_set(seed, nc=nc)
    m = DetectionMetrics(protocol="coco")
    for det, gt, gcls in images:
        m.update(det, gt, gcls)
    ours = m.compute()
    ref_5095, ref_50 = _pycocotools_map(images, nc)
    assert ours["mAP50"] == pytest.approx(ref_50, abs=1e-3)
    assert ours["mAP50-95"] == pytest.approx(ref_5095, abs=1e-3)
    assert 0.0 < ours["mAP50-95"] < ours["mAP50"] < 1.0
    assert 0.0 < ours["precision"] <= 1.0 and 0.0 < ours["recall"] <= 1.0


@pytest.mark.parametrize("protocol, perfect", [("coco", 1.0), ("yolo", 0.995)])
def test_perfect_detections(protocol, perfect):
    # The official evaluator's trapezoid over 101 points loses half of the last interval at recall 1: 0.995.
    gt = np.array([[0, 0, 10, 10], [20, 20, 50, 60]], float)
    det = np.c_[gt, [0.9, 0.8], [0, 1]]
    m = DetectionMetrics(protocol=protocol)
    m.update(det, gt, np.array([0, 1]))
    r = m.compute()
    assert r["mAP50"] == pytest.approx(perfect) and r["mAP50-95"] == pytest.approx(perfect)
    assert r["precision"] == pytest.approx(1.0) and r["recall"] == pytest.approx(1.0)


@pytest.mark.parametrize("protocol", ["yolo", "coco"])
def test_duplicate_detection_is_false_positive(protocol):
    gt = np.array([[0, 0, 10, 10]], float)
    det = np.array([[0, 0, 10, 10, 0.9, 0], [0, 0, 10, 10, 0.8, 0]], float)
    tp = match_detections(det[:, :4], det[:, 4], det[:, 5], gt, np.array([0]), protocol=protocol)
    assert tp[0].all() and not tp[1].any()


def test_matching_protocols_differ_where_documented():
    # Both detections overlap box B best; the weaker one also overlaps box A (IoU 0.6). COCO lets it fall back
    # to A once B is taken; the official matching keeps each detection's best-IoU box only, so it stays unmatched.
    gt = np.array([[0, 0, 10, 10], [4, 0, 14, 10]], float)
    det = np.array([[4, 0, 14, 10, 0.9, 0], [2.5, 0, 12.5, 10, 0.8, 0]], float)
    args = (det[:, :4], det[:, 4], det[:, 5], gt, np.array([0, 0]), np.array([0.5]))
    assert match_detections(*args, protocol="coco")[:, 0].tolist() == [True, True]
    assert match_detections(*args, protocol="yolo")[:, 0].tolist() == [True, False]
    with pytest.raises(ValueError, match="protocol"):
        match_detections(*args, protocol="voc")


def test_box_iou_np():
    a = np.array([[0, 0, 10, 10]], float)
    b = np.array([[5, 0, 15, 10], [20, 20, 30, 30]], float)
    np.testing.assert_allclose(box_iou_np(a, b), [[50 / 150, 0.0]])


def test_nms_suppresses_overlaps_and_caps():
    # two heavily overlapping boxes of class 0 and one of class 1 at the same place
    pred = torch.zeros(1, 4 + 2, 3)
    pred[0, :4, 0] = torch.tensor([50, 50, 20, 20])
    pred[0, :4, 1] = torch.tensor([51, 50, 20, 20])
    pred[0, :4, 2] = torch.tensor([50, 50, 20, 20])
    pred[0, 4, :2] = torch.tensor([0.9, 0.8])
    pred[0, 5, 2] = 0.7
    out = non_max_suppression(pred, conf_thres=0.1, iou_thres=0.5)[0]
    assert out.shape == (2, 6)
    assert sorted(out[:, 5].tolist()) == [0.0, 1.0]
    assert non_max_suppression(pred, conf_thres=0.1, iou_thres=0.5, agnostic=True)[0].shape[0] == 1
    assert non_max_suppression(pred, conf_thres=0.1, iou_thres=0.5, max_det=1)[0].shape[0] == 1
    with pytest.raises(ValueError):
        non_max_suppression(pred, conf_thres=2.0)
