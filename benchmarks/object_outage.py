"""An outage of the S3 server in the middle of a streamed epoch: the epoch completes, every batch identical to an
uninterrupted one (issue 35).

A synthetic training set is uploaded with ``fastload convert --to encoded --out s3://...`` to a local S3 server
(moto's server mode) in a process of its own, on a fixed port. One epoch of a streamed loader (cpu engine, its
workers, a shard cache smaller than the dataset, little read-ahead: shards are being downloaded throughout the
epoch) is run without a fault and its batches hashed. Then, for each outage length and kind, a fresh cache and
the same epoch, with an outage starting after ``--after`` batches:

- ``stop``: the server is stopped (SIGSTOP) for the outage, then continued (SIGCONT): a hung server; connections
  are accepted by the kernel and never answered, so every try waits for the read timeout.
- ``kill``: the server is killed (SIGKILL) and started again on the same port once the outage is over:
  connections are refused meanwhile. moto keeps its objects in memory, so the restarted server is given the same
  bucket and the same objects, byte for byte, before it listens: this simulates the restart of a server that
  keeps its data (MinIO, Ceph...), not the loss of it.

Each run prints the outage, the epoch's wall time beside the uninterrupted one, whether every batch is identical,
and the lines fastload wrote on stderr meanwhile (the loader's processes' wait reports); an epoch that fails (an
outage longer than the retry budget) prints the error's line that names the URL. The retry settings are the
defaults unless the environment sets them (``FASTLOAD_RETRY_SECONDS``, default 600 s).

    PYTHONPATH=$PWD python3 benchmarks/object_outage.py --outages 30,180 --kinds stop,kill
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np

BUCKET = "fastload-outage"

# The server's process: moto's in-memory S3, given the objects of a snapshot folder (if any) before it listens.
_SERVER = r"""
import logging, os, sys
from pathlib import Path
logging.getLogger("werkzeug").setLevel(logging.ERROR)
port, snapshot, bucket = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if snapshot:
    import boto3
    from moto import mock_aws
    os.environ.pop("AWS_ENDPOINT_URL", None)  # the objects go into this process's backend, not over the network
    mock_aws().start()
    client = boto3.client("s3")
    client.create_bucket(Bucket=bucket)
    root = Path(snapshot)
    for path in root.rglob("*"):
        if path.is_file():
            client.put_object(Bucket=bucket, Key=path.relative_to(root).as_posix(), Body=path.read_bytes())
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
server.start()
print("ready", flush=True)
sys.stdin.read()  # serves until the benchmark closes its stdin or kills it
"""


class Server:
    """The S3 server's process on ``port``; ``snapshot``: a folder of objects (key = relative path) it starts with."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.proc: subprocess.Popen | None = None

    def start(self, snapshot: Path | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(self.port), str(snapshot or ""), BUCKET],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout is None or self.proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"the S3 server did not start on port {self.port} (exit {self.proc.poll()})")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signum)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def snapshot(client, folder: Path) -> int:
    """Every object of the bucket into ``folder`` (a file per key); how many bytes."""
    total = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        for entry in page.get("Contents", []):
            path = folder / entry["Key"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(client.get_object(Bucket=BUCKET, Key=entry["Key"])["Body"].read())
            total += path.stat().st_size
    return total


@contextlib.contextmanager
def stderr_into(path: Path) -> Iterator[None]:
    """File descriptor 2 of this process (and of the loader's workers, forked meanwhile) written to ``path``."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def epoch(url: str, cache: Path, args: argparse.Namespace, outage=None) -> tuple[list[str], float]:
    """One epoch of a streamed loader over ``url`` with a fresh ``cache``: each batch's hash and the wall time;
    ``outage()`` starts (in a thread) after ``args.after`` batches."""
    import fastload
    from fastload.store import open_store

    store = open_store(url, "train", kind="stream", imgsz=args.imgsz, cache_dir=cache, cache_bytes=args.cache_bytes,
                       shard_bytes=args.shard_kb << 10, read_ahead=1, upload_kind="encoded")
    hashes: list[str] = []
    t0 = time.perf_counter()
    with fastload.loader(store, imgsz=args.imgsz, batch_size=args.batch, workers=args.workers, seed=0) as fl:
        for imgs, targets, paths, _ in fl:
            digest = hashlib.sha256(np.ascontiguousarray(np.asarray(imgs)).tobytes())
            digest.update(np.ascontiguousarray(np.asarray(targets)).tobytes())
            digest.update("\n".join(map(str, paths)).encode())
            hashes.append(digest.hexdigest())
            if outage is not None and len(hashes) == args.after:
                threading.Thread(target=outage, daemon=True).start()
    store.close()
    return hashes, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outages", default="30,180", help="outage lengths in seconds, comma separated")
    ap.add_argument("--kinds", default="stop,kill", help="stop (SIGSTOP, then SIGCONT), kill (then restart), or both")
    ap.add_argument("--images", type=int, default=400)
    ap.add_argument("--imgsz", type=int, default=256, help="the loader's image size (and the images' largest side)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--shard-kb", type=int, default=128, help="bytes of a shard, in KiB")
    ap.add_argument("--cache-fraction", type=float, default=0.25,
                    help="the shard cache's budget, a fraction of the store's bytes (at least 3 of its largest shard)")
    ap.add_argument("--after", type=int, default=3, help="batches delivered before the outage starts")
    args = ap.parse_args(argv)
    outages = [float(s) for s in args.outages.split(",") if s]
    kinds = [k for k in args.kinds.split(",") if k]
    if not outages or any(k not in ("stop", "kill") for k in kinds) or not kinds:
        ap.error("--outages N[,N..] seconds, --kinds stop, kill or stop,kill")

    from fastload.data.synthetic import make_synthetic_dataset
    from fastload.store import open_store
    from fastload.store.objects.client import retry_policy, s3_client
    from fastload.store.upload import convert_to_url

    server = Server(free_port())
    server.start()
    rows: list[tuple[str, float, float, bool, int]] = []  # kind, outage s, epoch s, batches identical, lines
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{server.port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    try:
        with tempfile.TemporaryDirectory(prefix="fastload-outage-") as tmp:
            root = Path(tmp)
            client = s3_client()
            client.create_bucket(Bucket=BUCKET)
            data = make_synthetic_dataset(root / "ds", n_train=args.images, n_val=0, min_size=args.imgsz // 2,
                                          max_size=args.imgsz, seed=0)
            url = f"s3://{BUCKET}/synth"
            manifest = convert_to_url(data, "encoded", url, imgsz=args.imgsz, splits="train", progress=False,
                                      log=lambda *_: None)
            stored = snapshot(client, root / "snapshot")  # what a restarted server is given again
            with open_store(url, "train", kind="stream", imgsz=args.imgsz, cache_dir=root / "probe",
                            shard_bytes=args.shard_kb << 10, read_ahead=0, upload_kind="encoded") as probe:
                shards = len(probe.bounds) - 1
                largest = int(np.diff(probe.offsets[probe.bounds]).max())
            args.cache_bytes = max(int(manifest.nbytes * args.cache_fraction), 3 * largest)
            print(f"{args.images} synthetic images, encoded store of {manifest.nbytes / 2**20:.1f} MiB ({stored} bytes "
                  f"in the bucket); {shards} shards of about {args.shard_kb} KiB, cache of "
                  f"{args.cache_bytes >> 10} KiB, "
                  f"read-ahead 1, "
                  f"cpu engine, {args.workers} workers, batch {args.batch}; retry budget: {retry_policy().budget()}")
            expected, _ = epoch(url, root / "cache-warm-up", args)  # imports, kernels, the page cache: not timed
            again, plain_s = epoch(url, root / "cache-plain", args)
            print(f"uninterrupted: {len(expected)} batches in {plain_s:.1f} s (after a warm-up epoch; the same "
                  f"batches: {again == expected})")
            for outage_s in outages:
                for kind in kinds:
                    recovered = threading.Event()

                    def outage(kind: str = kind, outage_s: float = outage_s, recovered=recovered) -> None:
                        if kind == "stop":
                            server.signal(signal.SIGSTOP)
                            time.sleep(outage_s)
                            server.signal(signal.SIGCONT)
                        else:
                            server.kill()
                            time.sleep(outage_s)
                            server.start(root / "snapshot")
                        recovered.set()

                    log = root / f"stderr-{kind}-{outage_s:g}.txt"
                    t0 = time.perf_counter()
                    failure = ""
                    with stderr_into(log):
                        try:
                            got, wall_s = epoch(url, root / f"cache-{kind}-{outage_s:g}", args, outage)
                        except Exception as exc:  # an outage longer than the retry budget
                            got, wall_s, failure = [], time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"
                    recovered.wait()  # the next run starts with the server up
                    lines = [line for line in log.read_text().splitlines() if line.startswith("fastload")]
                    same = got == expected
                    rows.append((kind, outage_s, wall_s, same, len(lines)))
                    print(f"\n{kind} for {outage_s:g} s after batch {args.after}: epoch {wall_s:.1f} s (uninterrupted "
                          f"{plain_s:.1f} s), {len(got)} batches, every batch identical: {same}; {len(lines)} line(s) "
                          f"on stderr:")
                    for line in lines:
                        print(f"  {line}")
                    if failure:  # the error's size, and its line that names the URL
                        named = [line for line in failure.splitlines() if "s3://" in line]
                        print(f"  the epoch failed after {wall_s:.0f} s with an error of {len(failure.splitlines())} "
                              f"line(s); the one naming the URL: {named[-1] if named else failure}")
    finally:
        server.kill()
    print("\n| outage | kind | epoch s | batches identical | lines on stderr |")
    print("|---:|---|---:|---|---:|")
    for kind, outage_s, wall_s, same, n in rows:
        print(f"| {outage_s:g} s | {kind} | {wall_s:.1f} | {same} | {n} |")
    return 0 if all(row[3] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
