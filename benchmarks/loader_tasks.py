"""What a loader task costs per image beside detection, on ONE core: the same data, seed and draws through
``fastload.loader(task=...)``, rendered in the calling process (``workers=0``), so the process CPU time is the whole
cost of a batch (pixels, HSV, labels and, for ``segment``, the masks).

    python benchmarks/loader_tasks.py [--imgsz 640] [--batch 16] [--images 64] [--repeat 2]

A synthetic segment set (``fastload synth --task segment``: ``--images`` images of 96 to 640 px, up to 6 shapes of
exact polygons each) in a temporary folder, its ram store, the default hyp (scratch-high); one epoch per task and
repeat after a first batch, CPU ms per image (process time), and the difference. ``segment`` runs with both
recipes' semantics (``"yolov9"``: the official segment loader's; ``"ultralytics"``) and overlap masks at
``mask_ratio=4``.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fastload  # noqa: E402
from fastload.data.synthetic import make_synthetic_dataset  # noqa: E402

CASES = (("detect", "yolov9"), ("segment", "yolov9"), ("detect", "ultralytics"), ("segment", "ultralytics"))


def cpu_ms_per_image(data: Path, task: str, recipe: str, imgsz: int, batch: int, seed: int,
                     **options: Any) -> tuple[float, int]:
    """CPU ms per image of one epoch after its first batch, and the instances the epoch's batches held
    (``options``: more :func:`fastload.loader` keywords, e.g. ``hsv_on``)."""
    fl = fastload.loader(data, "train", imgsz=imgsz, batch_size=batch, workers=0, store="ram", task=task,
                         recipe=recipe, seed=seed, **options)
    with fl:
        batches = iter(fl)
        next(batches)
        start, images, instances = time.process_time(), 0, 0
        for b in batches:
            images += len(b.paths)
            instances += len(b.targets)
    return (time.process_time() - start) / images * 1000, instances


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    if args.images < 2 * args.batch:  # the first batch is a warm-up: at least one more is timed
        ap.error(f"--images {args.images} gives fewer than two batches of --batch {args.batch}")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("FASTLOAD_SHM_DIR", tmp)  # the ram store's segment goes with the folder
        data = make_synthetic_dataset(Path(tmp) / "seg", n_train=args.images, n_val=0, seed=2, task="segment")
        print(f"{args.images} images, imgsz {args.imgsz}, batch {args.batch}, one core, best of {args.repeat}")
        print(f"{'task':8} {'recipe':12} {'CPU ms / image':>15} {'instances':>10}")
        best: dict[tuple[str, str], float] = {}
        for case in CASES:
            runs = [cpu_ms_per_image(data, *case, args.imgsz, args.batch, seed) for seed in range(args.repeat)]
            best[case] = min(ms for ms, _ in runs)
            print(f"{case[0]:8} {case[1]:12} {best[case]:15.2f} {runs[0][1]:10d}")
        for recipe in ("yolov9", "ultralytics"):
            extra = best[("segment", recipe)] - best[("detect", recipe)]
            print(f"segment - detect ({recipe}): {extra:+.2f} ms per image")


if __name__ == "__main__":
    main()
