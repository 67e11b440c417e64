"""Scan a split into a :class:`DatasetIndex`: image list, validated labels, original shapes, report.

Each image is checked cheaply (header probe for the EXIF-aware shape, plus the JPEG end-of-image
marker) or fully decoded with ``verify="full"``; its label file is parsed and validated. Corrupt
samples are skipped and counted, never fatal. Results are cached in a ``.npz`` (no pickle) beside
the labels folder -- ``labels/train2017.fastload.cache`` -- or in the user cache directory
(``$FASTLOAD_CACHE_DIR``, else ``$XDG_CACHE_HOME/fastload``, else ``~/.cache/fastload``) when that
folder is read-only. The cache key covers every image and label file's path, size and mtime,
``nc`` and the verify mode, so any change triggers a rescan.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Literal

import numpy as np
from tqdm import tqdm

from fastload.data.config import DataConfig, DataConfigError, load_data_config
from fastload.data.images import (
    IMG_FORMATS,
    CorruptImageError,
    decode_image,
    jpeg_first_scan,
    jpeg_is_complete,
    probe_header,
)
from fastload.data.labels import Problem, img2label_path, read_label_file

__all__ = ["DatasetIndex", "ScanReport", "Problem", "build_index", "list_images", "user_cache_dir"]

_log = logging.getLogger("fastload.data")

CACHE_VERSION = "fastload-index-1"
CACHE_SUFFIX = ".fastload.cache"
_HEAD_BYTES = 1 << 16  # enough for the header (and EXIF) of almost every JPEG
_TAIL_BYTES = 1 << 12

# the format a file suffix promises (a mismatch is noted, the file still used)
_SUFFIX_FORMAT = {"jpg": "jpeg", "jpeg": "jpeg", "mpo": "jpeg", "png": "png", "bmp": "bmp", "webp": "webp",
                  "tif": "tiff", "tiff": "tiff", "dng": "tiff", "pfm": "pfm"}

# per-sample label state
_FOUND, _MISSING, _EMPTY = 0, 1, 2


@dataclass
class ScanReport:
    """Counts and problems of one split scan.

    ``found`` / ``missing`` / ``empty``: images whose label file exists / does not exist
    (background) / has no valid rows; ``corrupt``: images skipped; ``duplicate``: duplicate label
    rows and duplicate image entries removed; ``rows_dropped``: invalid label rows removed;
    ``labels_without_image``: label files in a scanned labels folder with no image.
    """

    split: str = ""
    images: int = 0
    found: int = 0
    missing: int = 0
    empty: int = 0
    corrupt: int = 0
    duplicate: int = 0
    rows_dropped: int = 0
    labels_without_image: int = 0
    problems: list[Problem] = field(default_factory=list)
    cache_hit: bool = False
    cache_path: str | None = None

    def summary(self) -> str:
        """One line: the counts and where the cache is."""
        kept = self.images - self.corrupt
        cache = f"cache {'hit' if self.cache_hit else 'written'}: {self.cache_path}" if self.cache_path else "no cache"
        return (
            f"{self.split or 'scan'}: {kept} images ({self.found} labelled, {self.missing} without label file, "
            f"{self.empty} empty), {self.corrupt} corrupt skipped, {self.duplicate} duplicates removed, "
            f"{self.rows_dropped} bad label rows dropped, {self.labels_without_image} labels without image; {cache}"
        )

    def format(self) -> str:
        """One line per problem (empty string when clean)."""
        return "\n".join(str(p) for p in self.problems)

    def by_kind(self) -> dict[str, int]:
        """Number of problems of each kind."""
        out: dict[str, int] = {}
        for p in self.problems:
            out[p.kind] = out.get(p.kind, 0) + 1
        return out


@dataclass
class DatasetIndex:
    """The usable samples of a split: parallel lists/arrays in sorted image order."""

    im_files: list[str]
    label_files: list[str]
    labels: list[np.ndarray]
    shapes: np.ndarray
    names: list[str]
    report: ScanReport

    def __len__(self) -> int:
        return len(self.im_files)


# ----------------------------------------------------------------------------- listing
def _is_image(name: str) -> bool:
    return name.rsplit(".", 1)[-1].lower() in IMG_FORMATS and "." in name


def _walk_images(folder: Path) -> Iterable[str]:
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames.sort()
        for name in filenames:
            if _is_image(name):
                yield os.path.join(dirpath, name)


def _read_list_file(list_file: Path, origin: str) -> Iterable[str]:
    """Image paths of a .txt list; relative entries resolve against the list's folder (YOLOv5 ``./x``)."""
    try:
        text = list_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataConfigError(f"{origin}: cannot read image list {list_file} ({exc})") from None
    parent = list_file.parent
    for line in text.splitlines():
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        p = os.path.expanduser(entry)
        if not os.path.isabs(p):
            beside = os.path.normpath(parent / p)
            # YOLOv5 only rewrites `./x`; other relative entries it reads from the cwd. Prefer the
            # list's folder, keep the cwd reading when only that one exists.
            p = beside if os.path.exists(beside) or not os.path.exists(p) else os.path.abspath(p)
        yield p


def list_images(sources: list[Path], origin: str = "<data>", key: str = "split") -> list[str]:
    """Sorted image paths from folders, .txt lists or single image files; raises when a source is missing."""
    files: list[str] = []
    for src in sources:
        if src.is_dir():
            files.extend(_walk_images(src))
        elif src.is_file() and src.suffix.lower() == ".txt":
            files.extend(p for p in _read_list_file(src, origin) if _is_image(p))
        elif src.is_file() and _is_image(src.name):
            files.append(str(src))
        else:
            raise DataConfigError(f"{origin}: '{key}' source {src} does not exist (want a folder or .txt list)")
    return sorted(files)


def _orphan_labels(sources: list[Path], label_files: set[str]) -> list[str]:
    """Label files under the labels folder of each folder source that match no image."""
    orphans: list[str] = []
    for src in sources:
        if not src.is_dir():
            continue
        label_dir = Path(img2label_path(str(src) + os.sep + "x")).parent
        if label_dir == src or not label_dir.is_dir():
            continue
        for dirpath, _, filenames in os.walk(label_dir):
            for name in filenames:
                if name.endswith(".txt"):
                    p = os.path.join(dirpath, name)
                    if p not in label_files:
                        orphans.append(p)
    return sorted(orphans)


# ----------------------------------------------------------------------------- per-sample check
@dataclass
class _Sample:
    im_file: str
    label_file: str
    ok: bool = True
    shape: tuple[int, int] = (0, 0)
    labels: np.ndarray = field(default_factory=lambda: np.zeros((0, 5), np.float32))
    state: int = _MISSING
    duplicates: int = 0
    rows_dropped: int = 0
    problems: list[Problem] = field(default_factory=list)


def _read_head_tail(path: str, size: int) -> tuple[bytes, bytes | None]:
    """The whole file when small; otherwise its first 64 KiB and last 4 KiB."""
    with open(path, "rb") as f:
        if size <= _HEAD_BYTES + _TAIL_BYTES:
            return f.read(), None
        head = f.read(_HEAD_BYTES)
        f.seek(-_TAIL_BYTES, os.SEEK_END)
        return head, f.read()


def _check_image(path: str, size: int, verify: str) -> tuple[tuple[int, int], list[Problem]]:
    """Shape (after EXIF) of a usable image plus notes; raises CorruptImageError when it is not usable."""
    notes: list[Problem] = []
    if size == 0:
        raise CorruptImageError(path, "empty file (0 bytes)")
    try:
        head, tail = _read_head_tail(path, size) if verify != "full" else (Path(path).read_bytes(), None)
    except OSError as exc:
        raise CorruptImageError(path, f"cannot read file ({exc.strerror or exc})") from None
    try:
        fmt, h, w, orientation = probe_header(head, path)
    except CorruptImageError:
        if tail is None:
            raise
        head, tail = Path(path).read_bytes(), None  # header larger than 64 KiB: read it all
        fmt, h, w, orientation = probe_header(head, path)
    if fmt == "jpeg":
        if tail is None:
            complete = jpeg_is_complete(head)
        else:  # an EOI in the last 4 KiB, after the first scan, ends the image
            sos, eoi = jpeg_first_scan(head), tail.rfind(b"\xff\xd9")
            complete = sos > 0 and eoi >= 0 and size - len(tail) + eoi > sos
            if not complete:  # a long trailer after EOI, or a huge header: look at the whole file
                complete = jpeg_is_complete(Path(path).read_bytes())
        if not complete:
            raise CorruptImageError(path, "truncated JPEG (no end-of-image marker after the last scan)")
    elif fmt == "png" and (tail if tail is not None else head).rfind(b"IEND", -64) < 0:
        raise CorruptImageError(path, "truncated PNG (no IEND chunk at the end)")
    if min(h, w) < 10:  # YOLOv9's verify_image_label rejects these too
        raise CorruptImageError(path, f"image size {w}x{h} is below 10 pixels")
    if verify == "full":
        decode_image(head, path)
    suffix = path.rsplit(".", 1)[-1].lower()
    if _SUFFIX_FORMAT.get(suffix, fmt) != fmt:
        notes.append(Problem(path, "format_mismatch", f"file named .{suffix} is really {fmt.upper()} (decoded as {fmt})"))
    shape = (w, h) if orientation >= 5 else (h, w)
    return shape, notes


def _scan_one(im_file: str, im_size: int, label_file: str, label_exists: bool, nc: int, verify: str) -> _Sample:
    s = _Sample(im_file, label_file)
    try:
        s.shape, notes = _check_image(im_file, im_size, verify)
        s.problems.extend(notes)
    except CorruptImageError as exc:
        s.ok = False
        s.problems.append(Problem(im_file, "corrupt_image", exc.reason))
        return s
    if label_exists:
        res = read_label_file(label_file, nc)
        s.problems.extend(res.problems)
        if any(p.kind == "label_unreadable" for p in res.problems):
            s.ok = False  # unknown labels: training on it as background would be wrong
            return s
        s.labels, s.duplicates, s.rows_dropped = res.labels, res.duplicates, res.rows_dropped
        s.state = _FOUND if len(res.labels) else _EMPTY
    return s


# ----------------------------------------------------------------------------- cache
def user_cache_dir() -> Path:
    """``$FASTLOAD_CACHE_DIR``, else ``$XDG_CACHE_HOME/fastload``, else ``~/.cache/fastload``."""
    env = os.environ.get("FASTLOAD_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "fastload" if xdg else Path.home() / ".cache" / "fastload"


def _cache_candidates(label_dir: Path, tag: str) -> tuple[Path, Path]:
    """(beside the labels folder, in the user cache dir) for one labels folder."""
    name = label_dir.name + tag + CACHE_SUFFIX
    beside = label_dir.parent / name
    digest = hashlib.sha1(str(label_dir).encode()).hexdigest()[:12]
    return beside, user_cache_dir() / f"{digest}-{name}"


def _load_cache(path: Path, key: str) -> dict | None:
    try:
        with np.load(path, allow_pickle=False) as z:
            if str(z["version"]) != CACHE_VERSION or str(z["key"]) != key:
                return None
            return {k: z[k] for k in z.files}
    except (OSError, ValueError, KeyError, EOFError):
        return None


def _read_only(folder: Path) -> bool:
    """True for a folder we must not write: no access, or no write bit for anyone.

    The mode-bit test matters when running as root, where ``os.access`` always says yes: a
    dataset folder made read-only on purpose (``chmod a-w``) is left untouched.
    """
    try:
        mode = folder.stat().st_mode
    except OSError:
        return False  # does not exist yet: mkdir decides
    return not os.access(folder, os.W_OK) or not (mode & 0o222)


def _save_cache(paths: tuple[Path, Path], arrays: dict[str, np.ndarray]) -> Path | None:
    """Write atomically (tmp + os.replace) to the first writable location; None when neither is."""
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    data = buf.getvalue()
    for target in paths:
        if _read_only(target.parent):
            continue
        tmp = None
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)  # mkstemp makes 0600; other users of the dataset may read it
            os.replace(tmp, target)
            return target
        except OSError:
            if tmp is not None and os.path.exists(tmp):
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
    return None


def _stat(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def _cache_key(im_files: list[str], im_stats: list, label_files: list[str], label_stats: list, nc: int, verify: str) -> str:
    h = hashlib.sha1(f"{CACHE_VERSION}|nc={nc}|verify={verify}\n".encode())
    for f, s, lf, ls in zip(im_files, im_stats, label_files, label_stats):
        h.update(f"{f}\t{s}\t{lf}\t{ls}\n".encode())
    return h.hexdigest()


def _samples_to_arrays(samples: list[_Sample], key: str) -> dict[str, np.ndarray]:
    labels = [s.labels for s in samples]
    return {
        "version": np.array(CACHE_VERSION),
        "key": np.array(key),
        "im_files": np.array([s.im_file for s in samples], dtype=str),
        "label_files": np.array([s.label_file for s in samples], dtype=str),
        "ok": np.array([s.ok for s in samples], dtype=bool),
        "state": np.array([s.state for s in samples], dtype=np.int8),
        "shapes": np.array([s.shape for s in samples], dtype=np.int32).reshape(-1, 2),
        "counts": np.array([len(x) for x in labels], dtype=np.int64),
        "labels": np.concatenate(labels, 0) if labels else np.zeros((0, 5), np.float32),
        "duplicates": np.array([s.duplicates for s in samples], dtype=np.int32),
        "rows_dropped": np.array([s.rows_dropped for s in samples], dtype=np.int32),
        "problems": np.array(json.dumps([[s_.path, s_.kind, s_.message] for s in samples for s_ in s.problems])),
    }


def _arrays_to_samples(z: dict) -> list[_Sample]:
    problems: dict[str, list[Problem]] = {}
    for path, kind, message in json.loads(str(z["problems"])):
        problems.setdefault(path, []).append(Problem(path, kind, message))
    bounds = np.concatenate([[0], np.cumsum(z["counts"])])
    out = []
    for i, (im, lf) in enumerate(zip(z["im_files"].tolist(), z["label_files"].tolist())):
        s = _Sample(im, lf, bool(z["ok"][i]), tuple(int(v) for v in z["shapes"][i]))
        s.labels = np.ascontiguousarray(z["labels"][bounds[i] : bounds[i + 1]], dtype=np.float32)
        s.state, s.duplicates, s.rows_dropped = int(z["state"][i]), int(z["duplicates"][i]), int(z["rows_dropped"][i])
        s.problems = problems.pop(im, []) + problems.pop(lf, [])
        out.append(s)
    return out


# ----------------------------------------------------------------------------- build
def _progress(iterable, total: int, desc: str, enabled: bool):
    if not enabled or not sys.stderr.isatty():
        return iterable
    return tqdm(iterable, total=total, desc=desc, unit="img", leave=False)


def build_index(
    cfg: DataConfig | str | os.PathLike | dict,
    split: str,
    *,
    cache: bool = True,
    workers: int | None = None,
    progress: bool = True,
    verify: Literal["header", "full"] = "header",
) -> DatasetIndex:
    """Scan ``split`` of a data config into a :class:`DatasetIndex` (cached; corrupt samples skipped).

    ``verify="header"`` reads each image's header and (JPEG) end-of-image marker; ``"full"``
    decodes every image. ``workers`` threads scan in parallel (default ``min(8, cpu_count)``).
    """
    if verify not in ("header", "full"):
        raise ValueError(f"verify must be 'header' or 'full', got {verify!r}")
    cfg = load_data_config(cfg)
    sources = cfg.sources(split)
    listed = list_images(sources, cfg.origin, split)
    if not listed:
        where = ", ".join(map(str, sources))
        raise DataConfigError(f"{cfg.origin}: '{split}' has no images ({where}; suffixes {', '.join(IMG_FORMATS)})")
    report = ScanReport(split=split)

    im_files = sorted(set(listed))
    dup_entries = len(listed) - len(im_files)
    if dup_entries:
        report.duplicate += dup_entries
        report.problems.append(Problem(str(sources[0]), "duplicate_image", f"{dup_entries} image path(s) listed twice"))
    label_files = [img2label_path(f) for f in im_files]
    im_stats = [_stat(f) for f in im_files]
    label_stats = [_stat(f) for f in label_files]

    key = _cache_key(im_files, im_stats, label_files, label_stats, cfg.nc, verify)
    label_dir = Path(label_files[0]).parent if label_files else Path(img2label_path(str(sources[0]) + os.sep + "x")).parent
    single_folder = len(sources) == 1 and sources[0].is_dir()
    tag = "" if single_folder else "." + hashlib.sha1("|".join(map(str, sources)).encode()).hexdigest()[:8]
    candidates = _cache_candidates(label_dir, tag)

    samples: list[_Sample] | None = None
    if cache:
        for path in candidates:
            z = _load_cache(path, key) if path.is_file() else None
            if z is not None:
                samples = _arrays_to_samples(z)
                report.cache_hit, report.cache_path = True, str(path)
                break
    if samples is None:
        samples = []
        missing = [i for i, st in enumerate(im_stats) if st is None]
        for i in missing:
            samples.append(_Sample(im_files[i], label_files[i], ok=False, problems=[Problem(im_files[i], "missing_file", "listed image does not exist")]))
        todo = [i for i, st in enumerate(im_stats) if st is not None]
        n_workers = max(1, min(workers or min(8, os.cpu_count() or 1), len(todo) or 1))

        def job(i: int) -> _Sample:
            return _scan_one(im_files[i], im_stats[i][0], label_files[i], label_stats[i] is not None, cfg.nc, verify)

        with ThreadPoolExecutor(n_workers) as pool:
            samples.extend(_progress(pool.map(job, todo), len(todo), f"scanning {split}", progress))
        samples.sort(key=lambda s: s.im_file)
        if cache:
            written = _save_cache(candidates, _samples_to_arrays(samples, key))
            report.cache_path = str(written) if written else None

    report.images = len(samples)
    keep = [s for s in samples if s.ok]
    for s in samples:
        report.problems.extend(s.problems)
        if not s.ok:
            report.corrupt += 1
            continue
        report.found += s.state == _FOUND
        report.missing += s.state == _MISSING
        report.empty += s.state == _EMPTY
        report.duplicate += s.duplicates
        report.rows_dropped += s.rows_dropped

    orphans = _orphan_labels(sources, set(label_files))
    report.labels_without_image = len(orphans)
    report.problems.extend(Problem(p, "label_without_image", "label file has no matching image (ignored)") for p in orphans)

    shapes = np.array([s.shape for s in keep], dtype=np.int32).reshape(-1, 2)
    _log.info("%s", report.summary())
    return DatasetIndex(
        im_files=[s.im_file for s in keep],
        label_files=[s.label_file for s in keep],
        labels=[s.labels for s in keep],
        shapes=shapes,
        names=list(cfg.names),
        report=report,
    )
