"""What copy-paste (the segment task) costs, pixels and labels, on ONE core.

    python benchmarks/copy_paste_cost.py [--imgsz 640] [--batch 16] [--repeat 5]

The synthetic segment dataset of benchmarks/geometry_cost.py (smooth random pixels), the default hyp (scratch-high:
``copy_paste`` 0.3), ``--batch`` records per recipe drawn with ``copy_paste`` 0 and 0.3 (the same records but for
the paste). Per batch, best of ``--repeat`` (process CPU time): :func:`~fastload.augment.pipeline.render_sample`
(HSV included) and :func:`~fastload.augment.geometry.transform_geometry`; and how many instances were pasted.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cv2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.geometry_cost import best_ms, world  # noqa: E402
from fastload.augment.geometry import transform_geometry  # noqa: E402
from fastload.augment.params import ParamSampler  # noqa: E402
from fastload.augment.pipeline import render_sample  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    cv2.setNumThreads(1)
    rng = np.random.default_rng(0)
    shapes, labels = world(rng, 64, a.imgsz)
    images = [cv2.GaussianBlur(rng.integers(0, 256, (h, w, 3)).astype(np.uint8), (0, 0), 2.5) for h, w in shapes.tolist()]
    rows = [len(r) for r, _, _ in labels]
    out = np.empty((a.imgsz, a.imgsz, 3), np.uint8)
    print(f"| recipe | copy_paste | render ms / image | labels ms / batch of {a.batch} | instances after the warp |")
    print("|---|---:|---:|---:|---:|")
    for recipe in ("yolov9", "ultralytics"):
        for p in (0.0, 0.3):
            sampler = ParamSampler(shapes, None, a.imgsz, seed=0, recipe=recipe, copy_paste=p, instances=rows)
            records = sampler.sample_batch(0, range(a.batch))

            def render() -> None:
                for r in records:
                    render_sample(r, images.__getitem__, out=out, labels=labels.__getitem__)

            render_ms = best_ms(render, a.repeat) / a.batch
            labels_ms = best_ms(lambda: transform_geometry(records, labels.__getitem__, recipe, "segment"), a.repeat)
            n = len(transform_geometry(records, labels.__getitem__, recipe, "segment"))
            print(f"| {recipe} | {p} | {render_ms:.1f} | {labels_ms:.1f} | {n} |")


if __name__ == "__main__":
    main()
