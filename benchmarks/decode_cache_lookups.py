"""Decoded-image cache lookups per second, this checkout beside a baseline git ref, in one run.

Every mosaic sample reads 4-9 images through ``SharedDecodeCache.get``, so its common path (an image
this process already knows is published) must stay free of system calls. Measured on a synthetic
encoded store (``--images`` files at ``--imgsz``), each side in its own process and private shm root:

- ``fill``: the first read of every image by the creator (decode + write + publish; the decode dominates);
- ``first look``: a second cache object reads every image once (this checkout: one shared lock per image);
- ``known``: repeated reads of known images (the common path).

Rounds alternate between the two sides so a machine whose speed drifts affects both alike.

    python benchmarks/decode_cache_lookups.py --baseline 16c27f6 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure(images: int, imgsz: int, reads: int) -> dict[str, float]:
    """Lookups per second of the ``fastload`` on ``sys.path`` (the three phases above)."""
    from fastload.data.config import load_data_config
    from fastload.data.synthetic import make_synthetic_dataset
    from fastload.engines.shm_cache import SharedDecodeCache
    from fastload.store.files import FileStore

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["FASTLOAD_SHM_DIR"] = str(Path(tmp) / "shm")
        (Path(tmp) / "shm").mkdir()
        store = FileStore.from_config(load_data_config(make_synthetic_dataset(Path(tmp) / "data", n_train=images, n_val=1)))
        load = lambda i: store.load(i, imgsz)  # noqa: E731
        creator = SharedDecodeCache.open(store, imgsz, "bench", 1 << 30)
        reader = SharedDecodeCache.open(store, imgsz, "bench", 1 << 30)
        assert creator is not None and reader is not None and creator.slots == len(store)
        out = {}
        t0 = time.perf_counter()
        for i in range(len(store)):
            creator.get(i, load)
        out["fill"] = len(store) / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(len(store)):
            reader.get(i, load)
        out["first look"] = len(store) / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for k in range(reads):
            reader.get(k % len(store), load)
        out["known"] = reads / (time.perf_counter() - t0)
        assert reader.misses == 0
        reader.close()
        creator.close()
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default="HEAD~1", help="git ref to compare with (checked out in a temporary worktree)")
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--imgsz", type=int, default=160)
    ap.add_argument("--reads", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(a.images, a.imgsz, a.reads)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(base), a.baseline], check=True)
        try:
            sides = {"baseline": base, "this": REPO}
            runs: dict[str, list[dict[str, float]]] = {k: [] for k in sides}
            for _ in range(a.rounds):
                for name, root in sides.items():
                    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--images", str(a.images),
                           "--imgsz", str(a.imgsz), "--reads", str(a.reads)]
                    env = {**os.environ, "PYTHONPATH": str(root)}
                    runs[name].append(json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True,
                                                                text=True).stdout.splitlines()[-1]))
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=True)
    print(f"lookups/s, median of {a.rounds} rounds ({a.images} images at {a.imgsz} px; baseline {a.baseline})")
    print(f"{'phase':<12}{'baseline':>12}{'this':>12}{'ratio':>8}")
    for phase in runs["this"][0]:
        b, t = (sorted(r[phase] for r in runs[k])[len(runs[k]) // 2] for k in ("baseline", "this"))
        print(f"{phase:<12}{b:>12,.0f}{t:>12,.0f}{t / b:>8.2f}")


if __name__ == "__main__":
    main()
