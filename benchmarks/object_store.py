"""One store read several ways in one run: from local disk, staged from object storage, and streamed from it in
shards with a cache that holds the whole dataset and with one that holds a quarter of it, each without and with
read-ahead (the next shards of the epoch's order downloaded while the loader renders); for each uploaded kind:
``disk`` (decoded at ``--imgsz``: nothing to decode, about five times the JPEGs' bytes to download) and
``encoded`` (the JPEGs themselves, decoded on the node).

The training set (coco128 repeated to ``--images`` images, or as many synthetic images with ``--synthetic``) is
converted locally and uploaded to an S3 server this benchmark starts (moto's server mode, in a process of its own: the same
machine, no network, its Python server sharing the CPU with the loader; it reads a whole object for each
ranged GET, so large objects download slower from it than from a real S3). Every configuration runs the same loader (cpu
engine, ``--workers`` workers, full augmentation, ``partners="batch"``) for two epochs, after one unreported
warm-up run from local disk, and each local store again at the end (the machine's drift); the table gives the
time to the first batch and the images/s of each epoch (staging's time is counted in its first epoch), side by
side, each row's ratios against the local store of its own kind.

    PYTHONPATH=$PWD python3 benchmarks/object_store.py --images 1000 --imgsz 640
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import fastload
from fastload.data.synthetic import make_synthetic_dataset
from fastload.store import open_store
from fastload.store.convert import convert
from fastload.store.stage import stage
from fastload.store.upload import convert_to_url

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loader_throughput import COCO128, make_repeated  # noqa: E402  (a sibling script)


def run_epochs(data: Any, kind: str, args: argparse.Namespace, before_s: float = 0.0) -> dict[str, float]:
    """Two epochs of a loader over ``data`` (a yaml's store of ``kind``, or an open streamed store): seconds to the
    first batch and images/s of each epoch (``before_s``, spent before the loader could start, is added to the first
    epoch)."""
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    store = kind if isinstance(data, (str, Path)) else "auto"  # an open store is read as it is
    with fastload.loader(data, imgsz=args.imgsz, batch_size=args.batch, workers=args.workers, seed=0,
                         partners="batch", store=store, engine_options={"decode_cache_mb": 0}) as fl:
        for epoch in (1, 2):
            images = 0
            start = time.perf_counter()
            for i, batch in enumerate(fl):
                if epoch == 1 and i == 0:
                    out["first_batch_s"] = before_s + time.perf_counter() - t0
                images += len(batch[0])
            seconds = time.perf_counter() - start + (before_s + start - t0 if epoch == 1 else 0.0)
            out[f"epoch{epoch}_img_s"] = images / seconds
    return out


def start_server() -> subprocess.Popen:
    """moto's S3 server (only this benchmark's: the `dev` extra) in a process of its own, as a remote server would
    be: its Python threads do not share this process's interpreter lock; its CPU time still comes from this
    machine's cores. The environment is pointed at it."""
    code = ("import logging, sys\n"
            "from moto.server import ThreadedMotoServer\n"
            "logging.getLogger('werkzeug').setLevel(logging.ERROR)\n"
            "server = ThreadedMotoServer(ip_address='127.0.0.1', port=0, verbose=False)\n"
            "server.start()\n"
            "print('%s:%d' % server.get_host_and_port(), flush=True)\n"
            "sys.stdin.read()\n")  # serves until this benchmark ends
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    address = proc.stdout.readline().strip() if proc.stdout else ""
    if not address:
        raise SystemExit(f"the S3 server did not start (exit {proc.poll()})")
    os.environ.update(AWS_ENDPOINT_URL=f"http://{address}", AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1")
    return proc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=1000, help="training images (coco128 repeated, or synthetic)")
    ap.add_argument("--synthetic", action="store_true", help="synthetic images (a third of them PNGs) instead of coco128")
    ap.add_argument("--imgsz", type=int, default=640, help="the disk store's and the loader's image size")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2, help="the cpu engine's render processes")
    ap.add_argument("--shard-mb", type=float, default=16.0, help="bytes of one shard of the streamed store, in MiB")
    ap.add_argument("--read-ahead", type=int, default=2, help="shards read ahead in the rows with read-ahead")
    ap.add_argument("--upload", default="disk,encoded", help="the uploaded kinds compared: disk, encoded or both")
    args = ap.parse_args(argv)
    kinds = [k for k in args.upload.split(",") if k]
    if not kinds or any(k not in ("disk", "encoded") for k in kinds):
        ap.error(f"--upload {args.upload!r}: choose disk, encoded or disk,encoded")
    load_start = os.getloadavg()  # the machine may be shared: said beside the figures

    server = start_server()
    from fastload.store.objects.client import s3_client

    s3_client().create_bucket(Bucket="fastload-bench")
    rows: dict[str, tuple[str, dict[str, float]]] = {}  # name -> (kind, figures)
    try:
        with tempfile.TemporaryDirectory(prefix="fastload-objbench-") as tmp:
            root = Path(tmp)
            if args.synthetic:
                data = make_synthetic_dataset(root / "ds", n_train=args.images, n_val=0, min_size=args.imgsz // 2,
                                              max_size=args.imgsz * 2, seed=0)
            else:
                data = make_repeated(COCO128 / "coco128.yaml", root / "ds", args.images)
            quiet = dict(imgsz=args.imgsz, splits="train", progress=False, log=lambda *_: None)
            local = convert(data, kinds, out=root / "local", **quiet)
            print(f"{args.images} {'synthetic' if args.synthetic else 'coco128'} images at imgsz {args.imgsz}; cpu "
                  f"engine, {args.workers} workers, batch {args.batch}, shards of {args.shard_mb:g} MiB")
            run_epochs(local.yaml_path, kinds[0], args)  # warm-up: imports, kernels, the page cache; not reported
            for kind in kinds:
                url = f"s3://fastload-bench/{kind}"
                t0 = time.perf_counter()
                manifest = convert_to_url(data, kind, url, **quiet)
                print(f"{kind}: store of {manifest.nbytes / 2**20:.1f} MiB; convert + upload {time.perf_counter() - t0:.1f} s")
                rows[f"{kind}: local"] = kind, run_epochs(local.yaml_path, kind, args)
                t0 = time.perf_counter()
                staged = stage(url, root / f"staged-{kind}", progress=False, log=lambda *_: None)
                stage_s = time.perf_counter() - t0
                print(f"  staged {staged.nbytes / 2**20:.1f} MiB in {stage_s:.2f} s "
                      f"({staged.nbytes / 2**20 / stage_s:.0f} MiB/s)")
                rows[f"{kind}: staged (stage time in epoch 1)"] = kind, run_epochs(staged.yaml_path, kind, args, stage_s)
                shard_bytes = int(args.shard_mb * 2**20)
                for name, budget in (("cache holds all", manifest.nbytes + shard_bytes),
                                     # at least window + 1 = 2 shards beside the store's index files
                                     ("cache holds 1/4", max(manifest.nbytes // 4, 2 * shard_bytes + (1 << 20)))):
                    for read_ahead in (0, args.read_ahead):
                        cache = root / f"cache-{kind}-{budget}"
                        stored = open_store(url, "train", kind="stream", imgsz=args.imgsz, cache_dir=cache,
                                            cache_bytes=budget, shard_bytes=shard_bytes, read_ahead=read_ahead,
                                            upload_kind=kind)
                        ahead = f"read-ahead {stored.read_ahead_shards}" if read_ahead else "no read-ahead"
                        label = f"{kind}: streamed, {name} ({len(stored.bounds) - 1} shards), {ahead}"
                        rows[label] = kind, run_epochs(stored, kind, args)
                        stored.close()
                        shutil.rmtree(cache)
            for kind in kinds:  # the machine's speed drifts: the local rows measured again, last
                rows[f"{kind}: local, again"] = kind, run_epochs(local.yaml_path, kind, args)
    finally:
        server.kill()
        server.wait()
    print(f"load average at the start {load_start[0]:.1f}, at the end {os.getloadavg()[0]:.1f}")
    print("\n| configuration | first batch s | epoch 1 img/s | epoch 2 img/s | epoch 1 / local | epoch 2 / local |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (kind, r) in rows.items():
        base = rows[f"{kind}: local"][1]
        print(f"| {name} | {r['first_batch_s']:.2f} | {r['epoch1_img_s']:.0f} | {r['epoch2_img_s']:.0f} | "
              f"{r['epoch1_img_s'] / base['epoch1_img_s']:.2f} | {r['epoch2_img_s'] / base['epoch2_img_s']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
