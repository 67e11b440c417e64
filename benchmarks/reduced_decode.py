"""Reduced-DCT JPEG decode (``CPUOptions(decode_scale="reduced")``) against the full decode, side by side.

For each ``--imgsz`` on coco128 (640-pixel photographs, so 320 means a 1/2-scale and 160 a 1/4-scale
DCT decode, 640 none): CPU ms per loaded image (decode + resize to the loaded shape, one core) for
both paths, the pixel difference of the loaded images (mean over images, worst image, identical
images), and the loader from JPEG files without the decode cache (validation rect batches, 2
workers: decode-bound), both paths interleaved in rounds.

    python benchmarks/reduced_decode.py --imgsz 320,160,640
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import cv2
import numpy as np

REPO = Path(__file__).resolve().parents[1]
COCO128 = Path(os.environ.get("FASTLOAD_COCO128", REPO.parent / "shared" / "datasets" / "coco128"))


def per_image(store, imgsz: int, reduced: bool, rounds: int) -> float:
    """Best-of-``rounds`` CPU ms per ``store.load`` over all images."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.process_time()
        for i in range(len(store)):
            store.load(i, imgsz, reduced=reduced)
        best = min(best, (time.process_time() - t0) / len(store) * 1e3)
    return best


def loader_rate(yaml_path: Path, imgsz: int, reduced: bool, seconds: float) -> float:
    from fastload.fastloader import loader

    with loader(yaml_path, split="train", imgsz=imgsz, batch_size=32, store="files", augment=False, rect=True,
                pad=0.5, workers=2,
                engine_options={"decode_cache_mb": 0, "decode_scale": "reduced" if reduced else "full"}) as fl:
        it = iter(fl)
        next(it)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            try:
                n += next(it)[0].shape[0]
            except StopIteration:
                it = iter(fl)
        return n / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--imgsz", default="320,160,640", help="comma list of image sizes")
    ap.add_argument("--seconds", type=float, default=4.0, help="loader seconds per path and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    yaml_path = COCO128 / "coco128.yaml"
    if not yaml_path.is_file():
        print(f"coco128 not found at {COCO128} (set FASTLOAD_COCO128)")
        return 2
    from fastload.store.factory import open_store

    cv2.setNumThreads(0)
    out = {}
    print(f"reduced-DCT decode vs full decode, coco128 (128 JPEGs, 640 px long side), OpenCV {cv2.__version__}")
    print("| imgsz | full ms/img | reduced ms/img | speed-up | mean abs diff | worst image | identical images "
          "| loader full img/s | loader reduced img/s | loader ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for imgsz in (int(v) for v in args.imgsz.split(",")):
        with open_store(yaml_path, "train", kind="files", imgsz=imgsz) as store:
            diffs = []
            for i in range(len(store)):
                a = store.load(i, imgsz).astype(np.int16)
                b = store.load(i, imgsz, reduced=True).astype(np.int16)
                assert a.shape == b.shape, (store.im_files[i], a.shape, b.shape)
                diffs.append(float(np.abs(a - b).mean()))
            full, red = per_image(store, imgsz, False, args.rounds), per_image(store, imgsz, True, args.rounds)
        rates: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):  # interleaved: the machine's drift hits both paths alike
            for reduced in (False, True):
                rates[reduced].append(loader_rate(yaml_path, imgsz, reduced, args.seconds))
        ratio = float(np.median([b / a for a, b in zip(rates[False], rates[True])]))
        lf, lr = float(np.median(rates[False])), float(np.median(rates[True]))
        row = {"full_ms": full, "reduced_ms": red, "mean_abs_diff": float(np.mean(diffs)), "worst_image_diff": max(diffs),
               "identical_images": int(sum(d == 0 for d in diffs)), "loader_full": lf, "loader_reduced": lr,
               "loader_ratio": ratio}
        out[imgsz] = row
        print(f"| {imgsz} | {full:.2f} | {red:.2f} | {full / red:.2f}x | {row['mean_abs_diff']:.2f} | "
              f"{row['worst_image_diff']:.2f} | {row['identical_images']} | {lf:.0f} | {lr:.0f} | {ratio:.2f}x |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
