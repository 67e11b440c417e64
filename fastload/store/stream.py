"""A store streamed from object storage in shards into a bounded node-local cache, without staging it.

The ``disk`` store (decoded images at one imgsz) or the ``encoded`` store (the JPEGs) of a split, uploaded by
``fastload convert --to disk|encoded --out s3://...``, is read in *shards*: runs of consecutive records of its
records file (``pixels.bin``, ``images.bin``) of about ``shard_bytes`` each (the store's own ``offsets.npy`` is
the shard index: a shard is one byte range, fetched with parallel ranged GETs that are retried and resumed,
:mod:`fastload.store.objects.transfer`). The small index files (labels, shapes, checksums, offsets) are
downloaded when the store opens. Every record of a shard is checked against its crc32 before the shard is put
in the cache, and again when read (a decoded record on its first read in each process, an encoded one on every
read, as their local stores do).

A record that fails its crc32 is read again from the bucket, alone (one small ranged read), to tell where it was
damaged. At download: when the second read is intact the first was damaged on the way and is repaired in the
shard; when it fails too the uploaded object itself is damaged there, and the shard is kept anyway (its other
records are good). At read: when the bucket's bytes fail too the record is damaged at the source:
:class:`~fastload.store.base.DamagedRecordError` names it (store URL, record, source file), so a loader with
``strict=False`` skips and counts it as for a local store, and ``strict=True`` stops; when the bucket's bytes are
intact the cached shard was damaged on this node's disk after its download: it is removed and fetched again, once.
Nothing that fails its crc32 is ever returned.

The cache is a folder on a local disk or ``/dev/shm`` (``cache_dir``; default ``$FASTLOAD_CACHE_DIR`` or
``<tmp>/fastload-stream``), one for the whole node: ``cache_bytes`` bounds what ``du`` says of all of it, every
upload, build, store and shard size together, downloads in progress and index files included
(:class:`ShardCache`). Room for a new shard is made by removing shards no process maps: those of uploads no
process has open first (a replaced build is removed whole when its successor opens), then the least recently
read ones. The processes of one machine (the CPU engine's workers, the ranks of a node, other runs) share it:
one downloads a shard, the others wait for it (a lock file per shard).

The loader visits a streamed store shard by shard (:func:`fastload.order.shard_permutation`, through
:meth:`StreamingStore.shards`), so an epoch needs about ``window`` shards at a time and reads each one once
when the cache holds ``window + 1`` of them; the first batch needs the first ``window`` shards. While the
loader renders, :class:`ShardReadAhead` downloads the next ``read_ahead`` shards of the epoch's order into the
cache, so a worker finds them there instead of waiting on their download.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import shutil
import stat
import tempfile
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from fastload.data.checksum import file_crc32
from fastload.store.base import DamagedRecordError, ReadAhead, StoreError
from fastload.store.objects.client import RetryPolicy, UnavailableError, retry_policy, s3_client
from fastload.store.objects.manifest import MANIFEST, Manifest, fetch, read_manifest
from fastload.store.objects.transfer import Download, download, partial_path
from fastload.store.objects.urls import parse_url
from fastload.store.encoded import ARRAYS as ENCODED_ARRAYS
from fastload.store.encoded import IMAGES, read_encoded_meta
from fastload.store.packed import PIXELS, SHARD_BYTES, PackedStore, RecordFileStore, read_meta
from fastload.store.shm import flock_current, pid_alive

CACHE_BYTES = 4 << 30
ROOM_WAIT_S = 120.0  # how long a download waits for readers to let go of the shards whose room it needs
ROOM_WARN_S = 10.0  # when it says that it waits: readers that hold every shard for longer than a render may be stuck
ROOM_POLL_S = 0.05
BUDGET_LOCK = ".budget.lock"  # at the cache's root: every room-making of the node, one at a time
IN_USE_LOCK = ".in-use.lock"  # in an upload's folder: held shared by every process that has the upload open
READ_AHEAD = 2  # shards: one downloading while the next waits its turn keeps the connection busy
UPLOAD_KINDS = ("auto", "disk", "encoded")  # which uploaded store a stream reads (StreamingStore's upload_kind)
RECORD_FILES = {"disk": PIXELS, "encoded": IMAGES}  # the file of each readable kind whose byte ranges are shards

# Lock files a shard cache of this process holds now. A process forked meanwhile (a loader's workers started
# while a read-ahead downloads) would hold the same flock for as long as it lives: it closes its copies.
_HELD_LOCKS: set[int] = set()


def _close_inherited_locks() -> None:
    for fd in _HELD_LOCKS:
        os.close(fd)
    _HELD_LOCKS.clear()


# A fork waits for the read-ahead thread's download in progress to end, and no download starts during a fork: a
# child forked mid-download (the CPU engine's workers, started while the thread downloads the first shards) would
# inherit the locks the thread held then (a shard's flock taken but not yet recorded, a lock inside the S3 client)
# and wait for them forever.
_FETCHING = threading.Lock()


def _after_fork_in_child() -> None:
    global _FETCHING
    _FETCHING = threading.Lock()  # the parent's was held across the fork
    _close_inherited_locks()


os.register_at_fork(before=lambda: _FETCHING.acquire(), after_in_parent=lambda: _FETCHING.release(),
                    after_in_child=_after_fork_in_child)


def stream_cache_root() -> Path:
    """Where streamed stores keep their shards: ``$FASTLOAD_CACHE_DIR``, else ``<tmp>/fastload-stream``."""
    return Path(os.environ.get("FASTLOAD_CACHE_DIR") or Path(tempfile.gettempdir()) / "fastload-stream")


class ShardCache:
    """The shard files of one store, in ``root / upload / name``, under one budget for everything in ``root``.

    ``root`` is the node's cache (``cache_dir``): every upload, build, store, split and shard size streamed on the
    node keeps its files there, and ``budget`` bounds the bytes on disk of all of them together, as ``du`` counts
    them: shards, downloads in progress (at their full size from the start), index files and folders. Room for a
    new shard is made under one lock file at the root (``.budget.lock``), by removing, least recently read first,
    the shards of uploads no process has open (a replaced build, a dataset read before), then those of the uploads
    being read. A shard that a process maps is never removed (its readers hold a shared lock on it while mapped,
    :meth:`map`): removed, it would keep its blocks out of ``du``'s sight for as long as the map lives. When
    nothing can be removed, one download at a time may pass the budget by its own size (readers that hold every
    shard may be waiting for it); the others wait for a reader to move on, up to :attr:`wait_s` seconds. A
    download that gave up after the retry budget leaves its error beside the shard (``.shard-N.unavailable``)
    for the processes that waited for it.
    """

    def __init__(self, root: Path, upload: str, name: str, budget: int) -> None:
        self.root = Path(root)
        self.folder = self.root / upload / name
        self.budget = int(budget)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.block = os.statvfs(self.root).f_frsize  # a file takes whole blocks of the file system
        self.wait_s = ROOM_WAIT_S
        self.fetched = 0  # shards this process downloaded
        self._counting = threading.Lock()  # the read-ahead thread and the reads download different shards at once
        self.evicted = 0  # shards this process removed to make room

    def path(self, shard: int) -> Path:
        return self.folder / f"shard-{shard:06d}.bin"

    def resident_bytes(self) -> int:
        """The bytes on disk that no room-making removes while this store is open: its upload's index files, lock
        files and folders, and the root's own folder."""
        upload = self.folder.parent
        total = tree_on_disk(upload, self.block) + os.lstat(self.root).st_blocks * 512
        for shard in [*_shard_files(upload), *upload.glob("*/.shard-*.bin.download-*")]:
            with contextlib.suppress(FileNotFoundError):
                total -= _file_on_disk(shard.stat(), self.block)
        return total

    def on_disk(self, nbytes: int) -> int:
        """The bytes a file of ``nbytes`` takes on this file system: whole blocks."""
        return -(-int(nbytes) // self.block) * self.block

    def used(self) -> int:
        """The bytes on disk of everything under the root now, as ``du`` counts them, a download in progress at its
        full size (its file is created sparse at that size, and fills up as it downloads)."""
        return tree_on_disk(self.root, self.block)

    def get(self, shard: int, nbytes: int, fetch_into: Callable[[Path], None],
            stop: threading.Event | None = None) -> Path:
        """The cached file of ``shard`` (``nbytes``), downloaded by ``fetch_into(path)`` when absent; the file is
        marked as just used. Another process may remove it once this returns: :meth:`map` it, or ``get`` again.
        ``stop`` set while the download waits for room abandons it (StoreError)."""
        path = self.path(shard)
        with contextlib.suppress(FileNotFoundError):
            _mark_used(path)
            return path
        asked = time.time_ns()
        unavailable = self.folder / f".shard-{shard:06d}.unavailable"
        # one process (or the read-ahead thread) downloads it, the others wait
        self.folder.mkdir(parents=True, exist_ok=True)  # removed while no process had its upload open
        lock = flock_current(self.folder / f".shard-{shard:06d}.lock")
        _HELD_LOCKS.add(lock)
        try:
            if not path.is_file():
                _raise_if_given_up_since(unavailable, asked)
                self._reserve(path, nbytes, stop or threading.Event())
                try:
                    fetch_into(path)
                except UnavailableError as e:  # said to those waiting for this download: see _raise_if_given_up_since
                    unavailable.write_text(str(e))
                    raise
                unavailable.unlink(missing_ok=True)
                with self._counting:
                    self.fetched += 1
        finally:
            _HELD_LOCKS.discard(lock)
            os.close(lock)
        return path

    def map(self, shard: int) -> np.ndarray | None:
        """``shard``'s file mapped read-only in this process (a plain ndarray: slicing an np.memmap runs Python
        code per slice), marked as just used; None when it is not in the cache. While the map, or any view of it,
        is alive this process holds a shared lock on the file, and no process removes it to make room."""
        path = self.path(shard)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a remover that took it first unlinks it
            if not _still_at(fd, path):  # removed between the open and the lock
                return None
            _mark_used(path)
            size = os.fstat(fd).st_size
            if size == 0:
                return np.zeros(0, np.uint8)
            # the map keeps a duplicate of fd (the same open file): the shared lock lasts exactly as long as the map
            return np.frombuffer(mmap.mmap(fd, size, prot=mmap.PROT_READ), np.uint8)
        finally:
            os.close(fd)

    def discard(self, shard: int) -> None:
        """Take ``shard``'s file out of the cache (a copy found damaged): readers no longer find it, and it is
        removed, still counted meanwhile under a hidden name, once no process maps it."""
        with contextlib.suppress(FileNotFoundError):
            os.rename(self.path(shard), self.folder / f".shard-{shard:06d}.bin.discarded-{time.time_ns()}")

    def touch(self, shard: int) -> None:
        """Mark ``shard`` as just used, when it is in the cache (the least recently used are removed first)."""
        with contextlib.suppress(FileNotFoundError):
            _mark_used(self.path(shard))

    def _reserve(self, path: Path, nbytes: int, stop: threading.Event) -> None:
        """Make room for ``nbytes`` more under the root's budget, then take it: the download's file, created at its
        full size while the budget lock is held. When every shard that could make room is mapped, the download
        takes the room anyway if the cache is within its budget (one shard over it at most, node-wide), else waits
        (without the lock) for readers to move on, up to :attr:`wait_s` seconds."""
        need = self.on_disk(nbytes)
        resident = self.resident_bytes()
        if need + resident > self.budget:
            raise StoreError(f"the stream cache {self.root} (cache_bytes={self.budget}) cannot hold a shard of "
                             f"{nbytes} bytes beside the store's {resident} bytes of index files and folders; raise "
                             f"cache_bytes")
        start = time.monotonic()
        warned = False
        while True:
            with _budget_locked(self.root):
                _drop_dead_downloads(self.root)
                used = self.used()
                if used + need > self.budget:
                    used -= self._evict(used + need - self.budget)
                # every shard left is mapped (the views a render holds, a worker's last shard while it waits for
                # work): one download at a time passes the budget by its own size, so that those readers move on
                if used + need <= self.budget or used <= self.budget:
                    with open(partial_path(path), "wb") as f:
                        f.truncate(nbytes)
                    return
            waited = time.monotonic() - start
            if waited > min(ROOM_WARN_S, self.wait_s) and not warned:
                warned = True
                warnings.warn(f"fastload: the stream cache {self.root} (cache_bytes={self.budget}) has waited "
                              f"{waited:.0f} s for room for a shard: readers map every shard in it (a render maps the "
                              f"shards of its batch's images until it ends); cache_bytes should hold window + 1 shards "
                              f"and those of a batch per loader worker", stacklevel=2)
            if waited > self.wait_s:
                raise StoreError(
                    f"the stream cache {self.root} (cache_bytes={self.budget}) found no room for a shard of {nbytes} "
                    f"bytes in {self.wait_s:.0f} s: its {used} bytes are index files, shards being read and downloads "
                    f"in progress; raise cache_bytes (it must hold window + 1 shards of every store streamed on this "
                    f"node at once, and the shards of a batch per loader worker)")
            if stop.wait(ROOM_POLL_S):
                raise StoreError(f"the download of {path.name} into {self.folder} was abandoned while it waited "
                                 f"for room")

    def _evict(self, excess: int) -> int:
        """Remove shards until ``excess`` bytes are freed, or none is left that no process maps; returns the bytes
        freed. The uploads no process has open go first, least recently read shards first, then their index files
        and folders once no shard is left in them; then the shards of the uploads being read. The budget lock is
        held."""
        uploads = _uploads(self.root)
        held = {upload: _held(upload) for upload in uploads}
        freed = 0
        for reading in (False, True):
            shards = []
            for upload in (u for u in uploads if held[u] == reading):
                for shard in _shard_files(upload):
                    with contextlib.suppress(FileNotFoundError):  # discarded copies first
                        shards.append((shard.name.startswith("shard-"), shard.stat().st_mtime_ns, str(shard)))
            for *_, shard in sorted(shards):
                if freed >= excess:
                    return freed
                removed = _remove_unmapped(Path(shard), self.block)
                freed += removed
                self.evicted += bool(removed)
            if not reading:
                freed += sum(_remove_if_unread(upload, self.block) for upload in uploads if not held[upload])
        return freed


def hold_upload(root: Path, family: str, build: str) -> int:
    """Open the cache folder ``root / (family + build)`` of an upload for reading (made when absent): returns a
    descriptor holding a shared lock on its ``.in-use.lock`` (a forked process holds it too, until it ends), which
    keeps the folder's index files, and ranks its shards after those of uploads no process reads. The same URL's
    other builds (``family`` + another build) that no process has open are removed now, all but the shards a
    process still maps: a replaced build is never read again."""
    root.mkdir(parents=True, exist_ok=True)
    upload = root / (family + build)
    block = os.statvfs(root).f_frsize
    with _budget_locked(root):
        for other in _uploads(root):
            if other.name.startswith(family) and other != upload and not _held(other):
                for shard in _shard_files(other):
                    _remove_unmapped(shard, block)
                _remove_if_unread(other, block)
        upload.mkdir(exist_ok=True)
        fd = os.open(upload / IN_USE_LOCK, os.O_RDONLY | os.O_CREAT, 0o666)
        fcntl.flock(fd, fcntl.LOCK_SH)  # never waits: the exclusive lock is only tried under the budget lock
    return fd


def tree_on_disk(folder: Path, block: int) -> int:
    """The bytes on disk of ``folder`` and everything under it (``du -s``), a file never fewer than its size in
    whole ``block``s (a download in progress is created sparse at its full size)."""
    total = 0
    for parent, dirs, files in os.walk(folder):
        # each folder is counted once, as its parent's entry (the top one on its own)
        for name in [*([parent] if parent == str(folder) else []), *(os.path.join(parent, n) for n in dirs + files)]:
            with contextlib.suppress(FileNotFoundError):  # removed by another process meanwhile
                total += _file_on_disk(os.lstat(name), block)
    return total


def _file_on_disk(st: os.stat_result, block: int) -> int:
    """The bytes on disk of a file: its blocks, or its size in whole ``block``s when more (a sparse file, which
    fills up as it downloads); a folder's or link's blocks."""
    whole = -(-st.st_size // block) * block if stat.S_ISREG(st.st_mode) else 0
    return max(st.st_blocks * 512, whole)


@contextlib.contextmanager
def _budget_locked(root: Path) -> Iterator[None]:
    lock = flock_current(root / BUDGET_LOCK)
    _HELD_LOCKS.add(lock)
    try:
        yield
    finally:
        _HELD_LOCKS.discard(lock)
        os.close(lock)


def _uploads(root: Path) -> list[Path]:
    """The uploads' folders in the cache: those :func:`hold_upload` made, and those of earlier versions (shard folders
    without an in-use lock). Nothing else under ``root`` is ever removed, though counted in its bytes."""
    return [Path(e.path) for e in os.scandir(root) if e.is_dir(follow_symlinks=False)
            and ((Path(e.path) / IN_USE_LOCK).is_file() or any(Path(e.path).glob("*-shards-*")))]


def _held(upload: Path) -> bool:
    """True when a process has the upload open (:func:`hold_upload`); asked under the budget lock, so that no
    process opens it meanwhile."""
    try:
        fd = os.open(upload / IN_USE_LOCK, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _shard_files(upload: Path) -> list[Path]:
    """The shard files in an upload's folder, and the copies taken out of it (:meth:`ShardCache.discard`)."""
    return [*upload.glob("*/shard-*.bin"), *upload.glob("*/.shard-*.bin.discarded-*")]


def _remove_if_unread(upload: Path, block: int) -> int:
    """Remove the folder of an upload no process has open once it holds no shard and no download; returns the bytes
    on disk freed (its index files, lock files and folders)."""
    if _shard_files(upload) or any(upload.glob("*/.shard-*.bin.download-*")):
        return 0
    nbytes = tree_on_disk(upload, block)
    shutil.rmtree(upload, ignore_errors=True)
    return nbytes


def _remove_unmapped(shard: Path, block: int) -> int:
    """Remove ``shard`` unless a process maps it (holds its shared lock); returns the bytes on disk freed, 0 when
    it stays."""
    try:
        fd = os.open(shard, os.O_RDONLY)
    except FileNotFoundError:
        return 0
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0
        if not _still_at(fd, shard):
            return 0
        st = os.fstat(fd)
        shard.unlink()
        return _file_on_disk(st, block)
    finally:
        os.close(fd)


def _still_at(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _drop_dead_downloads(root: Path) -> None:
    """Remove the downloads of processes that died (killed mid-shard): their reserved room is free again."""
    for partial in root.glob("*/*/.shard-*.bin.download-*"):
        pid = partial.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid)):
            partial.unlink(missing_ok=True)


def _raise_if_given_up_since(unavailable: Path, asked: int) -> None:
    """Raise the error of the download of a shard that gave up (the server down for the whole retry budget) after
    ``asked`` (ns), while this read waited for it: trying again would make the read wait through a second budget."""
    with contextlib.suppress(FileNotFoundError):
        if unavailable.stat().st_mtime_ns >= asked:
            raise UnavailableError(unavailable.read_text())


def _mark_used(path: Path) -> None:
    """Set ``path``'s modification time to now, to the nanosecond: the kernel's own clock for file times ticks
    in milliseconds, and uses a millisecond apart must still be told apart by the least-recently-used rule."""
    now = time.time_ns()
    os.utime(path, ns=(now, now))


class StreamingStore(PackedStore):
    """One split's ``disk`` or ``encoded`` store in object storage, read shard by shard through a :class:`ShardCache`.

    Args:
      url: ``s3://bucket/prefix`` of a store uploaded by ``fastload convert --out`` (or ``.../data.yaml``).
      split: which split's store.
      imgsz: the loader's image size: an uploaded disk store must have been built at it.
      cache_dir: the cache's root (default :func:`stream_cache_root`); each build of an upload gets its own folder
        in it.
      cache_bytes: the most bytes on disk under ``cache_dir``, for every store streamed on the node: at least
        ``window + 1`` shards beside the store's index files (refused at open otherwise).
      shard_bytes: about how many bytes one shard (one ranged read) holds.
      window: how many consecutive shards an epoch shuffles together (:func:`fastload.order.shard_permutation`).
      read_ahead: how many shards beyond those being read the loader downloads in the background
        (:class:`ShardReadAhead`); at most as many as the cache holds beside ``window`` shards; 0: none, each
        shard is downloaded when a read first needs it.
      upload_kind: which uploaded store is read: ``disk`` (decoded images at ``imgsz``: nothing to decode, about
        five times the bytes to download), ``encoded`` (the JPEGs: decoded on the node, the fewest bytes), or
        ``auto``: the disk store when the upload holds one at ``imgsz``, else the encoded store.
      retry_seconds: how long a request that keeps failing (the server down, hung or restarting) is retried before
        the read fails (:func:`~fastload.store.objects.client.retry_policy`); default ``$FASTLOAD_RETRY_SECONDS``,
        else 600; 0: one try. Resolved here, so the loader's workers and Ray actors use the same budget.
    """

    kind = "stream"

    def __init__(self, url: str, split: str = "train", imgsz: int = 640, *, cache_dir: str | Path | None = None,
                 cache_bytes: int = CACHE_BYTES, shard_bytes: int = SHARD_BYTES, window: int = 1,
                 read_ahead: int = READ_AHEAD, upload_kind: str = "auto", retry_seconds: float | None = None) -> None:
        if int(window) < 1:
            raise ValueError(f"window must be >= 1 shard, got {window}")
        if int(read_ahead) < 0:
            raise ValueError(f"read_ahead must be >= 0 shards (0: none), got {read_ahead}")
        if upload_kind not in UPLOAD_KINDS:
            raise ValueError(f"upload_kind must be one of {', '.join(UPLOAD_KINDS)}, got {upload_kind!r}")
        self.retry = retry_policy(retry_seconds)
        url = url[: -len("/data.yaml")] if url.endswith("/data.yaml") else url
        manifest = read_manifest(parse_url(url), policy=self.retry)
        self.build = manifest.build
        digest = hashlib.sha1(str(manifest.url).encode()).hexdigest()[:10]
        cache_root = Path(cache_dir or stream_cache_root())
        family = f"{manifest.url.bucket}-{digest}-"  # the cache folders of every build of this URL
        upload_root = cache_root / (family + manifest.build)
        super(RecordFileStore, self).__init__()  # Store's: the records are not in a folder to open and check
        self._upload = (cache_root, family, manifest.build)
        self._hold: weakref.finalize | None = None
        self._hold_upload()  # before the index files land in its folder: nothing removes them while it is open
        self.upload_kind, rel = self._open_index(manifest, split, imgsz, upload_kind, upload_root)
        # how another process (a Ray actor on any node) opens this store into its own node's cache: small, JSON-able
        self.description: dict[str, Any] = {
            "url": str(manifest.url), "split": split, "imgsz": int(imgsz), "build": manifest.build,
            "cache_dir": None if cache_dir is None else str(cache_dir), "cache_bytes": int(cache_bytes),
            "shard_bytes": int(shard_bytes), "window": int(window), "upload_kind": self.upload_kind,
            "read_ahead": int(read_ahead), "retry_seconds": self.retry.seconds}
        self.path = str(manifest.url.child(rel))
        self.read_in_shards(int(shard_bytes), int(window))
        self.cache = ShardCache(cache_root, upload_root.name, f"{Path(rel).name}-shards-{int(shard_bytes)}",
                                int(cache_bytes))
        largest = int(np.diff(self.offsets[self.bounds]).max(initial=0))
        shard_room = max(self.cache.on_disk(largest), 1)
        resident = self.cache.resident_bytes()
        if cache_bytes < (self.window + 1) * shard_room + resident:
            self.close()
            raise StoreError(f"cache_bytes={cache_bytes} cannot hold window + 1 = {self.window + 1} shards of up to "
                             f"{largest} bytes (shard_bytes={int(shard_bytes)}) of {self.path} beside its {resident} "
                             f"bytes of index files and folders in cache_dir {cache_root}; raise cache_bytes or lower "
                             f"shard_bytes")
        # the shards being read (window) and those fetched ahead fit the cache together: nothing fetched ahead
        # pushes out a shard still being read
        self.read_ahead_shards = min(int(read_ahead), (int(cache_bytes) - resident) // shard_room - self.window)
        self.records_url = manifest.object_url(f"{rel}/{RECORD_FILES[self.upload_kind]}")
        self._checked: np.ndarray | None = None
        self._damaged_at_source: set[int] = set()  # records whose uploaded bytes fail their crc32 (in every process)
        self.refetched = 0  # shards this process found damaged in the cache and fetched again
        # shard files this process has mapped, most recently read last: at most the window an epoch reads at once
        self._maps: OrderedDict[int, np.ndarray] = OrderedDict()

    def _open_index(self, manifest: Manifest, split: str, imgsz: int, upload_kind: str,
                    upload_root: Path) -> tuple[str, str]:
        """Download the index of the split's store that ``upload_kind`` picks and read it; returns the kind read
        and the store's path inside the upload."""
        stores = _uploaded_stores(manifest, split)
        kind, fetched = upload_kind, None
        if kind == "auto":
            kind = "disk" if "disk" in stores else "encoded"
            if kind == "disk" and "encoded" in stores:  # a disk store at another imgsz: the encoded one serves any
                _fetch_index(manifest, stores["disk"], upload_root / stores["disk"], PIXELS, self.retry)
                fetched = "disk"
                if int(read_meta(upload_root / stores["disk"])["imgsz"]) != imgsz:
                    kind = "encoded"
        if kind not in stores:
            raise StoreError(
                f"{manifest.url} holds no {kind} store of {split} (it holds {', '.join(stores) or 'none'}); streaming reads "
                f"a disk store (decoded at one imgsz) or an encoded one (the JPEGs): upload one with `fastload convert "
                f"DATA.yaml --to encoded --out {manifest.url} --force` (or `--to disk --imgsz {imgsz}`)")
        rel = stores[kind]
        root = upload_root / rel
        if kind != fetched:  # fetched above: its files were checked against the manifest's sizes and crcs there
            _fetch_index(manifest, rel, root, RECORD_FILES[kind], self.retry)
        if kind == "disk":
            self._read_index(root)
            if self.imgsz != imgsz:
                raise StoreError(f"{manifest.url.child(rel)} holds images at imgsz {self.imgsz}, not {imgsz}")
        else:
            self.meta = read_encoded_meta(root)
            self._read_records_index(root, ENCODED_ARRAYS)
            self.decoded, self.imgsz, self.load_rule = False, None, None
        return kind, rel

    def read_ahead(self, indices: np.ndarray) -> ReadAhead | None:
        if self.read_ahead_shards < 1 or len(indices) == 0:
            return None
        return ShardReadAhead(self, self._shard_of[np.asarray(indices, np.int64)], self.read_ahead_shards)

    def cached_shard(self, shard: int, stop: threading.Event | None = None) -> Path:
        """The cache's file of ``shard``, downloaded (and checked) first when it is not there; ``stop`` set
        meanwhile abandons the download (:func:`~fastload.store.objects.transfer.download`)."""
        self._hold_upload()
        return self.cache.get(shard, self._shard_nbytes(shard), lambda dest: self._fetch_shard(shard, dest, stop),
                              stop)

    def read_image(self, i: int) -> np.ndarray | bytes:  # type: ignore[override]
        """Record ``i``: the loaded RGB image of a disk store (checked on its first read in this process), or the
        image bytes of an encoded one (checked on every read), from its shard in the cache.

        A record that fails its crc32 is read again from the bucket: damaged there too, it raises
        :class:`~fastload.store.base.DamagedRecordError` (and does at once on later reads in this process);
        intact there, its cached shard was damaged on this node's disk: the shard is fetched again and the record
        read from the new copy (still failing: DamagedRecordError)."""
        i = self.check_index(i)
        if i in self._damaged_at_source:
            raise self._source_damage(i)
        try:
            return self._checked_record(i)
        except DamagedRecordError as e:
            if e.kind != "checksum":
                raise
        if not self._intact(i, self._record_at_source(i)):
            self._damaged_at_source.add(i)
            raise self._source_damage(i)
        self._drop_damaged_copy(int(self._shard_of[i]), i)
        return self._checked_record(i)

    def _checked_record(self, i: int) -> np.ndarray | bytes:
        """Record ``i`` from the cache, checked as its local store checks it."""
        return super().read_image(i) if self.decoded else self._encoded_record(i)

    def _source_damage(self, i: int) -> DamagedRecordError:
        return self.damaged(i, "checksum", "crc32 mismatch in the uploaded object (damaged or changed in the bucket "
                                           "after the upload: read again from there, it fails again)")

    def _record_at_source(self, i: int) -> bytes:
        """Record ``i``'s bytes read again from the uploaded object: one ranged read, retried as a shard's."""
        with tempfile.TemporaryDirectory(prefix="fastload-record-") as folder:
            dest = Path(folder) / "record"
            # no check in the download: its callers compare the bytes with the record's crc32 themselves
            download(s3_client(), [Download(self.records_url, self.nbytes(i), None, dest, start=int(self.offsets[i]),
                                            object_size=int(self.offsets[-1]), check=lambda _: None)], policy=self.retry)
            return dest.read_bytes()

    def _drop_damaged_copy(self, shard: int, i: int) -> None:
        """Remove the cache's copy of ``shard``, whose record ``i`` was found damaged on this node's disk, so that
        the next read fetches the shard again."""
        self._maps.pop(shard, None)
        path = self.cache.path(shard)
        try:
            with open(path, "rb") as f:
                start = int(self.offsets[i] - self.offsets[self.bounds[shard]])
                damaged = not self._intact(i, os.pread(f.fileno(), self.nbytes(i), start))
        except FileNotFoundError:  # removed meanwhile (room made, or another process dropped it)
            return
        # another process that met the damage may have fetched the shard again already: keep its new copy
        if damaged:
            self.cache.discard(shard)  # removed once no process maps it: its blocks stay counted until then
            self.refetched += 1

    def _handles(self) -> tuple[str, ...]:
        return ("_checked", "_maps", "_hold")

    def close(self) -> None:
        """Let the shards go (unmapped once no view handed out is alive) and the upload's folder: the cache removes
        an upload no process has open first. A later read opens them again."""
        self._maps = OrderedDict()
        if self._hold is not None:
            self._hold()

    def _hold_upload(self) -> None:
        """Hold this store's upload open in the cache (:func:`hold_upload`): again after :meth:`close`, or in a copy
        unpickled in another process (a forked one shares its parent's hold)."""
        if self._hold is None or not self._hold.alive:
            self._hold = weakref.finalize(self, os.close, hold_upload(*self._upload))

    def _new_process(self) -> None:
        super()._new_process()
        self._maps = OrderedDict()  # a forked process maps the files itself

    def _record(self, i: int) -> np.ndarray:
        """Record ``i``'s bytes, a read-only view of its shard file mapped in this process (no copy)."""
        if self._checked is None or self._forked():
            self._pid = os.getpid()
            self._new_process()
        shard = int(self._shard_of[i])
        mapped = self._mapped(shard)
        start = int(self.offsets[i] - self.offsets[self.bounds[shard]])
        return mapped[start : start + self.nbytes(i)]

    def _mapped(self, shard: int) -> np.ndarray:
        """``shard``'s file mapped in this process, marked as just used in the node's cache (downloaded when absent).

        No process removes a shard another maps (:meth:`ShardCache.map`), so this one keeps at most ``window``
        shards mapped (those an epoch reads at once; the least recently read let go first), and none while it
        waits for a download, which may be waiting for the room those shards hold. A view handed out keeps its
        shard mapped until it dies."""
        mapped = self._maps.get(shard)
        if mapped is not None:
            self.cache.touch(shard)
        else:
            self._hold_upload()
            while len(self._maps) >= self.window:
                self._maps.popitem(last=False)
            while (mapped := self.cache.map(shard)) is None:
                self._maps.clear()
                self.cached_shard(shard)
            self._maps[shard] = mapped
        self._maps.move_to_end(shard)
        return mapped

    def _shard_nbytes(self, shard: int) -> int:
        return int(self.offsets[self.bounds[shard + 1]] - self.offsets[self.bounds[shard]])

    def _fetch_shard(self, shard: int, dest: Path, stop: threading.Event | None = None) -> None:
        a, b = int(self.bounds[shard]), int(self.bounds[shard + 1])
        first = int(self.offsets[a])

        def check(downloaded: Path) -> None:  # every record, before the shard is where readers look
            with open(downloaded, "r+b") as f:
                for i in range(a, b):
                    at = int(self.offsets[i]) - first
                    if self._intact(i, os.pread(f.fileno(), self.nbytes(i), at)):
                        continue
                    again = self._record_at_source(i)
                    if self._intact(i, again):  # damaged on the way here: the bucket's bytes are good
                        os.pwrite(f.fileno(), again, at)
                    # else damaged in the bucket: the shard is kept for its other records, and every read of
                    # this one fails its crc32 and names it (read_image)

        download(s3_client(), [Download(self.records_url, self._shard_nbytes(shard), None, dest, start=first,
                                        object_size=int(self.offsets[-1]), check=check)], policy=self.retry, stop=stop)


class ShardReadAhead:
    """Downloads the shards an epoch's order needs next into the cache, in one background thread, while the
    loader renders the shards before them.

    Deliberately simple: one thread, one shard at a time (a shard is already one ranged read of 16 parallel
    GETs), in the order the epoch first needs them, at most ``depth`` shards beyond those the consumer has
    reached. The consumer's position (:meth:`reached`, from the loader after each batch) is the signal because
    it is known in this process and every shard the order needs only before it is finished with: the workers
    render at or after it. Before each download the shards still needed from that position on are marked as
    just used, so the cache's least-recently-used rule removes shards behind the consumer, never one fetched
    ahead and not read yet. The download goes through :meth:`ShardCache.get` like any read: checked before it
    is kept, within the budget, once per node (a worker that needs the shard meanwhile waits for it). A shard
    it cannot fetch is left to the read that needs it, which downloads it again and reports the error; when the
    server was out for the whole retry budget, the thread ends, and the reads that waited for that download
    raise its error instead of waiting through a budget of their own.

    Args:
      store: the streamed store.
      shards: the shard of every sample of the order, in order.
      depth: shards fetched beyond those the consumer has reached (>= 1).
    """

    def __init__(self, store: StreamingStore, shards: np.ndarray, depth: int) -> None:
        ids, first = np.unique(shards, return_index=True)
        last = len(shards) - 1 - np.unique(shards[::-1], return_index=True)[1]
        need = np.argsort(first, kind="stable")
        self.store = store
        self.depth = int(depth)
        self.sequence = ids[need]  # the shards in the order the epoch first needs them
        self.first, self.last = first[need], last[need]  # the positions where each is needed first and last
        self._position = 0
        self._stopped = False
        self._abandon = threading.Event()  # set by stop(): the download in progress gives up its retries at once
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="fastload-read-ahead", daemon=True)
        self._thread.start()

    def reached(self, position: int) -> None:
        with self._changed:
            self._position = int(position)
            self._changed.notify()

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._abandon.set()
            self._changed.notify()
        self._thread.join()  # a download in progress ends: it is one shard, and it retries no more

    def _horizon(self, position: int) -> int:
        """How many shards of :attr:`sequence` may be in the cache once the consumer is at ``position``."""
        return int(np.searchsorted(self.first, position, side="right")) + self.depth

    def _run(self) -> None:
        for k, shard in enumerate(self.sequence.tolist()):
            with self._changed:
                while not self._stopped and k >= self._horizon(self._position):
                    self._changed.wait()
                if self._stopped:
                    return
                position = self._position
                self._abandon = threading.Event()  # this download's own: a failed download sets it too
            if self.last[k] < position:  # the consumer is past it already (read on demand)
                continue
            for later in reversed(range(k)):  # the shards still needed: newer than any behind the consumer
                if self.last[later] >= position:
                    self.store.cache.touch(int(self.sequence[later]))
            try:
                with _FETCHING:  # see its comment: no fork while this thread downloads
                    self.store.cached_shard(shard, self._abandon)
            except UnavailableError:
                return  # the server is out for longer than the budget: the reads waiting for this shard say so
            except StoreError:
                pass  # the read that needs it fetches it again and raises this error there


def _uploaded_stores(manifest: Manifest, split: str) -> dict[str, str]:
    """The stores the upload holds of ``split``, ``{kind: path inside the upload}``."""
    splits = manifest.info.get("splits", {})
    if split not in splits:
        raise StoreError(f"{manifest.url} holds no split {split!r} (it holds {', '.join(splits) or 'none'})")
    return {k: str(p) for k, p in splits[split].get("stores", {}).items()}


def _fetch_index(manifest: Manifest, rel: str, root: Path, records: str, policy: RetryPolicy) -> None:
    """Download the files of the store at ``rel`` other than its ``records`` file into ``root`` (kept when already
    there, intact), retried within ``policy``."""
    wanted = [(p[len(rel) + 1:], size, crc) for p, size, crc in manifest.objects
              if p.startswith(rel + "/") and p != f"{rel}/{records}"]
    if not wanted:
        raise StoreError(f"{manifest.url.child(MANIFEST)} lists no files of {rel}")
    missing = [(p, size, crc) for p, size, crc in wanted
               if not (root / p).is_file() or file_crc32(root / p) != (size, crc)]
    if missing:
        root.mkdir(parents=True, exist_ok=True)
        index_only = Manifest(manifest.url, manifest.build, tuple((f"{rel}/{p}", s, c) for p, s, c in missing),
                              manifest.info, manifest.created)
        fetch(index_only, root.parent, policy=policy)
