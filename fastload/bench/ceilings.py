"""The machine's ceilings that every stage is compared with: memory copy, raw sequential read, cores, RAM."""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np
import psutil

from fastload.bench import pagecache

_MB = 1e6


@dataclass
class Ceilings:
    """Machine figures (MB = 10^6 bytes).

    memcpy_mb_s: one core copying a 64 MB buffer (the most any in-memory store can deliver per core).
    raw_read_mb_s: sequential large-block read of the dataset's own files (cold when ``raw_read_cold``).
    cores: logical CPUs this process may use (affinity / cgroup aware where psutil can tell).
    """

    cores: int
    logical_cpus: int
    physical_cores: int | None
    ram_total_gb: float
    ram_available_gb: float
    memcpy_mb_s: float
    raw_read_mb_s: float | None
    raw_read_cold: bool
    raw_read_note: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def usable_cores() -> int:
    """CPUs available to this process: affinity mask, then a cgroup v2 quota if one is set."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:  # containers often limit CPU time by quota rather than by affinity
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]
        if quota != "max":
            n = min(n, max(1, int(float(quota) / float(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def memcpy_rate(seconds: float = 0.3, nbytes: int = 64 << 20) -> float:
    """MB/s of ``numpy.copyto`` between two ``nbytes`` buffers on one core."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in before timing
    n = 0
    t0 = time.perf_counter()
    while True:
        np.copyto(dst, src)
        n += 1
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return n * nbytes / dt / _MB


def _raw_read_rate(paths: Sequence[str], seconds: float = 1.0, block: int = 4 << 20) -> tuple[float | None, bool, str]:
    """Sequential read of ``paths`` (largest first, 4 MB blocks) after dropping them from the cache.

    Returns ``(MB/s or None, cold, note)``. Largest files first: a store file (lmdb, packed) is the
    closest thing to the device's sequential rate that the dataset offers without writing anything.
    """
    sized = []
    for p in paths:
        try:
            sized.append((os.path.getsize(p), str(p)))
        except OSError:
            continue
    sized.sort(reverse=True)
    if not sized:
        return None, False, "no readable files"
    chosen, total = [], 0
    for size, p in sized:  # only evict what the budget can read back, at most ~1 GB
        chosen.append(p)
        total += size
        if total >= 1 << 30:
            break
    dropped = pagecache.drop(chosen)
    buf = bytearray(block)
    view = memoryview(buf)
    nbytes = 0
    t0 = time.perf_counter()
    dt = 0.0
    for p in chosen:
        with open(p, "rb", buffering=0) as fh:
            while True:
                n = fh.readinto(view)
                nbytes += n or 0
                if not n:
                    break
                if time.perf_counter() - t0 >= seconds:
                    break
        dt = time.perf_counter() - t0
        if dt >= seconds:
            break
    dt = max(dt, 1e-9)
    note = f"{len(chosen)} file(s), largest first; " + dropped.describe()
    return nbytes / dt / _MB, dropped.ok, note


def measure_ceilings(paths: Sequence[str] = (), seconds: float = 1.0) -> Ceilings:
    """All ceilings; ``paths`` are the dataset's files (images and store files) for the raw read."""
    vm = psutil.virtual_memory()
    raw, cold, note = _raw_read_rate(paths, seconds) if paths else (None, False, "no on-disk files (the data is in memory)")
    return Ceilings(
        cores=usable_cores(),
        logical_cpus=psutil.cpu_count(logical=True) or os.cpu_count() or 1,
        physical_cores=psutil.cpu_count(logical=False),
        ram_total_gb=vm.total / 1e9,
        ram_available_gb=vm.available / 1e9,
        memcpy_mb_s=memcpy_rate(min(seconds, 0.5) / 2),
        raw_read_mb_s=raw,
        raw_read_cold=cold,
        raw_read_note=note,
    )
