"""Datasets larger than the decoded-image cache (issue 36): decodes per output image and images/s of the default
partners plan, side by side, with a cache that holds the whole decoded set and with one that holds a fraction.

Dataset: ``--images`` small synthetic JPEGs (long side 96-160 px, 1-5 boxes; ``fastload synth``'s generator),
read from their files with the CPU engine at ``--imgsz``. Configurations, each timed in one process, one after
the other in every round (so their ratios hold on a shared machine):

- ``fits, planned``: the default budget (1/8 of RAM) holds every loaded image: the loader plans YOLOv9's
  ``partners="dataset"``; the small-dataset reference;
- ``fits, batch``: the same cache, ``partners="batch"`` (what the plan's draw costs where the cache is no matter);
- ``small, dataset``: ``decode_cache_mb`` set so the cache holds ``1 / --ratio`` of the decoded set, today's
  plan asked for explicitly (``partners="dataset"``): what a large dataset got before the plan;
- ``small, planned``: the same cache, ``partners`` left to the loader (it plans ``"batch"``);
- ``small, batch, latest``: the same, with the cache turning over in epoch order (``decode_cache_keep="latest"``):
  whether the planned ``"batch"`` draw gains from it (its draws are unchanged).

``--recipe ultralytics``: Ultralytics' recipe with its default hyperparameters (read from the installed
``ultralytics``' ``cfg/default.yaml``) and ``partners="recent"``, what the Ultralytics compat layer passes
(Ultralytics' buffer of recent images), in three configurations:

- ``fits, recent``: the default budget holds the decoded set (the small-dataset reference);
- ``small, recent, first``: the small cache keeping its first images, asked for explicitly
  (``decode_cache_keep="first"``): what a large dataset got before the turnover;
- ``small, recent, planned``: the same cache, left to the loader (it plans ``decode_cache_keep="latest"``).

Each runs ``--epochs`` epochs; the first fills the cache and the rest are the steady state that is reported
(decodes counted by the engine, per output image; images/s; and CPU ms per image of the consumer and its
workers, which a machine shared with other work disturbs less than images/s). What decides the outcome is the
ratio of the cache to the decoded set, not the number of images: a few thousand images stand for COCO or
Objects365 at 640.

    python benchmarks/decode_plan.py --images 2000 --imgsz 640 --workers 2 --rounds 3
    python benchmarks/decode_plan.py --images 2000 --imgsz 640 --workers 2 --rounds 3 --recipe ultralytics
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import fastload  # noqa: E402
import psutil  # noqa: E402
from fastload.data.synthetic import make_synthetic_dataset  # noqa: E402
from fastload.engines.shm_cache import decoded_set_bytes  # noqa: E402
from fastload.store.factory import open_store  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=3000)
    p.add_argument("--imgsz", type=int, default=320)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--ratio", type=float, default=5.0, help="the small cache holds 1/RATIO of the decoded set")
    p.add_argument("--epochs", type=int, default=2, help="epochs per configuration (the first fills the cache)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--recipe", choices=("yolov9", "ultralytics"), default="yolov9",
                   help="yolov9: the planned partners; ultralytics: partners='recent' and the cache's turnover")
    p.add_argument("--data", default=None, help="folder of the dataset (made there once; default: a temporary one)")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of this process and ``pids`` (the workers) so far."""
    total = 0.0
    for proc in [psutil.Process()] + [psutil.Process(p) for p in pids]:
        t = proc.cpu_times()
        total += t.user + t.system
    return total


def run_config(data: Path, args: argparse.Namespace, **kw) -> dict:
    """Every epoch of one loader: images, decodes, wall and CPU seconds (consumer and workers); and its plan."""
    epochs = []
    with fastload.loader(data, imgsz=args.imgsz, batch_size=args.batch, workers=args.workers, store="files",
                         recipe=args.recipe, **kw) as fl:
        plan = str(fl.plan) + (f", {fl.cache_plan}" if fl.cache_plan.keep is not None else "")
        for _ in range(args.epochs):
            before = fl.stats()
            cpu = _cpu_seconds(before["worker_pids"])
            t = time.perf_counter()
            for _batch in fl:
                pass
            seconds = time.perf_counter() - t
            after = fl.stats()
            epochs.append({"images": after["images"] - before["images"], "decodes": after["decodes"] - before["decodes"],
                           "seconds": seconds, "cpu_seconds": _cpu_seconds(after["worker_pids"]) - cpu})
        stats = fl.stats()
    return {"plan": plan, "partners": stats["partners"], "partners_by": stats["partners_by"],
            "keep": stats["decode_cache_keep"], "keep_by": stats["decode_cache_keep_by"],
            "cache_slots": stats.get("decode_cache_slots"), "epochs": epochs}


def ultralytics_hyp() -> dict[str, float]:
    """The augmentation hyperparameters of the installed Ultralytics' ``cfg/default.yaml``."""
    import ultralytics
    import yaml
    from fastload.augment.hyp import AUGMENT_KEYS

    cfg = yaml.safe_load((Path(ultralytics.__file__).parent / "cfg" / "default.yaml").read_text())
    return {k: float(cfg[k]) for k in AUGMENT_KEYS}


def configurations(args: argparse.Namespace, small_mb: int) -> dict[str, dict]:
    """The loaders compared, by name (the first is the reference of the ratios)."""
    small = {"decode_cache_mb": small_mb}
    if args.recipe == "ultralytics":
        recent = {"partners": "recent", "hyp": ultralytics_hyp()}
        return {"fits, recent": recent,
                "small, recent, first": {**recent, "engine_options": {**small, "decode_cache_keep": "first"}},
                "small, recent, planned": {**recent, "engine_options": small}}
    return {"fits, planned": {},
            "fits, batch": {"partners": "batch"},
            "small, dataset": {"partners": "dataset", "engine_options": small},
            "small, planned": {"engine_options": small},
            "small, batch, latest": {"engine_options": {**small, "decode_cache_keep": "latest"}}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = Path(args.data) if args.data else Path(tempfile.mkdtemp(prefix="decode_plan_"))
    data = root / "data.yaml"
    if not data.is_file():
        t = time.perf_counter()
        make_synthetic_dataset(root, n_train=args.images, n_val=1, nc=3, seed=0, min_size=96, max_size=160,
                               max_objects=5)
        print(f"made {args.images} images in {time.perf_counter() - t:.0f} s: {root}", flush=True)
    store = open_store(data, split="train", kind="files")
    need = decoded_set_bytes(store, args.imgsz, args.recipe)
    store.close()
    small_mb = max(1, int(need / args.ratio) >> 20)
    print(f"decoded set at {args.imgsz}: {need / 2**20:.0f} MB; small cache: {small_mb} MB", flush=True)
    configs = configurations(args, small_mb)
    ref = next(iter(configs))
    results: dict[str, list[dict]] = {name: [] for name in configs}
    for r in range(args.rounds):
        for name, kw in configs.items():
            res = run_config(data, args, **kw)
            results[name].append(res)
            steady = res["epochs"][1:] or res["epochs"]
            imgs = sum(e["images"] for e in steady)
            print(f"round {r} {name:22s} {res['plan']}: steady {sum(e['decodes'] for e in steady) / imgs:.2f} "
                  f"decodes/output, {imgs / sum(e['seconds'] for e in steady):.0f} img/s, "
                  f"{1e3 * sum(e['cpu_seconds'] for e in steady) / imgs:.2f} CPU ms/img "
                  f"(first epoch {res['epochs'][0]['decodes'] / res['epochs'][0]['images']:.2f}, "
                  f"{res['epochs'][0]['images'] / res['epochs'][0]['seconds']:.0f} img/s)", flush=True)
    print(f"\n{args.images} images 96-160 px at imgsz {args.imgsz}, batch {args.batch}, {args.workers} workers, "
          f"{args.recipe} recipe, small cache 1/{args.ratio:g} of the decoded set; steady epochs, all rounds:")
    print(f"{'configuration':23s} {'partners (by)':24s} {'cache keeps (by)':18s} {'decodes/output':>15s} {'img/s':>7s} "
          f"{'vs fits':>8s} {'CPU ms/img':>11s} {'vs fits':>8s}")
    rate, cpu = {}, {}
    for name, runs in results.items():
        steady = [e for res in runs for e in (res["epochs"][1:] or res["epochs"])]
        imgs = sum(e["images"] for e in steady)
        rate[name] = imgs / sum(e["seconds"] for e in steady)
        cpu[name] = 1e3 * sum(e["cpu_seconds"] for e in steady) / imgs
        plan = f"{runs[0]['partners']} ({runs[0]['partners_by']})"
        keep = f"{runs[0]['keep']} ({runs[0]['keep_by']})"
        print(f"{name:23s} {plan:24s} {keep:18s} {sum(e['decodes'] for e in steady) / imgs:15.2f} {rate[name]:7.0f} "
              f"{rate[name] / rate[ref]:8.2f} {cpu[name]:11.2f} {cpu[ref] / cpu[name]:8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "decoded_bytes": need, "small_mb": small_mb,
                                               "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
