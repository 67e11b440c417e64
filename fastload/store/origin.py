"""Which source images a store was built from, and whether the stores recorded for one split agree.

Every store written by ``fastload convert`` records ``source_hash`` in its metadata: a hash of the
source image paths with their sizes and modification times (:func:`source_fingerprint`). The stores
that a ``data.yaml`` records for one split must share it; when they do not (two datasets converted
into one folder by an older version, or one store left from before the images changed), a loader
would read different images depending on the store it picks. ``open_store``, ``fastload verify`` and
``fastload info`` use :func:`mixed_sources` to say so instead.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from fastload.store.base import StoreError
from fastload.store.kinds import detect_kind
from fastload.store.encoded import read_encoded_meta
from fastload.store.lmdb_store import read_lmdb_meta
from fastload.store.packed import read_meta


class MixedStoresError(StoreError):
    """The stores recorded for one split were built from different source images."""


def source_fingerprint(im_files: Sequence[str]) -> str:
    """Hash of the source image list with sizes and mtimes (changes when the dataset changes)."""
    h = hashlib.sha1()
    for f in im_files:
        try:
            st = os.stat(f)
            h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        except OSError:
            h.update(f"{f}\0missing\n".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class StoreSource:
    """What a finished store says about its source: the hash and the number of source images."""

    source_hash: str
    images: int


def store_source(path: str | Path) -> StoreSource | None:
    """The source a finished store records, or None (absent, unfinished, unreadable, or written before
    stores recorded one)."""
    path = Path(path)
    kind = detect_kind(path) if path.exists() else None
    if kind is None:
        return None
    try:
        meta = {"lmdb": read_lmdb_meta, "encoded": read_encoded_meta}.get(kind, read_meta)(path)
    except (StoreError, OSError, ValueError):
        return None
    if not meta.get("source_hash"):
        return None
    return StoreSource(str(meta["source_hash"]), int(meta.get("source_files") or meta.get("n") or 0))


def mixed_sources(stores: Mapping[str, str | Path]) -> str | None:
    """None when the stores ``{kind: path}`` of one split agree on their source, else why not (one phrase,
    e.g. ``lmdb holds 8 source images, disk and ram hold 128, built from other images``)."""
    groups: dict[StoreSource, list[str]] = {}
    for kind, path in stores.items():
        src = store_source(path)
        if src is not None:
            groups.setdefault(src, []).append(kind)
    if len(groups) < 2:
        return None
    parts = [f"{' and '.join(kinds)} {'holds' if len(kinds) == 1 else 'hold'} {src.images} source images"
             for src, kinds in groups.items()]
    return ", ".join(parts) + ", each built from other images"


def check_one_source(stores: Mapping[str, str | Path], split: str, origin: str) -> None:
    """Raise :class:`MixedStoresError` when the stores recorded for ``split`` in ``origin`` disagree."""
    why = mixed_sources(stores)
    if why:
        raise MixedStoresError(
            f"{origin}: the {split} stores come from different datasets ({why}); convert the dataset again "
            f"into a fresh folder, or into this one with `fastload convert ... --force` to replace them all"
        )
