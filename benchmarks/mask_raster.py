"""Where to rasterise segment masks: cost per batch and agreement with the references' masks, on ONE core.

    python benchmarks/mask_raster.py [--imgsz 640] [--batch 16] [--ratio 4] [--instances 8] [--repeat 5]

Both references fill each polygon into a full-size zero image and shrink it by ``mask_ratio`` (INTER_LINEAR).
Three ways to get the shrunk masks of a batch (``--batch`` images of ``--instances`` star-shaped polygons of
1000 points, sizes log-uniform from 8 to 400 px, some crossing the border), each overlap=False:

* ``full``: the references' way (one full-size image per instance, fillPoly, resize);
* ``block``: :func:`fastload.augment.masks.polygon_mask`: fillPoly and resize only the ``mask_ratio``-aligned
  box around the polygon (exact when the size is a multiple of ``mask_ratio``);
* ``reduced``: fillPoly straight at the reduced size (points mapped to the reduced pixel centres, 8 bits of
  sub-pixel precision), no resize.

Prints ms per batch (best of ``--repeat``, process CPU time) and, per way, the IoU of each instance mask with
``full``'s (mean, minimum, share of instances >= 0.99; instances empty in both count as 1).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cv2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.geometry_cost import best_ms  # noqa: E402
from fastload.augment.geometry import resample_polygon  # noqa: E402
from fastload.augment.masks import polygon_mask  # noqa: E402

SHIFT = 8  # sub-pixel bits of the reduced fill


def star_polygons(rng: np.random.Generator, imgsz: int, n: int) -> list[np.ndarray]:
    out = []
    for _ in range(n):
        k = int(rng.integers(6, 40))
        size = float(np.exp(rng.uniform(np.log(8), np.log(400))))
        centre = rng.uniform(-0.05 * imgsz, 1.05 * imgsz, 2)
        angles = np.sort(rng.uniform(0, 2 * np.pi, k))
        radii = size / 2 * rng.uniform(0.4, 1.0, k)
        poly = np.stack([centre[0] + radii * np.cos(angles), centre[1] + radii * np.sin(angles)], 1)
        out.append(resample_polygon(poly, 1000, False))
    return out


def full_mask(poly: np.ndarray, hw: tuple[int, int], r: int) -> np.ndarray:
    full = np.zeros(hw, np.uint8)
    cv2.fillPoly(full, [poly.astype(np.int32)], 1)
    return cv2.resize(full, (hw[1] // r, hw[0] // r))


def reduced_mask(poly: np.ndarray, hw: tuple[int, int], r: int) -> np.ndarray:
    out = np.zeros((hw[0] // r, hw[1] // r), np.uint8)
    # reduced pixel X is centred on full-size coordinate r * X + (r - 1) / 2
    pts = np.round((poly.astype(np.int32) - (r - 1) / 2) / r * (1 << SHIFT)).astype(np.int32)
    cv2.fillPoly(out, [pts], 1, shift=SHIFT)
    return out


def iou(a: np.ndarray, b: np.ndarray) -> float:
    union = np.logical_or(a, b).sum()
    return 1.0 if union == 0 else float(np.logical_and(a, b).sum() / union)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ratio", type=int, default=4)
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    cv2.setNumThreads(1)
    rng = np.random.default_rng(a.seed)
    hw = (a.imgsz, a.imgsz)
    batch = [star_polygons(rng, a.imgsz, a.instances) for _ in range(a.batch)]
    ways = {"full": full_mask, "block": lambda p, s, r: polygon_mask(p, s, r), "reduced": reduced_mask}
    ref = [[full_mask(p, hw, a.ratio) for p in image] for image in batch]
    print(f"imgsz {a.imgsz}, batch {a.batch}, {a.instances} instances of 1000 points per image, mask_ratio {a.ratio}, "
          f"OpenCV {cv2.__version__}, one thread")
    print("| way | ms per batch | mean IoU with full | min IoU | instances >= 0.99 |")
    print("|---|---:|---:|---:|---:|")
    for name, fn in ways.items():
        ms = best_ms(lambda: [[fn(p, hw, a.ratio) for p in image] for image in batch], a.repeat)
        ious = np.array([iou(fn(p, hw, a.ratio), m) for image, refs in zip(batch, ref) for p, m in zip(image, refs)])
        print(f"| {name} | {ms:.2f} | {ious.mean():.4f} | {ious.min():.4f} | {(ious >= 0.99).mean():.1%} |")


if __name__ == "__main__":
    main()
