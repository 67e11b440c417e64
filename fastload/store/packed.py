"""Packed decoded images: one pixel file + small index arrays, opened with ``np.memmap``.

Layout of a packed store directory (used by ``disk`` stores and, under ``/dev/shm``, ``ram`` stores)::

    pixels.bin         all loaded images, RGB HWC uint8, back to back
    offsets.npy        int64 [N + 1]  byte offset of image i is offsets[i] .. offsets[i + 1]
    hw.npy             int32 [N, 2]   loaded (h, w) at imgsz, by meta["load_rule"]
    shapes.npy         int32 [N, 2]   original (h0, w0)
    labels.npy         float32 [M, 5] all labels concatenated
    label_counts.npy   int32 [N]
    checksums.npy      uint32 [N]     crc32 of the image's pixels then its label bytes (and points)
    points.npy         float32 [P, D] label points (segments, keypoints, OBB corners), in a store that has them
    point_counts.npy   int32 [M]      points of each label row, beside points.npy
    files.json         source image path per sample
    meta.json          schema, kind, imgsz, names, counts, options, shrink, load_rule (written last: the
                       commit marker; a store without load_rule holds YOLOv9's loaded images), and ``geometry``
                       where the labels have points (the schema is then PACKED_SCHEMA + GEOMETRY_STEP)

Reads are zero-copy views into the page cache, shared by every process that maps the file.
Writers build the directory in a temporary sibling and rename it into place at the end, so an
interrupted conversion never leaves a directory that opens.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from fastload._version import __version__
from fastload.data.checksum import record_checksum
from fastload.data.images import LoadRule, loaded_shape
from fastload.data.labels import ImageLabels
from fastload.store import shm
from fastload.store.base import (
    GEOMETRY_STEP,
    PACKED_SCHEMA,
    IncompleteStoreError,
    Shards,
    Store,
    StoreError,
    check_schema,
    geometry_meta,
    join_labels,
    label_arrays,
    split_labels,
)
from fastload.store.kinds import PARTIAL, WriteJob, in_shm, store_kind
from fastload.store.space import check_memory, check_space, fmt_bytes, tree_bytes
from fastload.store.writing import FileTasks, Progress, decoded_shrink, decoded_task, parallel_map

META = "meta.json"
PIXELS = "pixels.bin"
ARRAYS = ("offsets", "hw", "shapes", "labels", "label_counts", "checksums")
POINT_ARRAYS = ("points", "point_counts")  # beside ARRAYS in a store whose labels have points
SHARD_BYTES = 64 << 20  # about how many bytes of records one shard holds (RecordFileStore.read_in_shards)


def read_meta(path: Path) -> dict[str, Any]:
    """The commit record of a packed store, or IncompleteStoreError naming the directory."""
    return read_layout_meta(path, "packed", PACKED_SCHEMA,
                            older="its loaded image sizes are rounded where YOLOv9 truncates them: some images one "
                                  "pixel larger than the official loader's")


def read_layout_meta(path: Path, layout: str, schema: int, *, older: str | None = None) -> dict[str, Any]:
    """The commit record (``meta.json``, written last) of a store folder of ``layout`` at ``schema`` (see
    :func:`~fastload.store.base.check_schema`), or IncompleteStoreError naming the folder."""
    path = Path(path)
    meta_file = path / META
    if not path.is_dir():
        raise StoreError(f"no store at {path}")
    if not meta_file.is_file():
        raise IncompleteStoreError(
            f"{path} is an unfinished store (no {META}: the conversion was interrupted); "
            f"run `fastload convert` again to rebuild it"
        )
    try:
        meta = json.loads(meta_file.read_text())
    except ValueError as e:
        raise StoreError(f"damaged metadata {meta_file}: {e}") from e
    check_schema(path, meta, layout, schema, older=older)
    return meta


class RecordFileStore(Store):
    """A store whose records lie back to back in one file, indexed by ``offsets.npy`` (decoded ``disk``/``ram``
    stores, ``encoded`` stores): what they share, the index and the byte range of a record (a run of
    consecutive records is one byte range: what :mod:`fastload.store.stream` reads in shards)."""

    records_file = ""  # the file in the store's folder that holds the records
    offsets: np.ndarray  # int64 [N + 1]: record i is bytes offsets[i] .. offsets[i + 1] of the file
    checksums: np.ndarray  # uint32 [N]: crc32 of record i's bytes then its label bytes
    #: check records against their checksums when read (False only to measure what the check costs:
    #: ``benchmarks/store_read.py --check-cost``)
    check_on_read = True
    #: set by :meth:`read_in_shards`: shard ``s`` holds records ``bounds[s] .. bounds[s + 1]``; None: no shards
    bounds: np.ndarray | None = None

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = str(path)
        root = Path(path)
        self._read_index(root)
        size = (root / self.records_file).stat().st_size
        if size != int(self.offsets[-1]):
            raise StoreError(f"{root / self.records_file} holds {size} bytes, the index expects {int(self.offsets[-1])} "
                             f"(an incomplete copy?); copy it again or convert the dataset again")
        self._mm: np.ndarray | None = None  # the records file mapped in this process, opened on first read

    def _read_index(self, root: Path) -> None:
        """Everything but the records, from the store folder ``root``: metadata, index arrays, labels, files."""
        raise NotImplementedError

    def _read_records_index(self, root: Path, arrays: Sequence[str]) -> dict[str, np.ndarray]:
        """Set the index (offsets, shapes, checksums, labels, files, names) from the folder ``root`` whose
        metadata is in ``self.meta``, checked to agree on the number of records; returns every array read
        (``arrays``: the layout's ``.npy`` files)."""
        with_points = bool(self.meta.get("geometry"))
        loaded = {name: np.load(root / f"{name}.npy", allow_pickle=False)
                  for name in (*arrays, *(POINT_ARRAYS if with_points else ()))}
        self.offsets = loaded["offsets"].astype(np.int64)
        self.shapes = loaded["shapes"].astype(np.int32).reshape(-1, 2)
        self.checksums = loaded["checksums"].astype(np.uint32)
        self.labels = split_labels(loaded["labels"], loaded["label_counts"], loaded.get("points"),
                                   loaded.get("point_counts"))
        self.im_files = list(json.loads((root / "files.json").read_text()))
        self.names = list(self.meta.get("names", []))
        n = len(self.im_files)
        if not (len(self.offsets) == n + 1 and len(self.shapes) == len(self.labels) == len(self.checksums) == n):
            raise StoreError(f"{root}: index arrays disagree on the number of samples ({n} files)")
        return loaded

    def nbytes(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])

    def read_in_shards(self, shard_bytes: int = SHARD_BYTES, window: int = 1) -> None:
        """Have the loader visit this store shard by shard (:meth:`shards`): runs of consecutive records of about
        ``shard_bytes``, ``window`` of them shuffled together per epoch (:func:`fastload.order.shard_permutation`).

        A streamed store (:class:`fastload.store.stream.StreamingStore`) is read so; a local copy of the store it
        streams, read in shards of the same ``shard_bytes`` and ``window``, gives its loader the same batches
        (``open_store(..., kind="disk" | "encoded" | "ram", shard_bytes=..., window=...)``)."""
        if int(shard_bytes) < 1:
            raise ValueError(f"shard_bytes must be >= 1, got {shard_bytes}")
        if int(window) < 1:
            raise ValueError(f"window must be >= 1 shard, got {window}")
        self.bounds = shard_bounds(self.offsets, int(shard_bytes))
        self.window = int(window)
        self._shard_of = np.repeat(np.arange(len(self.bounds) - 1), np.diff(self.bounds)).astype(np.int64)

    def shards(self) -> Shards | None:
        return None if self.bounds is None else Shards(self._shard_of, self.window)

    def _handles(self) -> tuple[str, ...]:
        return ("_mm",)

    def _new_process(self) -> None:
        """What a process resets before its first read (this one's first, or a forked or unpickled copy's)."""

    def _records(self) -> np.ndarray:
        """The records file mapped in this process (mapped on first use, again in a forked process)."""
        if self._mm is None or self._forked():
            self._pid = os.getpid()
            self._new_process()
            if int(self.offsets[-1]) == 0:
                self._mm = np.zeros(0, np.uint8)
            else:
                # a plain ndarray view of the map: slicing a np.memmap runs Python-level
                # __array_finalize__ on every view (~5 per mosaic tile), slicing an ndarray does not
                self._mm = np.memmap(Path(self.path) / self.records_file, dtype=np.uint8, mode="r").view(np.ndarray)
        return self._mm

    def _record(self, i: int) -> np.ndarray:
        """Record ``i``'s bytes: a read-only view, no copy."""
        return self._records()[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def _encoded_record(self, i: int) -> bytes:
        """Record ``i``'s image bytes, checked against the crc32 written at conversion on every read, as an LMDB
        store does (small beside decoding them); :class:`DamagedRecordError` when they (or its labels) changed."""
        buf = self._record(i).tobytes()
        if self.check_on_read and not self._intact(i, buf):
            raise self.damaged(i, "checksum", "crc32 mismatch (image bytes or labels changed since conversion)")
        return buf

    def record_ok(self, i: int) -> bool:
        """True when record ``i``'s bytes and labels still match the checksum written at conversion."""
        i = self.check_index(i)
        return self._intact(i, self._record(i))

    def _intact(self, i: int, payload: bytes | np.ndarray) -> bool:
        """True when ``payload``, record ``i``'s bytes from wherever they were read, and its labels match the crc32
        written at conversion."""
        return record_checksum(payload, self.labels.image(i)) == int(self.checksums[i])

    def close(self) -> None:
        # Dropping the reference unmaps once no returned view is alive; closing the mmap by force
        # would break (BufferError) views a caller still holds.
        self._mm = None


class PackedStore(RecordFileStore):
    """A ``disk`` (or ``ram``, see :class:`RamStore`) store: loaded images served from one mapped file."""

    kind = "disk"
    decoded = True
    records_file = PIXELS

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self._checked: np.ndarray | None = None  # bool [N]: records whose checksum this process verified

    def _read_index(self, root: Path) -> None:
        self.meta = read_meta(root)
        self.imgsz = int(self.meta["imgsz"])
        self.load_rule = self.meta.get("load_rule", "yolov9")  # stores written before the rule: YOLOv9's
        arrays = self._read_records_index(root, ARRAYS)
        self.hw = arrays["hw"].astype(np.int32)
        if len(self.hw) != len(self.im_files):
            raise StoreError(f"{root}: index arrays disagree on the number of samples ({len(self.im_files)} files)")

    def _handles(self) -> tuple[str, ...]:
        return ("_mm", "_checked")

    def _new_process(self) -> None:
        self._checked = np.zeros(len(self.im_files), bool)  # per process: a forked copy checks again

    def _view(self, i: int) -> np.ndarray:
        h, w = int(self.hw[i, 0]), int(self.hw[i, 1])
        return self._record(i).reshape(h, w, 3)

    def read_image(self, i: int) -> np.ndarray:
        """The loaded RGB image ``i`` as a read-only view into the mapped file (no copy).

        The first read of a record in a process (``check_on_read``) checks its pixels (and labels) against the
        crc32 written at conversion (one pass over its bytes; later reads cost nothing: a bitmap remembers it) and
        raises :class:`~fastload.store.base.DamagedRecordError` when they changed.
        """
        i = self.check_index(i)
        img = self._view(i)
        checked: np.ndarray = self._checked  # type: ignore[assignment]  # the first read made this process's bitmap
        if self.check_on_read and not checked[i]:
            if not self._intact(i, img):
                raise self.damaged(i, "checksum", "crc32 mismatch (decoded pixels or labels changed since conversion)")
            checked[i] = True
        return img


class PackedWriter:
    """Writes a packed store into ``<final>.partial`` and renames it to ``final`` on :meth:`commit`.

    Records must be added in index order 0..N-1. Subclasses write other records in the same layout
    (:class:`fastload.store.encoded.EncodedWriter`): their file's name, layout, schema and index arrays.
    """

    records_file = PIXELS
    layout = "packed"
    schema = PACKED_SCHEMA

    def __init__(self, final: str | Path, *, imgsz: int | None, names: Sequence[str],
                 meta: dict[str, Any] | None = None, kpt_shape: Sequence[int] | None = None,
                 flip_idx: Sequence[int] | None = None) -> None:
        self.final = Path(final)
        self.tmp = self.final.with_name(self.final.name + ".partial")
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True)
        self.imgsz = imgsz
        self.names = list(names)
        self.extra = dict(meta or {})
        self.kpt_shape, self.flip_idx = kpt_shape, flip_idx  # the data yaml's, recorded with pose labels
        self._fh = open(self.tmp / self.records_file, "wb")
        self.offsets = [0]
        self.hw: list[tuple[int, int]] = []
        self.shapes: list[tuple[int, int]] = []
        self.labels: list[np.ndarray | ImageLabels] = []
        self.files: list[str] = []
        self.checksums: list[int] = []

    def add(self, img: np.ndarray, labels: np.ndarray | ImageLabels, shape: Sequence[int], file: str) -> None:
        """Append one loaded image (RGB HWC uint8) with its labels (rows, or rows with points:
        :meth:`~fastload.data.labels.FlatLabels.image`), original (h0, w0) and source path."""
        if img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3:
            raise StoreError(f"{file}: expected an RGB HWC uint8 image, got {img.dtype} {img.shape}")
        img = np.ascontiguousarray(img)
        self.hw.append((img.shape[0], img.shape[1]))
        self._append(memoryview(img).cast("B"), labels, shape, file)

    def _append(self, payload: bytes | memoryview, labels: np.ndarray | ImageLabels, shape: Sequence[int],
                file: str) -> None:
        if isinstance(labels, ImageLabels):
            labels = labels._replace(rows=np.asarray(labels.rows, np.float32).reshape(-1, 5))
        else:
            labels = np.asarray(labels, np.float32).reshape(-1, 5)
        self._fh.write(payload)
        self.offsets.append(self.offsets[-1] + len(payload))
        self.shapes.append((int(shape[0]), int(shape[1])))
        self.labels.append(labels)
        self.files.append(str(file))
        self.checksums.append(record_checksum(payload, labels))

    def _index_arrays(self) -> dict[str, np.ndarray]:
        """The layout's ``.npy`` files but the labels' (written by :meth:`commit`)."""
        return {"offsets": np.array(self.offsets, np.int64), "hw": np.array(self.hw, np.int32).reshape(-1, 2),
                "shapes": np.array(self.shapes, np.int32).reshape(-1, 2), "checksums": np.array(self.checksums, np.uint32)}

    def _size_meta(self) -> dict[str, Any]:
        return {"imgsz": self.imgsz, "pixel_bytes": int(self.offsets[-1])}

    def commit(self) -> Path:
        """Write the index and the commit marker, then move the store into place (replacing an old one)."""
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        flat = join_labels(self.labels)
        for name, arr in {**self._index_arrays(), **label_arrays(flat)}.items():
            np.save(self.tmp / f"{name}.npy", arr, allow_pickle=False)
        (self.tmp / "files.json").write_text(json.dumps(self.files))
        geometry = geometry_meta(flat, self.kpt_shape, self.flip_idx)
        meta = {**self.extra, "schema": self.schema + (GEOMETRY_STEP if geometry else 0), "layout": self.layout,
                "names": self.names, "n": len(self.files), "instances": len(flat.rows), **self._size_meta(), **geometry}
        # The marker goes last and is itself written atomically.
        tmp_meta = self.tmp / (META + ".tmp")
        tmp_meta.write_text(json.dumps(meta, indent=1))
        os.replace(tmp_meta, self.tmp / META)
        replace_dir(self.tmp, self.final)
        return self.final

    def abort(self) -> None:
        if not self._fh.closed:
            self._fh.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


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


def replace_dir(src: Path, dst: Path) -> None:
    """Move the finished directory ``src`` to ``dst``, replacing an existing ``dst`` with no window
    in which ``dst`` is a half-written store (it is either the old complete one, absent, or the new one)."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        old = dst.with_name(dst.name + f".old-{os.getpid()}")
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)


def packed_nbytes(shapes: np.ndarray, imgsz: int, load_rule: LoadRule = "yolov9") -> int:
    """Bytes ``pixels.bin`` will take for these original shapes at ``imgsz`` (to check space first)."""
    return int(sum(3 * h * w for h, w in (loaded_shape(int(a), int(b), imgsz, load_rule)
                                          for a, b in np.asarray(shapes).reshape(-1, 2))))


class RamStore(PackedStore):
    """A packed store in shared memory whose lifetime is tracked by :mod:`fastload.store.shm`.

    The process that opens it registers as a holder; :meth:`close` (or interpreter exit) releases
    the hold and the last holder removes the segment unless it is pinned. Forked/spawned workers that
    receive the object read the same pages and never touch the registry.
    """

    kind = "ram"

    def __init__(self, path: str | Path, *, build: Any = None, pinned: bool = False) -> None:
        shm.acquire(Path(path), build, pinned=pinned)
        self._holder_pid = os.getpid()
        try:
            super().__init__(path)
        except Exception:
            shm.release(Path(path))
            raise

    def close(self) -> None:
        super().close()
        if getattr(self, "_holder_pid", None) == os.getpid():
            self._holder_pid = None
            shm.release(Path(self.path))

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_holder_pid"] = None  # a worker copy is not a holder
        return state


# ----------------------------------------------------------------------------- writers (fastload convert)
def write_packed(job: WriteJob, final: Path, *, kind: str, check: Callable[[int], None]) -> tuple[Path, list[tuple[str, str]]]:
    """Decode, resize and pack the images of ``job`` into a packed store of ``kind`` at ``final`` (``check``: the
    room for its bytes); returns it and the images it skipped."""
    index, imgsz, rule = job.index, job.imgsz, job.load_rule
    files = index.im_files
    check(packed_nbytes(index.shapes, imgsz, rule))
    meta = {
        "kind": kind,
        "source_hash": job.source_hash,
        "source_files": len(files),
        "options": {"imgsz": imgsz},
        "shrink": decoded_shrink(rule),
        "load_rule": rule,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "fastload_version": __version__,
    }
    writer = PackedWriter(final, imgsz=imgsz, names=job.cfg.names, meta=meta, kpt_shape=job.cfg.kpt_shape,
                          flip_idx=job.cfg.flip_idx)
    return write_records(writer, job, decoded_task, FileTasks(files, (imgsz, rule)),
                         f"{kind} {final.name}", failed="undecodable")


def write_records(writer: PackedWriter, job: WriteJob, task: Callable[[Any], tuple[int, Any, str | None, int]],
                  tasks: Sequence[Any], label: str, *, failed: str) -> tuple[Path, list[tuple[str, str]]]:
    """Run ``task`` (:mod:`fastload.store.writing`'s ``decoded_task`` or ``encoded_task``) over ``tasks`` in the job's
    process pool, add each record to ``writer`` in source order and commit it, under a progress bar named
    ``label``; returns the store's path and the images skipped (a task that gives no record says why, else
    ``failed``). Any failure or interruption aborts the writer: no partial store stays."""
    files, labels, shapes = job.index.im_files, job.index.labels, job.index.shapes
    skipped: list[tuple[str, str]] = []
    bar = Progress(len(tasks), label, job.progress)
    try:
        for i, record, err, nbytes in parallel_map(task, tasks, job.workers):
            if record is None:
                skipped.append((files[i], err or failed))
            else:
                writer.add(record, labels.image(i), shapes[i], files[i])
            bar.update(1, nbytes)
        return writer.commit(), skipped
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()


def write_disk(job: WriteJob, final: Path) -> tuple[Path, list[tuple[str, str]]]:
    """The disk store of ``job`` at ``final`` (decoded images at ``job.imgsz``)."""
    return write_packed(job, final, kind="disk",
                        check=lambda n: check_space(final.parent, n + (16 << 20), f"disk store {final.name}"))


def write_ram(job: WriteJob, segment: Path) -> tuple[Path, list[tuple[str, str]]]:
    """The ram store of ``job``: a copy of its disk store when convert wrote one, else decoded from the source;
    pinned in shared memory until ``fastload unstage``. A segment in use by other processes is kept (refused
    when it holds other images than the ones ``job`` scanned)."""
    disk = store_kind("disk").path(job.cfg, job.name, job.out_dir, job.imgsz, job.load_rule)
    skipped: list[tuple[str, str]] = []
    with shm.locked(segment) as reg:
        reg.prune()
        if reg.pids and shm.is_complete(segment):
            held = _source_hash(segment)
            if held is not None and held != job.source_hash:
                raise StoreError(f"ram store {segment} holds other images than {job.cfg.origin} lists now and is in use "
                                 f"by PIDs {reg.pids}; stop them (or `fastload unstage --force {segment}`) and convert again")
            job.log(f"ram store {segment} is in use by PIDs {reg.pids}; kept as it is")
            reg.pinned = True
            return segment, skipped
        shutil.rmtree(segment, ignore_errors=True)
        if (disk / META).is_file():
            copy_packed(disk, segment)
        else:
            _, skipped = write_ram_from_source(job, segment)
        reg.pinned = True
        reg.info.update(created=time.time(), created_by=os.getpid(), source=str(job.cfg.origin))
    job.log(f"ram store pinned in shared memory ({fmt_bytes(tree_bytes(segment))}); free it with `fastload unstage {segment}`")
    return segment, skipped


def write_ram_from_source(job: WriteJob, segment: Path) -> tuple[Path, list[tuple[str, str]]]:
    """Decode the images of ``job`` into the ram segment ``segment`` (memory checked first)."""
    return write_packed(job, segment, kind="ram", check=lambda n: check_memory(n, f"ram store {segment.name}"))


def _source_hash(path: Path) -> str | None:
    """The source fingerprint a finished packed store records (None: unreadable, or none recorded)."""
    try:
        return read_meta(path).get("source_hash") or None
    except (StoreError, OSError, ValueError):
        return None


def copy_packed(src: Path, dst: Path) -> Path:
    """Copy a finished packed store (e.g. disk -> /dev/shm) through a temporary sibling."""
    src, dst = Path(src), Path(dst)
    meta = read_meta(src)
    if in_shm(dst):
        check_memory(int(meta.get("pixel_bytes", 0)), f"ram store {dst.name}")
    else:
        check_space(dst.parent, tree_bytes(src), f"copy of {src}")
    tmp = dst.with_name(dst.name + PARTIAL)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        if f.name != META and f.is_file():
            shutil.copyfile(f, tmp / f.name)
    meta["kind"] = "ram" if in_shm(dst) else meta.get("kind", "disk")
    meta["copied_from"] = str(src)
    (tmp / (META + ".tmp")).write_text(json.dumps(meta, indent=1))
    os.replace(tmp / (META + ".tmp"), tmp / META)
    replace_dir(tmp, dst)
    return dst
