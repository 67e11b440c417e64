"""Inference on images: draw the detected boxes and save the annotated copies.

CLI::

    python -m yolov9.detect --weights runs/train/exp/weights/best.pt --source path/to/images --imgsz 640
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import cv2
import numpy as np
import torch

from .boxes import scale_boxes_to_original
from .nms import non_max_suppression

__all__ = ["letterbox", "list_images", "draw_detections", "parse_args", "run", "main"]


def list_images(source: str | Path) -> list[Path]:
    """A single image, a folder (sorted, non-recursive) or a .txt list of image paths."""
    from fastload.data.images import IMG_FORMATS

    src = Path(source)
    if src.is_dir():
        files = sorted(p for p in src.iterdir() if p.suffix.lower().lstrip(".") in IMG_FORMATS)
    elif src.suffix.lower() == ".txt" and src.is_file():
        files = [Path(line.strip()) for line in src.read_text().splitlines() if line.strip()]
    elif src.is_file():
        files = [src]
    else:
        raise FileNotFoundError(f"--source {source}: no such file or folder")
    if not files:
        raise FileNotFoundError(f"--source {source}: no images found")
    return files


def letterbox(img: np.ndarray, imgsz: int, stride: int = 32, fill: int = 114) -> tuple[np.ndarray, tuple]:
    """Resize the long side to ``imgsz`` and pad to the next multiple of ``stride`` (centred, minimal rectangle).

    Returns the padded image and YOLOv9's shape tuple ``((h0, w0), ((gain, gain), (padw, padh)))``.
    """
    h0, w0 = img.shape[:2]
    r = min(imgsz / h0, imgsz / w0)
    h, w = max(round(h0 * r), 1), max(round(w0 * r), 1)
    if (h, w) != (h0, w0):
        img = cv2.resize(img, (w, h), interpolation=cv2.INTER_AREA if r < 1 else cv2.INTER_LINEAR)
    ph, pw = (-h) % stride, (-w) % stride
    top, left = ph // 2, pw // 2
    out = cv2.copyMakeBorder(img, top, ph - top, left, pw - left, cv2.BORDER_CONSTANT, value=(fill,) * 3)
    return out, ((h0, w0), ((h / h0, w / w0), (left, top)))


def _colour(c: int) -> tuple[int, int, int]:
    rng = np.random.default_rng(c)  # stable per-class colour
    return tuple(int(v) for v in rng.integers(40, 255, 3))


def draw_detections(img_bgr: np.ndarray, det: np.ndarray, names: list[str], line: int = 2) -> np.ndarray:
    """Draw ``det [n, 6]`` (x1, y1, x2, y2, score, cls) with class name and score on a BGR image (in place)."""
    for x1, y1, x2, y2, score, c in det:
        c = int(c)
        col = _colour(c)
        p1, p2 = (int(round(x1)), int(round(y1))), (int(round(x2)), int(round(y2)))
        cv2.rectangle(img_bgr, p1, p2, col, line, cv2.LINE_AA)
        label = f"{names[c] if c < len(names) else c} {score:.2f}"
        (tw, th), base = cv2.getTextSize(label, cv2.FONT_HERSHEY_SIMPLEX, 0.5, 1)
        ty = max(p1[1], th + base)
        cv2.rectangle(img_bgr, (p1[0], ty - th - base), (p1[0] + tw, ty), col, -1)
        cv2.putText(img_bgr, label, (p1[0], ty - base), cv2.FONT_HERSHEY_SIMPLEX, 0.5, (255, 255, 255), 1, cv2.LINE_AA)
    return img_bgr


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m yolov9.detect", description="Detect objects and save annotated images.")
    p.add_argument("--weights", required=True, help="checkpoint written by yolov9.train")
    p.add_argument("--cfg", default=None, help="model config for bare state_dicts")
    p.add_argument("--source", required=True, help="image file, folder or .txt list")
    p.add_argument("--imgsz", "--img", "--img-size", dest="imgsz", type=int, default=640)
    p.add_argument("--conf-thres", type=float, default=0.25)
    p.add_argument("--iou-thres", type=float, default=0.45)
    p.add_argument("--max-det", type=int, default=1000)
    p.add_argument("--device", default="")
    p.add_argument("--project", default="runs/detect")
    p.add_argument("--name", default="exp")
    p.add_argument("--exist-ok", action="store_true")
    p.add_argument("--save-txt", action="store_true", help="also write YOLO-format label files with scores")
    p.add_argument("--agnostic-nms", action="store_true")
    p.add_argument("--half", action="store_true", help="fp16 autocast on CUDA")
    return p.parse_args(argv)


@torch.no_grad()
def run(opt: argparse.Namespace) -> Path:
    """Annotate every source image; returns the output folder."""
    from fastload.data.images import read_image_file

    from .checkpoint import load_model
    from .models.yolo import reparameterize
    from .torch_utils import select_device
    from .train import _increment_path

    device = select_device(opt.device)
    model, _ = load_model(opt.weights, cfg=opt.cfg)
    model = reparameterize(model).to(device).eval().fuse()  # inference needs only the main branch
    stride = max(int(model.stride.max()), 32)
    out_dir = _increment_path(Path(opt.project) / opt.name, opt.exist_ok)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {}
    for path in list_images(opt.source):
        rgb = read_image_file(str(path))
        inp, shape = letterbox(rgb, opt.imgsz, stride)
        x = torch.from_numpy(np.ascontiguousarray(inp.transpose(2, 0, 1))).to(device).float().div_(255)[None]
        with torch.autocast(device.type, enabled=opt.half and device.type == "cuda"):
            y, _ = model(x)
        det = non_max_suppression(y.float(), opt.conf_thres, opt.iou_thres, max_det=opt.max_det, multi_label=False,
                                  agnostic=opt.agnostic_nms)[0]
        scale_boxes_to_original(det[:, :4], shape, inp.shape[:2])
        det_np = det.cpu().numpy()
        bgr = cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR)
        draw_detections(bgr, det_np, model.names)
        if not cv2.imwrite(str(out_dir / path.name), bgr):
            raise OSError(f"could not write {out_dir / path.name}")
        if opt.save_txt:
            h0, w0 = rgb.shape[:2]
            lines = [f"{int(c)} {(x1 + x2) / 2 / w0:.6f} {(y1 + y2) / 2 / h0:.6f} {(x2 - x1) / w0:.6f} "
                     f"{(y2 - y1) / h0:.6f} {s:.4f}" for x1, y1, x2, y2, s, c in det_np]
            (out_dir / "labels").mkdir(exist_ok=True)
            (out_dir / "labels" / f"{path.stem}.txt").write_text("\n".join(lines) + ("\n" if lines else ""))
        summary[path.name] = len(det_np)
    print(f"{len(summary)} images, {sum(summary.values())} detections -> {out_dir}")
    print(json.dumps(summary))
    return out_dir


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
