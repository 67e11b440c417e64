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
``FASTLOAD_CONVERT_DELAY`` (seconds per record) slows writing down for interruption tests.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from fastload.store.base import StoreError

KINDS = ("lmdb", "disk", "ram")
# Decoded (disk/ram) stores hold images shrunk once, with YOLOv9 validation's INTER_AREA: validation
# batches from them are the official ones bit for bit. YOLOv9 training shrinks with INTER_LINEAR, so
# training batches read from a decoded store differ slightly from the stock loader's (encoded stores
# are shrunk per mode, exactly as the official loader does). Recorded as meta["shrink"].
DECODED_SHRINK = "area"
COMMIT_EVERY = 64  # records per LMDB transaction: the most a kill can lose


# ----------------------------------------------------------------------------- helpers
def default_workers() -> int:
    return max(1, min(8, (os.cpu_count() or 1)))


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"


def free_bytes(path: Path) -> int:
    """Free bytes for an unprivileged writer on the filesystem holding ``path`` (or its nearest parent)."""
    p = Path(path)
    while not p.exists():
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


def check_space(path: Path, needed: int, what: str) -> None:
    """Raise StoreError naming needed vs free bytes when ``path``'s filesystem is too small."""
    free = free_bytes(path)
    if needed > free:
        raise StoreError(
            f"not enough space for {what} at {path}: needs about {fmt_bytes(needed)}, {fmt_bytes(free)} free"
        )


def check_memory(needed: int, what: str) -> None:
    """Raise StoreError when shared memory or available RAM cannot hold ``needed`` bytes."""
    import psutil

    from fastload.store import shm

    shm_free = free_bytes(shm.shm_root())
    avail = psutil.virtual_memory().available
    margin = 256 << 20  # leave room for the training process itself
    if needed + margin > min(shm_free, avail):
        raise StoreError(
            f"not enough memory for {what}: needs {fmt_bytes(needed)}, but {shm.shm_root()} has "
            f"{fmt_bytes(shm_free)} free and {fmt_bytes(avail)} RAM is available; use --to disk instead "
            f"(served from the page cache) or free memory"
        )


@contextlib.contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """Exclusive lock on ``out`` for one converter; a second one refuses at once."""
    lock_path = out / ".convert.lock"
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise StoreError(f"cannot write into {out} ({e.strerror or e}); choose another folder with --out") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            raise StoreError(
                f"another `fastload convert` (pid {other}) is writing into {out}; wait for it to finish"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)


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


def _delay() -> float:
    try:
        return float(os.environ.get("FASTLOAD_CONVERT_DELAY", "0") or 0)
    except ValueError:
        return 0.0


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
            buf = reencode(buf, max_side, quality, path)
        except Exception as e:  # a corrupt image is reported, never fatal
            return i, None, str(e), len(buf)
    return i, buf, None, len(buf)


def reencode(buf: bytes, max_side: int, quality: int, path: str | None = None) -> bytes:
    """Shrink an encoded image to ``max_side`` on its long side as JPEG ``quality``; small ones stay as they are."""
    import cv2

    from fastload.data.images import decode_image, probe_shape, resize_long_side

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
    from fastload.data.images import decode_image, resize_long_side

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
    with multiprocessing.get_context("fork").Pool(workers, initializer=_plain_worker_signals) as pool:
        yield from pool.imap(fn, tasks, chunksize=chunk)


def _plain_worker_signals() -> None:
    # A forked worker inherits its parent's Python signal handlers (e.g. `fastload bench` turns SIGTERM into
    # SystemExit to clean up). Pool.terminate() must simply kill the worker: a handler that runs instead can
    # leave it blocked on the task queue's lock and the terminate() hangs. Ctrl-C is the parent's to handle.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Progress:
    """A tqdm bar in images/s with MB/s of source data in its postfix."""

    def __init__(self, total: int, desc: str, enabled: bool, initial: int = 0) -> None:
        from tqdm import tqdm

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
def write_lmdb(
    index: Any,
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
    import lmdb

    from fastload.store.lmdb_store import LmdbWriter

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
        bar = Progress(len(files), f"lmdb {final.name}", progress, initial=len(writer.done))
        delay = _delay()
        batch: list[Any] = []
        try:
            for i, buf, err, nbytes in parallel_map(_encoded_task, tasks, workers):
                batch.append((i, buf, index.labels[i], index.shapes[i], files[i], err))
                if delay:
                    time.sleep(delay)
                if len(batch) >= (8 if delay else COMMIT_EVERY):
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
            "fastload_version": _version(),
        }
        return writer.commit(len(files), meta)
    except lmdb.Error as e:  # disk full, map errors: keep what is written and say how to go on
        writer.close()
        raise StoreError(f"writing {final.name} failed ({e}); free space if needed and rerun with --resume") from e
    except BaseException:
        writer.close()  # the partial environment stays for --resume
        raise


def write_packed(
    index: Any,
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
    from fastload.store.packed import PackedWriter, packed_nbytes

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
        "fastload_version": _version(),
    }
    writer = PackedWriter(final, imgsz=imgsz, names=names, meta=meta)
    skipped: list[tuple[str, str]] = []
    bar = Progress(len(files), f"{kind} {final.name}", progress)
    delay = _delay()
    try:
        for i, img, err, nbytes in parallel_map(_decoded_task, [(i, f, imgsz) for i, f in enumerate(files)], workers):
            if img is None:
                skipped.append((files[i], err or "undecodable"))
            else:
                writer.add(img, index.labels[i], index.shapes[i], files[i])
            if delay:
                time.sleep(delay)
            bar.update(1, nbytes)
        return writer.commit(), skipped
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()


def copy_packed(src: Path, dst: Path) -> Path:
    """Copy a finished packed store (e.g. disk -> /dev/shm) through a temporary sibling."""
    from fastload.store.packed import META, read_meta, replace_dir

    src, dst = Path(src), Path(dst)
    meta = read_meta(src)
    if str(dst).startswith(str(_shm_root())):
        check_memory(int(meta.get("pixel_bytes", 0)), f"ram store {dst.name}")
    else:
        check_space(dst.parent, _tree_size(src), f"copy of {src}")
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        if f.name != META and f.is_file():
            shutil.copyfile(f, tmp / f.name)
    meta["kind"] = "ram" if str(dst).startswith(str(_shm_root())) else meta.get("kind", "disk")
    meta["copied_from"] = str(src)
    (tmp / (META + ".tmp")).write_text(json.dumps(meta, indent=1))
    os.replace(tmp / (META + ".tmp"), tmp / META)
    replace_dir(tmp, dst)
    return dst


def _shm_root() -> Path:
    from fastload.store import shm

    return shm.shm_root()


def _tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _version() -> str:
    from fastload import __version__

    return __version__


# ----------------------------------------------------------------------------- ram stores
def build_ram(
    segment: Path,
    *,
    index: Any = None,
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
    _, skipped = write_packed(
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


def build_packed_from_source(cfg: Any, split: str, segment: Path, *, imgsz: int, kind: str = "ram") -> None:
    """Rebuild a packed store for ``split`` straight from the source images (used by open_store)."""
    index = scan(cfg, split, workers=default_workers(), progress=False)
    build_ram(segment, index=index, imgsz=imgsz, names=cfg.names, workers=default_workers(), progress=False)


def count_images(cfg: Any, split: str) -> int:
    """Number of images in a split (from a scan, which is cached by the data package)."""
    return len(scan(cfg, split, workers=default_workers(), progress=False).im_files)


def scan(cfg: Any, split: str, *, workers: int, progress: bool) -> Any:
    from fastload.data.index import build_index

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
    """
    from fastload.data.config import load_data_config

    cfg = load_data_config(data)
    kinds = _split_list(to)
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise StoreError(f"unknown store kind(s) {bad or to!r}; choose from {', '.join(KINDS)}")
    wanted = _split_list(splits) if splits else list(cfg.splits)
    missing = [s for s in wanted if s not in cfg.splits]
    if missing:
        raise StoreError(f"split(s) {missing} not in {cfg.origin} (it defines {', '.join(cfg.splits)})")
    if out is None:
        root = Path(cfg.root)
        # honour a folder marked read-only even for root, who could write into it anyway
        if root.is_dir() and not (root.stat().st_mode & 0o222 and os.access(root, os.W_OK)):
            raise StoreError(f"the dataset folder {root} is read-only; choose where the stores go with --out DIR")
    out_dir = Path(out) if out else Path(cfg.root) / "fastload"
    workers = default_workers() if workers is None else max(1, int(workers))

    stores: dict[str, dict[str, Path]] = {}
    reports: dict[str, Any] = {}
    skipped_all: list[tuple[str, str]] = []
    with output_lock(out_dir):
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
            for kind in kinds:
                path, skipped = _write_kind(
                    kind, cfg, name, index, out_dir, imgsz=imgsz, workers=workers, resume=resume,
                    max_side=max_side, quality=quality, progress=progress, log=log,
                )
                for f, why in skipped:
                    log(f"skipped {f}: {why}")
                skipped_all += skipped
                for s in group:
                    stores.setdefault(s, {})[kind] = path
                log(f"{kind} store for {'/'.join(group)}: {path}")
        yaml_path = write_yaml(cfg, out_dir, stores)
    log(f"wrote {yaml_path}")
    return ConvertResult(yaml_path, stores, reports, skipped_all)


def _write_kind(kind: str, cfg: Any, name: str, index: Any, out_dir: Path, *, imgsz: int, workers: int,
                resume: bool, max_side: int | None, quality: int, progress: bool,
                log: Callable[[str], None]) -> tuple[Path, list[tuple[str, str]]]:
    if kind == "lmdb":
        return write_lmdb(index, out_dir / f"{name}.lmdb", names=cfg.names, workers=workers, resume=resume,
                          max_side=max_side, quality=quality, progress=progress, log=log)
    if kind == "disk":
        return write_packed(index, out_dir / f"{name}-{imgsz}.disk", imgsz=imgsz, names=cfg.names,
                            workers=workers, progress=progress)
    # ram: pinned in shared memory until `fastload unstage` (or a reboot; open_store then rebuilds it)
    from fastload.store import shm
    from fastload.store.factory import ram_segment_path

    seg = ram_segment_path(cfg, name, imgsz)
    disk = out_dir / f"{name}-{imgsz}.disk"
    skipped: list[tuple[str, str]] = []
    with shm.locked(seg) as reg:
        reg.prune()
        if reg.pids and shm.is_complete(seg):
            log(f"ram store {seg} is in use by PIDs {reg.pids}; kept as it is")
            reg.pinned = True
            return seg, skipped
        shutil.rmtree(seg, ignore_errors=True)
        skipped = build_ram(seg, index=index, disk=disk if (disk / "meta.json").is_file() else None,
                            imgsz=imgsz, names=cfg.names, workers=workers, progress=progress)
        reg.pinned = True
        reg.info.update(created=time.time(), created_by=os.getpid(), source=str(cfg.origin))
    log(f"ram store pinned in shared memory ({fmt_bytes(_tree_size(seg))}); free it with `fastload unstage {seg}`")
    return seg, skipped


def _split_list(value: str | Sequence[str] | None) -> list[str]:
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else [x for v in value for x in str(v).split(",")]
    return [x.strip() for x in items if x.strip()]


def write_yaml(cfg: Any, out_dir: Path, stores: dict[str, dict[str, Path]]) -> Path:
    """Write ``out_dir/data.yaml``: the original keys with absolute paths, plus the merged ``fastload:`` key."""
    import yaml

    yaml_path = out_dir / "data.yaml"
    merged: dict[str, dict[str, str]] = {}
    if yaml_path.is_file():  # converting again into the same folder adds to what is there
        with contextlib.suppress(Exception):
            old = yaml.safe_load(yaml_path.read_text()) or {}
            for s, kinds in (old.get("fastload") or {}).items():
                merged[str(s)] = {str(k): str(v) for k, v in (kinds or {}).items()}
    for s, kinds in stores.items():
        for k, p in kinds.items():
            p = Path(p)
            # stores inside out_dir are written relative so the folder can be moved or staged
            rel = os.path.relpath(p, out_dir) if not str(p).startswith(str(_shm_root())) else str(p)
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
