"""`fastload convert` of this tree beside a git ref's, on a synthetic set of many small images (issue 23).

The set (``--images`` train images of 32-64 px, written by :func:`fastload.data.synthetic.make_synthetic_dataset`)
is converted to ``--to`` by each tree's CLI in its own subprocess (``PYTHONPATH`` at the tree), the two trees
alternating within each of ``--rounds`` interleaved rounds after one warm-up conversion (the scan cache and the
page cache). Printed per tree: the median wall and CPU seconds (user + sys of the process and its pool's
workers) and the median same-round ratio; and, counted in one more conversion each, how many times the
converter fingerprinted the source images (``store.origin.source_fingerprint``: a ``stat`` of every image) and
read the data config from its file, with the seconds they took.

    python benchmarks/convert_cost.py --baseline-ref 8dde2f0 --images 20000 --rounds 6
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loader_throughput import REPO, export_ref  # noqa: E402  (a sibling script)

CLI = "import sys; from fastload.cli import main; sys.exit(main())"

# Run in the tree's interpreter: every module's binding of the two functions is wrapped (the converter imports
# them by name), the conversion runs, and the counts go to the last line of stdout as JSON.
COUNTING = """
import json, sys, time
import fastload
import fastload.data.config as config
import fastload.store.origin as origin
from fastload.cli import main
import fastload.cli.convert_cmd, fastload.store.convert

calls = {"source_fingerprint": [0, 0.0], "config_reads": [0, 0.0]}

def counted(name, fn, reads_only):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            if not (reads_only and isinstance(a[0], config.DataConfig)):  # a DataConfig passed through is no read
                calls[name][0] += 1
                calls[name][1] += time.perf_counter() - t0
    return wrapper

wrapped = {origin.source_fingerprint: counted("source_fingerprint", origin.source_fingerprint, False),
           config.load_data_config: counted("config_reads", config.load_data_config, True)}
for module in list(sys.modules.values()):
    if getattr(module, "__name__", "").startswith("fastload"):
        for attr, value in list(vars(module).items()):
            if callable(value) and value in wrapped:
                setattr(module, attr, wrapped[value])
rc = main(sys.argv[1:])
print(json.dumps({**calls, "fastload_file": fastload.__file__}))
sys.exit(rc)
"""


def convert_once(tree: Path, argv: list[str], out: Path) -> dict[str, float]:
    """Wall and CPU seconds of one `fastload convert` by ``tree`` into a fresh ``out``."""
    shutil.rmtree(out, ignore_errors=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    # cwd: `python -c` puts the working directory first on sys.path, before PYTHONPATH
    proc = subprocess.run([sys.executable, "-c", CLI, *argv, "--out", str(out)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree, timeout=1800)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    shutil.rmtree(out, ignore_errors=True)
    if proc.returncode:
        raise RuntimeError(f"convert by {tree} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return {"wall_s": wall, "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)}


def counts(tree: Path, argv: list[str], out: Path) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-c", COUNTING, *argv, "--out", str(out)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree, timeout=1800)
    shutil.rmtree(out, ignore_errors=True)
    if proc.returncode:
        raise RuntimeError(f"convert by {tree} failed: {proc.stderr.strip().splitlines()[-1:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if not Path(got.pop("fastload_file")).resolve().is_relative_to(tree.resolve()):  # another fastload shadowed it
        raise RuntimeError(f"the conversion counted for {tree} imported another fastload")
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-ref", required=True, metavar="REF", help="the git ref to compare this tree with")
    ap.add_argument("--images", type=int, default=20000, help="synthetic train images")
    ap.add_argument("--to", default="lmdb,disk", help="store kinds to convert to")
    ap.add_argument("--imgsz", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="fastload-convert-cost-"))
    try:
        from fastload.data.synthetic import make_synthetic_dataset

        t0 = time.perf_counter()
        data = make_synthetic_dataset(work / "data", n_train=args.images, n_val=1, min_size=32, max_size=64, seed=0)
        print(f"{args.images} synthetic images written in {time.perf_counter() - t0:.0f} s", flush=True)
        commit = export_ref(args.baseline_ref, work / "baseline")
        trees = {"this": REPO, "baseline": work / "baseline"}
        conv = ["convert", str(data), "--to", args.to, "--imgsz", str(args.imgsz), "--split", "train",
                "--workers", str(args.workers), "--no-progress"]
        convert_once(trees["baseline"], conv, work / "out")  # warm-up: scan cache, page cache
        runs: dict[str, list[dict[str, float]]] = {"this": [], "baseline": []}
        for r in range(args.rounds):
            for side in (("baseline", "this") if r % 2 == 0 else ("this", "baseline")):
                runs[side].append(got := convert_once(trees[side], conv, work / "out"))
                print(f"  round {r + 1}/{args.rounds} {side:8s} {got['wall_s']:6.2f} s wall {got['cpu_s']:6.2f} s CPU",
                      flush=True)
        calls = {side: counts(tree, conv, work / "out") for side, tree in trees.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n`fastload convert --to {args.to} --imgsz {args.imgsz} --workers {args.workers}` of {args.images} images, "
          f"this tree vs {args.baseline_ref} ({commit[:10]}), {args.rounds} interleaved rounds, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| tree | wall s (median) | CPU s (median) | fingerprints (s) | config reads |")
    print("|---|---:|---:|---:|---:|")
    for side in ("baseline", "this"):
        fp, cfg = calls[side]["source_fingerprint"], calls[side]["config_reads"]
        print(f"| {side} | {statistics.median(x['wall_s'] for x in runs[side]):.2f} | "
              f"{statistics.median(x['cpu_s'] for x in runs[side]):.2f} | {fp[0]} ({fp[1]:.3f}) | {cfg[0]} |")
    for key in ("wall_s", "cpu_s"):
        ratios = [a[key] / b[key] for a, b in zip(runs["this"], runs["baseline"])]
        print(f"this / baseline, {key[:-2]}: median of rounds {statistics.median(ratios):.3f} "
              f"(rounds {min(ratios):.3f}-{max(ratios):.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "calls": calls, "baseline_commit": commit,
                                               "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
