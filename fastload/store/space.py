"""Bytes and room: formatting sizes, measuring folders, and checking that a filesystem or shared
memory can hold what is about to be written (so a conversion refuses before it starts)."""
from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

import psutil

from fastload.store.base import StoreError
from fastload.store.kinds import shm_root


def fmt_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KB"`` (binary multiples)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"


def free_bytes(path: str | Path) -> int:
    """Free bytes for an unprivileged writer on the filesystem holding ``path`` (or its nearest parent)."""
    st = _statvfs(path)
    return st.f_bavail * st.f_frsize


def size_bytes(path: str | Path) -> int:
    """Size of the filesystem holding ``path`` (or its nearest parent), used or not."""
    st = _statvfs(path)
    return st.f_blocks * st.f_frsize


def _statvfs(path: str | Path) -> os.statvfs_result:
    p = Path(path)
    while not p.exists():
        p = p.parent
    return os.statvfs(p)


def tree_bytes(path: str | Path) -> int:
    """Size of a file, or of every file under a folder. Files and folders that vanish meanwhile count 0:
    the shm listing sizes other processes' segments while they are built, renamed and removed."""
    try:
        st = os.stat(path)
    except OSError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size
    total = 0
    for folder, _, files in os.walk(path):  # os.walk skips a folder that cannot be listed (gone)
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(folder, name)).st_size
    return total


def check_space(path: str | Path, needed: int, what: str) -> None:
    """Raise StoreError naming needed vs free bytes when ``path``'s filesystem is too small."""
    free = free_bytes(path)
    if needed > free:
        raise StoreError(
            f"not enough space for {what} at {path}: needs about {fmt_bytes(needed)}, {fmt_bytes(free)} free"
        )


def check_memory(needed: int, what: str) -> None:
    """Raise StoreError when shared memory or available RAM cannot hold ``needed`` bytes."""
    root = shm_root()
    shm_free = free_bytes(root)
    avail = psutil.virtual_memory().available
    margin = 256 << 20  # leave room for the training process itself
    if needed + margin > min(shm_free, avail):
        raise StoreError(
            f"not enough memory for {what}: needs {fmt_bytes(needed)}, but {root} has "
            f"{fmt_bytes(shm_free)} free and {fmt_bytes(avail)} RAM is available; use --to disk instead "
            f"(served from the page cache) or free memory"
        )
