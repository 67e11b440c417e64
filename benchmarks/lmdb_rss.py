"""Max RSS of one process reading every record of an LMDB store, with the release of read pages and without.

    python benchmarks/lmdb_rss.py --root /tmp/lmdb_rss [--records 10000] [--record-kb 100]

Writes (once, reused) a store of random values, then runs in fresh processes: every record read with
``LmdbStore.read_image``, and ``fastload verify``, each with ``RELEASE_EVERY`` as it is and disabled. The page cache
is warm after the first run: what is compared is the pages each process keeps mapped, not disk reads.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from fastload.store.lmdb_store import LmdbWriter

DISABLE_RELEASE = "from fastload.store import lmdb_store; lmdb_store.RELEASE_EVERY = 1 << 62; "
READ_ALL = (
    "from fastload.store.lmdb_store import LmdbStore; store = LmdbStore({path!r})\n"
    "for i in range(len(store)): store.read_image(i)"
)
VERIFY = "import sys; from fastload.cli import main; sys.exit(main(['verify', {path!r}, '--no-progress']))"


def make_store(path: Path, records: int, record_bytes: int) -> None:
    rng = np.random.default_rng(0)
    writer = LmdbWriter(path, job={"benchmark": "lmdb_rss"}, map_size=records * (record_bytes + 8192))
    no_boxes = np.zeros((0, 5), np.float32)
    for start in range(0, records, 500):
        writer.add_many([(i, rng.integers(0, 256, record_bytes, np.uint8).tobytes(), no_boxes, (64, 64), f"{i}.jpg",
                          None) for i in range(start, min(start + 500, records))])
    writer.commit(records, {"kind": "lmdb", "names": []})


def max_rss_mib(code: str) -> tuple[float, float]:
    """(max RSS in MiB, seconds) of ``python -c code`` in a fresh process."""
    wait_start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)  # this child's own max RSS, not the largest of all children
    if status != 0:
        raise SystemExit(f"the measured process failed (wait status {status}): {code}")
    return usage.ru_maxrss / 1024, time.perf_counter() - wait_start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--record-kb", type=int, default=100)
    args = parser.parse_args()
    path = args.root / f"n{args.records}-kb{args.record_kb}.lmdb"
    if not (path / "data.mdb").exists():
        make_store(path, args.records, args.record_kb * 1000)
    print(f"{path}: {(path / 'data.mdb').stat().st_size / 2**20:.0f} MiB, {args.records} records")
    for imports in ("fastload.store.lmdb_store", "fastload.cli"):
        print(f"import {imports} only: {max_rss_mib('import ' + imports)[0]:.0f} MiB max RSS")
    for name, code in (("read every record", READ_ALL), ("fastload verify", VERIFY)):
        for release, prefix in (("released", ""), ("never released", DISABLE_RELEASE)):
            rss, seconds = max_rss_mib(prefix + code.format(path=str(path)))
            print(f"{name}, {release}: {rss:.0f} MiB max RSS, {seconds:.2f} s")


if __name__ == "__main__":
    main()
