"""Time to the first batch after ``load_state_dict`` at 90 % of an epoch, beside the same at 0 %.

A synthetic training set of ``--images`` small images (JPEG/PNG files, cpu engine, ``--workers`` workers,
no decoded cache). One loader runs the first 90 % of epoch 0 and saves its state there; that run's time is
what a resume that replays the skipped batches (``next()`` N times) would cost. Then, in alternating rounds,
a fresh loader is built, given the state of 0 % or of 90 %, and timed to its first batch; the renders and
decodes it counted by then (those of the delivered batch) show that nothing before the position was decoded.

    PYTHONPATH=$PWD python3 benchmarks/resume_cost.py --images 10000 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import fastload
from fastload.data.synthetic import make_synthetic_dataset


def build(data: Path, args: argparse.Namespace) -> fastload.FastLoader:
    return fastload.loader(data, imgsz=args.imgsz, batch_size=args.batch, store="files", workers=args.workers, seed=0,
                           engine_options={"decode_cache_mb": 0})


def first_batch_after(data: Path, state: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    """Build a loader, load ``state``, take one batch: seconds for each step and the engine's counters."""
    t0 = time.perf_counter()
    fl = build(data, args)
    t1 = time.perf_counter()
    try:
        fl.load_state_dict(state)
        next(iter(fl))
        t2 = time.perf_counter()
        stats = fl.stats()
    finally:
        fl.close()
    return {"build_s": t1 - t0, "first_batch_s": t2 - t1, "batches": stats["batches"], "decodes": stats["decodes"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=10000, help="synthetic training images (one epoch)")
    ap.add_argument("--imgsz", type=int, default=64, help="the loader's image size")
    ap.add_argument("--batch", type=int, default=16, help="images per batch")
    ap.add_argument("--workers", type=int, default=2, help="the cpu engine's render processes")
    ap.add_argument("--rounds", type=int, default=3, help="resumes timed per side, alternating")
    ap.add_argument("--at", type=float, default=0.9, help="where in the epoch the run is interrupted")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="fastload-resume-") as tmp:
        t0 = time.perf_counter()
        data = make_synthetic_dataset(tmp, n_train=args.images, n_val=0, min_size=32, max_size=96, seed=0)
        print(f"{args.images} synthetic images written in {time.perf_counter() - t0:.1f} s")
        with build(data, args) as fl:
            start = fl.state_dict()
            position = int(len(fl) * args.at)
            t0 = time.perf_counter()
            it = iter(fl)
            for _ in range(position):
                next(it)
            replay_s = time.perf_counter() - t0
            interrupted = fl.state_dict()
            del it
        print(f"epoch of {len(fl)} batches of {args.batch}; rendering the first {position} (what replaying them on "
              f"resume costs): {replay_s:.2f} s")
        results: dict[str, list[dict[str, float]]] = {"0%": [], f"{args.at:.0%}": []}
        for _ in range(args.rounds):  # the two sides alternate, so that a change of machine load hits both
            for name, state in zip(results, (start, interrupted)):
                results[name].append(first_batch_after(data, state, args))
    print(f"\n| resumed at | build s | time to first batch s | batches delivered | decodes |  (median of {args.rounds})")
    print("|---|---:|---:|---:|---:|")
    for name, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"| {name} | {med['build_s']:.3f} | {med['first_batch_s']:.3f} | {med['batches']:.0f} | {med['decodes']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"replay_s": replay_s, "position": position, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
