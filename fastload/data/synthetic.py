"""A synthetic YOLO dataset: filled shapes with exact boxes (or polygons, rotated boxes, keypoints) on noisy
gradient backgrounds.

Each object is drawn into its own mask and its box is the mask's pixel extent, so a box edge
always touches the shape and the shape never leaves its box (objects never overlap: each box
keeps a 3-pixel gap to the others). The mix exercises a loader: odd sizes and aspect ratios
(97x313, 1280x720, 333x333 ...), JPEG and PNG, grayscale PNGs, RGBA PNGs and about 10% images
with an empty label file. Output is byte-identical for the same arguments (one generator per
image, seeded from ``SeedSequence([seed, split, index])``).

Layout: ``images/{train,val}``, ``labels/{train,val}``, ``data.yaml``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import cv2
import numpy as np
import yaml

__all__ = ["make_synthetic_dataset", "plant_faults", "SHAPE_NAMES", "FIXED_SIZES", "class_names", "TASKS"]

TASKS: tuple[str, ...] = ("detect", "segment", "pose", "obb")
# The pose keypoints, as fractions of an object's window: top, left and right shoulders, left and right feet.
POSE_KEYPOINTS: tuple[tuple[float, float], ...] = ((0.5, 0.0), (0.0, 0.4), (1.0, 0.4), (0.2, 1.0), (0.8, 1.0))
POSE_FLIP_IDX: list[int] = [0, 2, 1, 4, 3]  # a left-right flip swaps left and right
POSE_OUTLINE: tuple[int, ...] = (0, 2, 4, 3, 1)  # the keypoints in the order the pentagon's outline visits them

SHAPE_NAMES: tuple[str, ...] = ("square", "circle", "triangle")
# (h, w) of the first train images: narrow, wide, square, tall, large -- the cases loaders get wrong.
FIXED_SIZES: tuple[tuple[int, int], ...] = ((313, 97), (720, 1280), (333, 333), (97, 313), (480, 640))
_GAP = 3  # pixels kept free around each box so neighbouring shapes never touch
_MIN_CONTRAST = 70.0  # luminance difference between a shape and its local background


def class_names(nc: int) -> list[str]:
    """``square, circle, triangle`` then ``square1, circle1, ...`` for larger ``nc``."""
    return [SHAPE_NAMES[c % 3] + (str(c // 3) if c >= 3 else "") for c in range(nc)]


def _image_kind(k: int) -> str:
    """File kind of the k-th image of a split: mostly JPEG, every third PNG, some gray / RGBA PNGs."""
    if k % 12 == 3:
        return "gray"
    if k % 12 == 8:
        return "rgba"
    return "png" if k % 3 == 1 else "jpg"


def _background(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    base = rng.uniform(60, 190, size=3)
    slope = rng.uniform(-20, 20, size=(2, 3))
    ys = np.linspace(-1, 1, h, dtype=np.float32)[:, None, None]
    xs = np.linspace(-1, 1, w, dtype=np.float32)[None, :, None]
    img = base + ys * slope[0] + xs * slope[1]
    img = img + rng.integers(-5, 6, size=(h, w, 3), dtype=np.int16)
    return np.clip(img, 0, 255).astype(np.uint8)


def _luma(rgb: np.ndarray) -> float:
    return float(0.299 * rgb[..., 0].mean() + 0.587 * rgb[..., 1].mean() + 0.114 * rgb[..., 2].mean())


def _shape_colour(rng: np.random.Generator, bg_luma: float) -> tuple[int, int, int]:
    """A random colour whose luminance differs from the background's by at least ``_MIN_CONTRAST``."""
    for _ in range(200):
        c = rng.integers(0, 256, size=3)
        if abs(_luma(c.astype(np.float64)) - bg_luma) >= _MIN_CONTRAST:
            return int(c[0]), int(c[1]), int(c[2])
    return (0, 0, 0) if bg_luma > 127 else (255, 255, 255)


def _shape_mask(rng: np.random.Generator, kind: int, bh: int, bw: int) -> np.ndarray:
    """A filled square(rectangle)/ellipse/triangle inside a bh x bw window."""
    mask = np.zeros((bh, bw), np.uint8)
    if kind == 0:
        mask[:] = 1
    elif kind == 1:
        cv2.ellipse(mask, (bw // 2, bh // 2), (max(1, (bw - 1) // 2), max(1, (bh - 1) // 2)), 0, 0, 360, 1, -1, cv2.LINE_8)
    else:
        apex = int(rng.integers(0, bw))
        pts = np.array([[0, bh - 1], [bw - 1, bh - 1], [apex, 0]], np.int32)
        cv2.fillPoly(mask, [pts], 1, cv2.LINE_8)
    return mask


def _windows(rng: np.random.Generator, h: int, w: int, max_objects: int) -> Iterator[tuple[int, int, int, int]]:
    """Up to ``max_objects`` (x0, y0, bw, bh) windows of an h x w image, each ``_GAP`` pixels from the others."""
    short = min(h, w)
    lo, hi = max(6, int(0.08 * short)), max(8, int(0.45 * short))
    taken: list[tuple[int, int, int, int]] = []
    for _ in range(int(rng.integers(1, max_objects + 1))):
        for _try in range(30):
            bw, bh = int(rng.integers(lo, hi + 1)), int(rng.integers(lo, hi + 1))
            if bw >= w - 2 or bh >= h - 2:
                continue
            x0, y0 = int(rng.integers(0, w - bw + 1)), int(rng.integers(0, h - bh + 1))
            if all(x0 >= bx1 + _GAP or x0 + bw + _GAP <= bx0 or y0 >= by1 + _GAP or y0 + bh + _GAP <= by0 for bx0, by0, bx1, by1 in taken):
                break
        else:
            continue
        taken.append((x0, y0, x0 + bw, y0 + bh))
        yield x0, y0, bw, bh


def _draw_objects(rng: np.random.Generator, img: np.ndarray, nc: int, max_objects: int) -> list[tuple[int, float, float, float, float]]:
    """Draw non-overlapping shapes; return YOLO rows (cls, xc, yc, w, h) of their exact pixel extents."""
    h, w = img.shape[:2]
    rows = []
    for x0, y0, bw, bh in _windows(rng, h, w, max_objects):
        cls = int(rng.integers(0, nc))
        mask = _shape_mask(rng, cls % 3, bh, bw)
        ys, xs = np.nonzero(mask)
        if len(xs) == 0:
            continue
        window = img[y0 : y0 + bh, x0 : x0 + bw]
        window[mask > 0] = _shape_colour(rng, _luma(window.astype(np.float64)))
        # exact extent of the drawn pixels, as pixel-edge coordinates
        ex0, ex1, ey0, ey1 = x0 + xs.min(), x0 + xs.max() + 1, y0 + ys.min(), y0 + ys.max() + 1
        rows.append((cls, (ex0 + ex1) / 2 / w, (ey0 + ey1) / 2 / h, (ex1 - ex0) / w, (ey1 - ey0) / h))
    return rows


def _polygon(rng: np.random.Generator, task: str, kind: int, x0: int, y0: int, bw: int, bh: int) -> np.ndarray:
    """``int32 [k, 2]`` pixel vertices of one object inside its window: a rectangle / ellipse / triangle
    (``segment``, by ``kind``), a rotated rectangle (``obb``), or the pentagon through the pose keypoints
    (:data:`POSE_KEYPOINTS`)."""
    if task == "obb":
        side = (min(bw, bh) - 2) / np.sqrt(2)  # any rotation of a rectangle this small stays in the window
        size = (float(rng.uniform(0.5, 1.0) * side), float(rng.uniform(0.5, 1.0) * side))
        corners = cv2.boxPoints(((x0 + (bw - 1) / 2, y0 + (bh - 1) / 2), size, float(rng.uniform(0, 180))))
        return np.round(corners).astype(np.int32)
    if task == "pose":
        kpts = [[x0 + fx * (bw - 1), y0 + fy * (bh - 1)] for fx, fy in POSE_KEYPOINTS]
        return np.array(kpts).round().astype(np.int32)
    x1, y1 = x0 + bw - 1, y0 + bh - 1
    if kind == 0:
        return np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]], np.int32)
    if kind == 1:
        centre, axes = (x0 + (bw - 1) // 2, y0 + (bh - 1) // 2), (max(1, (bw - 1) // 2), max(1, (bh - 1) // 2))
        return cv2.ellipse2Poly(centre, axes, 0, 0, 360, 15)[:-1].astype(np.int32)  # the last repeats the first
    return np.array([[x0, y1], [x1, y1], [x0 + int(rng.integers(0, bw)), y0]], np.int32)


def _draw_geometry(rng: np.random.Generator, img: np.ndarray, nc: int, max_objects: int, task: str) -> list[str]:
    """Draw non-overlapping polygons (``segment``), rotated rectangles (``obb``) or pose pentagons (``pose``); return
    their label rows: the exact vertices, or the box of the drawn pixels and the keypoints (x y visibility)."""
    h, w = img.shape[:2]
    lines = []
    for x0, y0, bw, bh in _windows(rng, h, w, max_objects):
        cls = int(rng.integers(0, nc))
        poly = _polygon(rng, task, cls % 3, x0, y0, bw, bh)
        colour = _shape_colour(rng, _luma(img[y0 : y0 + bh, x0 : x0 + bw].astype(np.float64)))
        cv2.fillPoly(img, [poly[list(POSE_OUTLINE)] if task == "pose" else poly], colour, cv2.LINE_8)
        xy = " ".join(f"{x / w:.6f} {y / h:.6f}" for x, y in poly.tolist())
        if task != "pose":
            lines.append(f"{cls} {xy}\n")
            continue
        ex0, ey0 = poly.min(0)
        ex1, ey1 = poly.max(0) + 1
        # mostly visible (2), some occluded but labelled (1), a few not labelled (0 at 0, 0 as COCO writes them)
        seen = rng.choice([2, 1, 0], size=len(poly), p=[0.8, 0.15, 0.05])
        kpts = " ".join(f"{x / w:.6f} {y / h:.6f} {v}" if v else "0 0 0" for (x, y), v in zip(poly.tolist(), seen))
        lines.append(f"{cls} {(ex0 + ex1) / 2 / w:.6f} {(ey0 + ey1) / 2 / h:.6f} {(ex1 - ex0) / w:.6f} "
                     f"{(ey1 - ey0) / h:.6f} {kpts}\n")
    return lines


def _image_size(rng: np.random.Generator, k: int, split: str, min_size: int, max_size: int) -> tuple[int, int]:
    if split == "train" and k < len(FIXED_SIZES):
        return FIXED_SIZES[k]
    long_side = int(rng.integers(min_size, max_size + 1))
    aspect = float(np.exp(rng.uniform(np.log(1 / 3), np.log(3))))
    h, w = (long_side, long_side * aspect) if aspect < 1 else (long_side / aspect, long_side)
    return max(16, int(round(h))), max(16, int(round(w)))


def _write_image(path_stem: Path, rgb: np.ndarray, kind: str) -> Path:
    if kind == "jpg":
        out = path_stem.with_suffix(".jpg")
        ok, enc = cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 92])
    else:
        out = path_stem.with_suffix(".png")
        if kind == "gray":
            arr = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
        elif kind == "rgba":
            arr = cv2.cvtColor(rgb, cv2.COLOR_RGB2BGRA)
            arr[:, :, 3] = 200  # a real alpha channel that readers must drop
        else:
            arr = cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR)
        ok, enc = cv2.imencode(".png", arr, [cv2.IMWRITE_PNG_COMPRESSION, 1])
    if not ok:  # pragma: no cover - cv2 always encodes uint8 images
        raise RuntimeError(f"cannot encode {out}")
    out.write_bytes(enc.tobytes())
    return out


def make_synthetic_dataset(
    out_dir: str | os.PathLike,
    *,
    n_train: int = 64,
    n_val: int = 16,
    nc: int = 3,
    seed: int = 0,
    min_size: int = 96,
    max_size: int = 640,
    max_objects: int = 6,
    task: str = "detect",
) -> Path:
    """Write a synthetic YOLO dataset under ``out_dir`` and return its ``data.yaml``.

    ``n_train`` / ``n_val`` images per split, ``nc`` classes (shape = class % 3), random long
    sides in ``[min_size, max_size]`` plus the fixed odd sizes of :data:`FIXED_SIZES` for the
    first train images, up to ``max_objects`` objects per image, every tenth image background
    with an empty label file. ``task`` (:data:`TASKS`): ``detect`` writes box rows; ``segment`` the exact polygons
    of rectangles, ellipses and triangles; ``obb`` the 4 corners of rotated rectangles; ``pose`` the box of a
    pentagon and its 5 vertices as keypoints with visibility (``kpt_shape`` [5, 3] and ``flip_idx`` in the yaml).
    """
    if nc < 1 or n_train < 0 or n_val < 0 or not (16 <= min_size <= max_size):
        raise ValueError(f"bad synthetic dataset arguments: nc={nc} n_train={n_train} n_val={n_val} sizes={min_size}..{max_size} "
                         f"(need nc >= 1, image counts >= 0, 16 <= min size <= max size)")
    if task not in TASKS:
        raise ValueError(f"bad synthetic dataset task {task!r} (want one of {', '.join(TASKS)})")
    out = Path(out_dir)
    for split_id, (split, n) in enumerate((("train", n_train), ("val", n_val))):
        im_dir, lb_dir = out / "images" / split, out / "labels" / split
        im_dir.mkdir(parents=True, exist_ok=True)
        lb_dir.mkdir(parents=True, exist_ok=True)
        for k in range(n):
            rng = np.random.default_rng(np.random.SeedSequence([seed, split_id, k]))
            h, w = _image_size(rng, k, split, min_size, max_size)
            img = _background(rng, h, w)
            if k % 10 == 9:
                text = ""
            elif task == "detect":
                rows = _draw_objects(rng, img, nc, max_objects)
                text = "".join(f"{c} {xc:.6f} {yc:.6f} {bw:.6f} {bh:.6f}\n" for c, xc, yc, bw, bh in rows)
            else:
                text = "".join(_draw_geometry(rng, img, nc, max_objects, task))
            stem = f"{split}_{k:05d}"
            _write_image(im_dir / stem, img, _image_kind(k))
            (lb_dir / f"{stem}.txt").write_text(text)
    data: dict[str, Any] = {"path": ".", "train": "images/train", "val": "images/val", "nc": nc,
                            "names": class_names(nc)}
    if task == "pose":
        data.update(kpt_shape=[len(POSE_KEYPOINTS), 3], flip_idx=POSE_FLIP_IDX)
    yaml_path = out / "data.yaml"
    yaml_path.write_text("# synthetic dataset written by fastload synth\n" + yaml.safe_dump(data, sort_keys=False))
    return yaml_path


# The faults a validation report must name: (image stem, what is planted). Label faults sit beside a good JPEG.
LABEL_FAULTS: dict[str, str] = {
    "f_class99": "99 0.5 0.5 0.2 0.2\n0 0.5 0.5 0.2 0.2\n",  # unknown class (and one good row that must survive)
    "f_x17": "1 1.7 0.5 0.2 0.2\n",  # x centre far outside [0, 1]
    "f_4cols": "1 0.5 0.5 0.2\n",  # a column missing
    "f_text": "person 0.5 0.5 0.2 0.2\n",  # a class name instead of an id
}


def plant_faults(dataset_dir: str | os.PathLike, split: str = "train", seed: int = 0) -> dict[str, Path]:
    """Add one file of each fault a loader meets in the wild to a dataset's ``split``; returns ``{fault: file}``.

    Image faults: a truncated JPEG, a zero-byte file, a PNG named ``.jpg`` (decodable, so kept). Label faults: a class
    id of 99, x = 1.7, four columns, non-numeric text. Used by ``fastload synth --plant-faults`` to see what the
    validation report says, and by the tests.
    """
    root = Path(dataset_dir)
    im_dir, lb_dir = root / "images" / split, root / "labels" / split
    im_dir.mkdir(parents=True, exist_ok=True)
    lb_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    def encoded(ext: str, h: int = 40, w: int = 50) -> bytes:
        return cv2.imencode(ext, rng.integers(0, 255, (h, w, 3), np.uint8))[1].tobytes()

    whole = encoded(".jpg")
    image_faults = {"truncated": ("f_truncated", whole[: len(whole) // 2]), "zero_bytes": ("f_zero", b""),
                    "png_as_jpg": ("f_png", encoded(".png", 30, 20))}
    faults: dict[str, Path] = {}
    for fault, (stem, data) in image_faults.items():
        (im_dir / f"{stem}.jpg").write_bytes(data)
        (lb_dir / f"{stem}.txt").write_text("0 0.5 0.5 0.1 0.1\n")
        faults[fault] = im_dir / f"{stem}.jpg"
    for stem, text in LABEL_FAULTS.items():
        (im_dir / f"{stem}.jpg").write_bytes(encoded(".jpg"))
        (lb_dir / f"{stem}.txt").write_text(text)
        faults[stem[2:]] = lb_dir / f"{stem}.txt"
    return faults
