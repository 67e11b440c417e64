"""Shared helpers of the augmentation tests: loaded images + labels from coco128 or synthetic data."""
from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

from fastload.data.images import read_image_file, resize_long_side


def load_folder(root: Path, imgsz: int, limit: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Loaded RGB images (long side imgsz) and their labels from a YOLO ``images/``+``labels/`` tree."""
    files = sorted(p for p in (root / "images").rglob("*") if p.suffix.lower() in (".jpg", ".png"))[:limit]
    images, labels = [], []
    for f in files:
        images.append(np.ascontiguousarray(resize_long_side(read_image_file(f), imgsz)))
        lf = Path(str(f).replace("/images/", "/labels/")).with_suffix(".txt")
        lab = np.loadtxt(lf, ndmin=2, dtype=np.float32) if lf.is_file() and lf.stat().st_size else np.zeros((0, 5), np.float32)
        labels.append(lab.reshape(-1, 5))
    return images, labels


def smooth_images(n: int, imgsz: int, seed: int = 0) -> list[np.ndarray]:
    """Photo-like smooth random images of assorted loaded shapes (long side imgsz)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        short = int(rng.integers(imgsz // 4, imgsz + 1))
        h, w = (imgsz, short) if rng.random() < 0.5 else (short, imgsz)
        img = rng.integers(0, 256, (h, w, 3)).astype(np.uint8)
        out.append(cv2.GaussianBlur(img, (0, 0), 2.5))
    return out


def random_world(n: int, imgsz: int, seed: int = 0, *, max_boxes: int, nc: int,
                 wh: tuple[float, float]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Loaded shapes (long side imgsz) and random normalised labels (up to ``max_boxes - 1`` per image, class
    ids below ``nc``, box sides in ``wh``), for tests that need boxes but no pixels."""
    rng = np.random.default_rng(seed)
    shapes, labels = [], []
    for _ in range(n):
        short = int(rng.integers(imgsz // 3, imgsz + 1))
        shapes.append((imgsz, short) if rng.random() < 0.5 else (short, imgsz))
        k = int(rng.integers(0, max_boxes))
        box_wh = rng.uniform(wh[0], wh[1], (k, 2))
        xy = rng.uniform(box_wh / 2, 1 - box_wh / 2)
        labels.append(np.concatenate((rng.integers(0, nc, (k, 1)), xy, box_wh), 1).astype(np.float32))
    return np.array(shapes), labels


def shapes_of(images: list[np.ndarray]) -> np.ndarray:
    return np.array([im.shape[:2] for im in images], np.int64)


def box_rows_only(labels: Path) -> Path:
    """Rewrite the first non-empty label file after the first in ``labels`` (a segment or obb set's) with box rows only,
    each polygon's box ``class xc yc w h``, as a set mixing detection and segment labels has; returns that file."""
    files = sorted(labels.glob("*.txt"))
    label = next(f for f in files[1:] if f.read_text().strip())
    rows = []
    for line in label.read_text().splitlines():
        cls, *xy = line.split()
        pts = np.array(xy, np.float64).reshape(-1, 2)
        (x0, y0), (x1, y1) = pts.min(0), pts.max(0)
        rows.append(f"{cls} {(x0 + x1) / 2:.6f} {(y0 + y1) / 2:.6f} {x1 - x0:.6f} {y1 - y0:.6f}")
    label.write_text("\n".join(rows) + "\n")
    return label
