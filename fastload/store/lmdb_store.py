"""LMDB store: the encoded image bytes as they are, one environment per split.

Keys (all values are raw bytes, msgpack or JSON; never pickle)::

    i:<src>     image bytes (the original file, or a smaller JPEG with --max-side)
    r:<src>     msgpack {"l": float32 label bytes, "s": [h0, w0], "f": source path, "c": crc32}
                (+ "p": float32 point bytes, "o": int32 points per row, in a store with label points)
    x:<src>     msgpack {"f": path, "e": reason}  a source image that could not be stored
    __job__     JSON fingerprint of the conversion (sources + options), checked by --resume
    __index__   msgpack {"keys", "labels", "counts", "shapes", "checksums": array bytes, "files"}
                (+ "points" float32 [P, D], "point_counts" int32 [M] bytes with label points)
    __meta__    JSON metadata: the commit marker, written last with __index__ (``geometry`` with label points:
                the schema is then SCHEMA_VERSION + GEOMETRY_STEP, see fastload.store.base)

``<src>`` is the image's position in the source scan (8 digits), so a resumed conversion knows
which records are done. ``crc32`` covers the image bytes followed by the label bytes (and the points,
:func:`~fastload.data.checksum.record_checksum`).

Readers open the environment read-only without the lock file (``lock=False``), lazily in each
process (re-opened after fork), so any number of DataLoader workers and DDP ranks can read at once. Each process
drops the pages it has read from its RSS every ``RELEASE_EVERY`` bytes (Linux), so none maps the whole store.
"""
from __future__ import annotations

import ctypes
import json
import mmap
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import lmdb
import msgpack
import numpy as np

from fastload._version import __version__
from fastload.data.checksum import record_checksum
from fastload.data.labels import FlatLabels, ImageLabels
from fastload.store.base import (
    GEOMETRY_STEP,
    SCHEMA_VERSION,
    IncompleteStoreError,
    Store,
    StoreError,
    check_schema,
    geometry_meta,
    join_labels,
    split_labels,
)
from fastload.store.kinds import PARTIAL, WriteJob, finish_hint
from fastload.store.packed import replace_dir
from fastload.store.space import check_space
from fastload.store.writing import FileTasks, Progress, encoded_task, parallel_map

COMMIT_EVERY = 64  # records per LMDB transaction written by write_lmdb: the most a kill can lose

META_KEY = b"__meta__"
INDEX_KEY = b"__index__"
JOB_KEY = b"__job__"


def _image_key(src: int) -> bytes:
    return b"i:%08d" % src


def _record_key(src: int) -> bytes:
    return b"r:%08d" % src


def _skip_key(src: int) -> bytes:
    return b"x:%08d" % src


#: Let the kernel read ahead in the mapped file (False only to measure what it saves: ``benchmarks/store_read.py
#: --cold``). A record is a whole encoded image, tens to hundreds of KiB in consecutive pages: without read-ahead
#: a record that is not in the page cache is read one 4 KiB page fault at a time, many times slower (a dataset
#: larger than memory, a first epoch).
READAHEAD = True


def _open_env(path: Path, *, write: bool = False, map_size: int = 1 << 30) -> lmdb.Environment:
    if write:
        return lmdb.open(str(path), map_size=map_size, subdir=True, meminit=False, max_dbs=0)
    return lmdb.open(
        str(path), readonly=True, lock=False, readahead=READAHEAD, meminit=False, subdir=True, max_readers=2048
    )


#: Bytes a process reads from one environment before it drops the map's pages from its resident set. Every page a
#: reader touches stays mapped in it (file-backed and shared, but counted by RSS-based limits of Kubernetes and
#: Slurm): without this a worker, or ``fastload verify``, ends up with the whole store in its RSS. The pages stay in
#: the page cache; the next read of one maps it again from there.
RELEASE_EVERY = 64 << 20
#: What the writer counts for one record it reads back when it commits (:meth:`LmdbWriter.commit`): a page.
_RECORD_READ_COST = 4096


def _map_span(env: lmdb.Environment, path: Path, key: bytes = META_KEY) -> tuple[int, int] | None:
    """(address, length) of this process's read-only shared mapping of ``path``/data.mdb, found in
    /proc/self/maps as the one holding the bytes of record ``key`` (py-lmdb's ``info()["map_addr"]`` is 0 without
    MDB_FIXEDMAP); None where that file is absent (not Linux) or the store has no such record yet."""
    try:
        with open("/proc/self/maps") as maps_file:
            maps = maps_file.read().splitlines()
    except OSError:
        return None
    with env.begin(buffers=True) as txn:
        view = txn.get(key)
        if view is None:
            return None
        address = np.frombuffer(view, np.uint8).ctypes.data
        del view  # no view into the map outlives its transaction
    data_file = os.path.realpath(path / "data.mdb")
    for line in maps:
        fields = line.split(maxsplit=5)
        start, end = (int(bound, 16) for bound in fields[0].split("-"))
        # Only a shared mapping of data.mdb itself: MADV_DONTNEED on a private one would discard its contents.
        if start <= address < end and fields[1][3] == "s" and len(fields) == 6 and fields[5] == data_file:
            return start, end - start
    return None


def _madvise_function() -> Callable[[int, int, int], int] | None:
    """libc's madvise where the platform has MADV_DONTNEED (not Windows)."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        return None
    madvise = ctypes.CDLL(None, use_errno=True).madvise  # the symbols this process has loaded: libc's among them
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_MADVISE = _madvise_function()


@dataclass
class _SharedEnv:
    """An environment open in this process, the stores using it, and the bytes read from it since its map's pages
    were last released."""

    env: lmdb.Environment
    users: int
    map_span: tuple[int, int] | None
    unreleased: int = 0

    def count_read(self, nbytes: int) -> None:
        """Count ``nbytes`` read through the map; past :data:`RELEASE_EVERY`, drop the map's pages from this
        process's RSS. Safe with no copy of the data lost: the reads return bytes copies, and a read-only shared
        file mapping faults its pages back in from the page cache (or the file)."""
        self.unreleased += nbytes
        if self.unreleased > RELEASE_EVERY and self.map_span is not None and _MADVISE is not None:
            # A failure (which would only leave the pages mapped) changes nothing for the reads: not checked.
            _MADVISE(self.map_span[0], self.map_span[1], mmap.MADV_DONTNEED)
            self.unreleased = 0


# py-lmdb allows one Environment per path per process, so stores (and metadata reads) in one process
# share it: {(pid, real path): _SharedEnv}.
_ENVS: dict[tuple[int, str], _SharedEnv] = {}


def _acquire_env(path: Path) -> _SharedEnv:
    key = (os.getpid(), os.path.realpath(path))
    shared = _ENVS.get(key)
    if shared is None:
        # A handle inherited through fork still counts as open in this process: close our copy of it
        # (lock-free and read-only, this only unmaps it here) before opening a fresh one.
        for other in [k for k in _ENVS if k[1] == key[1] and k[0] != key[0]]:
            try:
                _ENVS.pop(other).env.close()
            except lmdb.Error:
                pass
        env = _open_env(path)
        _check_complete(env, path)
        shared = _ENVS[key] = _SharedEnv(env, 0, _map_span(env, path))
    shared.users += 1
    return shared


def _check_complete(env: lmdb.Environment, path: Path) -> None:
    """A data.mdb shorter than the pages its header uses (a cut copy, a full disk) would crash the process
    with SIGBUS on the first read of a missing page: refuse it while that is still an error."""
    need = (int(env.info()["last_pgno"]) + 1) * int(env.stat()["psize"])
    have = (path / "data.mdb").stat().st_size
    if have < need:
        env.close()
        raise StoreError(
            f"{path / 'data.mdb'} is truncated ({have} of {need} bytes; an incomplete copy?); copy it again or "
            f"convert the dataset again"
        )


def _release_env(path: Path) -> None:
    key = (os.getpid(), os.path.realpath(path))
    shared = _ENVS.get(key)
    if shared is None:
        return
    shared.users -= 1
    if shared.users <= 0:
        del _ENVS[key]
        shared.env.close()


def read_lmdb_meta(path: Path) -> dict[str, Any]:
    """The committed metadata of an LMDB store, or IncompleteStoreError naming the directory."""
    path = Path(path)
    if not (path / "data.mdb").is_file():
        partial = path.with_name(path.name + PARTIAL)
        if partial.exists():
            raise IncompleteStoreError(f"{path} was never finished: {partial} is {finish_hint(partial)}")
        raise StoreError(f"no LMDB store at {path} (no data.mdb)")
    env = _acquire_env(path).env
    try:
        with env.begin() as txn:
            raw = txn.get(META_KEY)
    finally:
        _release_env(path)
    if raw is None:
        raise IncompleteStoreError(
            f"{path} is an unfinished LMDB store (no metadata record: the conversion was interrupted); "
            f"continue it with `fastload convert ... --to lmdb --resume`"
        )
    meta = json.loads(bytes(raw))
    check_schema(path, meta, "lmdb")
    return meta


class LmdbStore(Store):
    """Encoded image bytes from an LMDB environment (``decoded=False``)."""

    kind = "lmdb"
    decoded = False
    #: check each read's crc32 (False only to measure what the check costs: ``benchmarks/store_read.py
    #: --check-cost``)
    check_on_read = True

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = str(path)
        self.meta = read_lmdb_meta(Path(path))
        self.names = list(self.meta.get("names", []))
        self._shared: _SharedEnv | None = None
        shared = self._environment()
        with shared.env.begin() as txn:
            raw = txn.get(INDEX_KEY)
        if raw is None:
            raise StoreError(f"{path}: metadata present but index record missing (damaged store)")
        shared.count_read(len(raw))  # the index of a large store is large too (tens of MB at 1M images)
        index = msgpack.unpackb(bytes(raw), raw=False)
        self.keys = np.frombuffer(index["keys"], np.int64).copy()
        self.shapes = np.frombuffer(index["shapes"], np.int32).reshape(-1, 2).copy()
        self.checksums = np.frombuffer(index["checksums"], np.uint32).copy()
        flat = np.frombuffer(index["labels"], np.float32).reshape(-1, 5).copy()
        points = point_counts = None
        if "points" in index:
            dim = int(self.meta.get("geometry", {}).get("point_dim", 2))
            points = np.frombuffer(index["points"], np.float32).reshape(-1, dim).copy()
            point_counts = np.frombuffer(index["point_counts"], np.int32)
        self.labels = split_labels(flat, np.frombuffer(index["counts"], np.int32), points, point_counts)
        self.im_files = list(index["files"])
        if not (len(self.keys) == len(self.shapes) == len(self.labels) == len(self.im_files) == len(self.checksums)):
            raise StoreError(f"{path}: index arrays disagree on the number of samples")

    def _handles(self) -> tuple[str, ...]:
        return ("_shared",)

    def _environment(self) -> _SharedEnv:
        # One environment per process: an LMDB handle must not be used across fork.
        if self._shared is None or self._forked():
            self._pid = os.getpid()
            self._shared = _acquire_env(Path(self.path))
        return self._shared

    def _read_bytes(self, i: int) -> bytes:
        i = self.check_index(i)
        shared = self._environment()
        with shared.env.begin() as txn:
            buf = txn.get(_image_key(int(self.keys[i])))
        if buf is None:
            raise self.damaged(i, "read", "its image value is missing")
        shared.count_read(len(buf))
        return bytes(buf)

    def read_image(self, i: int) -> bytes:
        """Record ``i``'s image bytes, checked against the crc32 written at conversion on every read (a few
        hundredths of a millisecond per JPEG, against milliseconds to decode it); raises
        :class:`~fastload.store.base.DamagedRecordError` when they (or its labels) changed."""
        i = self.check_index(i)
        buf = self._read_bytes(i)
        if self.check_on_read and record_checksum(buf, self.labels.image(i)) != int(self.checksums[i]):
            raise self.damaged(i, "checksum", "crc32 mismatch (image bytes or labels changed since conversion)")
        return buf

    def record_ok(self, i: int) -> bool:
        """True when record ``i``'s image bytes and labels match the checksum written at conversion."""
        try:
            buf = self._read_bytes(i)
        except StoreError:
            return False
        return record_checksum(buf, self.labels.image(i)) == int(self.checksums[i])

    def close(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None and not self._forked():
            _release_env(Path(self.path))


class LmdbWriter:
    """Writes an LMDB store into ``<final>.partial``; :meth:`commit` seals it and renames it into place.

    With ``resume=True`` an existing partial environment made from the same sources and options is
    continued: :attr:`done` holds the source indices already written.
    """

    def __init__(self, final: str | Path, *, job: dict[str, Any], map_size: int, resume: bool = False) -> None:
        self.final = Path(final)
        self.tmp = self.final.with_name(self.final.name + ".partial")
        self.job = job
        if self.tmp.exists() and not resume:
            shutil.rmtree(self.tmp)
        self.map_size = max(int(map_size), 1 << 24)
        resuming = self.tmp.exists()
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.env = _open_env(self.tmp, write=True, map_size=self.map_size)
        self.done: set[int] = set()
        self._unreleased = 0  # bytes written or read since the map's pages were last dropped from this process
        if resuming:
            with self.env.begin() as txn:
                old = txn.get(JOB_KEY)
                if old is None or json.loads(bytes(old)) != job:
                    self.env.close()
                    raise StoreError(
                        f"cannot resume {self.tmp}: it was started from other sources or options; "
                        f"run without --resume to start over"
                    )
                for key, _ in txn.cursor():
                    if key[:2] in (b"r:", b"x:"):
                        self.done.add(int(key[2:]))
        else:
            self._put([(JOB_KEY, json.dumps(job).encode())])

    def _put(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """Write items in one transaction, growing the map when it fills up."""
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    for k, v in items:
                        txn.put(k, v)
                self._count(sum(len(v) for _, v in items))
                return
            except lmdb.MapFullError:
                self.map_size *= 2
                self.env.set_mapsize(self.map_size)

    def _count(self, nbytes: int) -> None:
        """Count ``nbytes`` written or read; past :data:`RELEASE_EVERY`, drop the map's pages from this process's
        RSS, as readers do (:meth:`_SharedEnv.count_read`). The writer's map is read-only (no MDB_WRITEMAP: pages
        are written with pwrite), yet every B-tree page it looks at maps its neighbours too (the kernel's
        fault-around), so without this a conversion ends up with the whole store in its RSS. Called between
        transactions, or within a read one whose values are copies: nothing points into the map."""
        self._unreleased += nbytes
        if self._unreleased > RELEASE_EVERY and _MADVISE is not None:
            span = _map_span(self.env, self.tmp, JOB_KEY)  # looked up each time: a grown map may have moved
            if span is not None:
                _MADVISE(span[0], span[1], mmap.MADV_DONTNEED)
            self._unreleased = 0

    def add_many(self, records: Iterable[tuple[int, bytes | None, np.ndarray | ImageLabels, Sequence[int], str,
                                               str | None]]) -> None:
        """Write ``(src, image_bytes or None, labels, (h0, w0), file, error)`` records in one transaction (labels:
        rows, or rows with points, :meth:`~fastload.data.labels.FlatLabels.image`)."""
        items: list[tuple[bytes, bytes]] = []
        for src, buf, labels, shape, file, error in records:
            if buf is None:
                items.append((_skip_key(src), msgpack.packb({"f": file, "e": error or "unreadable"})))
                continue
            rows, points, point_offsets = labels if isinstance(labels, ImageLabels) else (labels, None, None)
            lb = np.ascontiguousarray(rows, np.float32).reshape(-1, 5)
            image = ImageLabels(lb, points, point_offsets)
            rec = {"l": lb.tobytes(), "s": [int(shape[0]), int(shape[1])], "f": file, "c": record_checksum(buf, image)}
            if points is not None and point_offsets is not None:
                rec["p"] = np.ascontiguousarray(points, np.float32).tobytes()
                rec["o"] = np.diff(point_offsets).astype(np.int32).tobytes()
            items.append((_image_key(src), bytes(buf)))
            items.append((_record_key(src), msgpack.packb(rec)))
        self._put(items)

    def commit(self, n_sources: int, meta: dict[str, Any], *, point_dim: int | None = None,
               kpt_shape: Sequence[int] | None = None,
               flip_idx: Sequence[int] | None = None) -> tuple[Path, list[tuple[str, str]]]:
        """Seal the store: index + metadata in one last transaction, fsync, rename into place. ``point_dim``: the
        dimension of the records' label points (None: they have none); ``kpt_shape`` / ``flip_idx``: the data
        yaml's, for pose labels.

        Returns the final path and the ``(file, reason)`` of every source image that was skipped.
        """
        keys, shapes, files, sums, skipped = [], [], [], [], []
        labels: list[bytes | ImageLabels] = []
        with self.env.begin() as txn:
            for src in range(n_sources):
                self._count(_RECORD_READ_COST)
                raw = txn.get(_record_key(src))
                if raw is None:
                    bad = txn.get(_skip_key(src))
                    if bad is None:
                        raise StoreError(f"{self.tmp}: record {src} was never written; cannot commit")
                    info = msgpack.unpackb(bytes(bad), raw=False)
                    skipped.append((info["f"], info["e"]))
                    continue
                rec = msgpack.unpackb(bytes(raw), raw=False)
                keys.append(src)
                if point_dim is None:
                    labels.append(rec["l"])  # the rows' bytes as stored: no array object per record (1M: ~1 GB)
                else:
                    rows = np.frombuffer(rec["l"], np.float32).reshape(-1, 5)
                    per_row = np.frombuffer(rec["o"], np.int32)
                    labels.append(ImageLabels(rows, np.frombuffer(rec["p"], np.float32).reshape(-1, point_dim),
                                              np.concatenate([[0], np.cumsum(per_row)]).astype(np.int64)))
                shapes.append(rec["s"])
                files.append(rec["f"])
                sums.append(rec["c"])
        if point_dim is None:
            counts = np.fromiter(map(len, labels), np.int64, len(labels)) // (5 * 4)
            flat = FlatLabels(np.frombuffer(b"".join(labels), np.float32).reshape(-1, 5),  # type: ignore[arg-type]
                              np.concatenate([[0], np.cumsum(counts)]))
        else:
            flat = join_labels(labels)
        index = {
            "keys": np.array(keys, np.int64).tobytes(),
            "labels": flat.rows.tobytes(),
            "counts": flat.counts.astype(np.int32).tobytes(),
            "shapes": np.array(shapes, np.int32).reshape(-1, 2).tobytes(),
            "checksums": np.array(sums, np.uint32).tobytes(),
            "files": files,
        }
        geometry = geometry_meta(flat, kpt_shape, flip_idx)
        if flat.points is not None and flat.point_counts is not None:
            index.update(points=flat.points.tobytes(), point_counts=flat.point_counts.astype(np.int32).tobytes())
        full_meta = {
            **meta,
            "schema": SCHEMA_VERSION + (GEOMETRY_STEP if geometry else 0),
            "layout": "lmdb",
            "n": len(keys),
            "instances": len(flat.rows),
            "skipped": len(skipped),
            **geometry,
        }
        self._put([(INDEX_KEY, msgpack.packb(index)), (META_KEY, json.dumps(full_meta).encode())])
        self.env.sync(True)
        self.env.close()
        # The writer's lock file is useless to lock-free readers; drop it so copies stay small.
        (self.tmp / "lock.mdb").unlink(missing_ok=True)
        replace_dir(self.tmp, self.final)
        return self.final, skipped

    def close(self) -> None:
        """Leave the partial environment for --resume (interrupted run)."""
        try:
            self.env.close()
        except lmdb.Error:
            pass


def lmdb_bytes(im_bytes: np.ndarray) -> int:
    """The bytes an LMDB store of images of these sizes takes (docs/stores.md, "Sizes on disk"): each image its own
    run of 4 KiB overflow pages (a 16-byte header first), plus about 400 bytes of B-tree, record and index each."""
    sizes = np.asarray(im_bytes, np.int64)
    return int((-(-(sizes + 16) // 4096)).sum() * 4096 + 400 * len(sizes))


def write_lmdb(job: WriteJob, final: Path) -> tuple[Path, list[tuple[str, str]]]:
    """Write the LMDB store of ``job`` at ``final`` (the encoded files, re-encoded smaller above ``job.max_side``);
    returns its path and the images it had to skip. Resumable (``job.resume``) after an interruption."""
    index, max_side, quality = job.index, job.max_side, job.quality
    files = index.im_files
    needed = lmdb_bytes(index.im_bytes)
    spec = {"sources": job.source_hash, "n": len(files), "max_side": max_side, "quality": quality if max_side else None}
    point_dim = None if index.labels.points is None else int(index.labels.points.shape[1])
    if point_dim is not None:  # records of another fastload (without points) must not be resumed into this store
        spec["point_dim"] = point_dim
    if not (job.resume and final.with_name(final.name + PARTIAL).exists()):
        check_space(final.parent, needed + (16 << 20), f"LMDB store {final.name}")
    writer = LmdbWriter(final, job=spec, map_size=int(needed * 1.25) + (64 << 20), resume=job.resume)
    try:
        if writer.done:
            job.log(f"resuming {final.name}: {len(writer.done)} of {len(files)} records already written")
        todo = np.setdiff1d(np.arange(len(files)), np.fromiter(writer.done, np.int64, len(writer.done)))
        tasks = FileTasks(files, (max_side, quality), todo)
        bar = Progress(len(files), f"lmdb {final.name}", job.progress, initial=len(writer.done))
        batch: list[Any] = []
        try:
            for i, buf, err, nbytes in parallel_map(encoded_task, tasks, job.workers):
                batch.append((i, buf, index.labels.image(i), index.shapes[i], files[i], err))
                if len(batch) >= COMMIT_EVERY:
                    writer.add_many(batch)
                    batch.clear()
                bar.update(1, nbytes)
            if batch:
                writer.add_many(batch)
        finally:
            bar.close()
        meta = {
            "kind": "lmdb",
            "names": list(job.cfg.names),
            "source_hash": job.source_hash,
            "source_files": len(files),
            "options": {"max_side": max_side, "quality": spec["quality"]},
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "fastload_version": __version__,
        }
        return writer.commit(len(files), meta, point_dim=point_dim, kpt_shape=job.cfg.kpt_shape,
                             flip_idx=job.cfg.flip_idx)
    except lmdb.Error as e:  # disk full, map errors: keep what is written and say how to go on
        writer.close()
        raise StoreError(f"writing {final.name} failed ({e}); free space if needed and rerun with --resume") from e
    except BaseException:
        writer.close()  # the partial environment stays for --resume
        raise
