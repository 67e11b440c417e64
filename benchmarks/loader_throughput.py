"""Loader throughput, side by side: fastload engines/stores vs the stock YOLOv9 loader.

Dataset: coco128 repeated to ``--images`` (512) images (symlinks, so every repeat is its own file),
converted to lmdb, disk and ram stores. Each configuration is timed for ``--seconds`` after a
warm-up batch, in one run, so the ratios hold even when other work shares the machine. Printed:
images/s, ratio to the matching stock baseline, JPEG decodes per output image, machine ceilings
(single-core JPEG decode, memcpy of a 640x640x3 image), the PSS of a ram-store run (one copy shared
by workers and ranks), and a JSON file with everything.

The decode-bound case (issue #16: JPEG files or LMDB, a dataset larger than the decoded-image cache,
stood for by ``decode_cache_mb=0``) is measured beside the same with the cache on, each with
``partners="batch"``; ``--decode-bound`` runs only those rows, the stock baseline, the decodes per
output image of every engine (cpu, gpu on CPU tensors, dali in CPU mode, at ``--count-imgsz``) and
the 2-rank x 2-worker shared decoded cache (decodes per epoch machine-wide, PSS of its segment).

``--baseline-ref REF`` measures what a change costs instead: the common loop (each batch dropped when the
next is asked for) of a few CPU-engine configurations, with this tree's fastload and with the one at git
ref ``REF`` (exported to a temporary folder with ``git archive``), each run in its own subprocess with
``PYTHONPATH`` at its tree, alternating within each of the interleaved rounds; printed: both img/s and
the median same-round ratio (issue 22: batch ownership may cost at most 3 %); ``--ray`` adds ``engine="ray"``
(issue 23: the in-flight window both engines share).

    python benchmarks/loader_throughput.py --seconds 5 --json loader_throughput.json
    python benchmarks/loader_throughput.py --decode-bound --seconds 12 --rounds 4
    python benchmarks/loader_throughput.py --baseline-ref 16c27f6 --seconds 40 --rounds 8
    python benchmarks/loader_throughput.py --baseline-ref 8dde2f0 --ray --seconds 16 --rounds 4
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import cv2
import numpy as np
import psutil
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
COCO128 = Path(os.environ.get("FASTLOAD_COCO128", REPO.parent / "shared" / "datasets" / "coco128"))


# ----------------------------------------------------------------------------------------- dataset
def make_repeated(src_yaml: Path, out: Path, n: int, *, copies: bool = False) -> Path:
    """``n`` images made of coco128 repeated (symlinked under new names, or copied: ``copies``, files of their own
    that leave the page cache one by one) with their labels; returns the yaml."""
    cfg = yaml.safe_load(src_yaml.read_text())
    root = (src_yaml.parent / cfg.get("path", ".")).resolve()
    im_src = root / cfg["train"]
    images = sorted(p for p in im_src.iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
    lb_src = Path(str(im_src).replace(f"{os.sep}images{os.sep}", f"{os.sep}labels{os.sep}"))
    im_dir, lb_dir = out / "images" / "train", out / "labels" / "train"
    im_dir.mkdir(parents=True)
    lb_dir.mkdir(parents=True)
    for k in range(n):
        src = images[k % len(images)]
        stem = f"r{k // len(images)}_{src.stem}"
        if copies:
            shutil.copyfile(src, im_dir / f"{stem}{src.suffix}")
        else:
            (im_dir / f"{stem}{src.suffix}").symlink_to(src)
        lb = lb_src / f"{src.stem}.txt"
        if lb.is_file():
            (lb_dir / f"{stem}.txt").symlink_to(lb)
    data = {"path": str(out), "train": "images/train", "val": "images/train", "names": cfg["names"]}
    (out / "data.yaml").write_text(yaml.safe_dump(data))
    return out / "data.yaml"


# ----------------------------------------------------------------------------------------- ceilings
def ceilings(yaml_path: Path, seconds: float) -> dict[str, float]:
    """Single-core JPEG decode + long-side resize rate, and memcpy rate of one 640x640x3 image."""
    from fastload.data.config import load_data_config
    from fastload.data.images import decode_image, resize_long_side
    from fastload.data.index import build_index

    index = build_index(load_data_config(yaml_path), "train", progress=False)
    bufs = [Path(f).read_bytes() for f in index.im_files[:128]]
    t0, k = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        decode_image(bufs[k % len(bufs)])
        k += 1
    decode = k / (time.perf_counter() - t0)
    t0, k = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        resize_long_side(decode_image(bufs[k % len(bufs)]), 640)
        k += 1
    decode_resize = k / (time.perf_counter() - t0)
    a, b = np.random.randint(0, 255, (640, 640, 3), np.uint8), np.empty((640, 640, 3), np.uint8)
    t0, k = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds / 2:
        np.copyto(b, a)
        k += 1
    memcpy = k / (time.perf_counter() - t0)
    return {"decode_1core": decode, "decode_resize_1core": decode_resize, "memcpy_640_1core": memcpy,
            "memcpy_GBps": memcpy * a.nbytes / 1e9}


# ----------------------------------------------------------------------------------------- timing
def _cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def time_batches(make_iter: Callable[[], Iterable], seconds: float, *, min_epochs: int = 0,
                 pids: Callable[[Any], list[int]] | None = None) -> dict[str, float]:
    """Images/s over ``seconds`` after one warm-up batch (re-iterating epochs as needed).

    With ``min_epochs`` the run lasts at least that many whole epochs, and the first epoch's rate
    is reported separately (``first_epoch_images_per_s``: a cold decode cache) from the rate of
    the rest (``images_per_s``: steady state).
    """
    it = iter(make_iter())
    next(it)  # warm-up: workers started, first batch in flight
    procs = [os.getpid()] + (pids(it) if pids else [])
    cpu0 = _cpu_seconds(procs)
    n_img, n_batch, epochs = 0, 0, 0
    t0 = time.perf_counter()
    t_epoch1, n_epoch1 = None, 0
    while time.perf_counter() - t0 < seconds or epochs < min_epochs:
        try:
            imgs = next(it)[0]
        except StopIteration:
            epochs += 1
            if epochs == 1 and min_epochs:
                t_epoch1, n_epoch1 = time.perf_counter(), n_img
            it = iter(make_iter())
            continue
        n_img += imgs.shape[0]
        n_batch += 1
    t1 = time.perf_counter()
    out = {"images_per_s": n_img / (t1 - t0), "batches": n_batch, "seconds": t1 - t0}
    # CPU time per image over the loader's processes: hardly affected by other jobs on the machine
    out["cpu_ms_per_image"] = (_cpu_seconds(procs) - cpu0) / max(n_img, 1) * 1e3
    if t_epoch1 is not None:
        out["first_epoch_images_per_s"] = n_epoch1 / (t_epoch1 - t0)
        if n_img > n_epoch1:
            out["images_per_s"] = (n_img - n_epoch1) / (t1 - t_epoch1)
    return out


def run_fastload(yaml_path: Path, seconds: float, *, split: str = "train", min_epochs: int = 0, **kw: Any) -> dict[str, Any]:
    from fastload.fastloader import loader

    fl = loader(yaml_path, split=split, **kw)
    try:
        res = time_batches(lambda: fl, seconds, min_epochs=min_epochs, pids=lambda _: fl.stats()["worker_pids"])
        res.update(fl.stats())
        res.pop("worker_pids", None)
    finally:
        fl.close()
    return res


def run_stock(yaml_path: Path, seconds: float, *, imgsz: int, batch: int, workers: int, cache: bool,
              augment: bool = True, rect: bool = False) -> dict[str, Any]:
    """The clean-room stock YOLOv9 dataset in a torch DataLoader, as the official trainer runs it
    (:mod:`fastload.bench.stock`).

    ``cache=True`` is YOLOv9's ``--cache ram``: every loaded (resized) image kept in the main
    process before the workers fork. ``rect`` mimics YOLOv9 validation: images sorted by aspect,
    per-batch shapes, no shuffle.
    """
    from fastload.augment.params import per_index_shapes, rect_batch_shapes
    from fastload.bench.stock import StockDataset, stock_loader
    from fastload.data.config import load_data_config
    from fastload.data.images import loaded_shape
    from fastload.data.index import build_index

    index = build_index(load_data_config(yaml_path), "train", progress=False)
    files, labels, hw = list(index.im_files), list(index.labels), np.asarray(index.shapes)
    rect_shapes = None
    if rect:
        order, shapes = rect_batch_shapes(hw, batch, imgsz, stride=32, pad=0.5)
        files, labels, hw = [files[i] for i in order], [labels[i] for i in order], hw[order]
        rect_shapes = per_index_shapes(np.arange(len(files)), shapes, batch)
    loaded = np.array([loaded_shape(int(h), int(w), imgsz) for h, w in hw], np.int64)
    ds = StockDataset(files, labels, imgsz, None, augment=augment, rect_shapes=rect_shapes, loaded_shapes=loaded,
                      cache_ram=cache)
    dl = stock_loader(ds, batch_size=batch, workers=workers, shuffle=not rect)
    try:
        return time_batches(lambda dl=dl: dl, seconds, pids=lambda it: [w.pid for w in getattr(it, "_workers", [])])
    finally:
        del dl


# ----------------------------------------------------------------------------------------- memory
def pss_of_tree(pids: list[int], segment: str | None) -> dict[str, float]:
    """Sum of PSS (MiB) over ``pids`` and the part of it that maps files under ``segment`` (a ram store
    or a decoded-image cache)."""
    total = seg = 0.0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_full_info().pss
        except (psutil.Error, AttributeError):
            continue
        if segment is None:
            continue
        try:
            cur = None
            with open(f"/proc/{pid}/smaps") as f:
                for line in f:
                    if not line[0].isupper() or ":" not in line.split()[0]:  # mapping header line
                        parts = line.split()
                        cur = parts[5] if len(parts) > 5 else None
                    elif line.startswith("Pss:") and cur and cur.startswith(segment):
                        seg += int(line.split()[1]) * 1024
        except OSError:
            pass
    return {"pss_total_MiB": total / 2**20, "pss_segment_MiB": seg / 2**20}


def _pss_rank(rank: int, yaml_path: str, out_dir: str, world: int, batch: int, store: str, epochs: int) -> None:
    """One DDP rank: ``epochs`` epochs of ``store`` (ram: the first 4 batches), then rank 0 sums the PSS of
    every rank's processes and of the mapping that holds the images (the ram store, or the decoded cache)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rdv", rank=rank, world_size=world)
    from fastload.fastloader import loader

    decodes = []
    with loader(yaml_path, store=store, batch_size=batch, workers=2, rank=rank, world_size=world) as fl:
        for epoch in range(epochs):
            fl.set_epoch(epoch)
            for k, _ in enumerate(fl):
                if store == "ram" and k == 3:
                    break
            decodes.append(fl.stats()["decodes"])  # this rank's total so far
            dist.barrier()
        stats = fl.stats()
        Path(out_dir, f"pids{rank}.json").write_text(json.dumps([os.getpid()] + stats["worker_pids"]))
        Path(out_dir, f"decodes{rank}.json").write_text(json.dumps(decodes))
        dist.barrier()
        if rank == 0:
            pids = [p for f in Path(out_dir).glob("pids*.json") for p in json.loads(f.read_text())]
            if store == "ram":
                res = pss_of_tree(pids, fl.store.path)
                res["ram_store_MiB"] = sum(p.stat().st_size for p in Path(fl.store.path).rglob("*") if p.is_file()) / 2**20
            else:
                res = pss_of_tree(pids, stats["decode_cache_segment"])
                res["decoded_cache_reserved_MiB"] = stats["decode_cache_bytes"] / 2**20
                res["decoded_cache_images_held"] = [stats["decode_cache_filled"], stats["decode_cache_images"]]
                ranks = [json.loads(Path(out_dir, f"decodes{k}.json").read_text()) for k in range(world)]
                total = [sum(r[e] for r in ranks) for e in range(epochs)]
                res["machine_decodes_per_epoch"] = [total[0]] + [total[e] - total[e - 1] for e in range(1, epochs)]
            res["ring_MiB_per_rank"] = fl.engine.ring.n_slots * fl.engine.ring.slot_bytes / 2**20
            res["processes"] = len(pids)
            Path(out_dir, "pss.json").write_text(json.dumps(res))
        dist.barrier()
    dist.destroy_process_group()


def measure_pss(yaml_path: Path, batch: int, world: int = 2, *, store: str = "ram", epochs: int = 1) -> dict[str, Any]:
    import torch.multiprocessing as tmp

    with tempfile.TemporaryDirectory() as d:
        tmp.spawn(_pss_rank, args=(str(yaml_path), d, world, batch, store, epochs), nprocs=world, join=True)
        return json.loads(Path(d, "pss.json").read_text())


COUNTED_ENGINES = ("cpu", "gpu", "dali", "ray")


def decode_counts(yaml_path: Path, imgsz: int, batch: int, workers: int, batches: int) -> list[dict[str, Any]]:
    """Decodes per output image of every engine and ``partners`` over the first ``batches`` batches
    from files and lmdb (the CPU and Ray engines without their decoded caches: what a dataset larger
    than the cache costs)."""
    from fastload.fastloader import loader

    rows = []
    for engine in COUNTED_ENGINES:
        for store in ("files", "lmdb"):
            for partners in ("dataset", "batch"):
                kw: dict[str, Any] = dict(imgsz=imgsz, batch_size=batch, store=store, engine=engine, partners=partners)
                if engine == "cpu":
                    kw.update(workers=workers, engine_options={"decode_cache_mb": 0})
                elif engine == "ray":  # a local Ray instance on this machine's CPUs
                    kw["engine_options"] = {"actors": workers, "decode_cache_mb": 0}
                else:
                    kw["device"] = "cuda" if torch.cuda.is_available() else "cpu"
                    kw["workers"] = 0 if engine == "gpu" else workers
                    if engine == "gpu":
                        kw["prefetch"] = 0  # no background batch left rendering when the count stops
                row = {"engine": engine, "store": store, "partners": partners}
                try:
                    with loader(yaml_path, **kw) as fl:
                        for _ in itertools.islice(fl, batches):
                            pass
                        st = fl.stats()
                    row.update(decodes=st["decodes"], images=st["images"], decodes_per_image=st["decodes_per_image"])
                except Exception as e:  # DALI not installed, ...
                    row["error"] = f"{type(e).__name__}: {e}"
                rows.append(row)
                print(f"  decodes per output image: {engine:4s} {store:5s} partners={partners:7s} "
                      f"{row.get('decodes_per_image', float('nan')):5.2f} {row.get('error', '')}", flush=True)
    return rows


def cell(v: float, width: int, fmt: str) -> str:
    """``v`` formatted for the table, ``-`` when it is NaN (not measured)."""
    return format(v, f"{width}{fmt}") if v == v else "-".rjust(width)


# ----------------------------------------------------------------------------------------- goals
#: issue #3's targets: (goal, configurations it applies to, min images/s, min ratio to the row's baseline)
GOALS = (
    ("ram/disk >= 900 img/s and >= 4x stock ram cache",
     ("cpu ram", "cpu ram, HSV deferred to device", "cpu disk", "cpu disk, HSV deferred to device"), 900.0, 4.0),
    ("lmdb/files >= 500 img/s and >= 5x stock files",
     ("cpu lmdb", "cpu lmdb, HSV deferred to device", "cpu files", "cpu files, HSV deferred to device"), 500.0, 5.0),
    ("validation within 2x of the decode ceiling", ("val rect files, no cache",), 0.0, 0.5),
    # issue #16: the decode-bound case, partners="batch", decoded cache off (larger than memory) and on
    ("decode-bound, partners batch, HSV in workers >= 3.5x stock files",
     ("cpu files, batch partners, no decode cache", "cpu lmdb, batch partners, no decode cache",
      "cpu files, batch partners", "cpu lmdb, batch partners"), 0.0, 3.5),
    ("decode-bound, partners batch, HSV deferred >= 6x stock files",
     ("cpu files, batch partners, no decode cache, HSV deferred", "cpu lmdb, batch partners, no decode cache, HSV deferred",
      "cpu files, batch partners, HSV deferred", "cpu lmdb, batch partners, HSV deferred"), 0.0, 6.0),
)
DECODES_GOAL = 1.05  # issue #16: JPEG decodes per output image with partners="batch"


def check_goals(configs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One verdict per (goal, configuration) from the median rates and same-round ratios."""
    out = []
    for goal, names, min_ips, min_ratio in GOALS:
        for name in names:
            r = configs.get(name)
            if not r or "images_per_s" not in r:
                continue
            ips, ratio = float(r["images_per_s"]), float(r.get("ratio", float("nan")))
            out.append({"goal": goal, "config": name, "images_per_s": ips, "ratio": ratio,
                        "met": bool(ips >= min_ips and ratio >= min_ratio)})
    return out


# ----------------------------------------------------------------------------------------- a change's cost
#: the common-loop configurations ``--baseline-ref`` compares (name, loader keywords besides imgsz/batch/workers)
CHANGE_CONFIGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("cpu ram", {"store": "ram"}),
    ("cpu ram, HSV deferred to device", {"store": "ram", "hsv_on": "defer"}),
    ("cpu disk", {"store": "disk"}),
    ("cpu ram, workers 0", {"store": "ram", "workers": 0}),
)
#: ``--ray`` adds the Ray engine (as many actors as ``--workers``, a local Ray instance started by each run)
RAY_CHANGE_CONFIG: tuple[str, dict[str, Any]] = ("ray disk", {"store": "disk", "engine": "ray", "workers": 0})


def export_ref(ref: str, dest: Path) -> str:
    """The tree of git ref ``ref`` of this repository, written under ``dest``; returns its commit."""
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{ref}^{{commit}}"], check=True,
                            capture_output=True, text=True).stdout.strip()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", commit], check=True, capture_output=True)
    dest.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return commit


def run_in_tree(tree: Path, yaml_path: Path, seconds: float, kw: dict[str, Any]) -> dict[str, Any]:
    """``run_fastload`` in a subprocess that imports fastload from ``tree`` (this script's harness either way)."""
    spec = json.dumps({"yaml": str(yaml_path), "seconds": seconds, "kw": kw})
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--run-one", spec], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(tree)}, timeout=600)
    if proc.returncode:
        return {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    if not Path(res["fastload_file"]).resolve().is_relative_to(tree.resolve()):  # an install shadowed PYTHONPATH
        return {"error": f"imported {res['fastload_file']}, not the fastload of {tree}"}
    return res


def run_one(spec_json: str) -> int:
    """``--run-one``: one configuration with the fastload on ``sys.path``, its result as a JSON line."""
    import fastload

    spec = json.loads(spec_json)
    res = run_fastload(Path(spec["yaml"]), float(spec["seconds"]), **spec["kw"])
    res["fastload_file"] = fastload.__file__
    print(json.dumps(res, default=float))
    return 0


def slot_delivery_cost(batch: int, imgsz: int, n: int = 20000) -> dict[str, float]:
    """Microseconds per delivered batch, in this process: a slot lent as the caller's (a view with a finalizer
    that frees the slot when its last tensor dies: batch ownership) and dropped, against the plain view of a
    slot that the CPU engine delivered before (no bookkeeping). Free of the machine's noise, unlike img/s."""
    from fastload.engines.shm_batch import SlotRing

    ring = SlotRing(2, batch * imgsz * imgsz * 3)

    def plain() -> None:
        torch.from_numpy(ring.array(0, batch, imgsz, imgsz)).permute(0, 3, 1, 2)

    def owned() -> None:
        ring.lend(ring.acquire(), batch, imgsz, imgsz)  # dropped at once: the slot comes back

    out = {}
    for name, fn in (("plain_view_us", plain), ("owned_view_us", owned)):
        fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out[name] = (time.perf_counter() - t0) / n * 1e6
    ring.close()
    return out


def change_cost(args: argparse.Namespace, yaml_path: Path, work: Path) -> dict[str, Any]:
    """This tree against ``args.baseline_ref``, configuration by configuration, in interleaved rounds (the two
    trees alternate which goes first); the ratio of each configuration is the median of its rounds' ratios."""
    base_tree = work / "baseline"
    commit = export_ref(args.baseline_ref, base_tree)
    trees = {"this": REPO, "baseline": base_tree}
    common = dict(imgsz=args.imgsz, batch_size=args.batch, workers=args.workers)
    configs = tuple((name, kw) for name, kw in CHANGE_CONFIGS if not args.only or name in args.only)
    if args.ray:
        name, kw = RAY_CHANGE_CONFIG
        configs += ((name, {**kw, "engine_options": {"actors": args.workers}}),)
    runs: dict[str, dict[str, list[dict]]] = {name: {"this": [], "baseline": []} for name, _ in configs}
    for r in range(args.rounds):
        for name, kw in configs:
            for side in (("this", "baseline") if r % 2 == 0 else ("baseline", "this")):
                got = run_in_tree(trees[side], yaml_path, args.seconds / args.rounds, {**common, **kw})
                runs[name][side].append(got)
                print(f"  round {r + 1}/{args.rounds} {name:34s} {side:8s} {got.get('images_per_s', float('nan')):8.1f} img/s "
                      f"{got.get('error', '')}", flush=True)
    out: dict[str, Any] = {"baseline_ref": args.baseline_ref, "baseline_commit": commit, "configs": {}}
    print(f"\nthis tree vs {args.baseline_ref} ({commit[:10]}), common loop, {args.images} images, batch {args.batch}, "
          f"{args.workers} workers, imgsz {args.imgsz}, {args.seconds:.0f} s per side and configuration in {args.rounds} "
          f"interleaved rounds, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print("| configuration | this img/s | baseline img/s | ratio (median of rounds) | round ratios min-max | "
          "CPU ms/image this / baseline (median of rounds) | batches copied |")
    print("|---|---:|---:|---:|---|---:|---:|")
    for name, _ in configs:
        pairs = [(a["images_per_s"], b["images_per_s"]) for a, b in zip(runs[name]["this"], runs[name]["baseline"])
                 if "images_per_s" in a and "images_per_s" in b]
        ratios = [a / b for a, b in pairs]
        # CPU time per image over the loader's processes moves far less with other work on the machine than img/s
        cpu_ratios = [a["cpu_ms_per_image"] / b["cpu_ms_per_image"]
                      for a, b in zip(runs[name]["this"], runs[name]["baseline"])
                      if a.get("cpu_ms_per_image") and b.get("cpu_ms_per_image")]
        copied = sum(x.get("batches_copied", 0) for x in runs[name]["this"])
        row = {"rounds": runs[name], "ratios": ratios, "cpu_ratios": cpu_ratios, "batches_copied": copied}
        if pairs:
            row.update(this_images_per_s=float(np.median([a for a, _ in pairs])),
                       baseline_images_per_s=float(np.median([b for _, b in pairs])), ratio=float(np.median(ratios)),
                       cpu_ratio=float(np.median(cpu_ratios)) if cpu_ratios else float("nan"))
            print(f"| {name} | {row['this_images_per_s']:.1f} | {row['baseline_images_per_s']:.1f} | {row['ratio']:.3f} | "
                  f"{min(ratios):.3f}-{max(ratios):.3f} | {row['cpu_ratio']:.3f} | {copied} |")
        else:
            errors = {x.get("error") for side in runs[name].values() for x in side} - {None}
            print(f"| {name} | - | - | - | {'; '.join(sorted(errors))[:80]} | - | - |")
        out["configs"][name] = row
    try:  # only a tree with batch ownership has SlotRing.lend
        out["slot_delivery"] = cost = slot_delivery_cost(args.batch, args.imgsz)
        first = configs[0][0]
        period_us = args.batch / out["configs"][first]["this_images_per_s"] * 1e6
        print(f"this tree's slot bookkeeping per delivered batch: {cost['owned_view_us']:.1f} us (lent view with its finalizer, "
              f"freed) vs {cost['plain_view_us']:.1f} us (plain view): {cost['owned_view_us'] - cost['plain_view_us']:.1f} us "
              f"more, {(cost['owned_view_us'] - cost['plain_view_us']) / period_us * 100:.4f} % of a {first!r} batch period")
    except (AttributeError, KeyError) as e:
        print(f"no slot bookkeeping figure: {type(e).__name__}: {e}")
    return out


# ----------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=6.0, help="timed seconds per configuration (split over the rounds)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median round is reported")
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--json", default="loader_throughput.json")
    ap.add_argument("--quick", action="store_true", help="only the headline configurations")
    ap.add_argument("--no-stock", action="store_true", help="skip the stock baseline")
    ap.add_argument("--no-pss", action="store_true", help="skip the 2-rank PSS measurements")
    ap.add_argument("--decode-bound", action="store_true",
                    help="only the decode-bound rows (files/lmdb, partners, decoded cache off and on), stock files, "
                         "the decodes per output image of every engine and the 2-rank shared decoded cache")
    ap.add_argument("--count-imgsz", type=int, default=320, help="imgsz of the per-engine decode counts (counts do not depend on it)")
    ap.add_argument("--count-batches", type=int, default=4, help="batches per engine and setting the decode counts run")
    ap.add_argument("--baseline-ref", metavar="REF",
                    help="only compare this tree with git ref REF in the common loop (see above), side by side")
    ap.add_argument("--ray", action="store_true", help="with --baseline-ref: engine='ray' too (--workers actors, disk store)")
    ap.add_argument("--only", action="append", metavar="NAME", choices=[name for name, _ in CHANGE_CONFIGS],
                    help="with --baseline-ref: only this configuration (repeatable), e.g. 'cpu ram, workers 0'")
    ap.add_argument("--run-one", help=argparse.SUPPRESS)  # internal: one configuration, for --baseline-ref
    args = ap.parse_args(argv)
    if args.run_one:
        return run_one(args.run_one)
    if not (COCO128 / "coco128.yaml").is_file():
        print(f"coco128 not found at {COCO128} (set FASTLOAD_COCO128)")
        return 2

    work = Path(tempfile.mkdtemp(prefix="fastload-bench-"))
    shm_dir = Path("/dev/shm" if os.path.isdir("/dev/shm") else work) / f"fastload-bench-{os.getpid()}"
    os.environ["FASTLOAD_SHM_DIR"] = str(shm_dir)
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                           "torch": torch.__version__, "opencv": cv2.__version__,
                                           "loadavg_start": os.getloadavg()},
                               "args": vars(args), "configs": {}}
    from fastload.augment.functional.tiles import AXIS_KERNELS, default_axis_kernel

    kernel = default_axis_kernel()
    other_kernel = next(k for k in AXIS_KERNELS if k != kernel)
    results["machine"]["axis_kernel"] = kernel
    print(f"OpenCV {cv2.__version__}: axis-aligned tiles drawn by the {kernel!r} kernel", flush=True)
    try:
        from fastload.store.convert import convert

        src = make_repeated(COCO128 / "coco128.yaml", work / "data", args.images)
        t0 = time.perf_counter()
        to = "lmdb" if args.decode_bound else "disk,ram" if args.baseline_ref else "lmdb,disk,ram"
        conv = convert(src, to=to, out=work / "stores", imgsz=args.imgsz, splits="train", progress=False, log=lambda *_: None)
        results["convert_seconds"] = time.perf_counter() - t0
        y = conv.yaml_path
        if args.baseline_ref:
            results["change_cost"] = change_cost(args, y, work)
            results["machine"]["loadavg_end"] = os.getloadavg()
            Path(args.json).write_text(json.dumps(results, indent=1, default=float))
            print(f"wrote {args.json}")
            return 0
        results["ceilings"] = ceil = ceilings(src, min(args.seconds, 3.0))
        common = dict(imgsz=args.imgsz, batch_size=args.batch, workers=args.workers)

        configs: list[tuple[str, str, Callable[[float], dict]]] = []
        if not args.no_stock:
            configs += [
                ("stock files", "-", lambda t: run_stock(src, t, imgsz=args.imgsz, batch=args.batch, workers=args.workers, cache=False)),
                ("stock ram cache", "-", lambda t: run_stock(src, t, imgsz=args.imgsz, batch=args.batch, workers=args.workers, cache=True)),
            ]
        configs += [
            ("cpu ram", "stock ram cache", lambda t: run_fastload(y, t, store="ram", **common)),
            ("cpu ram, HSV deferred to device", "stock ram cache", lambda t: run_fastload(y, t, store="ram", hsv_on="defer", **common)),
            ("cpu disk", "stock ram cache", lambda t: run_fastload(y, t, store="disk", **common)),
            ("cpu disk, HSV deferred to device", "stock ram cache", lambda t: run_fastload(y, t, store="disk", hsv_on="defer", **common)),
            ("cpu lmdb", "stock files", lambda t: run_fastload(y, t, store="lmdb", min_epochs=2, **common)),
            ("cpu lmdb, HSV deferred to device", "stock files", lambda t: run_fastload(y, t, store="lmdb", hsv_on="defer", min_epochs=2, **common)),
            ("cpu files", "stock files", lambda t: run_fastload(y, t, store="files", min_epochs=2, **common)),
            ("cpu files, HSV deferred to device", "stock files", lambda t: run_fastload(y, t, store="files", hsv_on="defer", min_epochs=2, **common)),
            ("cpu files, no decode cache", "stock files", lambda t: run_fastload(y, t, store="files", engine_options={"decode_cache_mb": 0}, **common)),
            ("cpu lmdb, no decode cache", "stock files", lambda t: run_fastload(y, t, store="lmdb", engine_options={"decode_cache_mb": 0}, **common)),
        ]
        # the decode-bound case: partners from the batch, decoded cache off (a dataset larger than it) and on
        for st in ("files", "lmdb"):
            for cache in (False, True):
                for defer in (False, True):
                    name = f"cpu {st}, batch partners" + ("" if cache else ", no decode cache") + (", HSV deferred" if defer else "")
                    kw = dict(store=st, partners="batch", hsv_on="defer" if defer else "worker", **common)
                    if not cache:
                        kw["engine_options"] = {"decode_cache_mb": 0}
                    configs.append((name, "stock files", lambda t, kw=kw, cache=cache: run_fastload(y, t, min_epochs=2 if cache else 0, **kw)))
        configs += [
            ("stock val rect files", "-", lambda t: run_stock(src, t, imgsz=args.imgsz, batch=args.batch, workers=args.workers, cache=False, augment=False, rect=True)),
            ("val rect files, no cache", "decode ceiling", lambda t: run_fastload(y, t, store="files", augment=False, rect=True, pad=0.5, engine_options={"decode_cache_mb": 0}, **common)),
            ("val rect ram", "decode ceiling", lambda t: run_fastload(y, t, store="ram", augment=False, rect=True, pad=0.5, **common)),
        ]
        if not args.quick:
            configs += [
                ("lever: ram, hsv on consumer (cpu)", "cpu ram", lambda t: run_fastload(y, t, store="ram", hsv_on="consumer", **common)),
                ("lever: ram, layout nchw", "cpu ram", lambda t: run_fastload(y, t, store="ram", layout="nchw", **common)),
                (f"lever: ram, HSV deferred, {other_kernel} kernel", "cpu ram, HSV deferred to device",
                 lambda t: run_fastload(y, t, store="ram", hsv_on="defer", engine_options={"axis_kernel": other_kernel}, **common)),
                (f"lever: ram, {other_kernel} kernel", "cpu ram", lambda t: run_fastload(y, t, store="ram", engine_options={"axis_kernel": other_kernel}, **common)),
                ("lever: ram, workers 0", "cpu ram", lambda t: run_fastload(y, t, store="ram", **{**common, "workers": 0})),
                ("lever: ram, workers 1", "cpu ram", lambda t: run_fastload(y, t, store="ram", **{**common, "workers": 1})),
            ]
        if args.decode_bound:
            configs = [c for c in configs if c[0] == "stock files" or "batch partners" in c[0] or "no decode cache" in c[0]]
        if args.no_stock:
            configs = [c for c in configs if not c[0].startswith("stock")]

        # Rounds interleave the configurations, so load from other jobs on the machine hits them
        # alike; each configuration reports its median round.
        rounds: dict[str, list[dict]] = {name: [] for name, _, _ in configs}
        for r in range(args.rounds):
            for name, _, fn in configs:
                try:
                    rounds[name].append(fn(args.seconds / args.rounds))
                except Exception as e:  # one broken configuration must not hide the others
                    rounds[name].append({"error": f"{type(e).__name__}: {e}"})
                got = rounds[name][-1]
                cold = f" (first epoch, cold decode cache: {got['first_epoch_images_per_s']:.1f})" if "first_epoch_images_per_s" in got else ""
                print(f"  round {r + 1}/{args.rounds} {name:38s} {got.get('images_per_s', float('nan')):8.1f} img/s{cold} {got.get('error', '')}", flush=True)
        for name, runs in rounds.items():
            ok = [x for x in runs if "images_per_s" in x]
            res: dict[str, Any] = {"rounds": runs}
            if ok:
                res["images_per_s"] = float(np.median([x["images_per_s"] for x in ok]))
                res["cpu_ms_per_image"] = float(np.median([x["cpu_ms_per_image"] for x in ok]))
                if all("decodes_per_image" in x for x in ok):
                    res["decodes_per_image"] = float(np.median([x["decodes_per_image"] for x in ok]))
                firsts = [x["first_epoch_images_per_s"] for x in ok if "first_epoch_images_per_s" in x]
                if firsts:
                    res["first_epoch_images_per_s"] = float(np.median(firsts))
            else:
                res["error"] = runs[-1].get("error")
            results["configs"][name] = res

        results["machine"]["loadavg_end"] = os.getloadavg()
        again = ceilings(src, min(args.seconds, 3.0))  # the least-disturbed measurement is the ceiling
        results["ceilings_runs"] = [dict(ceil), again]
        for k in ceil:
            ceil[k] = max(ceil[k], again[k])
        decode_ceiling = ceil["decode_resize_1core"] * min(args.workers, os.cpu_count() or 1)
        results["decode_ceiling"] = decode_ceiling
        rows = []
        for name, base, _ in configs:
            r = results["configs"][name]
            ips = r.get("images_per_s", float("nan"))
            ref = decode_ceiling if base == "decode ceiling" else results["configs"].get(base, {}).get("images_per_s", float("nan"))
            r["baseline"], r["ratio"] = base, (ips / ref if ref == ref and ref else float("nan"))
            if base in rounds:  # ratio of the same round (the same machine load), median over rounds
                pairs = [a["images_per_s"] / b["images_per_s"] for a, b in zip(rounds[name], rounds[base])
                         if "images_per_s" in a and b.get("images_per_s")]
                if pairs:
                    r["ratio"] = float(np.median(pairs))
            rows.append((name, ips, base, r["ratio"], r.get("cpu_ms_per_image", float("nan")), r.get("decodes_per_image", float("nan"))))
            if "first_epoch_images_per_s" in r:
                cold = r["first_epoch_images_per_s"]
                r["first_epoch_ratio"] = cold / ref if ref == ref and ref else float("nan")
                rows.append((f"{name}, 1st epoch (cold cache)", cold, base, r["first_epoch_ratio"], float("nan"), float("nan")))
        if args.decode_bound or not args.quick:
            print(f"decodes per output image, first {args.count_batches} batches at imgsz {args.count_imgsz} "
                  "(cpu without its decoded cache):", flush=True)
            results["decode_counts"] = decode_counts(y, args.count_imgsz, args.batch, args.workers, args.count_batches)
        if not args.no_pss:
            for key, store, epochs in (("pss_2ranks_2workers", "ram", 1), ("shared_decode_cache_2ranks_2workers", "files", 3)):
                if args.decode_bound and store == "ram":
                    continue
                try:
                    results[key] = measure_pss(y, args.batch, store=store, epochs=epochs)
                except Exception as e:
                    results[key] = {"error": f"{type(e).__name__}: {e}"}
        results["machine"]["loadavg_pss_end"] = os.getloadavg()

        print(f"\nfastload loader throughput: {args.images} images (coco128 x{args.images // 128}), batch {args.batch}, "
              f"{args.workers} workers, imgsz {args.imgsz}, {args.seconds:.0f} s per config in {args.rounds} interleaved rounds "
              f"(median), {os.cpu_count()} CPUs, OpenCV {cv2.__version__}")
        print(f"ceilings (1 core): decode {ceil['decode_1core']:.0f} img/s, decode+resize {ceil['decode_resize_1core']:.0f} img/s, "
              f"memcpy 640x640x3 {ceil['memcpy_640_1core']:.0f} img/s ({ceil['memcpy_GBps']:.1f} GB/s); "
              f"decode ceiling with {args.workers} workers: {decode_ceiling:.0f} img/s")
        w = max(38, *(len(row[0]) for row in rows))
        print(f"| {'configuration':{w}s} | {'img/s':>8s} | {'vs':24s} | {'ratio':>6s} | {'CPU ms/img':>10s} | {'2-core bound':>12s} | {'decodes/img':>11s} |")
        print(f"|{'-' * (w + 2)}|{'-' * 10}|{'-' * 26}|{'-' * 8}|{'-' * 12}|{'-' * 14}|{'-' * 13}|")
        ncpu = min(os.cpu_count() or 1, max(args.workers, 1))
        for name, ips, base, ratio, cpu, dec in rows:
            bound = ncpu * 1e3 / cpu if cpu == cpu and cpu > 0 else float("nan")
            print(f"| {name:{w}s} | {ips:8.1f} | {base:24s} | {cell(ratio, 6, '.2f')} | {cell(cpu, 10, '.2f')} | "
                  f"{cell(bound, 12, '.0f')} | {cell(dec, 11, '.2f')} |")
        results["goals"] = goals = check_goals(results["configs"])
        for g in goals:
            print(f"goal {g['goal']}: {g['config']} {g['images_per_s']:.0f} img/s, {g['ratio']:.2f}x -> {'MET' if g['met'] else 'missed'}")
        for row in results.get("decode_counts", []):
            if row["partners"] == "batch" and "decodes_per_image" in row:
                dpi = row["decodes_per_image"]
                print(f"goal decodes per output image <= {DECODES_GOAL} with partners batch: {row['engine']} {row['store']} "
                      f"{dpi:.2f} -> {'MET' if dpi <= DECODES_GOAL else 'missed'}")
        if results.get("decode_counts"):
            print("| engine | store | decodes/img, partners dataset | decodes/img, partners batch |")
            print("|---|---|---:|---:|")
            counts = {(r["engine"], r["store"], r["partners"]): r for r in results["decode_counts"]}
            for engine in COUNTED_ENGINES:
                for st in ("files", "lmdb"):
                    cells = [counts.get((engine, st, p), {}) for p in ("dataset", "batch")]
                    print(f"| {engine} | {st} | " + " | ".join(
                        f"{c['decodes_per_image']:.2f}" if "decodes_per_image" in c else c.get("error", "-")[:40] for c in cells) + " |")
        if "pss_2ranks_2workers" in results:
            print(f"PSS, 2 ranks x (main + 2 workers), ram store: {json.dumps(results['pss_2ranks_2workers'])}")
        if "shared_decode_cache_2ranks_2workers" in results:
            print("shared decoded cache, 2 ranks x (main + 2 workers), files, partners dataset, 3 epochs: "
                  f"{json.dumps(results['shared_decode_cache_2ranks_2workers'])}")
        print(f"load average start {results['machine']['loadavg_start']}, end {results['machine']['loadavg_end']}")
        Path(args.json).write_text(json.dumps(results, indent=1, default=float))
        print(f"wrote {args.json}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
