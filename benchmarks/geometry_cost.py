"""What moving segment labels and building their masks costs per batch, fastload beside Ultralytics, on ONE core.

    python benchmarks/geometry_cost.py [--imgsz 640] [--batch 16] [--ratio 4] [--repeat 5]

A synthetic dataset (64 images, loaded long side ``--imgsz``, 3 to 11 star-shaped polygons of 10 to 60 vertices
each, as COCO's are), the default hyp (mosaic, scale 0.9, translate 0.1, fliplr), one batch of ``--batch`` records
per recipe. Per batch, best of ``--repeat`` (process CPU time):

* fastload: :func:`~fastload.augment.geometry.transform_geometry` (boxes and polygons of the batch) and
  :func:`~fastload.augment.masks.batch_masks` (overlap masks at ``--ratio``), for both recipes;
* Ultralytics 8.4 (when installed): the label steps of the same records with the same draws
  (tests/reference/geometry_replay.py): a deep copy of each image's label (its dataset's ``get_image_and_label``),
  ``Mosaic``'s label steps, ``RandomPerspective.apply_instances``, ``RandomFlip``, ``Format`` with its overlap masks.
  Its labels are resampled beforehand, once, as its dataset does when it loads them.

YOLOv9's loader does its label work inside ``__getitem__`` with the pixels, so it has no row here.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from copy import deepcopy
from pathlib import Path
from typing import Callable

import cv2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastload.augment.geometry import transform_geometry  # noqa: E402
from fastload.augment.masks import batch_masks  # noqa: E402
from fastload.augment.params import ParamSampler  # noqa: E402
from tests.reference.geometry_replay import (recording_draws, ultralytics_label, ultralytics_modules,  # noqa: E402
                                             ultralytics_sample)


def world(rng: np.random.Generator, n: int, imgsz: int):
    shapes, labels = [], []
    for _ in range(n):
        shapes.append((imgsz, int(rng.integers(imgsz * 2 // 3, imgsz + 1))))
        rows, pts = [], []
        for _ in range(int(rng.integers(3, 12))):
            centre, size, k = rng.uniform(0.2, 0.8, 2), rng.uniform(0.03, 0.4), int(rng.integers(10, 61))
            ang = np.sort(rng.uniform(0, 2 * np.pi, k))
            p = centre + size * rng.uniform(0.4, 1, (k, 1)) * np.stack([np.cos(ang), np.sin(ang)], 1)
            p = np.clip(p, 0, 1).astype(np.float32)
            lo, hi = p.min(0), p.max(0)
            rows.append([int(rng.integers(0, 80)), *(lo + hi) / 2, *(hi - lo)])
            pts.append(p)
        offsets = np.concatenate([[0], np.cumsum([len(p) for p in pts])]).astype(np.int64)
        labels.append((np.array(rows, np.float32), np.concatenate(pts), offsets))
    return np.array(shapes, np.int64), labels


def best_ms(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ratio", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    cv2.setNumThreads(1)
    shapes, labels = world(np.random.default_rng(0), 64, a.imgsz)
    print(f"imgsz {a.imgsz}, batch {a.batch}, mask_ratio {a.ratio}, overlap masks, one thread")
    print("| recipe | what | ms per batch | instances |")
    print("|---|---|---:|---:|")
    for recipe in ("yolov9", "ultralytics"):
        sampler = ParamSampler(shapes, None, a.imgsz, seed=0, recipe=recipe)
        with recording_draws() as sample:
            pairs = [sample(sampler, 0, i) for i in range(a.batch)]
        records = [r for r, _ in pairs]
        geo = transform_geometry(records, labels.__getitem__, recipe, "segment")
        ms_geo = best_ms(lambda: transform_geometry(records, labels.__getitem__, recipe, "segment"), a.repeat)
        ms_masks = best_ms(lambda: batch_masks(geo, a.batch, a.ratio, True), a.repeat)
        print(f"| {recipe} | fastload transform_geometry | {ms_geo:.1f} | {len(geo)} |")
        print(f"| {recipe} | fastload batch_masks | {ms_masks:.1f} | |")
        if recipe == "ultralytics" and importlib.util.find_spec("ultralytics") is not None:
            u = ultralytics_modules()
            loaded = {i: ultralytics_label(u, "segment", labels[i], tuple(shapes[i])) for i in range(len(shapes))}

            def reference() -> int:
                return sum(len(ultralytics_sample(u, "segment", lambda i, hw: deepcopy(loaded[i]), rec, draws,
                                                  imgsz=a.imgsz, mask_ratio=a.ratio, overlap=True, augment=True)["cls"])
                           for rec, draws in pairs)
            n_ref = reference()
            print(f"| ultralytics | Ultralytics label steps + Format masks | {best_ms(reference, a.repeat):.1f} | {n_ref} |")


if __name__ == "__main__":
    main()
