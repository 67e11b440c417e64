"""Segment and pose loaders beside the official YOLOv9 and Ultralytics ones, detection's rows again, in one run.

    nice -n 5 python benchmarks/task_loaders.py                          # 256 images a task, imgsz 640, batch 16, 2 workers
    python benchmarks/task_loaders.py --seconds 5 --rounds 3 --json /tmp/task_loaders.json
    python benchmarks/task_loaders.py --tasks segment --rounds 1          # one task's rows
    python benchmarks/task_loaders.py --tasks segment --polygon-memo-mb 0  # as on a set larger than the polygon memo

Data: three synthetic sets of fastload's generator (``make_synthetic_dataset``, the same seed and sizes: ``--images``
images of 96 to 640 px, up to 6 shapes each), ``task="detect"`` (box rows), ``"segment"`` (exact polygons) and
``"pose"`` (5 keypoints); each comparison reads one set, the official loader from a copy of it (the official and
Ultralytics loaders both write ``labels/train.cache``). Every loader: imgsz ``--imgsz``, batch ``--batch``,
``--workers`` workers, a RAM cache, and is timed for ``--seconds`` after a warm-up batch in ``--rounds`` interleaved
rounds (median round shown; ratios are medians of same-round ratios to the task's reference row: of images/s, and
of CPU ms per image over the loader's processes, reference / row, what the ratio is on cores the loaders have to
themselves, which a machine shared with other jobs does not give the images/s):

* the official YOLOv9 ``create_dataloader`` (``utils/dataloaders.py``; segment: ``utils/segment/dataloaders.py``,
  overlap masks, ``mask_downsample_ratio=4``) of a temporary copy of ``--yolov9``, ``cache="ram"``, its
  ``hyp.scratch-high.yaml`` (copy_paste 0.3, mixup 0.15), beside ``fastload.loader`` with the same hyp, the
  ``yolov9`` recipe and ``store="ram"``: HSV deferred to the consumer's device (not applied here) and in the workers;
* Ultralytics' own ``build_yolo_dataset`` + ``build_dataloader`` with ``cache="ram"`` and its defaults for the
  task (segment: overlap masks, ``mask_ratio=4``), beside what ``FastloadTrainer`` builds from the same arguments
  (``ultralytics_loader.py``'s ``fastload_loader``, the ram store): HSV on the consumer's device (drawn with gains 0,
  the same CPU work: its additive hue is applied there by ``FastloadTrainer``) and in the workers.

fastload's batches are built for a CUDA trainer (channels-last views) and kept on the CPU, as the references' are.
Then what bounds fastload's segment rows: the machine's ceilings (``loader_throughput.ceilings``), fastload's
one-core CPU ms per image of each task without workers (``loader_tasks.cpu_ms_per_image``), a profile of one
worker-less segment epoch split into pixels, labels, masks and the rest, and the cost of the masks' transport:
they travel from a worker to the consumer through its pipe (msgpack), not through the shared batch slot.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import multiprocessing as mp
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("YOLO_VERBOSE", "False")  # before ultralytics is imported: no per-dataset progress bars
os.environ.setdefault("YOLO_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loader_tasks import cpu_ms_per_image  # noqa: E402  (sibling scripts)
from loader_throughput import ceilings  # noqa: E402
from ultralytics_loader import fastload_loader, layout_of, measure, ultralytics_args, ultralytics_loader  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_UPSTREAM = REPO.parent / "shared" / "upstream" / "yolov9"
TASKS = ("segment", "pose", "detect")
MASK_RATIO = 4


@dataclass(frozen=True)
class Row:
    """One measured loader: its task, name, how ``measure`` iterates it, how it is built, its reference row."""

    task: str
    name: str
    kind: str
    make: Callable[[], Any]
    reference: str


# ----------------------------------------------------------------------------------------- the loaders
def synthetic_set(folder: Path, images: int, task: str) -> Path:
    """A synthetic training set of ``task`` in ``folder``; its yaml's ``path`` absolute (Ultralytics reads a relative
    one from the working directory) and its ``val`` the training images, as coco128's."""
    import yaml

    from fastload.data.synthetic import make_synthetic_dataset

    yaml_path = make_synthetic_dataset(folder, n_train=images, n_val=0, seed=2, task=task)
    cfg = yaml.safe_load(yaml_path.read_text())
    yaml_path.write_text(yaml.safe_dump({**cfg, "path": str(folder), "val": cfg["train"]}, sort_keys=False))
    return yaml_path


def official_modules(upstream: Path, work: Path) -> tuple[Any, Any, dict[str, Any]]:
    """The official ``utils.dataloaders`` and ``utils.segment.dataloaders`` of a copy of ``upstream``'s ``utils``
    (imported into this process, nothing of it changed), and its ``hyp.scratch-high.yaml``."""
    import cv2
    import yaml

    shutil.copytree(upstream / "utils", work / "yolov9" / "utils")
    opencv = {name: getattr(cv2, name) for name in ("imread", "imwrite", "imshow")}
    sys.path.insert(0, str(work / "yolov9"))
    import utils.dataloaders as detect  # the official code, from the copy (on sys.path above)
    import utils.segment.dataloaders as segment
    for name, function in opencv.items():  # its general.py replaces them process-wide
        setattr(cv2, name, function)
    hyp = yaml.safe_load((upstream / "data" / "hyps" / "hyp.scratch-high.yaml").read_text())
    return detect, segment, hyp


def official_loader(module: Any, images: Path, a: argparse.Namespace, hyp: dict[str, Any], task: str) -> Any:
    """The official ``create_dataloader`` as ``train_dual.py`` / ``segment/train.py`` call it, ``--cache ram``."""
    masks = {"mask_downsample_ratio": MASK_RATIO, "overlap_mask": True} if task == "segment" else {}
    loader, _ = module.create_dataloader(str(images), a.imgsz, a.batch, 32, hyp=hyp, augment=True, cache="ram",
                                         workers=a.workers, shuffle=True, **masks)
    return loader


def yolov9_recipe_loader(yaml_path: Path, a: argparse.Namespace, hyp: dict[str, Any], task: str, hsv_on: str) -> Any:
    """``fastload.loader`` with the official loader's hyperparameters and masks, from the ram store."""
    from fastload.fastloader import loader

    masks = {"mask_ratio": MASK_RATIO, "overlap_mask": True} if task == "segment" else {}
    return loader(yaml_path, imgsz=a.imgsz, batch_size=a.batch, workers=a.workers, store="ram", hsv_on=hsv_on,
                  layout=layout_of("cuda"), hyp=hyp, task=task, **masks)


def rows_of(task: str, yaml_path: Path, official_yaml: Path, a: argparse.Namespace,
            official: tuple[Any, Any, dict[str, Any]] | None) -> list[Row]:
    size = (a.imgsz, a.batch, a.workers)
    rows = []
    if official is not None and task in ("segment", "detect"):
        module = official[1] if task == "segment" else official[0]
        hyp = official[2]
        ref = f"official YOLOv9 {task}, cache ram"
        images = official_yaml.parent / "images" / "train"
        rows += [Row(task, ref, "official", lambda: official_loader(module, images, a, hyp, task), ref),
                 Row(task, f"fastload {task}, yolov9 recipe, ram, HSV deferred", "plain",
                     lambda: yolov9_recipe_loader(yaml_path, a, hyp, task, "defer"), ref),
                 Row(task, f"fastload {task}, yolov9 recipe, ram, HSV in workers", "plain",
                     lambda: yolov9_recipe_loader(yaml_path, a, hyp, task, "worker"), ref)]
    ref = f"Ultralytics {task}, cache ram"
    rows += [Row(task, ref, "ultralytics", lambda: ultralytics_loader(yaml_path, *size, "ram", task=task), ref),
             Row(task, f"fastload {task}, Ultralytics layer, ram, HSV on the device (not run here)", "fastload",
                 lambda: fastload_loader(yaml_path, *size, "ram", "ultralytics", hsv=False, task=task), ref),
             Row(task, f"fastload {task}, Ultralytics layer, ram, HSV in workers", "fastload",
                 lambda: fastload_loader(yaml_path, *size, "ram", "ultralytics", task=task), ref)]
    return rows


# ----------------------------------------------------------------------------------------- what bounds it
#: the functions whose cumulative CPU time is each part of a segment batch: ``render_sample`` draws the pixels and
#: calls ``_copy_paste`` (the mirrored canvas redrawn under the pasted instances), counted apart; the renderer moves
#: the labels of each record with copy-paste before drawing it (``move_record``, which also finds the pasted
#: outlines), and ``transform_geometry`` moves the others, all together, and assembles the batch
PARTS = {"pixels (mosaic, warp, mixup, flips)": ("render_sample",), "copy-paste (mirrored pixels)": ("_copy_paste",),
         "labels (polygons resampled, warped; boxes; paste outlines)": ("move_record", "transform_geometry"),
         "masks (rasterised, overlap)": ("batch_masks",)}


def without_hsv(yaml_path: Path, a: argparse.Namespace, hyp: dict[str, Any], recipe: str) -> dict[str, Any]:
    """The loader keywords of the rows with HSV left to the device: the ``yolov9`` recipe with the official hyp, HSV
    deferred; ``ultralytics`` (never deferred) with Ultralytics' defaults and HSV gains 0."""
    from fastload.augment.hyp import AUGMENT_KEYS

    if recipe == "yolov9":
        return {"hsv_on": "defer", "hyp": hyp}
    args, _ = ultralytics_args(yaml_path, a.imgsz, a.batch, 0, "ram", hsv=False)
    # copy_paste as FastloadTrainer passes it (its default 0), not the hyp's default (YOLOv9's 0.3)
    return {"hyp": {k: float(getattr(args, k)) for k in AUGMENT_KEYS} | {"copy_paste": float(args.copy_paste)}}


def segment_profile(yaml_path: Path, a: argparse.Namespace, recipe: str, **options: Any) -> dict[str, float]:
    """CPU ms per image of a worker-less segment epoch under cProfile, split into :data:`PARTS`."""
    from fastload.fastloader import loader

    with loader(yaml_path, imgsz=a.imgsz, batch_size=a.batch, workers=0, store="ram", task="segment",
                mask_ratio=MASK_RATIO, overlap_mask=True, recipe=recipe, **options) as fl:
        batches = iter(fl)
        next(batches)
        prof, images = cProfile.Profile(time.process_time), 0  # CPU time: other jobs on the machine do not count
        prof.enable()
        for b in batches:
            images += len(b.paths)
        prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    total = sum(tt for _, _, tt, _, _ in stats.values())
    out = {part: sum(ct for (_, _, fn), (_, _, _, ct, _) in stats.items() if fn in names) / images * 1e3
           for part, names in PARTS.items()}
    out["pixels (mosaic, warp, mixup, flips)"] -= out["copy-paste (mirrored pixels)"]
    out["rest (sampler, batch assembly)"] = total / images * 1e3 - sum(out.values())
    out["total, profiled"] = total / images * 1e3
    return out


def mask_bytes(yaml_path: Path, a: argparse.Namespace, hyp: dict[str, Any], batches: int = 4) -> dict[str, Any]:
    """Mean bytes of a batch's masks (and of its pixels), overlap and one per instance."""
    from fastload.fastloader import loader

    out: dict[str, Any] = {}
    for overlap in (True, False):
        with loader(yaml_path, imgsz=a.imgsz, batch_size=a.batch, workers=0, store="ram", hsv_on="defer", hyp=hyp,
                    task="segment", mask_ratio=MASK_RATIO, overlap_mask=overlap) as fl:
            got = [(b.masks.numel() * b.masks.element_size(), b.imgs.numel(), str(b.masks.dtype))
                   for _, b in zip(range(batches), fl)]
        key = "overlap" if overlap else "per instance"
        out[f"masks {key}, bytes per batch"] = statistics.mean(g[0] for g in got)
        out[f"masks {key}, dtypes"] = ", ".join(sorted({g[2] for g in got}))
        out["pixels, bytes per batch"] = statistics.mean(g[1] for g in got)
    return out


def _pipe_sender(conn: Any, nbytes: int, count: int) -> None:
    """A stand-in worker: ``count`` messages carrying an array of ``nbytes`` as the CPU engine's workers send masks."""
    import msgpack
    import numpy as np

    from fastload.engines.cpu_workers import array_fields

    masks = np.ones(nbytes, np.uint8)
    for _ in range(count):
        conn.send_bytes(msgpack.packb({"x": array_fields(masks)}))
    conn.close()


def pipe_transport_ms(nbytes: int, count: int = 40) -> dict[str, float]:
    """Wall and CPU ms (both processes) per batch of sending ``nbytes`` of masks through a worker pipe and reading
    them back as an array, fastload's way (msgpack, ``array_fields`` / ``array_from_fields``)."""
    import msgpack
    import psutil

    from fastload.engines.cpu_workers import array_from_fields

    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_pipe_sender, args=(send, nbytes, count))
    proc.start()
    send.close()
    child = psutil.Process(proc.pid)
    t0, c0 = time.perf_counter(), time.process_time()
    child_cpu = 0.0
    for k in range(count):
        array_from_fields(msgpack.unpackb(recv.recv_bytes())["x"])
        if k == count - 1:
            t = child.cpu_times()
            child_cpu = t.user + t.system
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    proc.join()
    return {"wall_ms": wall / count * 1e3, "cpu_ms": (cpu + child_cpu) / count * 1e3}


def bounds(yamls: dict[str, Path], a: argparse.Namespace, hyp: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"ceilings": ceilings(yamls["segment"], 1.0)}
    out["one core, CPU ms per image (no workers, no HSV)"] = {
        f"{task} {recipe}": cpu_ms_per_image(yamls[task], task, recipe, a.imgsz, a.batch, 0,
                                             **without_hsv(yamls[task], a, hyp, recipe))[0]
        for task in ("detect", "segment") for recipe in ("yolov9", "ultralytics")}
    out["segment profile"] = {recipe: segment_profile(yamls["segment"], a, recipe,
                                                      **without_hsv(yamls["segment"], a, hyp, recipe))
                              for recipe in ("yolov9", "ultralytics")}
    sizes = mask_bytes(yamls["segment"], a, hyp)
    out["mask bytes"] = sizes
    out["transport"] = {key: pipe_transport_ms(int(sizes[f"masks {key}, bytes per batch"]))
                        for key in ("overlap", "per instance")}
    return out


# ----------------------------------------------------------------------------------------- main
def set_polygon_memo(mb: float) -> None:
    """Every rendering process's memo of Ultralytics' resampled polygons (``LoadedPolygons``, built by each renderer;
    forked workers inherit this) bounded at ``mb``: what a set whose polygons exceed the memo costs (COCO's 118k
    images hold about 7 GB of them at 1000 points), without building such a set and both references' RAM caches of
    it."""
    from fastload.augment import geometry

    init = geometry.LoadedPolygons.__init__
    geometry.LoadedPolygons.__init__ = lambda self, max_bytes=int(mb * 2**20): init(self, max_bytes)  # type: ignore


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=256, help="synthetic images per task")
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--batch", type=int, default=16, help="images per batch")
    ap.add_argument("--workers", type=int, default=2, help="worker processes of every loader")
    ap.add_argument("--seconds", type=float, default=4.0, help="timed seconds per configuration and round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the median round is shown)")
    ap.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS), help="the tasks whose rows run")
    ap.add_argument("--yolov9", type=Path, default=DEFAULT_UPSTREAM, help="official YOLOv9 checkout (copied)")
    ap.add_argument("--polygon-memo-mb", type=float, default=None,
                    help="fastload's memo of Ultralytics' resampled polygons per rendering process, MB (default: the "
                         "library's 64); 0: every lookup misses, as on a set whose polygons exceed it (COCO's)")
    ap.add_argument("--no-bounds", action="store_true", help="skip the ceilings, profile and transport figures")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.polygon_memo_mb is not None:
        set_polygon_memo(a.polygon_memo_mb)
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="fastload-task-bench-") as tmp:
        work = Path(tmp)
        os.environ.setdefault("FASTLOAD_SHM_DIR", str(work / "shm"))  # the ram stores go with the folder
        (work / "shm").mkdir()
        yamls, official_yamls = {}, {}
        for task in TASKS:
            yamls[task] = synthetic_set(work / task, a.images, task)
            shutil.copytree(work / task, work / f"{task}-official")  # its images and labels (the yaml is not read)
            official_yamls[task] = work / f"{task}-official" / yamls[task].name
        official = None
        if (a.yolov9 / "utils" / "segment" / "dataloaders.py").is_file():
            official = official_modules(a.yolov9, work)
        else:
            print(f"no official YOLOv9 checkout at {a.yolov9} (--yolov9): its rows are left out")
        rows = [r for task in a.tasks for r in rows_of(task, yamls[task], official_yamls[task], a, official)]
        rounds: list[dict[str, dict[str, Any]]] = []
        for k in range(a.rounds):
            res = {}
            for row in rows:
                res[row.name] = measure(row.make, a.seconds, kind=row.kind)
                print(f"round {k + 1}: {row.name:72s} {res[row.name]['images_per_s']:8.1f} img/s "
                      f"{res[row.name]['cpu_ms_per_image']:6.2f} CPU ms/img", flush=True)
            rounds.append(res)
        load_end = os.getloadavg()
        table = {}
        for row in rows:
            table[row.name] = {
                "task": row.task, "reference": row.reference,
                "images_per_s": statistics.median(r[row.name]["images_per_s"] for r in rounds),
                "cpu_ms_per_image": statistics.median(r[row.name]["cpu_ms_per_image"] for r in rounds),
                "x reference": statistics.median(r[row.name]["images_per_s"] / r[row.reference]["images_per_s"]
                                                 for r in rounds),
                # the same ratio on a machine the loaders have to themselves (CPU time hardly moves with other jobs)
                "x reference, CPU": statistics.median(r[row.reference]["cpu_ms_per_image"] / r[row.name]["cpu_ms_per_image"]
                                                      for r in rounds)}
        memo = "" if a.polygon_memo_mb is None else f"polygon memo {a.polygon_memo_mb:g} MB, "
        print(f"\nsynthetic sets of {a.images} images, imgsz {a.imgsz}, batch {a.batch}, {a.workers} workers, RAM cache, {memo}"
              f"{a.rounds} rounds of {a.seconds:g} s (median round; ratio: median same-round ratio to the reference), "
              f"{os.cpu_count()} CPUs, load average {load_start[0]:.1f} at the start, {load_end[0]:.1f} at the end")
        print("| task | loader | img/s | CPU ms/img | x reference | x reference, CPU ms/img |")
        print("|---|---|---:|---:|---:|---:|")
        for name, t in table.items():
            print(f"| {t['task']} | {name} | {t['images_per_s']:.1f} | {t['cpu_ms_per_image']:.2f} | "
                  f"{t['x reference']:.2f} | {t['x reference, CPU']:.2f} |")
        out: dict[str, Any] = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
                               "loadavg": [load_start, load_end], "rounds": rounds, "table": table}
        if not a.no_bounds:
            out["bounds"] = b = bounds(yamls, a, official[2] if official else {})
            c = b["ceilings"]
            print(f"\nceilings, one core: memcpy of a 640x640x3 image {c['memcpy_640_1core']:.0f}/s "
                  f"({c['memcpy_GBps']:.1f} GB/s), JPEG decode {c['decode_1core']:.0f}/s")
            for name, ms in b["one core, CPU ms per image (no workers, no HSV)"].items():
                print(f"one core, no workers, HSV left to the device: {name}: {ms:.2f} CPU ms per image")
            for recipe, parts in b["segment profile"].items():
                print(f"segment, {recipe} recipe, one core under cProfile (CPU ms per image): "
                      + ", ".join(f"{part} {ms:.2f}" for part, ms in parts.items()))
            for key, value in b["mask bytes"].items():
                print(f"{key}: {value if isinstance(value, str) else f'{value / 2**20:.2f} MiB'}")
            for key, t in b["transport"].items():
                print(f"masks {key} through a worker pipe: {t['wall_ms']:.2f} ms wall, {t['cpu_ms']:.2f} ms CPU per batch "
                      f"({t['cpu_ms'] / a.batch:.3f} CPU ms per image)")
        if a.json:
            a.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
