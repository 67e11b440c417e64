"""What a streamed store's node-local cache holds on disk while a loader reads it, against its ``cache_bytes``.

A synthetic training set is converted to a ``disk`` store (decoded at ``--imgsz``) and uploaded to an S3 server
this benchmark starts (moto's server mode, in a process of its own, as ``object_store.py`` does). Then ``--runs``
runs of a 2-epoch loader (cpu engine, ``--workers`` workers, read-ahead 2) stream it through one ``cache_dir`` with
``cache_bytes`` of ``--budget-shards`` shards; before every run but the first the store is uploaded again
(``--force``: a new build at the same URL, as a re-conversion makes), so the later runs find the replaced build's
shards in the cache. Every second (and once at the end of each run) a thread samples:

- ``du``: the bytes on disk of every file and folder under ``cache_dir`` (``st_blocks * 512``, as ``du`` counts);
- ``mapped deleted``: the bytes of files under ``cache_dir`` removed from it while a process (the loader and its
  workers, from their ``/proc/<pid>/maps``) still maps them: ``du`` no longer sees them, the disk still holds them;
- ``df``: when ``cache_dir`` could be put on a tmpfs of its own (``mount -t tmpfs``, which needs root), the bytes
  that file system says are used: ``du`` and the mapped deleted files together, as the kernel counts them.

It prints the maximum of each, per run and over all, beside ``cache_bytes`` and the shard size.

    PYTHONPATH=$PWD python3 benchmarks/stream_cache_budget.py
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import fastload
from fastload.data.synthetic import make_synthetic_dataset
from fastload.store import open_store
from fastload.store.upload import convert_to_url

sys.path.insert(0, str(Path(__file__).resolve().parent))
from object_store import start_server  # noqa: E402  (a sibling script)


def du_bytes(root: Path) -> int:
    """What ``du -s --block-size=1 root`` says: the blocks of every file and folder under ``root``."""
    total = 0
    for folder, dirs, files in os.walk(root):
        for name in [folder, *(os.path.join(folder, n) for n in dirs + files)]:
            try:
                total += os.lstat(name).st_blocks * 512
            except FileNotFoundError:  # removed meanwhile
                pass
    return total


def descendants(pid: int) -> list[int]:
    """``pid`` and every process started under it (the loader's workers)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    parents[int(entry)] = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = [pid], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def mapped_deleted_bytes(pids: list[int], root: Path) -> int:
    """Bytes of the deleted files under ``root`` that ``pids`` map, each file once (by its inode): the largest
    extent any one process maps of it."""
    extents: dict[str, int] = {}
    prefix = str(root) + "/"
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                lines = f.readlines()
        except OSError:
            continue
        mapped: dict[str, int] = {}
        for line in lines:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(prefix) and fields[5].rstrip().endswith("(deleted)"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                mapped[fields[4]] = mapped.get(fields[4], 0) + end - start
        for inode, nbytes in mapped.items():
            extents[inode] = max(extents.get(inode, 0), nbytes)
    return sum(extents.values())


def df_used(root: Path) -> int:
    fs = os.statvfs(root)
    return (fs.f_blocks - fs.f_bfree) * fs.f_frsize


class Sampler:
    """Samples ``root`` every ``interval_s`` in a thread; keeps the maxima."""

    def __init__(self, root: Path, own_tmpfs: bool, interval_s: float = 1.0) -> None:
        self.root, self.own_tmpfs, self.interval_s = root, own_tmpfs, interval_s
        self.maxima = {"du": 0, "mapped deleted": 0, "du + mapped deleted": 0, "df": 0}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> None:
        if not self.root.is_dir():  # unmounted: the run ended with an error
            return
        du = du_bytes(self.root)
        deleted = mapped_deleted_bytes(descendants(os.getpid()), self.root)
        now = {"du": du, "mapped deleted": deleted, "du + mapped deleted": du + deleted,
               "df": df_used(self.root) if self.own_tmpfs else 0}
        for k, v in now.items():
            self.maxima[k] = max(self.maxima[k], v)
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        self.sample()
        return self.maxima


def mount_own_tmpfs(folder: Path, nbytes: int) -> bool:
    """Put a tmpfs of its own at ``folder`` (root only); False where that is not allowed."""
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    return done.returncode == 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=1200, help="synthetic training images")
    ap.add_argument("--imgsz", type=int, default=320, help="the disk store's and the loader's image size")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2, help="the cpu engine's render processes")
    ap.add_argument("--shard-mb", type=float, default=4.0, help="bytes of one shard, in MiB")
    ap.add_argument("--budget-shards", type=int, default=4, help="cache_bytes, in shards")
    ap.add_argument("--runs", type=int, default=2, help="loader runs; each one after the first reads a new build")
    args = ap.parse_args(argv)
    shard_bytes = int(args.shard_mb * 2**20)
    budget = args.budget_shards * shard_bytes
    server = start_server()
    from fastload.store.objects.client import s3_client

    s3_client().create_bucket(Bucket="fastload-bench")
    url = "s3://fastload-bench/budget"
    overall: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="fastload-cachebench-") as tmp:
        cache_dir = Path(tmp) / "cache"
        own_tmpfs = mount_own_tmpfs(cache_dir, 8 * budget)
        try:
            data = make_synthetic_dataset(Path(tmp) / "ds", n_train=args.images, n_val=0, min_size=args.imgsz // 2,
                                          max_size=args.imgsz * 2, seed=0)
            print(f"{args.images} synthetic images, disk store at imgsz {args.imgsz}; cpu engine, {args.workers} "
                  f"workers, batch {args.batch}; shards of {shard_bytes} bytes, cache_bytes {budget} "
                  f"({args.budget_shards} shards); cache_dir on "
                  f"{'a tmpfs of its own' if own_tmpfs else 'the temporary folder'}")
            for run in range(1, args.runs + 1):
                manifest = convert_to_url(data, "disk", url, imgsz=args.imgsz, splits="train", progress=False,
                                          force=run > 1, log=lambda *_: None)
                sampler = Sampler(cache_dir, own_tmpfs)
                stored = open_store(url, "train", kind="stream", imgsz=args.imgsz, cache_dir=cache_dir,
                                    cache_bytes=budget, shard_bytes=shard_bytes, upload_kind="disk")
                largest = int(max(stored.offsets[b] - stored.offsets[a]
                                  for a, b in zip(stored.bounds[:-1], stored.bounds[1:])))
                start = time.perf_counter()
                with fastload.loader(stored, imgsz=args.imgsz, batch_size=args.batch, workers=args.workers, seed=run,
                                     partners="batch") as fl:
                    for _ in range(2):
                        for _batch in fl:
                            pass
                seconds = time.perf_counter() - start
                stored.close()
                maxima = sampler.stop()
                for k, v in maxima.items():
                    overall[k] = max(overall.get(k, 0), v)
                print(f"run {run} (build {manifest.build}, {len(stored.bounds) - 1} shards, the largest {largest} "
                      f"bytes; 2 epochs in {seconds:.1f} s, {sampler.samples} samples): " + ", ".join(
                          f"max {k} {v} ({v / budget:.2f}x cache_bytes)" for k, v in maxima.items()
                          if k != "df" or own_tmpfs) + f"; du at its end {du_bytes(cache_dir)}")
        finally:
            if own_tmpfs:
                # --lazy: after an interrupt the workers may still hold it; detached now, freed once they end
                subprocess.run(["umount", "--lazy", str(cache_dir)], check=False)
            server.kill()
            server.wait()
    print("over all runs: " + ", ".join(f"max {k} {v} ({v / budget:.2f}x)" for k, v in overall.items()
                                        if k != "df" or own_tmpfs) + f"; cache_bytes {budget}, shard {shard_bytes}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
