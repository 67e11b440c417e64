"""``fastload convert``: build lmdb / encoded / disk / ram stores from a data.yaml, atomically and resumably.

For every requested split the dataset is scanned once (:func:`fastload.data.index.build_index`; its
report is printed with each problem once), then each store kind is written:

* ``lmdb`` - the encoded bytes, optionally re-encoded smaller (``max_side``/``quality``);
* ``encoded`` - the same bytes back to back in one file (:mod:`fastload.store.encoded`): streamable in byte ranges;
  resumable with ``resume=True`` after an interrupted run;
* ``disk`` - decoded images at ``imgsz`` packed into one file (:mod:`fastload.store.packed`);
* ``ram``  - the same packed layout in ``/dev/shm``, pinned until ``fastload unstage``.

Everything is written into a ``.partial`` sibling and renamed at the end, so an interrupted run
(Ctrl-C, ``kill -9``, disk full) never leaves a store that opens. Splits whose sources are identical
(coco128's train and val) share one store. A new ``data.yaml`` beside the stores keeps the
original keys (so the official YOLOv9 code still reads it) and adds ``fastload: {split: {kind: path}}``.

Decoding/encoding runs in a ``multiprocessing`` pool (``workers``), writing in the main process.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import yaml

from fastload.data.config import DataConfig, DataConfigError, load_data_config
from fastload.data.images import LoadRule, check_load_rule
from fastload.data.index import build_index
from fastload.store import shm
from fastload.store.base import StoreError
from fastload.store.kinds import (
    CONVERT_KINDS, ENCODED_KINDS, PARTIAL, RESUMABLE_KINDS, WriteJob, detect_kind, finish_note_path, in_shm, store_kind,
    write_finish_note,
)
from fastload.store.origin import source_fingerprint, store_source
from fastload.store.writing import default_workers


# ----------------------------------------------------------------------------- helpers
@contextlib.contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """Exclusive lock on ``out`` for one converter; a second one refuses at once. The lock file is removed
    when the holder finishes (while it still holds the lock), and so are the folders this call created
    when they are left empty (a conversion that failed before writing anything)."""
    lock_path = out / ".convert.lock"
    created = [d for d in (out, *out.parents) if not d.exists()]  # innermost first
    try:
        out.mkdir(parents=True, exist_ok=True)
        holder = shm.OneHolder(lock_path)
    except BlockingIOError as e:
        raise StoreError(
            f"another `fastload convert` (pid {e.args[0] or '?'}) is writing into {out}; wait for it to finish"
        ) from None
    except OSError as e:
        raise StoreError(f"cannot write into {out} ({e.strerror or e}); choose another folder with --out") from None
    try:
        with holder:
            yield
    finally:
        for folder in created:
            try:
                folder.rmdir()
            except OSError:  # not empty (stores, an interrupted conversion, another writer's lock): kept
                break


# ----------------------------------------------------------------------------- the whole conversion
@dataclasses.dataclass
class ConvertResult:
    """What a conversion wrote: the new yaml, ``{split: {kind: path}}``, and per-split scan reports."""

    yaml_path: Path
    stores: dict[str, dict[str, Path]]
    reports: dict[str, Any]
    skipped: list[tuple[str, str]]

def convert(
    data: Any,
    to: str | Sequence[str] = ("lmdb",),
    *,
    out: str | Path | None = None,
    imgsz: int = 640,
    load_rule: LoadRule = "yolov9",
    splits: str | Sequence[str] | None = None,
    workers: int | None = None,
    resume: bool = False,
    max_side: int | None = None,
    quality: int = 90,
    progress: bool = True,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> ConvertResult:
    """Convert a dataset into stores and write ``<out>/data.yaml`` pointing at them.

    Args:
      data: data.yaml path, dict or DataConfig.
      to: store kinds, a list or comma string of ``lmdb``, ``encoded``, ``disk``, ``ram``.
      out: output folder (default ``<dataset root>/fastload``).
      imgsz: long side of decoded (disk/ram) images.
      load_rule: whose loaded-image rule decoded (disk/ram) images are made with (:data:`fastload.data.images.LoadRule`):
        ``yolov9`` or ``ultralytics`` (the loader of the recipe of that name reads only a store of its rule).
      splits: which splits (default: every split the yaml defines).
      workers: decode/encode processes (default: CPU count, at most 8).
      resume: continue an interrupted LMDB conversion instead of starting over.
      max_side, quality: re-encode the images of lmdb and encoded stores whose long side exceeds ``max_side`` as
        JPEG ``quality`` (refused with only decoded kinds).
      force: ``out`` holds the stores of another dataset, or stores built before the images changed that
        this run does not rewrite: remove them instead of refusing (a folder holds one dataset's stores).
    """
    cfg = load_data_config(data)
    check_load_rule(load_rule)
    kinds = _split_list(to)
    bad = [k for k in kinds if k not in CONVERT_KINDS]
    if bad or not kinds:
        raise StoreError(f"unknown store kind(s) {bad or to!r}; choose from {', '.join(CONVERT_KINDS)}")
    if max_side and not any(k in ENCODED_KINDS for k in kinds):
        raise StoreError(f"max_side={max_side} re-encodes the images of {' and '.join(ENCODED_KINDS)} stores, and "
                         f"{', '.join(kinds)} stores hold decoded images at imgsz={imgsz}; drop max_side")
    wanted = _split_list(splits) if splits else list(cfg.splits)
    missing = [s for s in wanted if s not in cfg.splits]
    if missing:
        raise StoreError(f"split(s) {missing} not in {cfg.origin} (it defines {', '.join(cfg.splits)})")
    out_dir = output_folder(cfg, out)
    workers = default_workers() if workers is None else max(1, int(workers))

    stores: dict[str, dict[str, Path]] = {}
    reports: dict[str, Any] = {}
    skipped_all: list[tuple[str, str]] = []
    with output_lock(out_dir):
        kept = _stores_of_same_dataset(out_dir, cfg, force=force, log=log)
        groups: dict[tuple[str, ...], list[str]] = {}
        for s in wanted:  # splits with identical sources share one store
            groups.setdefault(tuple(str(p) for p in cfg.splits[s]), []).append(s)
        for group in groups.values():
            name = group[0]
            log(f"scanning {'/'.join(group)} ...")
            index = build_index(cfg, name, workers=workers, progress=progress)
            # every check and every store of this group uses this one fingerprint (a stat of each source image)
            job = WriteJob(cfg=cfg, name=name, index=index, source_hash=source_fingerprint(index.im_files),
                           out_dir=out_dir, imgsz=imgsz, workers=workers, progress=progress, resume=resume,
                           max_side=max_side, quality=quality, log=log, load_rule=load_rule)
            report = index.report
            for s in group:
                reports[s] = report
            log(report.summary() if len(group) == 1 else f"{'/'.join(group)} (same images): {report.summary()}")
            if report.problems:
                log(report.format())
            _drop_stale_stores(kept, group, kinds, job.source_hash, out_dir, cfg, force=force, log=log)
            for kind in kinds:
                final = store_kind(kind).path(cfg, name, out_dir, imgsz, load_rule)
                partial = final.with_name(final.name + PARTIAL)
                if kind != "ram":  # a ram store's partial is removed on any failure: nothing to finish
                    write_finish_note(partial, _finish_command(
                        cfg, kinds, out_dir, splits=wanted if splits else None, imgsz=imgsz, max_side=max_side,
                        quality=quality, load_rule=load_rule))
                try:
                    path, skipped = store_kind(kind).write(job, final)
                finally:
                    if not partial.exists():  # finished, or removed on failure: the note has nothing to finish
                        finish_note_path(partial).unlink(missing_ok=True)
                for f, why in skipped:
                    log(f"skipped {f}: {why}")
                skipped_all += skipped
                for s in group:
                    stores.setdefault(s, {})[kind] = path
                log(f"{kind} store for {'/'.join(group)}: {path}")
        for split, by_kind in stores.items():  # what this run wrote replaces what the folder held
            kept.setdefault(split, {}).update(by_kind)
        yaml_path = _write_yaml(cfg, out_dir, kept)
    log(f"wrote {yaml_path}")
    return ConvertResult(yaml_path, stores, reports, skipped_all)

def output_folder(cfg: DataConfig, out: str | Path | None) -> Path:
    """Where :func:`convert` writes: ``out``, else ``<dataset root>/fastload`` (refused when the dataset folder
    is read-only)."""
    if out is not None:
        return Path(out)
    root = Path(cfg.root)
    # honour a folder marked read-only even for root, who could write into it anyway
    if root.is_dir() and not (root.stat().st_mode & 0o222 and os.access(root, os.W_OK)):
        raise StoreError(f"the dataset folder {root} is read-only; choose where the stores go with --out DIR")
    return root / "fastload"

def _finish_command(cfg: DataConfig, kinds: Sequence[str], out_dir: Path, *, splits: Sequence[str] | None, imgsz: int,
                    max_side: int | None, quality: int, load_rule: LoadRule = "yolov9") -> list[str]:
    """The command line that finishes this run after an interruption (see ``finish_hint``): the same stores,
    splits and options, with ``--resume`` when a kind can resume. Every kind and split the run was to write,
    not only the interrupted one: which ones had finished is not known when the note is written."""
    command = ["fastload", "convert", str(Path(cfg.yaml_path).resolve()) if cfg.yaml_path else "DATA.yaml",
               "--to", ",".join(kinds), "--out", str(out_dir.resolve())]
    if splits:
        command += ["--split", ",".join(splits)]
    if any(store_kind(k).decoded for k in kinds):
        command += ["--imgsz", str(imgsz)] + ([] if load_rule == "yolov9" else ["--load-rule", load_rule])
    if max_side:
        command += ["--max-side", str(max_side), "--quality", str(quality)]
    return command + (["--resume"] if any(k in RESUMABLE_KINDS for k in kinds) else [])

def _split_list(value: str | Sequence[str] | None) -> list[str]:
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else [x for v in value for x in str(v).split(",")]
    return [x.strip() for x in items if x.strip()]

def _write_yaml(cfg: DataConfig, out_dir: Path, stores: dict[str, dict[str, Path]]) -> Path:
    """Write ``out_dir/data.yaml``: the original keys with absolute paths, plus ``fastload: {split: {kind: path}}``
    listing ``stores`` (the caller merges in what the folder already held)."""
    yaml_path = out_dir / "data.yaml"
    merged: dict[str, dict[str, str]] = {}
    for s, kinds in stores.items():
        for k, p in kinds.items():
            p = Path(p)
            # stores inside out_dir are written relative so the folder can be moved or staged
            rel = os.path.relpath(p, out_dir) if not in_shm(p) else str(p)
            merged.setdefault(s, {})[k] = rel
    raw = {k: v for k, v in dict(cfg.raw).items() if k != "fastload"}
    raw["path"] = str(Path(cfg.root).resolve())
    for s, sources in cfg.splits.items():
        vals = [str(Path(p).resolve()) for p in sources]
        raw[s] = vals[0] if len(vals) == 1 else vals
    raw["names"] = list(cfg.names)
    raw["nc"] = int(cfg.nc)
    raw["fastload"] = merged
    tmp = yaml_path.with_name(yaml_path.name + f".tmp{os.getpid()}")
    tmp.write_text(
        "# written by `fastload convert`: the original dataset keys plus the stores under `fastload:`\n"
        + yaml.safe_dump(raw, sort_keys=False, allow_unicode=True)
    )
    os.replace(tmp, yaml_path)
    return yaml_path

# ----------------------------------------------------------------------------- one dataset per folder
def _dataset_key(cfg: DataConfig) -> tuple[str, dict[str, list[str]]]:
    """What identifies a dataset: its root and the resolved sources of each split."""
    return (str(Path(cfg.root).resolve()),
            {s: [str(Path(p).resolve()) for p in sources] for s, sources in cfg.splits.items()})

def _stores_of_same_dataset(out_dir: Path, cfg: DataConfig, *, force: bool,
                            log: Callable[[str], None]) -> dict[str, dict[str, Path]]:
    """The stores ``out_dir/data.yaml`` records, when they belong to ``cfg``'s dataset.

    A folder holding another dataset's stores is refused (converting into it would mix the two), or
    with ``force`` emptied of them. An unreadable yaml records nothing (it is rewritten).
    """
    yaml_path = out_dir / "data.yaml"
    if not yaml_path.is_file():
        return {}
    try:
        old = load_data_config(yaml_path)
    except DataConfigError:
        return {}
    old_root, old_splits = _dataset_key(old)
    new_root, new_splits = _dataset_key(cfg)
    same = old_root == new_root and all(old_splits[s] == new_splits[s] for s in old_splits.keys() & new_splits.keys())
    if same:
        return {s: dict(kinds) for s, kinds in old.stores.items()}
    if not force:
        raise StoreError(
            f"{out_dir} holds the stores of another dataset ({old_root}); converting {cfg.origin} into it would mix "
            f"the two. Choose another --out, or pass --force to replace every store in it"
        )
    for kinds in old.stores.values():
        for kind, path in kinds.items():
            _remove_store(path, out_dir, log)
    yaml_path.unlink()
    return {}

def _drop_stale_stores(kept: dict[str, dict[str, Path]], group: Sequence[str], writing: Sequence[str],
                       source_hash: str, out_dir: Path, cfg: DataConfig, *, force: bool,
                       log: Callable[[str], None]) -> None:
    """Refuse (or with ``force`` remove) the stores of ``group`` that this run does not rewrite and that were
    built from other images than the ones just scanned; ``kept`` loses them."""
    stale: dict[str, Path] = {}
    for split in group:
        for kind, path in kept.get(split, {}).items():
            src = store_source(path) if kind not in writing else None
            if src is not None and src.source_hash != source_hash:
                stale[kind] = path
    if not stale:
        return
    if not force:
        every = ",".join(dict.fromkeys([*writing, *stale]))
        raise StoreError(
            f"the {' and '.join(stale)} store(s) of {'/'.join(group)} in {out_dir} were built from other images than "
            f"{cfg.origin} lists now (the dataset changed since); rebuild them too (--to {every}) or pass --force "
            f"to remove them"
        )
    for kind, path in stale.items():
        _remove_store(path, out_dir, log)
        for split in group:
            kept.get(split, {}).pop(kind, None)

def _remove_store(path: Path, out_dir: Path, log: Callable[[str], None]) -> None:
    """Remove one store a replaced folder recorded: a ram segment, or a store folder inside ``out_dir``."""
    path = Path(path)
    if in_shm(path):
        if path.exists():
            shm.remove(path)
            log(f"removed ram store {path}")
        return
    inside = Path(os.path.abspath(path)).is_relative_to(Path(os.path.abspath(out_dir)))
    if inside and detect_kind(path) is not None:
        shutil.rmtree(path)
        log(f"removed {path}")
    elif path.exists():
        log(f"left {path} alone (not a store inside {out_dir})")
