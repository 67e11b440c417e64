"""Evict a dataset's files from the page cache (for cold-read figures) and check that it worked.

Strategy, most targeted first:

1. ``posix_fadvise(POSIX_FADV_DONTNEED)`` on each file: no root needed, touches only our files, drops
   their *clean* pages (we ``fdatasync`` first so that freshly written files are clean too).
2. ``/proc/sys/vm/drop_caches`` (root only, machine-wide): used only when 1. is unavailable or left
   most pages resident.

Residency is measured with ``mincore(2)`` on a sample of the files, so the report can say "cold"
only when the pages really left memory. Files on tmpfs / ramfs (``/dev/shm``, a staged dataset)
live in memory by definition: there is no cold read to measure.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import psutil

MEMORY_FS = {"tmpfs", "ramfs", "devtmpfs"}


@dataclass
class DropResult:
    """What :func:`drop` managed: ``ok`` means the sampled pages are (mostly) no longer resident."""

    ok: bool
    method: str  # "fadvise", "drop_caches" or "none"
    files: int
    resident_after: float | None  # fraction of sampled pages still cached (None: could not check)
    reason: str = ""

    def describe(self) -> str:
        if not self.ok:
            return f"cold read not measured: {self.reason}"
        res = "" if self.resident_after is None else f", {self.resident_after:.0%} resident after"
        return f"page cache dropped with {self.method}{res}"


@functools.lru_cache(maxsize=1)
def _mounts() -> tuple[tuple[str, str], ...]:
    try:
        parts = psutil.disk_partitions(all=True)
    except Exception:  # psutil cannot read the mount table (sandbox): unknown, treated as a disk
        return ()
    return tuple(((p.mountpoint.rstrip("/") or "/"), p.fstype) for p in parts)


def filesystem_type(path: str | Path) -> str:
    """The filesystem type of the mount holding ``path`` ('' when unknown)."""
    target = os.path.realpath(path)
    best, fstype = "", ""
    for mp, fs in _mounts():
        if (target == mp or target.startswith(mp + "/") or mp == "/") and len(mp) >= len(best):
            best, fstype = mp, fs
    return fstype


def in_memory(paths: Sequence[str]) -> bool:
    """True when every file lives on a memory filesystem (tmpfs), where "cold" has no meaning."""
    return bool(paths) and not _on_disk(paths)


def _on_disk(paths: Sequence[str]) -> list[str]:
    """The paths that are not on a memory filesystem (the type is looked up once per folder)."""
    by_dir: dict[str, bool] = {}
    out = []
    for p in paths:
        d = os.path.dirname(os.path.abspath(p))
        if d not in by_dir:
            by_dir[d] = filesystem_type(d) in MEMORY_FS
        if not by_dir[d]:
            out.append(p)
    return out


def _fadvise(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        try:
            os.fdatasync(fd)  # dirty pages are not dropped; make them clean first
        except OSError:
            pass
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")  # page cache only; dentries and inodes stay
        return True
    except OSError:
        return False


_libc = None


def _mincore_fn():
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        _libc = ctypes.CDLL(name or "libc.so.6", use_errno=True)
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        _libc.mincore.restype = ctypes.c_int
    return _libc.mincore


def resident_fraction(paths: Iterable[str], max_files: int = 64, max_bytes: int = 256 << 20) -> float | None:
    """Fraction of the pages of (a sample of) ``paths`` held in the page cache; None if it cannot tell."""
    try:
        mincore = _mincore_fn()
    except (OSError, AttributeError):
        return None
    page = mmap.PAGESIZE
    total = resident = 0
    budget = max_bytes
    for n, path in enumerate(paths):
        if n >= max_files or budget <= 0:
            break
        try:
            size = os.path.getsize(path)
            if size == 0:
                continue
            length = min(size, budget)
            with open(path, "rb") as fh:
                # A private mapping is still backed by the cached pages until written; it gives a
                # writable buffer, which ctypes needs to take the address.
                mm = mmap.mmap(fh.fileno(), length, access=mmap.ACCESS_COPY)
        except (OSError, ValueError):
            continue
        try:
            pages = (length + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
            if mincore(ctypes.c_void_p(addr), ctypes.c_size_t(length), vec) != 0:
                return None
            resident += sum(v & 1 for v in vec)
            total += pages
            budget -= length
            del addr
        finally:
            try:
                mm.close()
            except BufferError:  # a lingering ctypes view; the mapping goes with the object
                pass
    return resident / total if total else None


def drop(paths: Sequence[str]) -> DropResult:
    """Evict ``paths`` from the page cache; see the module docstring for the strategy."""
    paths = [str(p) for p in paths]
    if not paths:
        return DropResult(False, "none", 0, None, "no files to drop")
    disk = _on_disk(paths)
    if not disk:
        return DropResult(False, "none", len(paths), None, f"{Path(paths[0]).parent} is on a memory filesystem (tmpfs)")
    paths = disk  # tmpfs pages cannot be dropped; judge the others only
    method = "none"
    if hasattr(os, "posix_fadvise"):
        done = sum(_fadvise(p) for p in paths)
        if done:
            method = "fadvise"
    resident = resident_fraction(paths)
    if (method == "none" or (resident is not None and resident > 0.5)) and _drop_caches():
        method = "drop_caches"
        resident = resident_fraction(paths)
    if method == "none":
        why = "posix_fadvise is unavailable on this OS and /proc/sys/vm/drop_caches needs root"
        return DropResult(False, method, len(paths), resident, why)
    if resident is not None and resident > 0.5:
        why = f"{resident:.0%} of the pages stayed cached after {method} (mapped by another process?)"
        return DropResult(False, method, len(paths), resident, why)
    return DropResult(True, method, len(paths), resident)
