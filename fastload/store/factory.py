"""``open_store``: the one way packages obtain a :class:`~fastload.store.base.Store`.

``data`` may be a ``data.yaml`` path, a dict, a :class:`fastload.data.config.DataConfig` or a store
directory. With ``kind="auto"`` the fastest store that ``fastload convert`` recorded for the split is
used, in the order ram > disk > lmdb > encoded > files; decoded stores (ram, disk) only when their ``imgsz``
equals the requested one; stores recorded for one split that were built from different images are refused
(:mod:`fastload.store.origin`). A ram store recorded in the yaml but absent from ``/dev/shm`` (after a
reboot) is rebuilt from the disk store, or from the source images when that is cheap.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from fastload.data.config import DataConfig, load_data_config
from fastload.data.images import LoadRule, check_load_rule
from fastload.store import shm
from fastload.store.base import IncompleteStoreError, Store, StoreError
from fastload.store.files import FileStore
from fastload.store.kinds import (
    AUTO_ORDER,
    IN_SHARDS,
    PARTIAL,
    REMOTE_KINDS,
    detect_kind,
    finish_hint,
    ram_segment_path,
    store_imgsz,
    store_kind,
    store_load_rule,
)
from fastload.store.objects.urls import is_url
from fastload.store.origin import check_one_source
from fastload.store.packed import RamStore
from fastload.store.rebuild import ram_builder

LOG = logging.getLogger(__name__)

def store_class(kind: str) -> type[Store]:
    """The class that reads stores of ``kind`` (one of :data:`fastload.store.kinds.KINDS`)."""
    return store_kind(kind).reader_class()


def open_store(
    data: Any,
    split: str = "train",
    kind: str = "auto",
    imgsz: int = 640,
    *,
    load_rule: LoadRule = "yolov9",
    **kwargs: Any,
) -> Store:
    """Open one split of a dataset as a store.

    Args:
      data: ``data.yaml`` path, dict, ``DataConfig``, or a store directory (lmdb / disk / ram, or a
        ``fastload convert`` output folder holding a ``data.yaml``), or ``s3://bucket/prefix[/data.yaml]`` of an
        uploaded store: one of the split's stores is streamed (:class:`fastload.store.stream.StreamingStore`; with
        ``upload_kind="auto"``, its ``disk`` store when it has one at ``imgsz``, else its ``encoded`` store).
      split: ``train``, ``val`` or ``test``.
      kind: ``auto`` or one of ``files | lmdb | encoded | disk | ram | gpu | stream``. ``ram`` on a yaml without a recorded
        ram store builds one in shared memory on demand (removed when the last user exits).
      imgsz: the training image size; decoded stores must match it.
      load_rule: the loaded-image rule (:data:`fastload.data.images.LoadRule`) decoded stores must have been
        made with: ``auto`` skips the others, a ram store built on demand has a segment per rule, and a decoded
        store asked for by kind or path that was made with another rule is refused (StoreError).
      kwargs: passed to the GPU store (``kind="gpu"``: ``device``, ``share``, ``chunk_bytes``, ``base``),
        ``build_index`` (``kind="files"``: ``cache``, ``workers``, ``progress``), the streamed store (``kind="stream"``:
        :class:`~fastload.store.stream.StreamingStore`'s keywords), or, for ``kind="disk" | "encoded" | "ram"``,
        ``shard_bytes`` and ``window``: the store is read in shards as a streamed copy of it is
        (:meth:`~fastload.store.packed.RecordFileStore.read_in_shards`), so its loader gives the stream's batches;
        any other keyword, or one with another kind (``auto`` takes none), raises TypeError.
    """
    # an unknown kind, or a keyword the kind does not take, fails here, before anything is opened
    takes = store_kind(kind).open_keywords if kind != "auto" else ()
    extra = [k for k in kwargs if k not in takes]
    if extra:
        raise TypeError(f"open_store(kind={kind!r}) takes no {', '.join(map(repr, extra))} keyword; "
                        + (f"it takes {', '.join(takes)}" if takes else "it takes none besides data, split, kind and imgsz"))
    check_load_rule(load_rule)
    if is_url(data):  # a store in object storage is streamed (or staged first: `fastload stage URL --to DIR`)
        if kind != "auto" and kind not in REMOTE_KINDS:
            raise StoreError(f"{data}: a store in object storage is read as {' or '.join(REMOTE_KINDS)} (or auto); "
                             f"for a {kind} store, stage it first: `fastload stage {data} --to DIR` and open "
                             f"DIR/data.yaml")
        remote = store_class(REMOTE_KINDS[0] if kind == "auto" else kind)(str(data), split, imgsz, **kwargs)
        try:
            remote.check_load_rule(load_rule)
        except StoreError:
            remote.close()
            raise
        return remote
    if kind in REMOTE_KINDS:
        raise StoreError(f"kind={kind!r} reads a store uploaded to object storage (s3://BUCKET/PREFIX), not {data!r}")
    if kwargs and takes == IN_SHARDS:
        local = open_store(data, split, kind, imgsz, load_rule=load_rule)
        local.read_in_shards(**kwargs)  # type: ignore[attr-defined]  # the kinds that take IN_SHARDS have it
        return local
    if kind == "gpu":
        return _open_gpu(data, split, imgsz, load_rule, **kwargs)

    if isinstance(data, (str, os.PathLike)) and Path(data).is_dir():
        root = Path(data)
        if (root / "data.yaml").is_file() and detect_kind(root) is None:
            return open_store(root / "data.yaml", split=split, kind=kind, imgsz=imgsz, load_rule=load_rule, **kwargs)
        return open_path(root, kind=kind, imgsz=imgsz, load_rule=load_rule)

    cfg = data if isinstance(data, DataConfig) else load_data_config(data)
    recorded = {k: Path(p) for k, p in cfg.stores.get(split, {}).items()}
    if kind == "files":
        return _files(cfg, split, **kwargs)
    # which store is picked must not change which images are loaded
    check_one_source(recorded, split, cfg.origin)
    if kind == "ram":
        return _open_ram(cfg, split, imgsz, load_rule, recorded, explicit=True)
    if kind in RECORDED_ONLY:
        check_recorded(cfg, split, kind)
        return open_path(recorded[kind], kind=kind, imgsz=imgsz, load_rule=load_rule)

    # auto
    for k in AUTO_ORDER:
        if k == "files":
            return _files(cfg, split, **kwargs)
        if k not in recorded:
            continue
        if store_kind(k).decoded and store_imgsz(recorded[k]) not in (None, imgsz):
            LOG.info("%s store %s is for another imgsz than %d; skipped", k, recorded[k], imgsz)
            continue
        if store_kind(k).decoded and store_load_rule(recorded[k]) not in (None, load_rule):
            LOG.info("%s store %s holds images of another loaded-image rule than %s's; skipped", k, recorded[k], load_rule)
            continue
        try:
            if k == "ram":
                return _open_ram(cfg, split, imgsz, load_rule, recorded, explicit=False)
            return open_path(recorded[k], kind=k, imgsz=imgsz, load_rule=load_rule)
        except StoreError as e:
            LOG.warning("%s store for split %r not used: %s", k, split, e)
    raise AssertionError("unreachable")


# the kinds open_store opens only where the yaml records one (``ram`` is built on demand, ``files`` read in place)
RECORDED_ONLY = ("disk", "lmdb", "encoded")


def check_recorded(cfg: DataConfig, split: str, kind: str) -> None:
    """Raise the StoreError :func:`open_store` raises for a ``kind`` of :data:`RECORDED_ONLY` that ``cfg`` records no
    store of for ``split``; nothing for the other kinds. It reads the config only and opens nothing, so that a caller
    with costly set-up before its loaders (the trainer builds its model first) can refuse such a run at once."""
    if kind in RECORDED_ONLY and kind not in cfg.stores.get(split, {}):
        raise StoreError(
            f"no {kind} store recorded for split {split!r} in {cfg.yaml_path or 'the data config'}; "
            f"create one with `fastload convert {cfg.yaml_path or 'data.yaml'} --to {kind}` and pass the "
            f"data.yaml it writes"
        )


def open_path(path: str | Path, kind: str = "auto", imgsz: int | None = None, load_rule: LoadRule | None = None) -> Store:
    """Open a store directory, detecting its kind (lmdb environment, encoded or packed layout); a decoded store of
    another ``imgsz`` or ``load_rule`` (None: any) than the ones given is refused."""
    path = Path(path)
    partial = path if path.name.endswith(PARTIAL) else path.with_name(path.name + PARTIAL)
    if path == partial:
        raise IncompleteStoreError(f"{path} is {finish_hint(partial)}")
    if partial.exists() and not path.exists():
        raise IncompleteStoreError(f"{path} was never finished: {partial} is {finish_hint(partial)}")
    if not path.exists():
        raise StoreError(f"no store at {path}")
    found = detect_kind(path)
    if found is None:
        raise StoreError(f"{path} is not a fastload store (no data.mdb or meta.json)")
    if kind not in ("auto", found) and not (kind == "disk" and found == "ram"):
        raise StoreError(f"{path} is a {found} store, not {kind}")
    store = store_class(found)(path)
    if not store.decoded:  # encoded images are resized to any imgsz, by any rule
        return store
    if imgsz is not None and store.imgsz != imgsz:
        store.close()
        raise StoreError(f"{path} holds images at imgsz {store.imgsz}, not the requested {imgsz}; convert again with --imgsz {imgsz}")
    if load_rule is not None:
        try:
            store.check_load_rule(load_rule)
        except StoreError:
            store.close()
            raise
    return store


def _files(cfg: DataConfig, split: str, **kwargs: Any) -> Store:
    if split not in cfg.splits:
        raise StoreError(f"split {split!r} is not defined in {cfg.yaml_path or 'the data config'}")
    return FileStore.from_config(cfg, split, **kwargs)


def _open_ram(cfg: DataConfig, split: str, imgsz: int, load_rule: LoadRule, recorded: dict[str, Path], *,
              explicit: bool) -> Store:
    seg = recorded.get("ram")
    if seg is not None and store_load_rule(seg) not in (None, load_rule):
        # a recorded ram store of the other rule is not this one: the rule's own segment, built on demand
        recorded = {k: p for k, p in recorded.items() if k != "ram"}
        seg = None
    seg = seg or ram_segment_path(cfg, split, imgsz, load_rule)
    size = store_imgsz(seg)
    if size is not None and size != imgsz:
        raise StoreError(f"ram store {seg} is for imgsz {size}, not {imgsz}; run `fastload convert --to ram --imgsz {imgsz}`")
    build = None
    if not shm.is_complete(seg):
        # A ram store asked for on a yaml that records none is built on demand; a recorded one that
        # vanished (reboot) is rebuilt from the disk store, or from the source only when that is cheap.
        build = ram_builder(cfg, split, imgsz, recorded, allow_decode=explicit and "ram" not in recorded,
                            load_rule=load_rule)
    try:
        return RamStore(seg, build=build)
    except StoreError as e:
        if build is None and not shm.is_complete(seg):
            raise StoreError(
                f"ram store {seg} for split {split!r} is not in shared memory (rebooted?) and rebuilding it "
                f"from the source images is not cheap; run `fastload convert {cfg.yaml_path or 'data.yaml'} "
                f"--to ram` (or --to disk, from which it is rebuilt quickly)"
            ) from e
        raise


def _open_gpu(data: Any, split: str, imgsz: int, load_rule: LoadRule, *, base: str = "auto", **kwargs: Any) -> Store:
    """``open_store(..., kind="gpu")``: fill a GpuStore from the best host store of ``data``.

    ``base`` picks the host store kind (default ``auto``: ram > disk > lmdb > files); ``kwargs`` go
    to :class:`fastload.store.gpu.GpuStore` (``device``, ``share``).
    """
    gpu_store = store_class("gpu")
    host = open_store(data, split=split, kind=base, imgsz=imgsz, load_rule=load_rule)
    try:
        return gpu_store(host, imgsz=imgsz, load_rule=load_rule, **kwargs)
    except BaseException:
        host.close()
        raise
