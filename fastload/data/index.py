"""Scan a split into a :class:`DatasetIndex`: image list, validated labels, original shapes, report.

Each image is checked cheaply (header probe for the EXIF-aware shape, plus the JPEG end-of-image
marker) or fully decoded with ``verify="full"``; its label file is parsed and validated. Corrupt
samples are skipped and counted, never fatal. Results are cached in a ``.npz`` of flat arrays (no
pickle, no per-image object: the image paths as one blob, the labels as one ``float32 [M, 5]`` array
with offsets, the points of segment / pose / OBB rows as one ``float32 [P, D]`` array with per-row
offsets) beside the labels folder -- ``labels/train2017.fastload.cache`` -- or in the user cache
directory (``$FASTLOAD_CACHE_DIR``, else ``$XDG_CACHE_HOME/fastload``, else ``~/.cache/fastload``)
when that folder is read-only.

The cache is valid for exactly the image paths it lists with every image and label file's size and
mtime (ns) as they are now, ``nc`` and the verify mode: each open lists the folders and stats every
file (one ``stat`` per file, relative to its folder's descriptor, in processes), and any difference --
a file added, removed, renamed, rewritten or touched -- means a rescan. What it cannot see: a file
rewritten in place with the same size whose mtime is restored (or a file system without mtimes).

A rescan runs in forked processes (threads for small sets) with a progress bar on a terminal. It
holds a lock file beside the cache, so concurrent builds of one split -- the ranks of a DDP job on one
node, or on nodes sharing the file system -- scan once: the others wait and read the cache.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import itertools
import json
import logging
import multiprocessing
import os
import sys
import tempfile
import zipfile
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Literal, Sequence

try:
    import fcntl
except ImportError:  # not on Windows: scans there are not serialised between processes
    fcntl = None  # type: ignore[assignment]

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
from fastload.data.labels import FlatLabels, Problem, img2label_path, label_paths, read_label_file

__all__ = ["DatasetIndex", "ScanReport", "Problem", "build_index", "list_images", "user_cache_dir"]

_log = logging.getLogger("fastload.data")

CACHE_VERSION = "fastload-index-3"  # 3: label points (segments, keypoints, OBB corners)
CACHE_SUFFIX = ".fastload.cache"
_HEAD_BYTES = 1 << 16  # enough for the header (and EXIF) of almost every JPEG
_TAIL_BYTES = 1 << 12
_SCAN_CHUNK = 512  # images per scan task
_STAT_CHUNK = 4096  # files per stat task
# the per-image arrays of a scan (the cache adds version, meta, files and stats)
# (points / point_offsets: [0, 2] / [0] when the labels carry no points)
_SCAN_KEYS = ("ok", "state", "shapes", "label_offsets", "labels", "points", "point_offsets", "duplicates",
              "rows_dropped", "problems")

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
    """The usable samples of a split in sorted image order: their paths, labels (:class:`FlatLabels`: one array
    for all images, with the points of segment / pose / OBB rows), ``int32 [n, 2]`` shapes (h, w) and ``int64 [n]``
    file sizes in bytes; ``kpt_shape``: the data yaml's (K, D) of pose labels (their points are always x, y,
    visibility), else None."""

    im_files: list[str]
    labels: FlatLabels
    shapes: np.ndarray
    names: list[str]
    report: ScanReport
    im_bytes: np.ndarray
    kpt_shape: tuple[int, int] | None = None

    def __len__(self) -> int:
        return len(self.im_files)

    @functools.cached_property
    def label_files(self) -> list[str]:
        """The label file path of each image (whether it exists or not)."""
        return label_paths(self.im_files)


# ----------------------------------------------------------------------------- listing
def _is_image(name: str) -> bool:
    return name.rsplit(".", 1)[-1].lower() in IMG_FORMATS and "." in name


def _walk_images(folder: Path) -> Iterable[str]:
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames.sort()
        prefix = os.path.join(dirpath, "")
        yield from (prefix + name for name in filenames if _is_image(name))


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


def _orphan_labels(sources: list[Path], label_groups: dict[str, tuple[list[int], list[str]]]) -> list[str]:
    """Label files under the labels folder of each folder source that match no image (``label_groups``: the
    images' label files by folder, :func:`_by_folder`)."""
    orphans: list[str] = []
    for src in sources:
        if not src.is_dir():
            continue
        label_dir = Path(img2label_path(str(src) + os.sep + "x")).parent
        if label_dir == src or not label_dir.is_dir():
            continue
        for dirpath, _, filenames in os.walk(label_dir):
            group = label_groups.get(dirpath)
            extra = set(filenames).difference(group[1]) if group else filenames
            orphans.extend(os.path.join(dirpath, n) for n in extra if n.endswith(".txt"))
    return sorted(orphans)


# ----------------------------------------------------------------------------- per-sample check
@dataclass
class _Sample:
    im_file: str
    label_file: str
    ok: bool = True
    shape: tuple[int, int] = (0, 0)
    labels: np.ndarray = field(default_factory=lambda: np.zeros((0, 5), np.float32))
    points: np.ndarray | None = None  # float32 [p, D] with per-row offsets (LabelResult's), None: no geometry
    point_offsets: np.ndarray | None = None
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


def _scan_one(im_file: str, im_size: int, label_file: str, label_exists: bool, nc: int, verify: str,
              kpt_shape: tuple[int, int] | None = None) -> _Sample:
    """Check one image (``im_size`` < 0: it does not exist) and read its label file (pose rows with ``kpt_shape``)."""
    s = _Sample(im_file, label_file)
    if kpt_shape is not None:  # pose labels always carry points, an image without any too
        s.points, s.point_offsets = np.zeros((0, 3), np.float32), np.zeros(1, np.int64)
    if im_size < 0:
        s.ok = False
        s.problems.append(Problem(im_file, "missing_file", "listed image does not exist"))
        return s
    try:
        s.shape, notes = _check_image(im_file, im_size, verify)
        s.problems.extend(notes)
    except CorruptImageError as exc:
        s.ok = False
        s.problems.append(Problem(im_file, "corrupt_image", exc.reason))
        return s
    if label_exists:
        res = read_label_file(label_file, nc, kpt_shape)
        s.problems.extend(res.problems)
        if any(p.kind == "label_unreadable" for p in res.problems):
            s.ok = False  # unknown labels: training on it as background would be wrong
            return s
        s.labels, s.duplicates, s.rows_dropped = res.labels, res.duplicates, res.rows_dropped
        if res.points is not None:
            s.points, s.point_offsets = res.points, res.point_offsets
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


def _load_cache(path: Path, meta: str, files_blob: bytes, stats: np.ndarray) -> dict[str, np.ndarray] | None:
    """The scan arrays of a cache file made for exactly these files (names, sizes, mtimes) and settings, else None."""
    try:
        with np.load(path, allow_pickle=False) as z:
            if str(z["version"]) != CACHE_VERSION or str(z["meta"]) != meta:
                return None
            if z["files"].tobytes() != files_blob or not np.array_equal(z["stats"], stats):
                return None
            return {k: z[k] for k in _SCAN_KEYS}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None


def _find_cache(paths: tuple[Path, Path], meta: str, files_blob: bytes,
                stats: np.ndarray) -> tuple[dict[str, np.ndarray] | None, Path | None]:
    """(scan arrays, the file) of the first valid cache among ``paths``, or (None, None)."""
    for path in paths:
        arrays = _load_cache(path, meta, files_blob, stats) if path.is_file() else None
        if arrays is not None:
            return arrays, path
    return None, None


@contextlib.contextmanager
def _scan_lock(paths: tuple[Path, Path]) -> Iterator[None]:
    """Hold an exclusive lock beside the first cache location we may write (no lock where neither is writable)."""
    fd = None
    for target in paths:
        if _read_only(target.parent):
            continue
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(str(target) + ".lock", os.O_RDWR | os.O_CREAT, 0o666)
            break
        except OSError:
            continue
    if fd is None:
        yield
        return
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


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


def _stat_part(folder: str, names: list[str]) -> np.ndarray:
    """``int64 [n, 2]``: (size, mtime in ns) of each name in ``folder`` (stat'ed relative to one descriptor of
    it), ``-1`` for a name that does not exist."""
    out = np.full((len(names), 2), -1, np.int64)
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return out
    found: list[tuple[int, int, int]] = []
    try:
        for k, name in enumerate(names):
            try:
                st = os.stat(name, dir_fd=fd)
            except OSError:
                continue
            found.append((k, st.st_size, st.st_mtime_ns))
    finally:
        os.close(fd)
    if found:
        rows = np.array(found, np.int64)
        out[rows[:, 0]] = rows[:, 1:]
    return out


def _by_folder(paths: Sequence[str]) -> dict[str, tuple[list[int], list[str]]]:
    """``{folder: (positions, names)}`` of the paths."""
    groups: dict[str, tuple[list[int], list[str]]] = {}
    for i, p in enumerate(paths):
        folder, sep, name = p.rpartition(os.sep)
        folder = folder or sep or "."  # "/x.jpg" is in "/", "x.jpg" in the working directory
        group = groups.get(folder)
        if group is None:
            group = groups[folder] = ([], [])
        group[0].append(i)
        group[1].append(name)
    return groups


def _stat_many(groups: dict[str, tuple[list[int], list[str]]], n: int, workers: int) -> np.ndarray:
    """``int64 [n, 2]``: (size, mtime in ns) of each of ``n`` paths (:func:`_by_folder`), ``-1`` for a path that
    does not exist; in parts stat'ed by ``workers`` processes when there are many (:func:`_pool`)."""
    parts = [(d, idx[k : k + _STAT_CHUNK], names[k : k + _STAT_CHUNK])
             for d, (idx, names) in groups.items() for k in range(0, len(idx), _STAT_CHUNK)]
    out = np.full((n, 2), -1, np.int64)
    with _pool(workers, len(parts)) as pool:
        for (_, idx, _), stats in zip(parts, pool.map(_stat_part, [p[0] for p in parts], [p[2] for p in parts])):
            out[idx] = stats
    return out


def _pool(workers: int, tasks: int) -> Executor:
    """Forked processes for four tasks or more (where the platform forks), else threads."""
    n = max(1, min(workers, tasks))
    if n > 1 and tasks >= 4 and "fork" in multiprocessing.get_all_start_methods():
        return ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork"))
    return ThreadPoolExecutor(n)


def _join(strings: Sequence[str]) -> bytes:
    """The strings as one NUL-separated blob (names that are not UTF-8 kept byte for byte)."""
    return "\0".join(strings).encode("utf-8", "surrogateescape")


def _scan_arrays(samples: list[_Sample]) -> dict[str, np.ndarray]:
    """The per-image results of a scan as flat arrays (the cache's and :class:`DatasetIndex`'s layout)."""
    labels = FlatLabels.from_arrays([s.labels for s in samples], [s.points for s in samples],
                                    [s.point_offsets for s in samples])
    return {
        "ok": np.array([s.ok for s in samples], dtype=bool),
        "state": np.array([s.state for s in samples], dtype=np.int8),
        "shapes": np.array([s.shape for s in samples], dtype=np.int32).reshape(-1, 2),
        **_label_arrays(labels),
        "duplicates": np.array([s.duplicates for s in samples], dtype=np.int32),
        "rows_dropped": np.array([s.rows_dropped for s in samples], dtype=np.int32),
        "problems": np.array(json.dumps([[p.path, p.kind, p.message] for s in samples for p in s.problems])),
    }


def _label_arrays(labels: FlatLabels) -> dict[str, np.ndarray]:
    """The scan arrays of ``labels`` (no points: empty ``points`` and ``point_offsets``)."""
    plain = labels.points is None
    return {"label_offsets": labels.offsets, "labels": labels.rows,
            "points": np.zeros((0, 2), np.float32) if plain else labels.points,
            "point_offsets": np.zeros(0, np.int64) if plain else labels.point_offsets}


def _arrays_labels(arrays: dict[str, np.ndarray]) -> FlatLabels:
    """The :class:`FlatLabels` of scan arrays (:func:`_label_arrays`)."""
    plain = len(arrays["point_offsets"]) == 0
    return FlatLabels(arrays["labels"], arrays["label_offsets"], None if plain else arrays["points"],
                      None if plain else arrays["point_offsets"])


def _scan_chunk(items: list[tuple[str, int, str, bool]], nc: int, verify: str,
                kpt_shape: tuple[int, int] | None) -> dict[str, np.ndarray]:
    """Scan a chunk of (image, size, label file, label exists) in this process: its :func:`_scan_arrays`."""
    return _scan_arrays([_scan_one(im, size, lf, exists, nc, verify, kpt_shape) for im, size, lf, exists in items])


def _merge(chunks: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Concatenate :func:`_scan_arrays` of consecutive chunks."""
    if len(chunks) == 1:
        return chunks[0]
    out = {k: np.concatenate([c[k] for c in chunks]) for k in ("ok", "state", "shapes", "duplicates", "rows_dropped")}
    out.update(_label_arrays(FlatLabels.concatenate([_arrays_labels(c) for c in chunks])))
    out["problems"] = np.array(json.dumps([p for c in chunks for p in json.loads(str(c["problems"]))]))
    return out


# ----------------------------------------------------------------------------- build
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
    decodes every image. ``workers`` processes (threads for a small set) stat the files and scan them
    (default ``min(8, cpu_count)``).
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

    im_files = list(dict.fromkeys(listed))  # listed is sorted: duplicates dropped, the order kept
    dup_entries = len(listed) - len(im_files)
    if dup_entries:
        report.duplicate += dup_entries
        report.problems.append(Problem(str(sources[0]), "duplicate_image", f"{dup_entries} image path(s) listed twice"))
    label_files = label_paths(im_files)
    workers = max(1, workers or min(8, os.cpu_count() or 1))
    label_groups = _by_folder(label_files)
    stats = np.concatenate([_stat_many(_by_folder(im_files), len(im_files), workers),
                            _stat_many(label_groups, len(label_files), workers)], 1)
    meta = json.dumps({"nc": cfg.nc, "verify": verify, "kpt_shape": cfg.kpt_shape})
    files_blob = _join(im_files)

    label_dir = Path(label_files[0]).parent
    single_folder = len(sources) == 1 and sources[0].is_dir()
    tag = "" if single_folder else "." + hashlib.sha1("|".join(map(str, sources)).encode()).hexdigest()[:8]
    candidates = _cache_candidates(label_dir, tag)

    arrays, hit = _find_cache(candidates, meta, files_blob, stats) if cache else (None, None)
    if arrays is None and cache:
        with _scan_lock(candidates):  # one scan per node (or shared file system): the other ranks wait, then read it
            arrays, hit = _find_cache(candidates, meta, files_blob, stats)
            if arrays is None:
                arrays = _scan(im_files, label_files, stats, cfg.nc, verify, workers, progress, split, cfg.kpt_shape)
                written = _save_cache(candidates, dict(arrays, version=np.array(CACHE_VERSION), meta=np.array(meta),
                                                       files=np.frombuffer(files_blob, np.uint8), stats=stats))
                report.cache_path = str(written) if written else None
    if arrays is None:
        arrays = _scan(im_files, label_files, stats, cfg.nc, verify, workers, progress, split, cfg.kpt_shape)
    if hit is not None:
        report.cache_hit, report.cache_path = True, str(hit)
    return _to_index(arrays, im_files, stats[:, 0], sources, label_groups, cfg, report)


def _scan(im_files: list[str], label_files: list[str], stats: np.ndarray, nc: int, verify: str, workers: int,
          progress: bool, split: str, kpt_shape: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
    """Scan every image and label file in chunks, by ``workers`` processes when there are many (:func:`_pool`)."""
    items = list(zip(im_files, stats[:, 0].tolist(), label_files, (stats[:, 2] >= 0).tolist()))
    chunks = [items[k : k + _SCAN_CHUNK] for k in range(0, len(items), _SCAN_CHUNK)]
    bar = tqdm(total=len(items), desc=f"scanning {split}", unit="img", leave=False) \
        if progress and sys.stderr.isatty() else None
    done = []
    with _pool(workers, len(chunks)) as pool:
        for part in pool.map(_scan_chunk, chunks, itertools.repeat(nc), itertools.repeat(verify),
                             itertools.repeat(kpt_shape)):
            done.append(part)
            if bar is not None:
                bar.update(len(part["ok"]))
    if bar is not None:
        bar.close()
    return _merge(done)


def _to_index(arrays: dict[str, np.ndarray], im_files: list[str], im_bytes: np.ndarray, sources: list[Path],
              label_groups: dict[str, tuple[list[int], list[str]]], cfg: DataConfig, report: ScanReport) -> DatasetIndex:
    """The usable samples of a scan's arrays, with the report's counts and problems."""
    ok = arrays["ok"]
    keep = np.flatnonzero(ok)
    state = arrays["state"][keep]
    report.images = len(ok)
    report.corrupt = int(len(ok) - len(keep))
    report.found, report.missing, report.empty = (int((state == s).sum()) for s in (_FOUND, _MISSING, _EMPTY))
    report.duplicate += int(arrays["duplicates"][keep].sum())
    report.rows_dropped = int(arrays["rows_dropped"][keep].sum())
    report.problems.extend(Problem(*p) for p in json.loads(str(arrays["problems"])))
    orphans = _orphan_labels(sources, label_groups)
    report.labels_without_image = len(orphans)
    report.problems.extend(Problem(p, "label_without_image", "label file has no matching image (ignored)") for p in orphans)
    labels = _arrays_labels(arrays)
    everything = len(keep) == len(ok)
    _log.info("%s", report.summary())
    return DatasetIndex(
        im_files=im_files if everything else [im_files[i] for i in keep.tolist()],
        labels=labels if everything else labels.subset(keep),
        shapes=np.ascontiguousarray(arrays["shapes"][keep], np.int32).reshape(-1, 2),
        names=list(cfg.names),
        report=report,
        im_bytes=np.ascontiguousarray(im_bytes[keep], np.int64),
        kpt_shape=cfg.kpt_shape,
    )
