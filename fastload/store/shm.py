"""Lifetime of shared-memory stores: one copy per machine, removed when its last user is gone.

A ram store is a packed store directory under ``/dev/shm`` (``FASTLOAD_SHM_DIR`` overrides the root)
named ``fastload-*``. Beside it lives a *holders* file ``<name>.holders``: JSON with the PIDs that
currently use the segment and a ``pinned`` flag. Every change to it happens under ``flock`` on that
same file, so concurrent openers (DataLoader workers, DDP ranks, a second training run) agree:

* the first opener builds the segment (others block on the lock, then find it complete);
* each opener adds its PID; :func:`release` removes it, and the last one out removes the segment
  (unless it is pinned by ``fastload convert --to ram``, which keeps it until ``fastload unstage``);
* PIDs that no longer exist (a rank killed with SIGKILL) are pruned by the next opener or by
  :func:`cleanup_stale` (``fastload unstage --stale``); an unfinished build left by a killed creator
  has no commit marker and is removed by the next opener before it rebuilds.

``fastload info --shm`` lists every segment with its live/dead holders.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from fastload.store.base import StoreError
from fastload.store.kinds import SHM_PREFIX, shm_root
from fastload.store.space import tree_bytes

HOLDERS_SUFFIX = ".holders"
COMMIT_FILE = "meta.json"  # the packed layout's commit marker (see packed.py)


def pid_alive(pid: int) -> bool:
    """True when ``pid`` names a running (non-zombie) process on this machine."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:  # a zombie (killed, not yet reaped) no longer uses the segment
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return True


def holders_path(segment: Path) -> Path:
    return segment.with_name(segment.name + HOLDERS_SUFFIX)


def is_complete(segment: Path) -> bool:
    return (segment / COMMIT_FILE).is_file()


@dataclasses.dataclass
class Registry:
    """The holders file's content while its lock is held."""

    pids: list[int]
    pinned: bool = False
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def prune(self) -> list[int]:
        dead = [p for p in self.pids if not pid_alive(p)]
        self.pids = [p for p in self.pids if p not in dead]
        return dead


def flock_current(path: Path, *, wait: bool = True) -> int:
    """Open ``path`` (creating it) and hold its exclusive flock; returns the descriptor.

    A lock file is removed by its last holder while it still holds the lock, so a lock taken on a file
    that is no longer at ``path`` guards nothing: retry on the new one. Without ``wait``, a lock held
    elsewhere raises BlockingIOError whose message is the file's first bytes (the holder's pid).
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            os.close(fd)
            raise BlockingIOError(holder) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


class OneHolder:
    """``lock_path``'s flock, taken when made (held elsewhere: BlockingIOError at once, whose message is the holder's
    pid) with this process's pid written in the file; a context manager that removes the file (while still holding
    it) and lets the lock go. Taken apart from the ``with``, so that only the taking is the caller's to refuse."""

    def __init__(self, lock_path: Path) -> None:
        self.path = Path(lock_path)
        self.fd = flock_current(self.path, wait=False)
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, str(os.getpid()).encode(), 0)
        except BaseException:
            self.__exit__()
            raise

    def __enter__(self) -> "OneHolder":
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)  # a process waiting on the old file retries on a new one (flock_current)
        os.close(self.fd)


@contextlib.contextmanager
def locked(segment: Path) -> Iterator[Registry]:
    """Hold the segment's flock and yield its registry; changes are written back on exit."""
    hp = holders_path(segment)
    hp.parent.mkdir(parents=True, exist_ok=True)
    fd = flock_current(hp)
    try:
        raw = os.pread(fd, 1 << 20, 0)
        try:
            data = json.loads(raw.decode()) if raw.strip() else {}
        except (ValueError, UnicodeDecodeError):
            data = {}  # a torn write from a killed process: treat as no holders
        reg = Registry([int(p) for p in data.get("pids", [])], bool(data.get("pinned", False)), data.get("info", {}))
        try:
            yield reg
        except BaseException:
            # A failed build (no memory, no source) must not leave an empty registry or half a segment.
            if not reg.pids and not is_complete(segment):
                _remove_tree(segment)
                os.unlink(hp)
            raise
        if reg.info.get("_removed"):
            os.unlink(hp)  # still holding the lock: waiters notice the inode change and retry
        else:
            body = json.dumps({"pids": reg.pids, "pinned": reg.pinned, "info": reg.info}).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, body, 0)
    finally:
        os.close(fd)


def _remove_tree(segment: Path) -> None:
    shutil.rmtree(segment, ignore_errors=True)
    for p in segment.parent.glob(segment.name + ".partial*"):
        shutil.rmtree(p, ignore_errors=True)


def build_reserved(segment: Path, data_name: str, nbytes: int, meta: dict[str, Any], *,
                   reserve: int | None = None, files: dict[str, bytes] | None = None) -> None:
    """Create ``segment`` as a folder holding ``data_name`` (``nbytes``, its first ``reserve`` bytes reserved now,
    None: all), ``files`` (name: content) and the commit marker (``meta``), via a temporary sibling and a rename: a
    :func:`acquire` build for segments that processes fill after they open them. Raises OSError when the
    filesystem cannot reserve the bytes (a full ``/dev/shm`` fails here, not as a SIGBUS in a later write); nothing
    is left behind then. Bytes not reserved now must be reserved (:func:`os.posix_fallocate`) before any process
    writes them."""
    tmp = segment.with_name(segment.name + f".partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        fd = os.open(tmp / data_name, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            now = nbytes if reserve is None else min(int(reserve), nbytes)
            if hasattr(os, "posix_fallocate") and now > 0:  # (macOS has none: the file is only sized)
                os.posix_fallocate(fd, 0, now)
            os.ftruncate(fd, nbytes)  # the full size, reserved or not
        finally:
            os.close(fd)
        for name, content in (files or {}).items():
            (tmp / name).write_bytes(content)
        (tmp / COMMIT_FILE).write_text(json.dumps(meta))
        os.rename(tmp, segment)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# Segments this process holds, released at interpreter exit (a SIGKILL skips this: see cleanup_stale).
_HELD: dict[str, int] = {}


def acquire(
    segment: Path,
    build: Callable[[Path], None] | None = None,
    *,
    pinned: bool = False,
    info: dict[str, Any] | None = None,
) -> None:
    """Register this process as a user of ``segment``, building it first with ``build(segment)`` if absent.

    ``build`` must write the complete store at ``segment`` (via a temporary sibling and a rename).
    It runs while the lock is held, so exactly one process per machine builds; the others wait.
    Raises :class:`fastload.store.base.StoreError` when the segment is absent and ``build`` is None.
    """
    segment = Path(segment)
    with locked(segment) as reg:
        reg.prune()
        if not is_complete(segment):
            if not reg.pids:  # an unfinished build whose creator died: nobody can be using it
                _remove_tree(segment)
            if build is None:
                raise StoreError(
                    f"ram store {segment} is not in shared memory (rebooted or removed); "
                    f"rebuild it with `fastload convert DATA --to ram`"
                )
            build(segment)
            if not is_complete(segment):
                raise StoreError(f"building ram store {segment} did not finish")
            reg.info.update(info or {}, created=time.time(), created_by=os.getpid())
        pid = os.getpid()
        if pid not in reg.pids:
            reg.pids.append(pid)
        reg.pinned = reg.pinned or pinned
    _HELD[str(segment)] = _HELD.get(str(segment), 0) + 1


def release(segment: Path) -> bool:
    """Drop this process's hold; remove the segment when no live holder remains and it is not pinned.

    Returns True when the segment was removed.
    """
    segment = Path(segment)
    key = str(segment)
    count = _HELD.get(key, 0)
    if count > 1:  # several stores in this process share the hold
        _HELD[key] = count - 1
        return False
    _HELD.pop(key, None)
    if not holders_path(segment).exists():
        return False
    with locked(segment) as reg:
        pid = os.getpid()
        reg.pids = [p for p in reg.pids if p != pid]
        reg.prune()
        if reg.pids or reg.pinned:
            return False
        _remove_tree(segment)
        reg.info["_removed"] = True
        return True


def remove(segment: Path, *, force: bool = False) -> None:
    """Remove a segment now. Refuses while live processes hold it unless ``force``."""
    segment = Path(segment)
    with locked(segment) as reg:
        reg.prune()
        if reg.pids and not force:
            raise StoreError(
                f"ram store {segment} is in use by PIDs {reg.pids}; stop them first or pass --force"
            )
        _remove_tree(segment)
        reg.info["_removed"] = True


@dataclasses.dataclass
class SegmentInfo:
    """One ``fastload-*`` entry found under the shm root."""

    path: Path
    nbytes: int
    complete: bool
    pinned: bool
    live: list[int]
    dead: list[int]

    @property
    def stale(self) -> bool:
        """Nobody alive uses it and it is not pinned (or it is an unfinished build)."""
        return not self.live and (not self.pinned or not self.complete)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["path"] = str(self.path)
        d["stale"] = self.stale
        return d


def list_segments(root: Path | None = None, prefix: str = SHM_PREFIX) -> list[SegmentInfo]:
    """Every segment (finished or not) under the shm root whose name starts with ``prefix``: ram
    stores and the per-machine decoded-image caches of the CPU and Ray engines (``fastload-dcache-*``).

    A segment is recognised by its holders file, which exists from the first moment of a build;
    other ``fastload-*`` entries are not ours to list or remove.
    """
    root = Path(root) if root else shm_root()
    names = {
        p.name[: -len(HOLDERS_SUFFIX)]
        for p in (root.glob(prefix + "*" + HOLDERS_SUFFIX) if root.is_dir() else [])
    }
    out = []
    for name in sorted(names):
        seg = root / name
        data: dict[str, Any] = {}
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(holders_path(seg).read_text() or "{}")
        pids = [int(p) for p in data.get("pids", [])]
        live = [p for p in pids if pid_alive(p)]
        nbytes = tree_bytes(seg) + sum(tree_bytes(p) for p in root.glob(name + ".partial*"))
        out.append(
            SegmentInfo(seg, nbytes, is_complete(seg), bool(data.get("pinned")), live, [p for p in pids if p not in live])
        )
    return out


def cleanup_stale(root: Path | None = None, prefix: str = SHM_PREFIX) -> list[SegmentInfo]:
    """Remove segments named ``prefix*`` that nobody alive holds (and unfinished builds); returns what
    was removed."""
    removed = []
    for seg in list_segments(root, prefix):
        if not seg.stale:
            continue
        with locked(seg.path) as reg:
            reg.prune()
            if reg.pids or (reg.pinned and is_complete(seg.path)):
                continue  # someone adopted it meanwhile
            _remove_tree(seg.path)
            reg.info["_removed"] = True
        removed.append(seg)
    return removed


@atexit.register
def _release_all() -> None:
    for key in list(_HELD):
        _HELD[key] = 1
        with contextlib.suppress(Exception):
            release(Path(key))
