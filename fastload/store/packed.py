"""Packed decoded images: one pixel file + small index arrays, opened with ``np.memmap``.

Layout of a packed store directory (used by ``disk`` stores and, under ``/dev/shm``, ``ram`` stores)::

    pixels.bin         all loaded images, RGB HWC uint8, back to back
    offsets.npy        int64 [N + 1]  byte offset of image i is offsets[i] .. offsets[i + 1]
    hw.npy             int32 [N, 2]   loaded (h, w) at imgsz
    shapes.npy         int32 [N, 2]   original (h0, w0)
    labels.npy         float32 [M, 5] all labels concatenated
    label_counts.npy   int32 [N]
    checksums.npy      uint32 [N]     crc32 of the image's pixels then its label bytes
    files.json         source image path per sample
    meta.json          schema, kind, imgsz, names, counts, options  (written last: the commit marker)

Reads are zero-copy views into the page cache, shared by every process that maps the file.
Writers build the directory in a temporary sibling and rename it into place at the end, so an
interrupted conversion never leaves a directory that opens.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from fastload.data.checksum import record_checksum
from fastload.data.images import loaded_shape
from fastload.store import shm
from fastload.store.base import (
    PACKED_SCHEMA,
    IncompleteStoreError,
    Store,
    StoreError,
    check_schema,
    join_labels,
    split_labels,
)

META = "meta.json"
PIXELS = "pixels.bin"
ARRAYS = ("offsets", "hw", "shapes", "labels", "label_counts", "checksums")


def read_meta(path: Path) -> dict[str, Any]:
    """The commit record of a packed store, or IncompleteStoreError naming the directory."""
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
    check_schema(path, meta, "packed", PACKED_SCHEMA,
                 older="its loaded image sizes are rounded where YOLOv9 truncates them: some images one pixel "
                       "larger than the official loader's")
    return meta


class PackedStore(Store):
    """A ``disk`` (or ``ram``, see :class:`RamStore`) store: loaded images served from one mapped file."""

    kind = "disk"
    decoded = True
    #: check each record's checksum on its first read in a process (False only to measure what the check
    #: costs: ``benchmarks/store_read.py --check-cost``)
    check_on_read = True

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = str(path)
        root = Path(path)
        self.meta = read_meta(root)
        self.imgsz = int(self.meta["imgsz"])
        arrays = {name: np.load(root / f"{name}.npy", allow_pickle=False) for name in ARRAYS}
        self.offsets = arrays["offsets"].astype(np.int64)
        self.hw = arrays["hw"].astype(np.int32)
        self.shapes = arrays["shapes"].astype(np.int32).reshape(-1, 2)
        self.checksums = arrays["checksums"].astype(np.uint32)
        self.labels = split_labels(arrays["labels"], arrays["label_counts"])
        self.im_files = list(json.loads((root / "files.json").read_text()))
        self.names = list(self.meta.get("names", []))
        n = len(self.im_files)
        if not (len(self.offsets) == n + 1 and len(self.hw) == len(self.shapes) == len(self.labels) == n):
            raise StoreError(f"{root}: index arrays disagree on the number of samples ({n} files)")
        size = (root / PIXELS).stat().st_size
        if size != int(self.offsets[-1]):
            raise StoreError(f"{root / PIXELS} holds {size} bytes, the index expects {int(self.offsets[-1])}")
        self._mm: np.ndarray | None = None
        self._checked: np.ndarray | None = None  # bool [N]: records whose checksum this process verified

    def _handles(self) -> tuple[str, ...]:
        return ("_mm", "_checked")

    def _pixels(self) -> np.ndarray:
        if self._mm is None or self._forked():
            self._pid = os.getpid()
            self._checked = np.zeros(len(self.im_files), bool)  # per process: a forked copy checks again
            if int(self.offsets[-1]) == 0:
                self._mm = np.zeros(0, np.uint8)
            else:
                # a plain ndarray view of the map: slicing a np.memmap runs Python-level
                # __array_finalize__ on every view (~5 per mosaic tile), slicing an ndarray does not
                self._mm = np.memmap(Path(self.path) / PIXELS, dtype=np.uint8, mode="r").view(np.ndarray)
        return self._mm

    def _view(self, i: int) -> np.ndarray:
        h, w = int(self.hw[i, 0]), int(self.hw[i, 1])
        o = int(self.offsets[i])
        return self._pixels()[o : o + h * w * 3].reshape(h, w, 3)

    def read_image(self, i: int) -> np.ndarray:
        """The loaded RGB image ``i`` as a read-only view into the mapped file (no copy).

        The first read of a record in a process checks its pixels (and labels) against the crc32 written
        at conversion (one pass over its bytes; later reads cost nothing: a bitmap remembers it) and
        raises :class:`~fastload.store.base.DamagedRecordError` when they changed.
        """
        i = self.check_index(i)
        img = self._view(i)
        checked: np.ndarray = self._checked  # type: ignore[assignment]  # _view() made this process's bitmap
        if self.check_on_read and not checked[i]:
            if record_checksum(img, self.labels[i]) != int(self.checksums[i]):
                raise self.damaged(i, "checksum", "crc32 mismatch (decoded pixels or labels changed since conversion)")
            checked[i] = True
        return img

    def nbytes(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])

    def record_ok(self, i: int) -> bool:
        """True when record ``i``'s pixels and labels still match the checksum written at conversion."""
        return record_checksum(self._view(self.check_index(i)), self.labels[i]) == int(self.checksums[i])

    def close(self) -> None:
        # Dropping the reference unmaps once no returned view is alive; closing the mmap by force
        # would break (BufferError) views a caller still holds.
        self._mm = None


class PackedWriter:
    """Writes a packed store into ``<final>.partial`` and renames it to ``final`` on :meth:`commit`.

    Records must be added in index order 0..N-1.
    """

    def __init__(self, final: str | Path, *, imgsz: int, names: Sequence[str], meta: dict[str, Any] | None = None):
        self.final = Path(final)
        self.tmp = self.final.with_name(self.final.name + ".partial")
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True)
        self.imgsz = int(imgsz)
        self.names = list(names)
        self.extra = dict(meta or {})
        self._fh = open(self.tmp / PIXELS, "wb")
        self.offsets = [0]
        self.hw: list[tuple[int, int]] = []
        self.shapes: list[tuple[int, int]] = []
        self.labels: list[np.ndarray] = []
        self.files: list[str] = []
        self.checksums: list[int] = []

    def add(self, img: np.ndarray, labels: np.ndarray, shape: Sequence[int], file: str) -> None:
        """Append one loaded image (RGB HWC uint8) with its labels, original (h0, w0) and source path."""
        if img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3:
            raise StoreError(f"{file}: expected an RGB HWC uint8 image, got {img.dtype} {img.shape}")
        img = np.ascontiguousarray(img)
        labels = np.asarray(labels, np.float32).reshape(-1, 5)
        self._fh.write(memoryview(img).cast("B"))
        self.offsets.append(self.offsets[-1] + img.nbytes)
        self.hw.append((img.shape[0], img.shape[1]))
        self.shapes.append((int(shape[0]), int(shape[1])))
        self.labels.append(labels)
        self.files.append(str(file))
        self.checksums.append(record_checksum(img, labels))

    def commit(self) -> Path:
        """Write the index and the commit marker, then move the store into place (replacing an old one)."""
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        flat, counts = join_labels(self.labels)
        arrays = {
            "offsets": np.array(self.offsets, np.int64),
            "hw": np.array(self.hw, np.int32).reshape(-1, 2),
            "shapes": np.array(self.shapes, np.int32).reshape(-1, 2),
            "labels": flat,
            "label_counts": counts,
            "checksums": np.array(self.checksums, np.uint32),
        }
        for name, arr in arrays.items():
            np.save(self.tmp / f"{name}.npy", arr, allow_pickle=False)
        (self.tmp / "files.json").write_text(json.dumps(self.files))
        meta = {
            **self.extra,
            "schema": PACKED_SCHEMA,
            "layout": "packed",
            "imgsz": self.imgsz,
            "names": self.names,
            "n": len(self.files),
            "instances": int(counts.sum()),
            "pixel_bytes": int(self.offsets[-1]),
        }
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


def packed_nbytes(shapes: np.ndarray, imgsz: int) -> int:
    """Bytes ``pixels.bin`` will take for these original shapes at ``imgsz`` (to check space first)."""
    return int(sum(3 * h * w for h, w in (loaded_shape(int(a), int(b), imgsz) for a, b in np.asarray(shapes).reshape(-1, 2))))


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
