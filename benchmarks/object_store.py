"""One store read several ways in one run: from local disk, staged from object storage, and streamed from it in
shards with a cache that holds the whole dataset and with one that holds a quarter of it, each without and with
read-ahead (the next shards of the epoch's order downloaded while the loader renders).

A synthetic training set of ``--images`` images is converted to a ``disk`` store at ``--imgsz`` locally and
uploaded to an S3 server started in this process (moto's server mode: the same machine, no network, its
Python server sharing the CPU with the loader). Every configuration runs the same loader (cpu engine,
``--workers`` workers, full augmentation, ``partners="batch"``) for two epochs, after one unreported warm-up
run from local disk, and local disk again at the end (the machine's drift); the table gives the time to the
first batch and the images/s of each epoch (staging's time is counted in its first epoch), side by side.

    PYTHONPATH=$PWD python3 benchmarks/object_store.py --images 2000 --imgsz 320
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
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


def run_epochs(data: Any, args: argparse.Namespace, before_s: float = 0.0) -> dict[str, float]:
    """Two epochs of a loader over ``data``: seconds to the first batch and images/s of each epoch
    (``before_s``, spent before the loader could start, is added to the first epoch)."""
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    # a yaml's disk store; an open (streamed) store is read as it is
    with fastload.loader(data, imgsz=args.imgsz, batch_size=args.batch, workers=args.workers, seed=0,
                         partners="batch", store="disk") as fl:
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=2000, help="synthetic training images")
    ap.add_argument("--imgsz", type=int, default=320, help="the disk store's and the loader's image size")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2, help="the cpu engine's render processes")
    ap.add_argument("--shard-mb", type=float, default=8.0, help="bytes of one shard of the streamed store, in MiB")
    ap.add_argument("--read-ahead", type=int, default=2, help="shards read ahead in the rows with read-ahead")
    args = ap.parse_args(argv)
    load_start = os.getloadavg()  # the machine may be shared: said beside the figures

    # moto is only this benchmark's server (the `dev` extra): imported when it runs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(AWS_ENDPOINT_URL=f"http://{host}:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    from fastload.store.objects.client import s3_client

    s3_client().create_bucket(Bucket="fastload-bench")
    url = "s3://fastload-bench/synthetic"
    rows: dict[str, dict[str, float]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="fastload-objbench-") as tmp:
            root = Path(tmp)
            data = make_synthetic_dataset(root / "ds", n_train=args.images, n_val=0, min_size=args.imgsz // 2,
                                          max_size=args.imgsz * 2, seed=0)
            quiet = dict(imgsz=args.imgsz, splits="train", progress=False, log=lambda *_: None)
            local = convert(data, "disk", out=root / "local", **quiet)
            t0 = time.perf_counter()
            manifest = convert_to_url(data, "disk", url, **quiet)
            print(f"{args.images} images, disk store of {manifest.nbytes / 2**20:.1f} MiB; convert + upload "
                  f"{time.perf_counter() - t0:.1f} s; cpu engine, {args.workers} workers, batch {args.batch}")

            run_epochs(local.yaml_path, args)  # warm-up: imports, kernels, the page cache; not reported
            rows["local disk"] = run_epochs(local.yaml_path, args)
            t0 = time.perf_counter()
            staged = stage(url, root / "staged", progress=False, log=lambda *_: None)
            stage_s = time.perf_counter() - t0
            print(f"staged {staged.nbytes / 2**20:.1f} MiB in {stage_s:.2f} s ({staged.nbytes / 2**20 / stage_s:.0f} MiB/s)")
            rows["staged (stage time in epoch 1)"] = run_epochs(staged.yaml_path, args, before_s=stage_s)
            shard_bytes = int(args.shard_mb * 2**20)
            for name, budget in (("streamed, cache holds all", manifest.nbytes + shard_bytes),
                                 ("streamed, cache holds 1/4", max(manifest.nbytes // 4, 2 * shard_bytes))):
                for read_ahead in (0, args.read_ahead):
                    cache = root / f"cache-{budget}"
                    stored = open_store(url, "train", kind="stream", imgsz=args.imgsz, cache_dir=cache,
                                        cache_bytes=budget, shard_bytes=shard_bytes, read_ahead=read_ahead)
                    ahead = f"read-ahead {stored.read_ahead_shards}" if read_ahead else "no read-ahead"
                    rows[f"{name} ({len(stored.bounds) - 1} shards), {ahead}"] = run_epochs(stored, args)
                    stored.close()
                    shutil.rmtree(cache)
            # the machine's speed drifts: the first row measured again, last
            rows["local disk, again"] = run_epochs(local.yaml_path, args)
    finally:
        server.stop()
    print(f"load average at the start {load_start[0]:.1f}, at the end {os.getloadavg()[0]:.1f}")
    base = rows["local disk"]
    print("\n| configuration | first batch s | epoch 1 img/s | epoch 2 img/s | epoch 1 / local | epoch 2 / local |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['first_batch_s']:.2f} | {r['epoch1_img_s']:.0f} | {r['epoch2_img_s']:.0f} | "
              f"{r['epoch1_img_s'] / base['epoch1_img_s']:.2f} | {r['epoch2_img_s'] / base['epoch2_img_s']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
