"""A store streamed from object storage in shards into a bounded node-local cache, without staging it.

The ``disk`` store of a split, uploaded by ``fastload convert --to disk --out s3://...``, is read in
*shards*: runs of consecutive records of its ``pixels.bin`` of about ``shard_bytes`` each (the store's own
``offsets.npy`` is the shard index: a shard is one byte range, fetched with parallel ranged GETs that are
retried and resumed, :mod:`fastload.store.objects.transfer`). The small index files (labels, shapes,
checksums, offsets) are downloaded when the store opens. Every record of a shard is checked against its
crc32 before the shard is put in the cache, and again on its first read in each process.

The cache is a folder on a local disk or ``/dev/shm`` (``cache_dir``; default ``$FASTLOAD_CACHE_DIR`` or
``<tmp>/fastload-stream``) holding at most ``cache_bytes`` of shards, counted as the bytes of the files in it,
downloads in progress included: room for a new shard is made by removing the least recently read ones. The
processes of one machine (the CPU engine's workers, the ranks of a node) share it: one downloads a shard,
the others wait for it (a lock file per shard).

The loader visits a streamed store shard by shard (:func:`fastload.order.shard_permutation`, through
:meth:`StreamingStore.shards`), so an epoch needs about ``window`` shards at a time and reads each one once
when the cache holds ``window + 1`` of them; the first batch needs the first ``window`` shards.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from fastload.data.checksum import file_crc32, record_checksum
from fastload.store.base import Shards, StoreError
from fastload.store.objects.client import s3_client
from fastload.store.objects.manifest import MANIFEST, Manifest, fetch, read_manifest
from fastload.store.objects.transfer import Download, download, partial_path
from fastload.store.objects.urls import parse_url
from fastload.store.packed import PIXELS, PackedStore
from fastload.store.shm import flock_current, pid_alive

SHARD_BYTES = 64 << 20
CACHE_BYTES = 4 << 30


def stream_cache_root() -> Path:
    """Where streamed stores keep their shards: ``$FASTLOAD_CACHE_DIR``, else ``<tmp>/fastload-stream``."""
    return Path(os.environ.get("FASTLOAD_CACHE_DIR") or Path(tempfile.gettempdir()) / "fastload-stream")


def shard_bounds(offsets: np.ndarray, shard_bytes: int) -> np.ndarray:
    """``int64 [k + 1]``: shard ``s`` holds records ``bounds[s] .. bounds[s + 1]``, consecutive records of about
    ``shard_bytes`` (a record larger than that is a shard of its own)."""
    offsets = np.asarray(offsets, np.int64)
    n = len(offsets) - 1
    bounds = [0]
    while bounds[-1] < n:
        end = int(np.searchsorted(offsets, offsets[bounds[-1]] + shard_bytes, side="right")) - 1
        bounds.append(min(n, max(end, bounds[-1] + 1)))
    return np.asarray(bounds, np.int64)


class ShardCache:
    """Shard files in ``folder``, at most ``budget`` bytes of them (downloads in progress included)."""

    def __init__(self, folder: Path, budget: int) -> None:
        self.folder = Path(folder)
        self.budget = int(budget)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.fetched = 0  # shards this process downloaded
        self.evicted = 0  # shards this process removed to make room

    def path(self, shard: int) -> Path:
        return self.folder / f"shard-{shard:06d}.bin"

    def used(self) -> int:
        """Bytes of the files in the folder now (shards and downloads in progress; lock files are empty)."""
        total = 0
        for entry in os.scandir(self.folder):
            with contextlib.suppress(FileNotFoundError):  # removed by another process meanwhile
                total += entry.stat().st_size
        return total

    def get(self, shard: int, nbytes: int, fetch_into: Callable[[Path], None]) -> Path:
        """The cached file of ``shard`` (``nbytes``), downloaded by ``fetch_into(path)`` when absent; the file is
        marked as just used. Another process may remove it once this returns: reopen through ``get``."""
        path = self.path(shard)
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)
            return path
        lock = flock_current(self.folder / f".shard-{shard:06d}.lock")  # one process downloads it, others wait
        try:
            if not path.is_file():
                self._reserve(path, nbytes)
                fetch_into(path)
                self.fetched += 1
        finally:
            os.close(lock)
        return path

    def _reserve(self, path: Path, nbytes: int) -> None:
        """Remove least recently used shards until ``nbytes`` more fit the budget, then take them: the download's
        file, created at its full size while the budget lock is held."""
        if nbytes > self.budget:
            raise StoreError(f"the stream cache {self.folder} ({self.budget} bytes) cannot hold a shard of {nbytes} "
                             f"bytes; raise cache_bytes")
        lock = flock_current(self.folder / ".budget.lock")
        try:
            self._drop_dead_downloads()
            used = self.used()
            while used + nbytes > self.budget:
                shards = []
                for p in self.folder.glob("shard-*.bin"):
                    with contextlib.suppress(FileNotFoundError):
                        shards.append((p.stat().st_mtime_ns, p.stat().st_size, p))
                if not shards:
                    raise StoreError(f"the stream cache {self.folder} ({self.budget} bytes) cannot hold a shard of "
                                     f"{nbytes} bytes beside the {used} bytes being downloaded; raise cache_bytes")
                _, size, oldest = min(shards)
                oldest.unlink(missing_ok=True)
                used -= size
                self.evicted += 1
            with open(partial_path(path), "wb") as f:
                f.truncate(nbytes)
        finally:
            os.close(lock)

    def _drop_dead_downloads(self) -> None:
        """Remove the downloads of processes that died (killed mid-shard): their reserved room is free again."""
        for partial in self.folder.glob(".shard-*.bin.download-*"):
            pid = partial.name.rsplit("-", 1)[-1]
            if pid.isdigit() and not pid_alive(int(pid)):
                partial.unlink(missing_ok=True)


class StreamingStore(PackedStore):
    """One split's ``disk`` store in object storage, read shard by shard through a :class:`ShardCache`.

    Args:
      url: ``s3://bucket/prefix`` of a store uploaded by ``fastload convert --out`` (or ``.../data.yaml``).
      split: which split's ``disk`` store.
      imgsz: the loader's image size: the uploaded disk store must have been built at it.
      cache_dir: the cache's root (default :func:`stream_cache_root`); each upload gets its own folder in it.
      cache_bytes: the most bytes of shards the cache holds; at least ``window + 1`` shards.
      shard_bytes: about how many bytes one shard (one ranged read) holds.
      window: how many consecutive shards an epoch shuffles together (:func:`fastload.order.shard_permutation`).
    """

    kind = "stream"

    def __init__(self, url: str, split: str = "train", imgsz: int = 640, *, cache_dir: str | Path | None = None,
                 cache_bytes: int = CACHE_BYTES, shard_bytes: int = SHARD_BYTES, window: int = 1) -> None:
        if int(window) < 1:
            raise ValueError(f"window must be >= 1 shard, got {window}")
        url = url[: -len("/data.yaml")] if url.endswith("/data.yaml") else url
        manifest = read_manifest(parse_url(url))
        rel = _disk_store_of(manifest, split, imgsz)
        digest = hashlib.sha1(str(manifest.url).encode()).hexdigest()[:10]
        root = Path(cache_dir or stream_cache_root()) / f"{manifest.url.bucket}-{digest}-{manifest.build}" / rel
        _fetch_index(manifest, rel, root)
        super(PackedStore, self).__init__()  # the pixels are not in the folder: PackedStore's own check would fail
        self.path = str(manifest.url.child(rel))
        self._read_index(root)
        if self.imgsz != imgsz:
            raise StoreError(f"{self.path} holds images at imgsz {self.imgsz}, not {imgsz}")
        self.window = int(window)
        self.bounds = shard_bounds(self.offsets, int(shard_bytes))
        self._shard_of = np.repeat(np.arange(len(self.bounds) - 1), np.diff(self.bounds)).astype(np.int64)
        largest = int(np.diff(self.offsets[self.bounds]).max(initial=0))
        if cache_bytes < (self.window + 1) * largest:
            raise StoreError(f"cache_bytes={cache_bytes} cannot hold window + 1 = {self.window + 1} shards of up to "
                             f"{largest} bytes of {self.path}; raise cache_bytes or lower shard_bytes")
        self.pixels_url = manifest.object_url(f"{rel}/{PIXELS}")
        self.cache = ShardCache(root.parent / f"{root.name}-shards-{int(shard_bytes)}", int(cache_bytes))
        self._mm: np.ndarray | None = None
        self._checked: np.ndarray | None = None

    def shards(self) -> Shards:
        return Shards(self._shard_of, self.window)

    def _view(self, i: int) -> np.ndarray:
        if self._checked is None or self._forked():
            self._pid = os.getpid()
            self._checked = np.zeros(len(self.im_files), bool)  # per process, as PackedStore's
        shard = int(self._shard_of[i])
        first = int(self.offsets[self.bounds[shard]])
        h, w = int(self.hw[i, 0]), int(self.hw[i, 1])
        while True:
            path = self.cache.get(shard, self._shard_nbytes(shard), lambda dest: self._fetch_shard(shard, dest))
            try:
                with open(path, "rb") as f:
                    data = os.pread(f.fileno(), h * w * 3, int(self.offsets[i]) - first)
                break
            except FileNotFoundError:  # removed by another process to make room between get() and open()
                continue
        return np.frombuffer(data, np.uint8).reshape(h, w, 3)

    def _shard_nbytes(self, shard: int) -> int:
        return int(self.offsets[self.bounds[shard + 1]] - self.offsets[self.bounds[shard]])

    def _fetch_shard(self, shard: int, dest: Path) -> None:
        a, b = int(self.bounds[shard]), int(self.bounds[shard + 1])
        first = int(self.offsets[a])

        def check(downloaded: Path) -> None:  # every record, before the shard is where readers look
            with open(downloaded, "rb") as f:
                for i in range(a, b):
                    h, w = int(self.hw[i, 0]), int(self.hw[i, 1])
                    img = np.frombuffer(os.pread(f.fileno(), h * w * 3, int(self.offsets[i]) - first), np.uint8)
                    if record_checksum(img, self.labels[i]) != int(self.checksums[i]):
                        raise StoreError(f"{self.pixels_url}: record {i} ({self.im_files[i]}) fails its crc32 (changed "
                                         f"or damaged after the upload); shard {shard} was not kept")

        download(s3_client(), [Download(self.pixels_url, self._shard_nbytes(shard), None, dest, start=first,
                                        object_size=int(self.offsets[-1]), check=check)])


def _disk_store_of(manifest: Manifest, split: str, imgsz: int) -> str:
    """The path inside the upload of ``split``'s disk store, or a StoreError saying what the upload holds."""
    splits = manifest.info.get("splits", {})
    if split not in splits:
        raise StoreError(f"{manifest.url} holds no split {split!r} (it holds {', '.join(splits) or 'none'})")
    stores: dict[str, Any] = splits[split].get("stores", {})
    if "disk" not in stores:
        raise StoreError(f"{manifest.url} holds no disk store of {split} (it holds {', '.join(stores) or 'none'}); "
                         f"streaming reads decoded records: upload one with `fastload convert DATA.yaml --to disk "
                         f"--imgsz {imgsz} --out {manifest.url} --force`")
    return str(stores["disk"])


def _fetch_index(manifest: Manifest, rel: str, root: Path) -> None:
    """Download the disk store's files other than its pixels into ``root`` (kept when already there, intact)."""
    wanted = [(p[len(rel) + 1:], size, crc) for p, size, crc in manifest.objects
              if p.startswith(rel + "/") and p != f"{rel}/{PIXELS}"]
    if not wanted:
        raise StoreError(f"{manifest.url.child(MANIFEST)} lists no files of {rel}")
    missing = [(p, size, crc) for p, size, crc in wanted
               if not (root / p).is_file() or file_crc32(root / p) != (size, crc)]
    if missing:
        root.mkdir(parents=True, exist_ok=True)
        index_only = Manifest(manifest.url, manifest.build, tuple((f"{rel}/{p}", s, c) for p, s, c in missing),
                              manifest.info, manifest.created)
        fetch(index_only, root.parent)
