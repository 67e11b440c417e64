"""Loader throughput, side by side: fastload engines/stores vs the stock YOLOv9 loader.

Dataset: coco128 repeated to ``--images`` (512) images (symlinks, so every repeat is its own file),
converted to lmdb, disk and ram stores. Each configuration is timed for ``--seconds`` after a
warm-up batch, in one run, so the ratios hold even when other work shares the machine. Printed:
images/s, ratio to the matching stock baseline, machine ceilings (single-core JPEG decode,
memcpy of a 640x640x3 image), the PSS of a ram-store run (one copy shared by workers and ranks),
and a JSON file with everything.

    python benchmarks/loader_throughput.py --seconds 5 --json loader_throughput.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
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
def make_repeated(src_yaml: Path, out: Path, n: int) -> Path:
    """``n`` images made of coco128 repeated (symlinked under new names) with their labels; returns the yaml."""
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
    """Sum of PSS (MiB) over ``pids`` and the part of it that maps the ram store ``segment``."""
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
    return {"pss_total_MiB": total / 2**20, "pss_ram_store_MiB": seg / 2**20}


def _pss_rank(rank: int, yaml_path: str, out_dir: str, world: int, batch: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rdv", rank=rank, world_size=world)
    from fastload.fastloader import loader

    with loader(yaml_path, store="ram", batch_size=batch, workers=2, rank=rank, world_size=world) as fl:
        for k, _ in enumerate(fl):
            if k == 3:
                break
        dist.barrier()
        if rank == 0:
            pids = []
            for f in Path(out_dir).glob("pids*.json"):
                pids += json.loads(f.read_text())
        Path(out_dir, f"pids{rank}.json").write_text(json.dumps([os.getpid()] + fl.stats()["worker_pids"]))
        dist.barrier()
        if rank == 0:
            pids = [p for f in Path(out_dir).glob("pids*.json") for p in json.loads(f.read_text())]
            res = pss_of_tree(pids, fl.store.path)
            res["ram_store_MiB"] = sum(p.stat().st_size for p in Path(fl.store.path).rglob("*") if p.is_file()) / 2**20
            res["ring_MiB_per_rank"] = fl.engine.ring.n_slots * fl.engine.ring.slot_bytes / 2**20
            res["processes"] = len(pids)
            Path(out_dir, "pss.json").write_text(json.dumps(res))
        dist.barrier()
    dist.destroy_process_group()


def measure_pss(yaml_path: Path, batch: int, world: int = 2) -> dict[str, Any]:
    import torch.multiprocessing as tmp

    with tempfile.TemporaryDirectory() as d:
        tmp.spawn(_pss_rank, args=(str(yaml_path), d, world, batch), nprocs=world, join=True)
        return json.loads(Path(d, "pss.json").read_text())


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
)


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
    ap.add_argument("--no-pss", action="store_true", help="skip the 2-rank PSS measurement")
    args = ap.parse_args(argv)
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
        conv = convert(src, to="lmdb,disk,ram", out=work / "stores", imgsz=args.imgsz, splits="train",
                       progress=False, log=lambda *_: None)
        results["convert_seconds"] = time.perf_counter() - t0
        y = conv.yaml_path
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
            rows.append((name, ips, base, r["ratio"], r.get("cpu_ms_per_image", float("nan"))))
            if "first_epoch_images_per_s" in r:
                cold = r["first_epoch_images_per_s"]
                r["first_epoch_ratio"] = cold / ref if ref == ref and ref else float("nan")
                rows.append((f"{name}, 1st epoch (cold cache)", cold, base, r["first_epoch_ratio"], float("nan")))
        if not args.no_pss:
            try:
                results["pss_2ranks_2workers"] = measure_pss(y, args.batch)
            except Exception as e:
                results["pss_2ranks_2workers"] = {"error": f"{type(e).__name__}: {e}"}
        results["machine"]["loadavg_pss_end"] = os.getloadavg()

        print(f"\nfastload loader throughput: {args.images} images (coco128 x{args.images // 128}), batch {args.batch}, "
              f"{args.workers} workers, imgsz {args.imgsz}, {args.seconds:.0f} s per config in {args.rounds} interleaved rounds "
              f"(median), {os.cpu_count()} CPUs, OpenCV {cv2.__version__}")
        print(f"ceilings (1 core): decode {ceil['decode_1core']:.0f} img/s, decode+resize {ceil['decode_resize_1core']:.0f} img/s, "
              f"memcpy 640x640x3 {ceil['memcpy_640_1core']:.0f} img/s ({ceil['memcpy_GBps']:.1f} GB/s); "
              f"decode ceiling with {args.workers} workers: {decode_ceiling:.0f} img/s")
        print(f"| {'configuration':38s} | {'img/s':>8s} | {'vs':24s} | {'ratio':>6s} | {'CPU ms/img':>10s} | {'2-core bound':>12s} |")
        print(f"|{'-' * 40}|{'-' * 10}|{'-' * 26}|{'-' * 8}|{'-' * 12}|{'-' * 14}|")
        ncpu = min(os.cpu_count() or 1, max(args.workers, 1))
        for name, ips, base, ratio, cpu in rows:
            bound = ncpu * 1e3 / cpu if cpu == cpu and cpu > 0 else float("nan")
            print(f"| {name:38s} | {ips:8.1f} | {base:24s} | {cell(ratio, 6, '.2f')} | {cell(cpu, 10, '.2f')} | {cell(bound, 12, '.0f')} |")
        results["goals"] = goals = check_goals(results["configs"])
        for g in goals:
            print(f"goal {g['goal']}: {g['config']} {g['images_per_s']:.0f} img/s, {g['ratio']:.2f}x -> {'MET' if g['met'] else 'missed'}")
        if "pss_2ranks_2workers" in results:
            print(f"PSS, 2 ranks x (main + 2 workers), ram store: {json.dumps(results['pss_2ranks_2workers'])}")
        print(f"load average start {results['machine']['loadavg_start']}, end {results['machine']['loadavg_end']}")
        Path(args.json).write_text(json.dumps(results, indent=1, default=float))
        print(f"wrote {args.json}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
