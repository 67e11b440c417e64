"""Ultralytics' own training loader beside fastload's (fastload.compat.ultralytics), in one run.

    python benchmarks/ultralytics_loader.py                              # 256 images, imgsz 640, batch 32, 2 workers
    python benchmarks/ultralytics_loader.py --images 512 --seconds 12 --rounds 3 --json /tmp/ultralytics_loader.json
    python benchmarks/ultralytics_loader.py --recipe yolov9              # fastload drawing YOLOv9's recipe instead

Dataset: coco128 repeated to ``--images`` images (symlinks, see loader_throughput.py). Every loader is built
from the same Ultralytics argument namespace (its defaults: mosaic 1.0, scale 0.5, translate 0.1, HSV
0.015/0.7/0.4, fliplr 0.5, no mixup) and iterated as its trainer would, with ``--workers`` workers:

* Ultralytics: its ``YOLODataset`` in its ``InfiniteDataLoader`` (``build_yolo_dataset`` / ``build_dataloader``),
  without a cache and with ``cache="ram"``;
* fastload: the loader ``FastloadTrainer`` builds (``build_loader``, ``--recipe`` with those hyperparameters:
  ``ultralytics``, its default, with Ultralytics' mosaic partners, or ``yolov9``), from the image files, from
  an LMDB store, from the shared ram store (``cache="ram"``) and from the packed disk store (``cache="disk"``), HSV
  in the workers; the files as on a
  dataset larger than memory (no decoded-image cache, mosaic partners from the batch: one decode per image);
  and the ram and disk stores with HSV left to the consumer's device, not applied here: what a CUDA trainer's
  batches cost the CPU (``--recipe yolov9``: ram only, ``hsv_on="defer"``; ``ultralytics``, whose additive hue is
  applied on the consumer's device by ``FastloadTrainer`` on CUDA, never deferred: drawn with HSV gains 0, the
  same CPU work). fastload's loaders are built for a trainer on ``--model-device`` (default cuda: channels-last
  batches, as ``FastloadTrainer`` gives a CUDA trainer, whose model is channels-last); every loader's batches
  stay on the CPU.

Each configuration is timed for ``--seconds`` after a warm-up batch, in ``--rounds`` interleaved rounds
(median round shown; ratios are the medians of same-round ratios to the Ultralytics rows). ``--cold`` copies the
images instead of linking them and drops them and the stores from the page cache before every measurement: a
dataset larger than memory, read from the disk (give enough ``--images`` that a measurement never reads one
twice). ``--pss`` also
runs 2 processes (standing for 2 DDP ranks) x ``--workers`` workers with ``cache="ram"`` each way and sums
their PSS: Ultralytics holds one cache per rank, fastload one ram store per machine.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

os.environ.setdefault("YOLO_VERBOSE", "False")  # before ultralytics is imported: no per-dataset progress bars
os.environ.setdefault("YOLO_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loader_throughput import COCO128, make_repeated, pss_of_tree, time_batches  # noqa: E402  (a sibling script)

ULTRALYTICS = ("ultralytics, no cache", "ultralytics, cache ram")


def ultralytics_args(yaml_path: Path, imgsz: int, batch: int, workers: int, cache: Any,
                     hsv: bool = True, task: str = "detect") -> tuple[Any, dict[str, Any]]:
    """Ultralytics' arguments (its defaults but these) and its dataset dict; ``hsv=False``: HSV gains 0."""
    from ultralytics.cfg import get_cfg
    from ultralytics.data.utils import check_det_dataset

    no_hsv = {} if hsv else {"hsv_h": 0.0, "hsv_s": 0.0, "hsv_v": 0.0}
    args = get_cfg(overrides={"data": str(yaml_path), "imgsz": imgsz, "batch": batch, "workers": workers,
                              "cache": cache, "task": task, **no_hsv})
    return args, check_det_dataset(str(yaml_path))


def ultralytics_loader(yaml_path: Path, imgsz: int, batch: int, workers: int, cache: Any, task: str = "detect") -> Any:
    from ultralytics.data import build_dataloader, build_yolo_dataset

    args, data = ultralytics_args(yaml_path, imgsz, batch, workers, cache, task=task)
    dataset = build_yolo_dataset(args, data["train"], batch, data, mode="train", stride=32)
    return build_dataloader(dataset, batch, workers, shuffle=True, rank=-1)


def fastload_loader(yaml_path: Path, imgsz: int, batch: int, workers: int, cache: Any, recipe: str,
                    store: str = "auto", hsv: bool = True, model_device: str = "cuda", task: str = "detect") -> Any:
    """The loader FastloadTrainer builds for a trainer on ``model_device``, its batches kept on the CPU
    (``fastload_device=None``, as Ultralytics' rows): on cuda channels-last, as the trainer's model there."""
    import torch

    from fastload.compat.ultralytics import UltralyticsOptions
    from fastload.compat.ultralytics.loader import LoaderRequest, build_loader

    args, data = ultralytics_args(yaml_path, imgsz, batch, workers, cache, hsv, task)
    opts = UltralyticsOptions(recipe=recipe, num_workers=workers, store=store, device=None)
    request = LoaderRequest(data["train"], batch, "train", rect=False, stride=32, device=torch.device(model_device))
    return build_loader(args, data, request, opts)


def layout_of(model_device: str) -> str:
    """The batch layout FastloadTrainer gives a trainer on ``model_device`` (the plain loaders below take it too)."""
    return "nhwc" if model_device == "cuda" else "nchw"


def decode_bound_loader(yaml_path: Path, imgsz: int, batch: int, workers: int, recipe: str, model_device: str) -> Any:
    """The image files as on a dataset larger than memory: no decoded-image cache, mosaic partners from the
    batch (one decode per image), as docs/benchmarks.md's decode-bound rows."""
    from fastload.augment.hyp import AUGMENT_KEYS
    from fastload.fastloader import loader

    args, _ = ultralytics_args(yaml_path, imgsz, batch, workers, False)
    return loader(yaml_path, imgsz=imgsz, batch_size=batch, workers=workers, partners="batch", recipe=recipe,
                  layout=layout_of(model_device),
                  engine_options={"decode_cache_mb": 0}, hyp={k: float(getattr(args, k)) for k in AUGMENT_KEYS})


def deferred_hsv_loader(yaml_path: Path, imgsz: int, batch: int, workers: int, model_device: str) -> Any:
    """The ram-store loader with the same hyperparameters, HSV gains left for the consumer's device."""
    from fastload.augment.hyp import AUGMENT_KEYS
    from fastload.fastloader import loader

    args, _ = ultralytics_args(yaml_path, imgsz, batch, workers, "ram")
    return loader(yaml_path, imgsz=imgsz, batch_size=batch, workers=workers, store="ram", hsv_on="defer",
                  layout=layout_of(model_device),
                  hyp={k: float(getattr(args, k)) for k in AUGMENT_KEYS})


def measure(make: Callable[[], Any], seconds: float, *, kind: str) -> dict[str, Any]:
    """Images/s and CPU ms per image of one freshly built loader (``kind``: ultralytics or official, a torch
    ``InfiniteDataLoader`` yielding dicts or tuples; fastload, the Ultralytics layer's dicts; plain, fastload's tuples)."""
    ld = make()
    try:
        if kind in ("ultralytics", "official"):
            batches: Callable[[], Iterable] = (lambda: ((b["img"],) for b in ld)) if kind == "ultralytics" else (lambda: ld)
            pids = lambda _: [w.pid for w in getattr(ld.iterator, "_workers", [])]  # noqa: E731
        elif kind == "fastload":
            batches = lambda: ((b["img"],) for b in ld)  # noqa: E731
            pids = lambda _: ld.stats()["worker_pids"]  # noqa: E731
        else:
            batches, pids = (lambda: ld), (lambda _: ld.stats()["worker_pids"])
        return time_batches(batches, seconds, pids=pids)
    finally:
        close = getattr(ld, "close", None)
        if close is not None:
            close()


def configurations(yaml_path: Path, lmdb_yaml: Path, disk_yaml: Path,
                   a: argparse.Namespace) -> dict[str, tuple[Callable[[], Any], str]]:
    size = (a.imgsz, a.batch, a.workers)
    on = {"model_device": a.model_device}
    configs = {
        "ultralytics, no cache": (lambda: ultralytics_loader(yaml_path, *size, False), "ultralytics"),
        "ultralytics, cache ram": (lambda: ultralytics_loader(yaml_path, *size, "ram"), "ultralytics"),
        "fastload files": (lambda: fastload_loader(yaml_path, *size, False, a.recipe, **on), "fastload"),
        "fastload lmdb": (lambda: fastload_loader(yaml_path, *size, False, a.recipe, store=str(lmdb_yaml), **on),
                          "fastload"),
        "fastload files, batch partners, no decode cache": (lambda: decode_bound_loader(yaml_path, *size, a.recipe, **on),
                                                            "plain"),
        "fastload ram (cache ram)": (lambda: fastload_loader(yaml_path, *size, "ram", a.recipe, **on), "fastload"),
        "fastload disk (cache disk)": (lambda: fastload_loader(yaml_path, *size, "disk", a.recipe, store=str(disk_yaml), **on),
                                       "fastload"),
    }
    if a.recipe == "yolov9":  # the ultralytics recipe's additive hue is never deferred (loader() refuses it)
        configs["fastload ram, HSV deferred to device"] = (lambda: deferred_hsv_loader(yaml_path, *size, **on), "plain")
    else:  # on CUDA FastloadTrainer applies it on the device: what the CPU does then, without HSV's GPU cost
        configs["fastload ram, HSV on the device (not run here)"] = (
            lambda: fastload_loader(yaml_path, *size, "ram", a.recipe, hsv=False, **on), "fastload")
        configs["fastload disk, HSV on the device (not run here)"] = (
            lambda: fastload_loader(yaml_path, *size, "disk", a.recipe, store=str(disk_yaml), hsv=False, **on),
            "fastload")
    return configs


# ----------------------------------------------------------------------------------------- PSS
def _pss_rank(way: str, yaml_path: str, imgsz: int, batch: int, workers: int, recipe: str, out: str, done: Any) -> None:
    """One stand-in rank: a ``cache="ram"`` loader, three batches, its process ids written, then held until measured."""
    if way == "ultralytics":
        ld = ultralytics_loader(Path(yaml_path), imgsz, batch, workers, "ram")
    else:
        ld = fastload_loader(Path(yaml_path), imgsz, batch, workers, "ram", recipe)
    it = iter(ld)
    for _ in range(3):
        next(it)
    if way == "ultralytics":
        pids, segment = [w.pid for w in ld.iterator._workers], None
    else:
        pids, segment = ld.stats()["worker_pids"], str(ld.loader.store.path)
    Path(out).write_text(json.dumps({"pids": [os.getpid(), *pids], "segment": segment}))
    done.wait()
    del it
    if way == "fastload":
        ld.close()


def measure_pss(way: str, yaml_path: Path, a: argparse.Namespace, ranks: int = 2) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    done = ctx.Event()
    with tempfile.TemporaryDirectory() as d:
        outs = [str(Path(d) / f"rank{k}.json") for k in range(ranks)]
        procs = [ctx.Process(target=_pss_rank, args=(way, str(yaml_path), a.imgsz, a.batch, a.workers, a.recipe, o, done))
                 for o in outs]
        for p in procs:
            p.start()
        try:
            while not all(Path(o).exists() for o in outs):
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"a {way} rank failed")
                procs[0].join(0.2)
            info = [json.loads(Path(o).read_text()) for o in outs]
            pids = [p for i in info for p in i["pids"]]
            res = pss_of_tree(pids, info[0]["segment"])
            res["processes"] = len(pids)
        finally:
            done.set()
            for p in procs:
                p.join(60)
    return res


# ----------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    from fastload.augment.params import RECIPES

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=256, help="coco128 repeated to this many images")
    ap.add_argument("--imgsz", type=int, default=640, help="Ultralytics' imgsz")
    ap.add_argument("--batch", type=int, default=32, help="images per batch")
    ap.add_argument("--workers", type=int, default=2, help="worker processes of every loader")
    ap.add_argument("--seconds", type=float, default=8.0, help="timed seconds per configuration and round")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (the median round is shown)")
    ap.add_argument("--recipe", choices=RECIPES, default="ultralytics",
                    help="fastload's augmentation recipe (default: FastloadTrainer's, ultralytics)")
    ap.add_argument("--model-device", choices=("cuda", "cpu"), default="cuda",
                    help="the trainer device fastload's loaders are built for (batches stay on the CPU either way): "
                         "cuda, channels-last batches as FastloadTrainer gives a CUDA trainer (default); cpu, "
                         "contiguous, with the transposing copy Ultralytics' own loader also makes")
    ap.add_argument("--pss", action="store_true", help="also the PSS of 2 processes x workers with cache='ram'")
    ap.add_argument("--cold", action="store_true",
                    help="a cold disk: the images copied (not linked) and dropped from the page cache before every "
                         "measurement (give enough --images that a measurement never reads one twice)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    from fastload.bench.pagecache import drop
    from fastload.store.convert import convert

    with tempfile.TemporaryDirectory(prefix="fastload-ultra-bench-") as tmp:
        work = Path(tmp)
        os.environ.setdefault("FASTLOAD_SHM_DIR", str(work / "shm"))
        (work / "shm").mkdir(exist_ok=True)
        yaml_path = make_repeated(COCO128 / "coco128.yaml", work / "data", a.images, copies=a.cold)
        quiet = dict(imgsz=a.imgsz, splits="train", progress=False, log=lambda _: None)
        convert(yaml_path, "lmdb", out=work / "lmdb", **quiet)
        # the recipe's loaded images, as `cache="disk"` reads them (Ultralytics' rule for its recipe)
        convert(yaml_path, "disk", out=work / "disk", load_rule="ultralytics" if a.recipe == "ultralytics" else "yolov9",
                **quiet)
        configs = configurations(yaml_path, work / "lmdb" / "data.yaml", work / "disk" / "data.yaml", a)
        on_disk = sorted(str(p) for d in ("data", "lmdb", "disk") for p in (work / d).rglob("*") if p.is_file())
        rounds: list[dict[str, dict[str, Any]]] = []
        for r in range(a.rounds):
            res = {}
            for name, (make, kind) in configs.items():
                if a.cold:  # every image and store file leaves memory: the measurement reads them from the disk
                    dropped = drop(on_disk)
                    if not dropped.ok:
                        raise SystemExit(f"--cold: the files could not be dropped from the page cache ({dropped.describe()})")
                res[name] = measure(make, a.seconds, kind=kind)
                print(f"round {r + 1}: {name:40s} {res[name]['images_per_s']:8.1f} img/s "
                      f"{res[name]['cpu_ms_per_image']:6.2f} CPU ms/img", flush=True)
            rounds.append(res)
        table = {}
        for name in configs:
            row = {"images_per_s": statistics.median(r[name]["images_per_s"] for r in rounds),
                   "cpu_ms_per_image": statistics.median(r[name]["cpu_ms_per_image"] for r in rounds)}
            for base in ULTRALYTICS:
                row[f"x {base}"] = statistics.median(r[name]["images_per_s"] / r[base]["images_per_s"] for r in rounds)
            table[name] = row
        cold = " (copies, dropped from the page cache before each measurement)" if a.cold else ""
        print(f"\ncoco128 repeated to {a.images} images{cold}, imgsz {a.imgsz}, batch {a.batch}, {a.workers} workers, "
              f"fastload recipe {a.recipe}, batches for a {a.model_device} trainer "
              f"({layout_of(a.model_device)}), {a.rounds} rounds of {a.seconds:g} s (median round; ratios: median same-round ratio)")
        print(f"| configuration | img/s | CPU ms/img | x {ULTRALYTICS[0]} | x {ULTRALYTICS[1]} |")
        print("|---|---:|---:|---:|---:|")
        for name, row in table.items():
            print(f"| {name} | {row['images_per_s']:.1f} | {row['cpu_ms_per_image']:.2f} | "
                  f"{row['x ' + ULTRALYTICS[0]]:.2f} | {row['x ' + ULTRALYTICS[1]]:.2f} |")
        out: dict[str, Any] = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
                               "rounds": rounds, "table": table}
        if a.pss:
            out["pss"] = {way: measure_pss(way, yaml_path, a) for way in ("ultralytics", "fastload")}
            for way, p in out["pss"].items():
                print(f"PSS, 2 processes x (main + {a.workers} workers), cache='ram', {way}: "
                      f"{p['pss_total_MiB']:.0f} MiB over {p['processes']} processes"
                      + (f" ({p['pss_segment_MiB']:.0f} MiB of it the shared ram store)" if way == "fastload" else ""))
        if a.json:
            a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
