"""Store kinds and where they live: the one list of kind names, the shared-memory root, and how a
folder is recognised as a store. Every other store module takes these from here."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from fastload.store.base import PACKED_SCHEMA

if TYPE_CHECKING:
    from fastload.data.config import DataConfig

# Every kind open_store() knows (see :func:`fastload.store.factory.store_class`).
KINDS = ("files", "lmdb", "disk", "ram", "gpu")
# kind="auto": the fastest host store recorded for a split; "gpu" is used only when asked for.
AUTO_ORDER = ("ram", "disk", "lmdb", "files")
# What `fastload convert --to` writes ("files" is the source itself, "gpu" is filled at open).
CONVERT_KINDS = ("lmdb", "disk", "ram")

SHM_PREFIX = "fastload-"  # ram store segments under the shm root are named fastload-*


def shm_root() -> Path:
    """Root folder of shared-memory stores: ``$FASTLOAD_SHM_DIR``, else ``/dev/shm`` (read on every call)."""
    return Path(os.environ.get("FASTLOAD_SHM_DIR", "/dev/shm"))


def in_shm(path: str | Path) -> bool:
    """True when ``path`` lies under the shm root (a ram store, or a copy meant to be one)."""
    return str(path).startswith(str(shm_root()))


def detect_kind(path: str | Path) -> str | None:
    """``lmdb``, ``disk``, ``ram`` (a packed store named ``fastload-*`` directly under the shm root)
    or None when ``path`` is not a store folder."""
    path = Path(path)
    if (path / "data.mdb").is_file():
        return "lmdb"
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


def ram_segment_path(cfg: DataConfig, split: str, imgsz: int) -> Path:
    """The shared-memory folder of a split's ram store, stable for the same sources, imgsz and packed schema."""
    sources = [str(Path(p).resolve()) for p in cfg.splits.get(split, [])]
    # the schema is part of the name: a segment an older fastload left behind is never picked up
    digest = hashlib.sha1(json.dumps([sources, imgsz, PACKED_SCHEMA]).encode()).hexdigest()[:10]
    slug = re.sub(r"[^A-Za-z0-9_.]+", "_", Path(cfg.root).name or "data")[:32]
    return shm_root() / f"{SHM_PREFIX}{slug}-{digest}-{imgsz}"


# ----------------------------------------------------------------------------- interrupted conversions
PARTIAL = ".partial"  # a store being written is <final>.partial until it is renamed into place
RESUMABLE_KINDS = ("lmdb",)  # `convert --resume` continues these; disk/ram conversions start over


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
    for kind in ("lmdb", "disk"):
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

