"""Validation: letterboxed rect batches from fastload, NMS, P / R / mAP@0.5 / mAP@0.5:0.95.

Scores as the official YOLOv9 ``val.py`` does by default (``--protocol yolo``), or as pycocotools does
(``--protocol coco``); :mod:`yolov9.metrics` says how they differ.

CLI::

    python -m yolov9.val --data data.yaml --weights runs/train/exp/weights/best.pt --imgsz 640 --batch-size 32
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
import torch.nn as nn

from .boxes import clip_boxes, scale_boxes_to_original, xywh2xyxy
from .metrics import PROTOCOLS, DetectionMetrics, Protocol
from .nms import non_max_suppression

if TYPE_CHECKING:
    from fastload.fastloader import FastLoader

__all__ = ["evaluate", "boxes_to_original", "make_val_loader", "run", "parse_args", "main"]


def make_val_loader(data: Any, imgsz: int, batch_size: int, *, workers: int = 4, stride: int = 32,
                    single_cls: bool = False, store: str = "auto", engine: str = "cpu", split: str = "val",
                    device: torch.device | None = None) -> FastLoader:
    """Validation batches as YOLOv9 builds them: no augmentation, rect batches, pad 0.5, fixed order."""
    import fastload
    from fastload.engines.factory import engine_class

    cls = engine_class(engine)
    return fastload.loader(data, split=split, imgsz=imgsz, batch_size=batch_size, augment=False, rect=True,
                           pad=0.5, shuffle=False, stride=stride, single_cls=single_cls,
                           **cls.renderer_keywords(workers),  # worker processes, Ray actors, or none
                           store=store, engine=engine, device=device if cls.renders_on == "device" else None)


def boxes_to_original(pred: torch.Tensor, gt: torch.Tensor, shape: tuple, protocol: Protocol) -> None:
    """Map predicted and label xyxy boxes from the letterboxed input back to original pixels, in place.

    ``shape`` is the loader's ``((h0, w0), ((gain_h, gain_w), (padw, padh)))``. As in YOLOv9, the letterbox put
    the image's first column and row at ``round(pad - 0.1)`` and the labels at the unrounded padding. ``"coco"``:
    exact geometry, predictions measured from the image, labels from the unrounded padding, each axis with its
    own gain. ``"yolo"``: what the official ``val.py`` computes (its ``scale_boxes``): both measured from the
    unrounded padding and divided by the height gain. The two differ by up to half a pixel and the width gain's
    rounding; the official evaluator's numbers need the official mapping.
    """
    (h0, w0), ((gh, gw), (pw, ph)) = shape
    pad = torch.tensor((pw, ph, pw, ph), dtype=gt.dtype, device=gt.device)
    if protocol == "yolo":
        for b in (pred, gt):
            b -= pad.to(b.dtype)
            b /= gh
    else:
        left, top = round(pw - 0.1), round(ph - 0.1)
        pred -= torch.tensor((left, top, left, top), dtype=pred.dtype, device=pred.device)
        gt -= pad
        for b in (pred, gt):
            b[:, [0, 2]] /= gw
            b[:, [1, 3]] /= gh
    clip_boxes(pred, (h0, w0))
    clip_boxes(gt, (h0, w0))


@torch.no_grad()
def evaluate(model: nn.Module, loader: Iterable, device: torch.device, *, loss_fn: Callable | None = None,
             conf_thres: float = 0.001, iou_thres: float = 0.7, max_det: int = 300, amp: bool = False,
             amp_dtype: torch.dtype = torch.float16, single_cls: bool = False, progress: bool = False,
             protocol: Protocol = "yolo") -> dict:
    """Run ``model`` over ``loader``; returns P, R, mAP50, mAP50-95 and (with ``loss_fn``) val losses.

    Predictions and labels are both mapped back to original image pixels (using the loader's ``shapes``,
    see :func:`boxes_to_original`) before matching, as YOLOv9 does.
    """
    was_training = model.training
    model.eval()
    metrics = DetectionMetrics(protocol=protocol)
    loss_sum = torch.zeros(3, device=device)
    n_batches = 0
    it = loader
    if progress:
        from tqdm import tqdm

        it = tqdm(loader, total=len(loader), desc="val", leave=False)
    for imgs, targets, _paths, shapes in it:
        imgs = imgs.to(device, non_blocking=True).float().div_(255)
        targets = targets.to(device)
        h, w = imgs.shape[2:]
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp and device.type == "cuda"):
            out = model(imgs)
        if loss_fn is not None:
            loss_sum += loss_fn(out, targets)[1]
        n_batches += 1
        dets = non_max_suppression(out[0].float(), conf_thres, iou_thres, max_det=max_det, multi_label=True,
                                   agnostic=single_cls)
        for si, det in enumerate(dets):
            lab = targets[targets[:, 0] == si]
            gt = xywh2xyxy(lab[:, 2:6] * torch.tensor((w, h, w, h), device=device))
            det = det.clone()
            if single_cls:
                det[:, 5] = 0
            if shapes[si] is not None and len(shapes[si]) > 1 and shapes[si][1] is not None:
                boxes_to_original(det[:, :4], gt, shapes[si], protocol)
            elif shapes[si] is not None:  # no letterbox record: a centred letterbox of the input size
                scale_boxes_to_original(det[:, :4], shapes[si], (h, w))
                scale_boxes_to_original(gt, shapes[si], (h, w))
            metrics.update(det.cpu().numpy(), gt.cpu().numpy(), lab[:, 1].cpu().numpy())
    model.train(was_training)
    res = metrics.compute()
    if loss_fn is not None:
        box, cls, dfl = (loss_sum / max(n_batches, 1)).tolist()
        res.update(box_loss=box, cls_loss=cls, dfl_loss=dfl)
    return res


def fitness(res: dict) -> float:
    """YOLOv9's model selection score: 0.1 mAP@0.5 + 0.9 mAP@0.5:0.95."""
    return 0.1 * res["mAP50"] + 0.9 * res["mAP50-95"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m yolov9.val", description="Validate a YOLOv9 checkpoint.")
    p.add_argument("--data", required=True, help="data.yaml")
    p.add_argument("--weights", required=True, help="checkpoint written by yolov9.train (or a state_dict + --cfg)")
    p.add_argument("--cfg", default=None, help="model config for bare state_dicts")
    p.add_argument("--batch-size", "--batch", dest="batch_size", type=int, default=32)
    p.add_argument("--imgsz", "--img", "--img-size", dest="imgsz", type=int, default=640)
    p.add_argument("--conf-thres", type=float, default=0.001)
    p.add_argument("--iou-thres", type=float, default=0.7)
    p.add_argument("--max-det", type=int, default=300)
    p.add_argument("--task", choices=("val", "test", "train"), default="val", help="split to evaluate")
    p.add_argument("--device", default="")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--single-cls", action="store_true")
    p.add_argument("--store", default="auto")
    p.add_argument("--loader", choices=("cpu", "gpu", "dali"), default="cpu")
    p.add_argument("--half", action="store_true", help="fp16 autocast on CUDA")
    p.add_argument("--reparam", action="store_true", help="drop the PGI auxiliary branch and fuse before validating")
    p.add_argument("--protocol", choices=PROTOCOLS, default="yolo",
                   help="yolo: score as the official val.py (default); coco: as pycocotools")
    return p.parse_args(argv)


def run(opt: argparse.Namespace) -> dict:
    from .checkpoint import load_model
    from .models.yolo import reparameterize
    from .torch_utils import select_device

    device = select_device(opt.device)
    model, _ = load_model(opt.weights, cfg=opt.cfg)
    if opt.reparam:
        model = reparameterize(model).eval().fuse()
    model.to(device).eval()
    gs = max(int(model.stride.max()), 32)
    loader = make_val_loader(opt.data, opt.imgsz, opt.batch_size, workers=opt.workers, stride=gs,
                             single_cls=opt.single_cls, store=opt.store, engine=opt.loader, split=opt.task,
                             device=device)
    try:
        res = evaluate(model, loader, device, conf_thres=opt.conf_thres, iou_thres=opt.iou_thres,
                       max_det=opt.max_det, amp=opt.half, single_cls=opt.single_cls, progress=True,
                       protocol=opt.protocol)
    finally:
        loader.close()
    return res


def main(argv: list[str] | None = None) -> int:
    opt = parse_args(argv)
    res = run(opt)
    print(f"P {res['precision']:.4f}  R {res['recall']:.4f}  mAP50 {res['mAP50']:.4f}  mAP50-95 {res['mAP50-95']:.4f}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
