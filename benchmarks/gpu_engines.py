"""GPU-engine throughput: nvJPEG decode rate and images/s of each engine x store (run by gpu_check.sh).

Builds (or takes) a dataset, converts it to lmdb and ram at ``--imgsz``, then prints one line per
measurement. Without CUDA it says so, measures the CPU engine (and the torch engine on CPU
tensors, which shows the code path works, not its speed) and exits 0. Nothing is downloaded.

    python benchmarks/gpu_engines.py [--data coco128.yaml] [--imgsz 640] [--batch 64] [--batches 10]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def log(msg: str) -> None:
    print(msg, flush=True)


def prepare(args: argparse.Namespace, work: Path) -> Path:
    """The data.yaml of a converted (lmdb + ram) dataset."""
    from fastload.store.convert import convert

    if args.data:
        src = Path(args.data)
        log(f"data: {src}")
    else:
        from fastload.data.synthetic import make_synthetic_dataset

        src = make_synthetic_dataset(work / "synth", n_train=args.images, n_val=4, nc=3, seed=0)
        log(f"data: synthetic, {args.images} train images (fastload.data.synthetic)")
    t = time.perf_counter()
    res = convert(src, to="lmdb,ram", out=work / "stores", imgsz=args.imgsz, progress=False, log=lambda *_: None)
    log(f"converted to lmdb + ram at imgsz {args.imgsz} in {time.perf_counter() - t:.1f} s")
    return res.yaml_path


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def decode_rate(yaml_path: Path, device: str, batch: int, seconds: float) -> None:
    """torchvision.io.decode_jpeg on lists of JPEG bytes (nvJPEG on CUDA)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    from fastload.data.images import sniff_format
    from fastload.store.factory import open_store

    with open_store(yaml_path, kind="lmdb") as st:
        bufs = [bytes(st.read_image(i)) for i in range(len(st))]
    jpegs = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in bufs if sniff_format(b) == "jpeg"]
    if not jpegs:
        log("decode: no JPEG files in the data set")
        return
    chunk = (jpegs * (batch // len(jpegs) + 1))[:batch]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        decode_jpeg(chunk, mode=ImageReadMode.RGB, device=device)  # warm-up (nvJPEG handles)
        sync(device)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            decode_jpeg(chunk, mode=ImageReadMode.RGB, device=device)
            n += len(chunk)
        sync(device)
    dt = time.perf_counter() - t0
    name = "nvJPEG" if device.startswith("cuda") else "libjpeg (CPU, one thread)"
    log(f"decode  {name:<28s} {n / dt:9.1f} images/s  (batches of {len(chunk)}, stored JPEGs)")


def engine_rate(yaml_path: Path, engine: str, store: str, device: str | None, args: argparse.Namespace) -> None:
    from fastload.fastloader import loader

    label = f"engine={engine:<4s} store={store:<5s} device={device or 'cpu'}"
    try:
        opts = dict(store=store, engine=engine, imgsz=args.imgsz, batch_size=args.batch,
                    workers=None if engine == "gpu" else args.workers,  # the gpu engine takes no workers
                    device=device, hyp=None, seed=0)
        with loader(yaml_path, **opts) as fl:
            it = iter(fl)
            done, seen = 0, 0
            t0 = None
            while done < args.warmup + args.batches:
                try:
                    imgs, targets, _, _ = next(it)
                except StopIteration:
                    it = iter(fl)
                    continue
                done += 1
                if done == args.warmup:
                    sync(device or "cpu")
                    t0 = time.perf_counter()
                elif done > args.warmup:
                    seen += imgs.shape[0]
            sync(device or "cpu")
            dt = time.perf_counter() - (t0 or time.perf_counter())
        log(f"augment {label:<40s} {seen / max(dt, 1e-9):9.1f} images/s  ({args.imgsz}px, scratch-high, batch {args.batch})")
    except Exception as exc:  # a backend missing here must not hide the others
        log(f"augment {label:<40s} skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.environ.get("COCO128") and str(Path(os.environ["COCO128"]) / "coco128.yaml"))
    p.add_argument("--images", type=int, default=int(os.environ.get("IMAGES", 256)), help="synthetic images")
    p.add_argument("--imgsz", type=int, default=int(os.environ.get("IMGSZ", 640)))
    p.add_argument("--batch", type=int, default=int(os.environ.get("BATCH", 64)))
    p.add_argument("--batches", type=int, default=int(os.environ.get("BATCHES", 10)), help="timed batches per run")
    p.add_argument("--warmup", type=int, default=int(os.environ.get("WARMUP", 2)))
    p.add_argument("--workers", type=int, default=int(os.environ.get("WORKERS", min(16, os.cpu_count() or 1))))
    p.add_argument("--work", default=os.environ.get("WORK"), help="scratch folder (default: a temp dir)")
    args = p.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="fastload-gpucheck-"))
    os.environ.setdefault("FASTLOAD_SHM_DIR", str(Path("/dev/shm" if os.path.isdir("/dev/shm") else work) / f"fastload-gpucheck-{os.getpid()}"))
    cuda = torch.cuda.is_available()
    log(f"torch {torch.__version__}  cuda {'available: ' + torch.cuda.get_device_name(0) if cuda else 'NOT available'}"
        f"  cpu cores {os.cpu_count()}")
    try:
        import nvidia.dali as dali

        log(f"DALI {dali.__version__}")
        has_dali = True
    except ImportError:
        log("DALI not installed: engine='dali' skipped (pip install fastload[dali])")
        has_dali = False
    try:
        yaml_path = prepare(args, work)
        dev = "cuda:0" if cuda else "cpu"
        decode_rate(yaml_path, dev, args.batch, seconds=3.0 if cuda else 1.0)
        engine_rate(yaml_path, "cpu", "lmdb", dev if cuda else None, args)
        engine_rate(yaml_path, "cpu", "ram", dev if cuda else None, args)
        if not cuda:
            log("no CUDA GPU: GPU figures not measured. The torch engine on CPU tensors (correctness path, not a speed figure):")
            torch.set_num_threads(1)  # intra-op threads only contend with the loader's own thread here
            engine_rate(yaml_path, "gpu", "ram", "cpu", args)
            return 0
        for store in ("lmdb", "ram", "gpu"):
            engine_rate(yaml_path, "gpu", store, dev, args)
        if has_dali:
            for store in ("lmdb", "ram"):
                engine_rate(yaml_path, "dali", store, dev, args)
        return 0
    finally:
        shutil.rmtree(os.environ["FASTLOAD_SHM_DIR"], ignore_errors=True)
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
