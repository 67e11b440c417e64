"""``fastload convert``: build lmdb / disk / ram stores from a data.yaml, atomically and resumably.

For every requested split the dataset is scanned once (:func:`fastload.data.index.build_index`; its
report is printed with each problem once), then each store kind is written:

* ``lmdb`` - the encoded bytes, optionally re-encoded smaller (``max_side``/``quality``);
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
import json
import multiprocessing
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import cv2
import lmdb
import numpy as np
import yaml
from tqdm import tqdm

from fastload._version import __version__
from fastload.data.config import DataConfig, DataConfigError, load_data_config
from fastload.data.images import ShrinkFilter, decode_image, probe_shape, resize_long_side
from fastload.data.index import DatasetIndex, build_index
from fastload.store import shm
from fastload.store.base import StoreError
from fastload.store.kinds import (
    CONVERT_KINDS, PARTIAL, RESUMABLE_KINDS, detect_kind, finish_note_path, in_shm, ram_segment_path,
    write_finish_note,
)
from fastload.store.lmdb_store import LmdbWriter
from fastload.store.origin import source_fingerprint, store_source
from fastload.store.packed import META, PackedWriter, packed_nbytes, read_meta, replace_dir
from fastload.store.space import check_memory, check_space, fmt_bytes, tree_bytes

# Decoded (disk/ram) stores hold images shrunk once, with YOLOv9 validation's INTER_AREA: validation
# batches from them are the official ones bit for bit. YOLOv9 training shrinks with INTER_LINEAR, so
# training batches read from a decoded store differ slightly from the stock loader's (encoded stores
# are shrunk per mode, exactly as the official loader does). Recorded as meta["shrink"].
DECODED_SHRINK: ShrinkFilter = "area"
COMMIT_EVERY = 64  # records per LMDB transaction: the most a kill can lose


# ----------------------------------------------------------------------------- helpers
def default_workers() -> int:
    return max(1, min(8, (os.cpu_count() or 1)))


@contextlib.contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """Exclusive lock on ``out`` for one converter; a second one refuses at once. The lock file is removed
    when the holder finishes (while it still holds the lock), and so are the folders this call created
    when they are left empty (a conversion that failed before writing anything)."""
    lock_path = out / ".convert.lock"
    created = [d for d in (out, *out.parents) if not d.exists()]  # innermost first
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = shm.flock_current(lock_path, wait=False)
    except BlockingIOError as e:
        raise StoreError(
            f"another `fastload convert` (pid {e.args[0] or '?'}) is writing into {out}; wait for it to finish"
        ) from None
    except OSError as e:
        raise StoreError(f"cannot write into {out} ({e.strerror or e}); choose another folder with --out") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock_path)
        os.close(fd)
        for folder in created:
            try:
                folder.rmdir()
            except OSError:  # not empty (stores, an interrupted conversion, another writer's lock): kept
                break




# ----------------------------------------------------------------------------- worker tasks
def _encoded_task(task: tuple[int, str, int | None, int]) -> tuple[int, bytes | None, str | None, int]:
    """Read one file (re-encoding it smaller when its long side exceeds ``max_side``)."""
    i, path, max_side, quality = task
    try:
        buf = Path(path).read_bytes()
    except OSError as e:
        return i, None, f"cannot read: {e}", 0
    if max_side:
        try:
            buf = _reencode(buf, max_side, quality, path)
        except Exception as e:  # a corrupt image is reported, never fatal
            return i, None, str(e), len(buf)
    return i, buf, None, len(buf)


def _reencode(buf: bytes, max_side: int, quality: int, path: str | None = None) -> bytes:
    """Shrink an encoded image to ``max_side`` on its long side as JPEG ``quality``; small ones stay as they are."""
    h, w = probe_shape(buf, path)
    if max(h, w) <= max_side:
        return buf
    img = resize_long_side(decode_image(buf, path), max_side)
    ok, enc = cv2.imencode(".jpg", cv2.cvtColor(img, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, int(quality)])
    if not ok:
        raise StoreError(f"{path}: JPEG re-encode failed")
    return enc.tobytes()


def _decoded_task(task: tuple[int, str, int]) -> tuple[int, np.ndarray | None, str | None, int]:
    """Decode one file and resize it to its loaded shape (as YOLOv9's load_image)."""
    i, path, imgsz = task
    try:
        buf = Path(path).read_bytes()
        img = np.ascontiguousarray(resize_long_side(decode_image(buf, path), imgsz, shrink=DECODED_SHRINK))
    except Exception as e:
        return i, None, str(e), 0
    return i, img, None, len(buf)


def parallel_map(fn: Callable[[Any], Any], tasks: Sequence[Any], workers: int) -> Iterator[Any]:
    """``fn`` over ``tasks`` in order, in a process pool when ``workers > 1`` (chunked)."""
    if workers <= 1 or len(tasks) <= 1:
        yield from map(fn, tasks)
        return
    chunk = max(1, min(32, len(tasks) // (workers * 8)))
    pool = multiprocessing.get_context("fork").Pool(workers, initializer=_plain_worker_signals)
    try:
        yield from pool.imap(fn, tasks, chunksize=chunk)
    except BaseException:  # an error, Ctrl-C or an abandoned iteration: stop the workers now
        pool.terminate()
        raise
    # Finished: the workers exit on their own. Not terminate(): it holds the task queue's lock while it joins
    # workers it has sent SIGTERM, and a worker still starting (before its initializer) survives that
    # signal and then waits for the lock forever (seen in a loaded CI run).
    pool.close()
    pool.join()


def _plain_worker_signals() -> None:
    # A forked worker inherits its parent's Python signal handlers (e.g. `fastload bench` turns SIGTERM into
    # SystemExit to clean up). Pool.terminate() must simply kill the worker: a handler that runs instead can
    # leave it blocked on the task queue's lock and the terminate() hangs. Ctrl-C is the parent's to handle.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class _Progress:
    """A tqdm bar in images/s with MB/s of source data in its postfix."""

    def __init__(self, total: int, desc: str, enabled: bool, initial: int = 0) -> None:
        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="img", disable=not enabled, dynamic_ncols=True)
        self.t0 = time.perf_counter()
        self.bytes = 0
        self.last = 0.0

    def update(self, n: int, nbytes: int) -> None:
        self.bytes += nbytes
        self.bar.update(n)
        now = time.perf_counter()
        if now - self.last > 0.5:
            self.last = now
            self._show_rate(now)

    def _show_rate(self, now: float) -> None:
        self.bar.set_postfix_str(f"{self.bytes / max(now - self.t0, 1e-9) / 1e6:.1f} MB/s", refresh=False)

    def close(self) -> None:
        self._show_rate(time.perf_counter())  # the final rate, not the one sampled after the first image
        self.bar.close()


# ----------------------------------------------------------------------------- per-kind writers
def _write_lmdb(
    index: DatasetIndex,
    final: Path,
    *,
    names: Sequence[str],
    workers: int,
    resume: bool,
    max_side: int | None,
    quality: int,
    progress: bool,
    log: Callable[[str], None] = print,
) -> tuple[Path, list[tuple[str, str]]]:
    """Write one LMDB store from a scan index; returns its path and the images it had to skip."""
    files = list(index.im_files)
    src_bytes = sum(os.path.getsize(f) for f in files if os.path.exists(f))
    job = {"sources": source_fingerprint(files), "n": len(files), "max_side": max_side, "quality": quality if max_side else None}
    if not (resume and final.with_name(final.name + ".partial").exists()):
        check_space(final.parent, int(src_bytes * 1.1) + (16 << 20), f"LMDB store {final.name}")
    writer = LmdbWriter(final, job=job, map_size=int(src_bytes * 1.5) + (64 << 20), resume=resume)
    try:
        if writer.done:
            log(f"resuming {final.name}: {len(writer.done)} of {len(files)} records already written")
        todo = [i for i in range(len(files)) if i not in writer.done]
        tasks = [(i, files[i], max_side, quality) for i in todo]
        bar = _Progress(len(files), f"lmdb {final.name}", progress, initial=len(writer.done))
        batch: list[Any] = []
        try:
            for i, buf, err, nbytes in parallel_map(_encoded_task, tasks, workers):
                batch.append((i, buf, index.labels[i], index.shapes[i], files[i], err))
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
            "names": list(names),
            "source_hash": job["sources"],
            "source_files": len(files),
            "options": {"max_side": max_side, "quality": job["quality"]},
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "fastload_version": __version__,
        }
        return writer.commit(len(files), meta)
    except lmdb.Error as e:  # disk full, map errors: keep what is written and say how to go on
        writer.close()
        raise StoreError(f"writing {final.name} failed ({e}); free space if needed and rerun with --resume") from e
    except BaseException:
        writer.close()  # the partial environment stays for --resume
        raise


def _write_packed(
    index: DatasetIndex,
    final: Path,
    *,
    imgsz: int,
    names: Sequence[str],
    workers: int,
    progress: bool,
    kind: str = "disk",
    check: Callable[[int], None] | None = None,
) -> tuple[Path, list[tuple[str, str]]]:
    """Decode, resize and pack one split into a packed store at ``final``; returns it and skipped images."""
    files = list(index.im_files)
    needed = packed_nbytes(index.shapes, imgsz)
    if check is not None:
        check(needed)
    else:
        check_space(final.parent, needed + (16 << 20), f"{kind} store {final.name}")
    meta = {
        "kind": kind,
        "source_hash": source_fingerprint(files),
        "source_files": len(files),
        "options": {"imgsz": imgsz},
        "shrink": DECODED_SHRINK,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "fastload_version": __version__,
    }
    writer = PackedWriter(final, imgsz=imgsz, names=names, meta=meta)
    skipped: list[tuple[str, str]] = []
    bar = _Progress(len(files), f"{kind} {final.name}", progress)
    try:
        for i, img, err, nbytes in parallel_map(_decoded_task, [(i, f, imgsz) for i, f in enumerate(files)], workers):
            if img is None:
                skipped.append((files[i], err or "undecodable"))
            else:
                writer.add(img, index.labels[i], index.shapes[i], files[i])
            bar.update(1, nbytes)
        return writer.commit(), skipped
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()


def copy_packed(src: Path, dst: Path) -> Path:
    """Copy a finished packed store (e.g. disk -> /dev/shm) through a temporary sibling."""
    src, dst = Path(src), Path(dst)
    meta = read_meta(src)
    if in_shm(dst):
        check_memory(int(meta.get("pixel_bytes", 0)), f"ram store {dst.name}")
    else:
        check_space(dst.parent, tree_bytes(src), f"copy of {src}")
    tmp = dst.with_name(dst.name + ".partial")
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


# ----------------------------------------------------------------------------- ram stores
def _build_ram(
    segment: Path,
    *,
    index: DatasetIndex | None = None,
    disk: Path | None = None,
    imgsz: int,
    names: Sequence[str],
    workers: int,
    progress: bool,
) -> list[tuple[str, str]]:
    """Write a ram segment (copying ``disk`` when given, else decoding ``index``); checks memory first."""
    if disk is not None:
        copy_packed(disk, segment)
        return []
    _, skipped = _write_packed(
        index,
        segment,
        imgsz=imgsz,
        names=names,
        workers=workers,
        progress=progress,
        kind="ram",
        check=lambda n: check_memory(n, f"ram store {segment.name}"),
    )
    return skipped


def build_packed_from_source(cfg: DataConfig, split: str, segment: Path, *, imgsz: int, kind: str = "ram") -> None:
    """Rebuild a packed store for ``split`` straight from the source images (used by open_store)."""
    index = scan(cfg, split, workers=default_workers(), progress=False)
    _build_ram(segment, index=index, imgsz=imgsz, names=cfg.names, workers=default_workers(), progress=False)


def count_images(cfg: DataConfig, split: str) -> int:
    """Number of images in a split (from a scan, which is cached by the data package)."""
    return len(scan(cfg, split, workers=default_workers(), progress=False).im_files)


def scan(cfg: DataConfig, split: str, *, workers: int, progress: bool) -> DatasetIndex:
    return build_index(cfg, split, workers=workers, progress=progress)


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
      to: store kinds, a list or comma string of ``lmdb``, ``disk``, ``ram``.
      out: output folder (default ``<dataset root>/fastload``).
      imgsz: long side of decoded (disk/ram) images.
      splits: which splits (default: every split the yaml defines).
      workers: decode/encode processes (default: CPU count, at most 8).
      resume: continue an interrupted LMDB conversion instead of starting over.
      max_side, quality: re-encode LMDB images whose long side exceeds ``max_side`` as JPEG ``quality``.
      force: ``out`` holds the stores of another dataset, or stores built before the images changed that
        this run does not rewrite: remove them instead of refusing (a folder holds one dataset's stores).
    """
    cfg = load_data_config(data)
    kinds = _split_list(to)
    bad = [k for k in kinds if k not in CONVERT_KINDS]
    if bad or not kinds:
        raise StoreError(f"unknown store kind(s) {bad or to!r}; choose from {', '.join(CONVERT_KINDS)}")
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
            index = scan(cfg, name, workers=workers, progress=progress)
            report = index.report
            for s in group:
                reports[s] = report
            log(report.summary() if len(group) == 1 else f"{'/'.join(group)} (same images): {report.summary()}")
            if report.problems:
                log(report.format())
            _drop_stale_stores(kept, group, kinds, source_fingerprint(index.im_files), out_dir, cfg,
                               force=force, log=log)
            for kind in kinds:
                final = _store_path(kind, cfg, name, out_dir, imgsz)
                partial = final.with_name(final.name + PARTIAL)
                if kind != "ram":  # a ram store's partial is removed on any failure: nothing to finish
                    write_finish_note(partial, _finish_command(
                        cfg, kinds, out_dir, splits=wanted if splits else None, imgsz=imgsz, max_side=max_side,
                        quality=quality))
                try:
                    path, skipped = _write_kind(
                        kind, cfg, name, index, out_dir, imgsz=imgsz, workers=workers, resume=resume,
                        max_side=max_side, quality=quality, progress=progress, log=log,
                    )
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


def _store_path(kind: str, cfg: DataConfig, name: str, out_dir: Path, imgsz: int) -> Path:
    """Where the ``kind`` store of split group ``name`` goes (ram: its shared-memory segment)."""
    if kind == "lmdb":
        return out_dir / f"{name}.lmdb"
    if kind == "disk":
        return out_dir / f"{name}-{imgsz}.disk"
    return ram_segment_path(cfg, name, imgsz)


def _finish_command(cfg: DataConfig, kinds: Sequence[str], out_dir: Path, *, splits: Sequence[str] | None, imgsz: int,
                    max_side: int | None, quality: int) -> list[str]:
    """The command line that finishes this run after an interruption (see ``finish_hint``): the same stores,
    splits and options, with ``--resume`` when a kind can resume. Every kind and split the run was to write,
    not only the interrupted one: which ones had finished is not known when the note is written."""
    command = ["fastload", "convert", str(Path(cfg.yaml_path).resolve()) if cfg.yaml_path else "DATA.yaml",
               "--to", ",".join(kinds), "--out", str(out_dir.resolve())]
    if splits:
        command += ["--split", ",".join(splits)]
    if any(k != "lmdb" for k in kinds):
        command += ["--imgsz", str(imgsz)]
    if "lmdb" in kinds and max_side:
        command += ["--max-side", str(max_side), "--quality", str(quality)]
    return command + (["--resume"] if any(k in RESUMABLE_KINDS for k in kinds) else [])


def _write_kind(kind: str, cfg: DataConfig, name: str, index: DatasetIndex, out_dir: Path, *, imgsz: int, workers: int,
                resume: bool, max_side: int | None, quality: int, progress: bool,
                log: Callable[[str], None]) -> tuple[Path, list[tuple[str, str]]]:
    if kind == "lmdb":
        return _write_lmdb(index, _store_path(kind, cfg, name, out_dir, imgsz), names=cfg.names, workers=workers,
                           resume=resume, max_side=max_side, quality=quality, progress=progress, log=log)
    if kind == "disk":
        return _write_packed(index, _store_path(kind, cfg, name, out_dir, imgsz), imgsz=imgsz, names=cfg.names,
                             workers=workers, progress=progress)
    # ram: pinned in shared memory until `fastload unstage` (or a reboot; open_store then rebuilds it)
    seg = _store_path(kind, cfg, name, out_dir, imgsz)
    disk = _store_path("disk", cfg, name, out_dir, imgsz)
    skipped: list[tuple[str, str]] = []
    with shm.locked(seg) as reg:
        reg.prune()
        if reg.pids and shm.is_complete(seg):
            held = store_source(seg)
            if held is not None and held.source_hash != source_fingerprint(index.im_files):
                raise StoreError(f"ram store {seg} holds other images than {cfg.origin} lists now and is in use by "
                                 f"PIDs {reg.pids}; stop them (or `fastload unstage --force {seg}`) and convert again")
            log(f"ram store {seg} is in use by PIDs {reg.pids}; kept as it is")
            reg.pinned = True
            return seg, skipped
        shutil.rmtree(seg, ignore_errors=True)
        skipped = _build_ram(seg, index=index, disk=disk if (disk / "meta.json").is_file() else None,
                            imgsz=imgsz, names=cfg.names, workers=workers, progress=progress)
        reg.pinned = True
        reg.info.update(created=time.time(), created_by=os.getpid(), source=str(cfg.origin))
    log(f"ram store pinned in shared memory ({fmt_bytes(tree_bytes(seg))}); free it with `fastload unstage {seg}`")
    return seg, skipped


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
