"""Store kinds and where they live: the registry of kinds (what reads and writes each, how the loader
treats it), the shared-memory root, and how a folder is recognised as a store. Every other store module
takes these from here.

Adding a kind is one module (its :class:`~fastload.store.base.Store` and its writer) plus one
:class:`StoreKind` line in :data:`STORE_KINDS`.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from fastload.data.images import LoadRule
from fastload.store.base import PACKED_SCHEMA

if TYPE_CHECKING:
    from fastload.data.config import DataConfig
    from fastload.data.index import DatasetIndex
    from fastload.store.base import Store


@dataclass(frozen=True)
class WriteJob:
    """One store to write for ``fastload convert`` (or a ram-store rebuild): what a kind's writer gets."""

    cfg: DataConfig
    name: str  # the split (the first of the splits with these sources) the store is named after
    index: DatasetIndex  # the scan of its sources
    source_hash: str  # origin.source_fingerprint of index.im_files, computed once per conversion
    out_dir: Path
    imgsz: int
    workers: int
    progress: bool
    resume: bool = False
    max_side: int | None = None
    quality: int = 90
    log: Callable[[str], None] = print
    load_rule: LoadRule = "yolov9"  # the loaded-image rule of a decoded store's images


@dataclass(frozen=True)
class StoreKind:
    """One kind of store, as ``open_store``, ``store="auto"``, ``fastload convert`` and ``fastload bench`` see it.

    ``reader`` and ``writer`` are ``"module:name"`` references, imported when first used (the gpu store needs
    torch; the CLI's store commands stay light).
    """

    name: str
    reader: str  # its Store class
    writer: str | None = None  # its writer, (WriteJob, final path) -> (path, skipped images); None: not converted
    # where convert writes it: (cfg, name, out, imgsz, load_rule); a decoded store's name says a rule other than yolov9's
    path: Callable[[DataConfig, str, Path, int, LoadRule], Path] | None = None
    decoded: bool = False  # holds loaded pixels at one imgsz (else the encoded images)
    auto_rank: int | None = None  # its place in store="auto", 0 first; None: only when asked for by name
    on_host: bool = True  # False: its images live in device memory (engines declare whether they draw from it)
    resumable: bool = False  # `fastload convert --resume` continues an interrupted conversion
    open_keywords: tuple[str, ...] = ()  # the keywords open_store(kind=...) passes on (anything else is refused)
    remote: bool = False  # opened from an s3:// URL (its reader takes the URL, split, imgsz), not from a path

    def reader_class(self) -> type[Store]:
        return _resolve(self.reader)

    def write(self, job: WriteJob, final: Path) -> tuple[Path, list[tuple[str, str]]]:
        """Write this kind's store of ``job`` at ``final``; returns its path and the source images it skipped."""
        if self.writer is None:
            raise ValueError(f"`fastload convert` does not write {self.name} stores")
        return _resolve(self.writer)(job, final)


def _resolve(ref: str) -> Any:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def _in_out(pattern: str) -> Callable[[DataConfig, str, Path, int, LoadRule], Path]:
    """A store path inside convert's output folder, ``pattern`` formatted with the split name, imgsz and
    ``rule`` (``-ultralytics`` for that loaded-image rule, empty for YOLOv9's)."""
    return lambda cfg, name, out_dir, imgsz, load_rule="yolov9": out_dir / pattern.format(
        name=name, imgsz=imgsz, rule="" if load_rule == "yolov9" else f"-{load_rule}")


def _ram_path(cfg: DataConfig, name: str, out_dir: Path, imgsz: int, load_rule: LoadRule = "yolov9") -> Path:
    return ram_segment_path(cfg, name, imgsz, load_rule)


# what a store of records back to back in one file takes to be read in shards as a streamed copy of it is
# (RecordFileStore.read_in_shards): the same batches as the stream's loader
IN_SHARDS = ("shard_bytes", "window")

STORE_KINDS: dict[str, StoreKind] = {k.name: k for k in (
    StoreKind("files", "fastload.store.files:FileStore", auto_rank=4, open_keywords=("cache", "workers", "progress")),
    StoreKind("lmdb", "fastload.store.lmdb_store:LmdbStore", "fastload.store.lmdb_store:write_lmdb",
              _in_out("{name}.lmdb"), auto_rank=2, resumable=True),
    # the same encoded images in one flat file: what object storage streams in byte ranges
    StoreKind("encoded", "fastload.store.encoded:EncodedStore", "fastload.store.encoded:write_encoded",
              _in_out("{name}.encoded"), auto_rank=3, open_keywords=IN_SHARDS),
    StoreKind("disk", "fastload.store.packed:PackedStore", "fastload.store.packed:write_disk",
              _in_out("{name}-{imgsz}{rule}.disk"), decoded=True, auto_rank=1, open_keywords=IN_SHARDS),
    # pinned in shared memory until `fastload unstage` (or a reboot; open_store then rebuilds it)
    StoreKind("ram", "fastload.store.packed:RamStore", "fastload.store.packed:write_ram", _ram_path, decoded=True,
              auto_rank=0, open_keywords=IN_SHARDS),
    StoreKind("gpu", "fastload.store.gpu:GpuStore", decoded=True, on_host=False,
              open_keywords=("device", "share", "chunk_bytes", "base")),
    # a disk or encoded store in object storage, read in shards into a node-local cache (open_store of an s3://
    # URL); decoded or not as the uploaded store it reads (StreamingStore.decoded)
    StoreKind("stream", "fastload.store.stream:StreamingStore", remote=True,
              open_keywords=("cache_dir", "cache_bytes", "shard_bytes", "window", "read_ahead", "upload_kind",
                             "retry_seconds")),
)}
# Every kind open_store() knows.
KINDS = tuple(STORE_KINDS)
# kind="auto": the fastest host store recorded for a split, in this order; the others only when asked for.
AUTO_ORDER = tuple(sorted((k.name for k in STORE_KINDS.values() if k.auto_rank is not None),
                          key=lambda n: STORE_KINDS[n].auto_rank))
# What `fastload convert --to` writes ("files" is the source itself, "gpu" is filled at open).
CONVERT_KINDS = tuple(k.name for k in STORE_KINDS.values() if k.writer is not None)
# What convert writes with the encoded images themselves (its max_side/quality re-encode them).
ENCODED_KINDS = tuple(k.name for k in STORE_KINDS.values() if k.writer is not None and not k.decoded)
RESUMABLE_KINDS = tuple(k.name for k in STORE_KINDS.values() if k.resumable)  # the others start over
REMOTE_KINDS = tuple(k.name for k in STORE_KINDS.values() if k.remote)  # what open_store opens an s3:// URL as


def store_kind(name: str) -> StoreKind:
    """The registered kind called ``name``."""
    if name not in STORE_KINDS:
        raise ValueError(f"unknown store kind {name!r}; choose auto or one of {', '.join(KINDS)}")
    return STORE_KINDS[name]


SHM_PREFIX = "fastload-"  # ram store segments under the shm root are named fastload-*


def shm_root() -> Path:
    """Root folder of shared-memory stores: ``$FASTLOAD_SHM_DIR``, else ``/dev/shm`` (read on every call)."""
    return Path(os.environ.get("FASTLOAD_SHM_DIR", "/dev/shm"))


def in_shm(path: str | Path) -> bool:
    """True when ``path`` lies under the shm root (a ram store, or a copy meant to be one)."""
    return str(path).startswith(str(shm_root()))


def detect_kind(path: str | Path) -> str | None:
    """``lmdb``, ``encoded``, ``disk``, ``ram`` (a packed store named ``fastload-*`` directly under the shm root)
    or None when ``path`` is not a store folder."""
    path = Path(path)
    if (path / "data.mdb").is_file():
        return "lmdb"
    if (path / "images.bin").is_file():
        return "encoded"
    if (path / "meta.json").is_file() or (path / "pixels.bin").is_file():
        try:
            under_shm = path.resolve().parent == shm_root().resolve()
        except OSError:
            under_shm = False
        return "ram" if under_shm and path.name.startswith(SHM_PREFIX) else "disk"
    return None


def store_imgsz(path: str | Path) -> int | None:
    """imgsz of a decoded store from its metadata, or from a ram segment's name when it is absent."""
    path = Path(path)
    meta = path / "meta.json"
    if meta.is_file():
        try:
            return int(json.loads(meta.read_text()).get("imgsz"))
        except (ValueError, TypeError):
            return None
    m = re.search(r"-(\d+)$", path.name)
    return int(m.group(1)) if m else None


def store_load_rule(path: str | Path) -> LoadRule | None:
    """The loaded-image rule a decoded store's metadata records (``yolov9`` when it records none: stores
    written before the rule existed), or None when it has no readable metadata."""
    try:
        return json.loads((Path(path) / "meta.json").read_text()).get("load_rule", "yolov9")
    except (OSError, ValueError, AttributeError):
        return None


def ram_segment_path(cfg: DataConfig, split: str, imgsz: int, load_rule: LoadRule = "yolov9") -> Path:
    """The shared-memory folder of a split's ram store, stable for the same sources, imgsz, packed schema and
    loaded-image rule (each rule has a segment of its own: one never serves the other)."""
    sources = [str(Path(p).resolve()) for p in cfg.splits.get(split, [])]
    # the schema is part of the name: a segment an older fastload left behind is never picked up
    key: list[Any] = [sources, imgsz, PACKED_SCHEMA] + ([] if load_rule == "yolov9" else [load_rule])
    digest = hashlib.sha1(json.dumps(key).encode()).hexdigest()[:10]
    slug = re.sub(r"[^A-Za-z0-9_.]+", "_", Path(cfg.root).name or "data")[:32]
    return shm_root() / f"{SHM_PREFIX}{slug}-{digest}-{imgsz}"


# ----------------------------------------------------------------------------- interrupted conversions
PARTIAL = ".partial"  # a store being written is <final>.partial until it is renamed into place


def finish_note_path(partial: str | Path) -> Path:
    """The hidden file beside ``<final>.partial`` holding the command that finishes that conversion."""
    partial = Path(partial)
    return partial.with_name(f".{partial.name}.json")


def write_finish_note(partial: str | Path, command: list[str]) -> Path:
    """Record ``command`` (argv) as the way to finish the conversion writing ``partial``."""
    note = finish_note_path(partial)
    note.write_text(json.dumps({"finish": command}))
    return note


def _kind_of_partial(partial: Path) -> str | None:
    final = partial.name[: -len(PARTIAL)]
    for kind in ("lmdb", "encoded", "disk"):
        if final.endswith(f".{kind}"):
            return kind
    return "ram" if final.startswith(SHM_PREFIX) else None


def finish_hint(partial: str | Path) -> str:
    """What ``partial`` is and the exact command that finishes it, to follow "<partial> is " or "<partial>: "
    (the command was recorded by the convert that started it; without that record a placeholder stands in
    for the data.yaml)."""
    partial = Path(partial)
    kind = _kind_of_partial(partial)
    try:
        command = shlex.join(json.loads(finish_note_path(partial).read_text())["finish"])
    except (OSError, ValueError, KeyError, TypeError):
        extra = " --resume" if kind in RESUMABLE_KINDS else ""
        command = f"fastload convert DATA.yaml --to {kind or 'KIND'} --out {shlex.quote(str(partial.parent))}{extra}"
    return (f"an interrupted conversion ({kind + ' store; ' if kind else ''}loaders never use it); finish it with "
            f"`{command}` (--resume continues an {'/'.join(RESUMABLE_KINDS)} conversion where it stopped; "
            f"{'/'.join(k for k in CONVERT_KINDS if k not in RESUMABLE_KINDS)} conversions start over)")


def unfinished_conversions(folder: str | Path) -> list[Path]:
    """The interrupted conversions (``*.partial`` folders) directly inside ``folder``, sorted."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob(f"*{PARTIAL}") if p.is_dir())

