"""Encoded images back to back in one file: the ``encoded`` store.

Layout of an encoded store folder (``<split>.encoded``)::

    images.bin         the encoded image of every record (the source file's bytes, or a smaller JPEG with
                       --max-side), back to back
    offsets.npy        int64 [N + 1]  record i is bytes offsets[i] .. offsets[i + 1] of images.bin
    shapes.npy         int32 [N, 2]   original (h0, w0)
    labels.npy         float32 [M, 5] all labels concatenated
    label_counts.npy   int32 [N]
    checksums.npy      uint32 [N]     crc32 of the image bytes then its label bytes (as an LMDB record's)
    points.npy, point_counts.npy      label points, where the labels have them (as in a disk store)
    files.json         source image path per record
    meta.json          schema, kind, names, counts, options (written last: the commit marker), ``geometry``

It holds what an LMDB store holds (decoding still costs CPU) in the layout of a ``disk`` store, so a run of
consecutive records is one byte range of one file: object storage serves a shard of them in one ranged read
(:mod:`fastload.store.stream`), at the size of the JPEGs rather than of decoded pixels. Read locally, a record
is a slice of the memory-mapped file.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from fastload._version import __version__
from fastload.data.labels import ImageLabels
from fastload.store.kinds import WriteJob
from fastload.store.packed import PackedWriter, RecordFileStore, read_layout_meta, write_records
from fastload.store.space import check_space
from fastload.store.writing import FileTasks, encoded_task

IMAGES = "images.bin"
ARRAYS = ("offsets", "shapes", "labels", "label_counts", "checksums")
ENCODED_SCHEMA = 1


def read_encoded_meta(path: str | Path) -> dict[str, Any]:
    """The commit record of an encoded store, or IncompleteStoreError naming the folder."""
    return read_layout_meta(Path(path), "encoded", ENCODED_SCHEMA)


class EncodedStore(RecordFileStore):
    """Encoded image bytes from one memory-mapped file (``decoded=False``)."""

    kind = "encoded"
    decoded = False
    records_file = IMAGES

    def _read_index(self, root: Path) -> None:
        self.meta = read_encoded_meta(root)
        self._read_records_index(root, ARRAYS)

    def read_image(self, i: int) -> bytes:
        """Record ``i``'s image bytes, checked against the crc32 written at conversion on every read (small beside
        decoding them); raises :class:`~fastload.store.base.DamagedRecordError` when they (or its labels) changed."""
        return self._encoded_record(self.check_index(i))


class EncodedWriter(PackedWriter):
    """Writes an encoded store into ``<final>.partial`` and renames it to ``final`` on :meth:`commit`."""

    records_file = IMAGES
    layout = "encoded"
    schema = ENCODED_SCHEMA

    def add(self, buf: bytes, labels: np.ndarray | ImageLabels, shape: Sequence[int],  # type: ignore[override]
            file: str) -> None:
        """Append one encoded image with its labels, original (h0, w0) and source path."""
        self._append(buf, labels, shape, file)

    def _index_arrays(self) -> dict[str, np.ndarray]:
        return {k: v for k, v in super()._index_arrays().items() if k != "hw"}

    def _size_meta(self) -> dict[str, Any]:
        return {"image_bytes": int(self.offsets[-1])}


def write_encoded(job: WriteJob, final: Path) -> tuple[Path, list[tuple[str, str]]]:
    """Write the encoded store of ``job`` at ``final`` (the encoded files, re-encoded smaller above
    ``job.max_side``); returns its path and the images it had to skip. Not resumable: it starts over."""
    files = job.index.im_files
    src_bytes = int(job.index.im_bytes.sum())  # the index's sizes: no stat per file
    check_space(final.parent, src_bytes + (16 << 20), f"encoded store {final.name}")
    quality = job.quality if job.max_side else None
    meta = {"kind": "encoded", "source_hash": job.source_hash, "source_files": len(files),
            "options": {"max_side": job.max_side, "quality": quality},
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "fastload_version": __version__}
    writer = EncodedWriter(final, imgsz=None, names=job.cfg.names, meta=meta, kpt_shape=job.cfg.kpt_shape,
                           flip_idx=job.cfg.flip_idx)
    return write_records(writer, job, encoded_task, FileTasks(files, (job.max_side, job.quality)), f"encoded {final.name}", failed="unreadable")
