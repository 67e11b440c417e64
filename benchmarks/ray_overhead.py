"""What going through Ray costs: engine="ray" with N actors beside engine="cpu" with N workers, same store.

Dataset: coco128 repeated to ``--images`` images (as in loader_throughput.py), converted to lmdb and disk
stores at ``--imgsz``. On one local Ray instance (this machine's CPUs), each pair is timed in interleaved
rounds and the ratio ray/cpu is taken per round (the same machine load), median over rounds. Both engines
run the same renderer, so the difference is Ray's: task round trips, Ray's own processes, and with
``delivery="object_store"`` (what actors on other nodes use) the copy of every batch into the object
store; the default ``delivery="auto"`` has actors on this node render into shared-memory slots. CPU
ms/img counts every process of this tree (workers, actors and Ray's daemons, which the local instance
starts as our children): on a shared machine the fairer figure than img/s. Also printed:

* the transfer cost of one batch: an actor returning a ready batch-sized array, fetched by ``ray.get``
  one at a time (what a batch costs on top of rendering it, on one node), and an empty call's round trip;
* the render cost of one core (engine="cpu", workers=0), from which docs/gpu-idle.md works out what
  N CPU nodes deliver to one GPU node.

    nice -n 5 python benchmarks/ray_overhead.py --seconds 12 --json ray_overhead.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from fastload.bench.stages import CpuClock

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loader_throughput import COCO128, make_repeated, time_batches  # noqa: E402  (a sibling script)


class _Echo:
    """A Ray actor that hands out one ready batch-sized array: transfer without rendering."""

    def __init__(self, nbytes: int) -> None:
        self.batch = np.random.randint(0, 255, nbytes, np.uint8)

    def batch_(self) -> np.ndarray:
        return self.batch

    def nothing(self) -> None:
        return None


def transfer_cost(ray: Any, nbytes: int, seconds: float) -> dict[str, float]:
    """Milliseconds per ``ray.get`` of a ``nbytes`` result from an actor on this node, one in flight, over
    ``seconds`` (an empty call's round trip beside it)."""
    actor = ray.remote(_Echo).options(num_cpus=1).remote(nbytes)
    ray.get(actor.nothing.remote())

    def per_call(method: Any, seconds: float) -> float:
        ray.get(method.remote())
        t0, k = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            out = ray.get(method.remote())
            k += 1
        del out
        return (time.perf_counter() - t0) / k * 1e3

    try:
        empty = per_call(actor.nothing, 1.0)
        full = per_call(actor.batch_, seconds)
    finally:
        ray.kill(actor)
    return {"empty_call_ms": empty, "batch_ms": full, "batch_MB": nbytes / 1e6, "GBps": nbytes / (full * 1e-3) / 1e9}


def spilled_mib() -> float:
    """MiB the local Ray instance has spilled to disk since it started (0 when it never had to)."""
    from ray._private.internal_api import memory_summary  # `ray memory --stats-only`; no public API has it

    m = re.search(r"Spilled (\d+) MiB", memory_summary(stats_only=True))
    return float(m.group(1)) if m else 0.0


def run(yaml_path: Path, seconds: float, *, min_epochs: int = 0, **kw: Any) -> dict[str, Any]:
    """A loader timed by loader_throughput.time_batches; ``cpu_ms_per_image`` counts this whole process tree
    (fastload bench's clock): the loader's workers, and Ray's own processes and actors (children of the
    process that started the local instance). Processes that end while timed drop out of the count."""
    from fastload.fastloader import loader

    with loader(yaml_path, **kw) as fl:
        clock, t0 = CpuClock(), time.perf_counter()
        res = time_batches(lambda: fl, seconds, min_epochs=min_epochs)
        elapsed = time.perf_counter() - t0
        used = clock.cores_since(elapsed)["cpu_loader_cores"] * elapsed
        stats = fl.stats()
    res.update({k: stats[k] for k in ("slot_batches", "object_store_batches") if k in stats})
    res["cpu_ms_per_image"] = used / max(res["images_per_s"] * res["seconds"], 1) * 1e3  # warm-up batch included
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=12.0, help="timed seconds per configuration (split over the rounds)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2, help="cpu workers and ray actors")
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--object-store-mb", type=int, default=2048,
                    help="object store of the local Ray instance (Ray's default is 30 %% of RAM); spilling to disk, "
                         "if Ray ever needs it, is reported per configuration")
    ap.add_argument("--json", default="ray_overhead.json")
    args = ap.parse_args(argv)
    if not (COCO128 / "coco128.yaml").is_file():
        print(f"coco128 not found at {COCO128} (set FASTLOAD_COCO128)")
        return 2
    import cv2
    import ray

    work = Path(tempfile.mkdtemp(prefix="fastload-ray-bench-"))
    results: dict[str, Any] = {"args": vars(args), "machine": {"cpus": os.cpu_count(), "ray": ray.__version__,
                                                              "opencv": cv2.__version__, "loadavg_start": os.getloadavg()}}
    try:
        from fastload.store.convert import convert

        src = make_repeated(COCO128 / "coco128.yaml", work / "data", args.images)
        y = convert(src, to="lmdb,disk", out=work / "stores", imgsz=args.imgsz, splits="train", progress=False,
                    log=lambda *_: None).yaml_path

        def start_ray() -> None:
            ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                     object_store_memory=args.object_store_mb << 20)

        batch_bytes = args.batch * args.imgsz * args.imgsz * 3
        common = dict(imgsz=args.imgsz, batch_size=args.batch)
        cpu = dict(engine="cpu", workers=args.workers, **common)
        rayk = dict(engine="ray", engine_options={"actors": args.workers}, **common)
        ray_store = dict(engine="ray", engine_options={"actors": args.workers, "delivery": "object_store"}, **common)
        # name -> (baseline name or "-", run); pairs share everything but the engine
        configs: dict[str, tuple[str, Callable[[float], dict]]] = {
            "cpu disk": ("-", lambda t: run(y, t, store="disk", **cpu)),
            "ray disk": ("cpu disk", lambda t: run(y, t, store="disk", **rayk)),
            # what actors on other nodes use: every batch through the object store
            "ray disk, object store": ("cpu disk", lambda t: run(y, t, store="disk", **ray_store)),
            "cpu disk, HSV deferred": ("-", lambda t: run(y, t, store="disk", hsv_on="defer", **cpu)),
            "ray disk, HSV deferred": ("cpu disk, HSV deferred", lambda t: run(y, t, store="disk", hsv_on="defer", **rayk)),
            # encoded store: every read decodes (a dataset larger than the cache), then the machine's decoded cache
            "cpu lmdb, no decode cache": ("-", lambda t: run(
                y, t, store="lmdb", **{**cpu, "engine_options": {"decode_cache_mb": 0}})),
            "ray lmdb, no decode cache": ("cpu lmdb, no decode cache", lambda t: run(
                y, t, store="lmdb", **{**rayk, "engine_options": {"actors": args.workers, "decode_cache_mb": 0}})),
            "cpu lmdb (decode cache)": ("-", lambda t: run(y, t, store="lmdb", min_epochs=2, **cpu)),
            "ray lmdb (decode cache)": ("cpu lmdb (decode cache)", lambda t: run(y, t, store="lmdb", min_epochs=2, **rayk)),
            "render, 1 core (cpu, workers 0)": ("-", lambda t: run(y, t, store="disk", **{**cpu, "workers": 0})),
        }
        rounds: dict[str, list[dict]] = {name: [] for name in configs}
        for r in range(args.rounds):
            # A fresh local instance per round: on this machine, an instance that had served several short-lived
            # loaders in a row began spilling delivered batches to disk (the spilled column shows it if it recurs)
            if ray.is_initialized():
                ray.shutdown()
            start_ray()
            for name, (_, fn) in configs.items():
                try:
                    rounds[name].append(fn(args.seconds / args.rounds))
                except Exception as e:  # one broken configuration must not hide the others
                    rounds[name].append({"error": f"{type(e).__name__}: {e}"})
                got = rounds[name][-1]
                got["spilled_MiB"] = spilled_mib()
                print(f"  round {r + 1}/{args.rounds} {name:34s} {got.get('images_per_s', float('nan')):8.1f} img/s "
                      f"(object store: {got['spilled_MiB']:.0f} MiB spilled this round) {got.get('error', '')}", flush=True)
        # after the loaders: the object store's pages have been touched once (its first pass is slower)
        results["transfer"] = transfer_cost(ray, batch_bytes, min(args.seconds / 3, 4.0))
        results["configs"] = {}
        print(f"\nengine='ray' ({args.workers} actors) vs engine='cpu' ({args.workers} workers): {args.images} images "
              f"(coco128 x{args.images // 128}), batch {args.batch}, imgsz {args.imgsz}, {args.seconds:.0f} s per "
              f"configuration in {args.rounds} interleaved rounds (median), {os.cpu_count()} CPUs, Ray {ray.__version__}")
        print(f"| {'configuration':34s} | {'img/s':>8s} | {'vs':26s} | {'ratio':>6s} | {'overhead':>8s} | {'CPU ms/img':>10s} |")
        print(f"|{'-' * 36}|{'-' * 10}|{'-' * 28}|{'-' * 8}|{'-' * 10}|{'-' * 12}|")
        for name, (base, _) in configs.items():
            ok = [x for x in rounds[name] if "images_per_s" in x]
            res: dict[str, Any] = {"rounds": rounds[name], "baseline": base}
            ips = float(np.median([x["images_per_s"] for x in ok])) if ok else float("nan")
            cpu_ms = float(np.median([x["cpu_ms_per_image"] for x in ok])) if ok else float("nan")
            ratio = float("nan")
            if base != "-":
                pairs = [a["images_per_s"] / b["images_per_s"] for a, b in zip(rounds[name], rounds[base])
                         if "images_per_s" in a and b.get("images_per_s")]
                ratio = float(np.median(pairs)) if pairs else float("nan")
            res.update(images_per_s=ips, cpu_ms_per_image=cpu_ms, ratio=ratio)
            results["configs"][name] = res
            overhead = f"{(1 - ratio) * 100:7.1f}%" if ratio == ratio else "-".rjust(8)
            print(f"| {name:34s} | {ips:8.1f} | {base:26s} | {ratio:6.2f} | {overhead} | {cpu_ms:10.2f} |"
                  .replace("|    nan |", "|      - |"))
        t = results["transfer"]
        one_core = results["configs"]["render, 1 core (cpu, workers 0)"]
        render_ms = one_core["cpu_ms_per_image"]
        print(f"transfer of one batch ({t['batch_MB']:.1f} MB) from an actor on this node: {t['batch_ms']:.2f} ms "
              f"({t['GBps']:.2f} GB/s, {t['batch_ms'] / args.batch:.3f} ms per image); an empty call {t['empty_call_ms']:.2f} ms")
        print(f"render cost on one core: {render_ms:.2f} ms of CPU per image (engine='cpu', workers 0: "
              f"{one_core['images_per_s']:.0f} img/s on a core it shared); the transfer is "
              f"{t['batch_ms'] / args.batch / render_ms * 100:.0f} % of it")
        cfg = results["configs"]
        for ray_name, cpu_name in (("ray disk", "cpu disk"), ("ray disk, object store", "cpu disk"),
                                   ("ray disk, HSV deferred", "cpu disk, HSV deferred")):
            extra = cfg[ray_name]["cpu_ms_per_image"] - cfg[cpu_name]["cpu_ms_per_image"]
            print(f"{ray_name}: img/s {cfg[ray_name]['ratio']:.2f}x {cpu_name}; CPU time per image {extra:+.2f} ms "
                  f"({extra / cfg[cpu_name]['cpu_ms_per_image'] * 100:+.0f} %)")
        for name, c in cfg.items():
            via = [(x.get("slot_batches", 0), x.get("object_store_batches", 0)) for x in c["rounds"] if "images_per_s" in x]
            if name.startswith("ray") and via:
                print(f"{name}: batches through shared-memory slots / the object store, all rounds: "
                      f"{sum(a for a, _ in via)} / {sum(b for _, b in via)}")
        goal = cfg["ray disk"]["ratio"]
        print(f"goal: overhead of going through Ray <= 15 % (ray disk vs cpu disk, img/s): {(1 - goal) * 100:.1f} % -> "
              f"{'MET' if goal >= 0.85 else 'missed'}")
        from ray._private.internal_api import memory_summary  # `ray memory --stats-only`; no public API has it

        results["object_store"] = summary = " ".join(memory_summary(stats_only=True).split())
        print(f"object store at the end: {summary}")
        results["machine"]["loadavg_end"] = os.getloadavg()
        print(f"load average start {results['machine']['loadavg_start']}, end {results['machine']['loadavg_end']}")
        Path(args.json).write_text(json.dumps(results, indent=1, default=float))
        print(f"wrote {args.json}")
    finally:
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
