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
mtime (ns) as they are now, ``nc``, the verify mode and the sources. An open checks that in two steps:

* **the listings**: every folder the scan listed (each image folder, each labels folder and the folders under
  them) is listed again, and its names, in the order the file system gives them, must hash to what they did.
  So a file (image, label, or anything else) added, removed or renamed in any of them, or a new sub-folder, is
  noticed without a path string per file. (A folder listed in another order than before -- no local or
  network file system we know does that for an unchanged folder -- costs the full check below, nothing else.)
* **every file's stat**: each image and each existing label file is stat'ed (in processes, in parts; the
  paths come from the cache as one blob), and its size and mtime (ns) must be those cached. So a file
  rewritten in place or touched (its folder's listing does not change) is noticed too.

The listings and the stats are tasks of one pool, so a folder of a million names is listed beside the stats.

When a listing differs, the split is listed and stat'ed in full and compared with the cache: a file added that
is no image (a README beside the images) keeps the cache, refreshed; any difference in the image paths or the
stats means a rescan. What is not noticed: a file rewritten with the same size and its mtime put back
(``touch -r``, ``cp -p`` of a same-size file), or any change on a file system without mtimes. ``.txt`` list
sources and single image files are always listed in full (from the list), then stat'ed as above.

A rescan runs in forked processes (threads for small sets) with a progress bar on a terminal. It
holds a lock file beside the cache, so concurrent builds of one split -- the ranks of a DDP job on one
node, or on nodes sharing the file system -- scan once: the others wait and read the cache. The ranks of
one torchrun launch on a node (:func:`node_launch`) also check a valid cache once: the first to take the lock
checks it and writes its verdict beside the lock (``.checked``); the others read the cache while they wait for
the lock, then take a verdict of their launch on the file they read, at most ``_SHARED_CHECK_S`` old, instead of
checking.
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
import operator
import os
import socket
import sys
import tempfile
import threading
import time
import zipfile
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Literal, Sequence

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
from fastload.data.paths import PathList

__all__ = ["DatasetIndex", "ScanReport", "Problem", "build_index", "list_images", "user_cache_dir"]

_log = logging.getLogger("fastload.data")

CACHE_VERSION = "fastload-index-4"  # 3: label points (segments, keypoints, OBB corners); 4: folder listings
CACHE_SUFFIX = ".fastload.cache"
_HEAD_BYTES = 1 << 16  # enough for the header (and EXIF) of almost every JPEG
_TAIL_BYTES = 1 << 12
_SCAN_CHUNK = 512  # images per scan task
_STAT_CHUNK = 16384  # files per stat task
# the per-image arrays of a scan (the cache adds version, meta, the listing's -- files, label_files, listings,
# listed_twice, orphans -- and stats)
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
    checked_by_another_rank: bool = False  # a hit another rank of this DDP launch on this node checked (node_launch)

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
    """The usable samples of a split in sorted image order: their paths (:class:`PathList`: one blob for all
    images), labels (:class:`FlatLabels`: one array for all images, with the points of segment / pose / OBB rows),
    ``int32 [n, 2]`` shapes (h, w) and ``int64 [n]`` file sizes in bytes; ``kpt_shape``: the data yaml's (K, D) of
    pose labels (their points are always x, y, visibility), else None."""

    im_files: PathList
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


def _listing_digest(names: Iterable[bytes]) -> str:
    """The digest of a folder's entry names, in the order the file system lists them."""
    return hashlib.sha1(b"\0".join(names)).hexdigest()


def _digest_now(folder: str) -> str:
    """:func:`_listing_digest` of ``folder`` as it is now ("" when it is no readable folder): one listing, no
    string per name."""
    try:
        return _listing_digest(os.listdir(os.fsencode(folder)))
    except OSError:
        return ""


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()  # follows links, as os.walk(followlinks=True) does
    except OSError:
        return False


def _walk(top: str, listings: dict[str, str]) -> Iterator[tuple[str, list[str]]]:
    """(folder, names of what is not a folder in it) for ``top`` and every folder under it (links followed,
    sub-folders in name order); each folder's :func:`_listing_digest` goes into ``listings``, made from the very
    listing the names come from ("" for ``top`` when it is no readable folder)."""
    try:
        with os.scandir(top) as it:
            entries = list(it)
    except OSError:
        listings[top] = ""
        return
    listings[top] = _listing_digest(os.fsencode(e.name) for e in entries)
    is_dir = [_is_dir(e) for e in entries]
    yield top, [e.name for e, d in zip(entries, is_dir) if not d]
    for name in sorted(e.name for e, d in zip(entries, is_dir) if d):
        yield from _walk(os.path.join(top, name), listings)


def _walk_images(folder: Path, listings: dict[str, str]) -> Iterable[str]:
    for dirpath, filenames in _walk(str(folder), listings):
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


def list_images(sources: list[Path], origin: str = "<data>", key: str = "split",
                listings: dict[str, str] | None = None) -> list[str]:
    """Sorted image paths from folders, .txt lists or single image files; raises when a source is missing.

    ``listings``: filled with the listing digest of every folder listed (the cache's first check)."""
    files: list[str] = []
    listings = {} if listings is None else listings
    for src in sources:
        if src.is_dir():
            files.extend(_walk_images(src, listings))
        elif src.is_file() and src.suffix.lower() == ".txt":
            files.extend(p for p in _read_list_file(src, origin) if _is_image(p))
        elif src.is_file() and _is_image(src.name):
            files.append(str(src))
        else:
            raise DataConfigError(f"{origin}: '{key}' source {src} does not exist (want a folder or .txt list)")
    return sorted(files)


def _label_root(src: Path) -> str:
    """The labels folder of a folder source (the ``/images/`` -> ``/labels/`` rule applied to the folder)."""
    return os.path.dirname(img2label_path(str(src) + os.sep + "x"))


def _list_labels(sources: list[Path], image_folders: Iterable[str], listings: dict[str, str]) -> dict[str, list[str]]:
    """``{folder: label file names}`` under the labels folder of each folder source, and the listing digest of those
    folders and of the labels folder of every image folder (whether it exists or not) into ``listings``."""
    found: dict[str, list[str]] = {}
    for src in sources:
        root = _label_root(src)
        if src.is_dir() and root != str(src) and root not in listings:
            for dirpath, filenames in _walk(root, listings):
                found[dirpath] = [n for n in filenames if n.endswith(".txt")]
    for folder in list(image_folders):
        label_folder = _label_root(Path(folder))
        if label_folder not in listings:
            listings[label_folder] = _digest_now(label_folder)
    return found


def _orphan_labels(found: dict[str, list[str]], label_groups: dict[str, tuple[list[int], list[str]]]) -> list[str]:
    """The label files of ``found`` (:func:`_list_labels`) that match no image (``label_groups``: the images' label
    files by folder, :func:`_by_folder`)."""
    orphans: list[str] = []
    for dirpath, names in found.items():
        group = label_groups.get(dirpath)
        extra = set(names).difference(group[1]) if group else names
        orphans.extend(os.path.join(dirpath, n) for n in extra)
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


def _file_id(st: os.stat_result) -> list[int]:
    """What tells one version of a file from another: device, inode, size, mtime (ns)."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


_CHECK_KEYS = ("listings", "stats", "files", "label_files")  # the arrays a check reads before it starts


@contextlib.contextmanager
def _opened_cache(path: Path, meta: str) -> Iterator[tuple[np.lib.npyio.NpzFile, list[int]] | None]:
    """The cache file at ``path`` open for reading (its arrays read on access) and its :func:`_file_id`, when it was
    made by this version for these settings and sources (``meta``); else None."""
    try:
        f = open(path, "rb")
    except OSError:  # no cache there (or unreadable)
        f = None
    if f is None:
        yield None
        return
    with f:
        try:
            z = np.load(f, allow_pickle=False)
            fresh = str(z["version"]) == CACHE_VERSION and str(z["meta"]) == meta
            file_id = _file_id(os.fstat(f.fileno()))
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
            fresh = False
        yield (z, file_id) if fresh else None


def _read_arrays(z: np.lib.npyio.NpzFile, keys: Iterable[str], into: dict[str, np.ndarray]) -> bool:
    """Read the arrays ``keys`` of an :func:`_opened_cache` into ``into``; False when the file is unreadable."""
    try:
        into.update((k, z[k]) for k in keys)
        return True
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return False


def _read_cache(path: Path, meta: str) -> tuple[dict[str, np.ndarray], list[int]] | None:
    """Every array of the cache file at ``path`` and its :func:`_file_id` (:func:`_opened_cache`), else None."""
    arrays: dict[str, np.ndarray] = {}
    with _opened_cache(path, meta) as got:
        return (arrays, got[1]) if got is not None and _read_arrays(got[0], got[0].files, arrays) else None


def _still_valid(cached: dict[str, np.ndarray], files: PathList, workers: int, meanwhile: Callable[[], bool]) -> bool:
    """True when every folder the cached scan listed lists the same names now (:func:`_digest_now`) and every cached
    image (``files``) and existing label file has its cached size and mtime now, and ``meanwhile()`` (run in this
    process while the pool works: the rest of the cache is read) is True. The listings and the stats are tasks of
    one pool (:func:`_stat_paths`), so the listing of a large folder runs beside the stats; a label file the cache
    says is missing still is when its folder lists the same names."""
    listings = json.loads(str(cached["listings"]))
    stats = cached["stats"]
    label_files = PathList(cached["label_files"].tobytes())
    has_label = stats[:, 2] >= 0
    done: list[bool] = []
    (im_now, label_now), digests = _stat_paths([(files, None), (label_files, has_label)], workers, list(listings),
                                               lambda: done.append(meanwhile()))
    if not all(done):
        return False
    return (digests == list(listings.values()) and np.array_equal(im_now, stats[:, :2])
            and np.array_equal(label_now, stats[:, 2:]))


_held_locks = threading.local()  # .paths: the lock files this thread holds (a build holds one from check to write)


@contextlib.contextmanager
def _scan_lock(paths: tuple[Path, Path], while_waiting: Callable[[], object] | None = None) -> Iterator[Path | None]:
    """Hold an exclusive lock beside the first cache location we may write and yield the lock file's path (None:
    no lock, neither is writable). Taken again by the thread that holds it, it is held already: nothing happens.
    ``while_waiting()`` runs when another process holds the lock, before this one waits for it."""
    held = _held_locks.__dict__.setdefault("paths", set())
    fd = lock = None
    for target in paths:
        if _read_only(target.parent):
            continue
        lock = Path(str(target) + ".lock")
        if lock in held:
            yield lock
            return
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
            break
        except OSError:
            continue
    if fd is None:
        yield None
        return
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (fcntl.LOCK_NB if while_waiting is not None else 0))
            except BlockingIOError:
                while_waiting()  # type: ignore[misc]  # LOCK_NB only with it
                fcntl.flock(fd, fcntl.LOCK_EX)
        held.add(lock)
        yield lock
    finally:
        held.discard(lock)
        os.close(fd)  # closing releases the lock


# ----------------------------------------------------------------------------- one check per node
_SHARED_CHECK_S = 60.0  # how long one rank's verdict on a cache stands for the other ranks of its launch


def node_launch() -> str | None:
    """What the ranks of one DDP launch on this node have in common, and nothing else does: the host, the parent
    process (torchrun's agent, which starts them) and its start time, and torchrun's run id, restart count and port;
    None unless torchrun's ``LOCAL_WORLD_SIZE`` says this node runs several ranks (or the parent is gone)."""
    try:
        if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= 1:
            return None
    except ValueError:
        return None
    parent = os.getppid()
    if parent <= 1:  # orphaned: no launch to share with
        return None
    try:
        with open(f"/proc/{parent}/stat", "rb") as f:
            started = f.read().rsplit(b")", 1)[-1].split()[19].decode()  # field 22: start time since boot
    except (OSError, IndexError):
        started = "?"
    env = ":".join(os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_PORT"))
    return f"{socket.gethostname()}:{parent}:{started}:{env}"


def _verdicts_path(lock: Path) -> Path:
    return lock.with_name(lock.name[: -len(".lock")] + ".checked")


def _verdicts(lock: Path) -> dict[str, list]:
    """``{launch: [cache path, its file id, when checked]}`` of the verdicts file beside ``lock`` ({} if none)."""
    try:
        got = json.loads(_verdicts_path(lock).read_text())
        return got if isinstance(got, dict) else {}
    except (OSError, ValueError):
        return {}


def _vouched(lock: Path, launch: str) -> tuple[Path, list[int]] | None:
    """(cache path, file id) that a rank of ``launch`` found valid in the last :data:`_SHARED_CHECK_S`, else None."""
    got = _verdicts(lock).get(launch)
    try:
        path, file_id, at = got  # type: ignore[misc]
        fresh = 0 <= time.time() - float(at) < _SHARED_CHECK_S
    except (TypeError, ValueError):
        return None
    return (Path(path), [int(v) for v in file_id]) if fresh else None


def _vouch(lock: Path, launch: str, path: Path) -> None:
    """Record (holding ``lock``) that the cache at ``path``, as it is now, is valid for the ranks of ``launch``;
    verdicts older than :data:`_SHARED_CHECK_S` are dropped. Best effort: a rank that finds none checks itself."""
    now = time.time()
    kept = {k: v for k, v in _verdicts(lock).items()
            if isinstance(v, list) and len(v) == 3 and isinstance(v[2], (int, float)) and now - v[2] < _SHARED_CHECK_S}
    try:
        kept[launch] = [str(path), _file_id(os.stat(path)), now]
        target = _verdicts_path(lock)
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(kept))
        os.replace(tmp, target)
    except OSError:
        pass


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


_SIZE, _MTIME = operator.attrgetter("st_size"), operator.attrgetter("st_mtime_ns")
# the path lists being stat'ed, by job number: forked stat processes read them from here (nothing is sent)
_STAT_JOBS: dict[int, list[tuple[PathList, np.ndarray | None]]] = {}
_stat_job_ids = itertools.count()


def _stat_range(job: int, which: int, start: int, stop: int) -> np.ndarray:
    """``int64 [stop - start, 2]``: (size, mtime in ns) of paths ``start:stop`` of list ``which`` of ``job``; ``-1``
    for a path that does not exist or that the list's mask leaves out."""
    paths, only = _STAT_JOBS[job][which]
    out = np.full((stop - start, 2), -1, np.int64)
    # one split of the blob, no string per path; a mask keeps what it says exists
    names = paths.blob[paths.offsets[start] : paths.offsets[stop]].split(b"\0")[:-1]
    rows = np.arange(stop - start) if only is None else np.flatnonzero(only[start:stop])
    if only is not None:
        names = list(itertools.compress(names, only[start:stop].tolist()))
    try:
        found = list(map(os.stat, names))  # one loop in C when every file is there (the usual case)
    except OSError:  # a file is missing: one at a time
        found = []
        for name in names:
            try:
                found.append(os.stat(name))
            except OSError:
                found.append(None)
        keep = [k for k, st in enumerate(found) if st is not None]
        rows, found = rows[keep], [found[k] for k in keep]
    out[rows, 0] = np.fromiter(map(_SIZE, found), np.int64, len(found))
    out[rows, 1] = np.fromiter(map(_MTIME, found), np.int64, len(found))
    return out


def _digests_now(folders: list[str]) -> list[str]:
    """:func:`_digest_now` of each folder."""
    return [_digest_now(f) for f in folders]


def _stat_paths(lists: list[tuple[PathList, np.ndarray | None]], workers: int, folders: Sequence[str] = (),
                meanwhile: Callable[[], object] | None = None) -> tuple[list[np.ndarray], list[str]]:
    """``int64 [n, 2]``: (size, mtime in ns) of each path of each (paths, mask) in ``lists``, ``-1`` where there is
    no file or where the bool mask (None: every path) is False; and the :func:`_digest_now` of each of ``folders``.
    In parts, by ``workers`` processes when there are many (:func:`_pool`); the folders are listed first, in one
    task per worker (each a share of them), so that a folder of a million names is listed beside the stats.
    ``meanwhile()`` runs in this process once every task is sent."""
    job = next(_stat_job_ids)
    _STAT_JOBS[job] = lists
    tasks = [(which, a, min(a + _STAT_CHUNK, len(paths)))
             for which, (paths, _) in enumerate(lists) for a in range(0, len(paths), _STAT_CHUNK)]
    shares = [list(folders[k :: workers]) for k in range(min(workers, len(folders)))]
    try:
        with _pool(workers, len(tasks) + len(shares)) as pool:  # forked after _STAT_JOBS has the job
            listed = [pool.submit(_digests_now, share) for share in shares]
            stated = pool.map(_stat_range, itertools.repeat(job), *zip(*tasks)) if tasks else iter(())
            if meanwhile is not None:
                meanwhile()
            parts = list(stated)
            by_share = [f.result() for f in listed]
    finally:
        del _STAT_JOBS[job]
    digests = [by_share[k % len(shares)][k // len(shares)] for k in range(len(folders))]
    out = []
    for which, (paths, _) in enumerate(lists):
        mine = [part for (w, _, _), part in zip(tasks, parts) if w == which]
        out.append(np.concatenate(mine) if mine else np.zeros((0, 2), np.int64))
    return out, digests


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


def _pool(workers: int, tasks: int) -> Executor:
    """Forked processes for four tasks or more (where the platform forks), else threads."""
    n = max(1, min(workers, tasks))
    if n > 1 and tasks >= 4 and "fork" in multiprocessing.get_all_start_methods():
        return ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork"))
    return ThreadPoolExecutor(n)


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
    workers = max(1, workers or min(8, os.cpu_count() or 1))
    meta = json.dumps({"nc": cfg.nc, "verify": verify, "kpt_shape": cfg.kpt_shape, "sources": [str(s) for s in sources]})
    single_folder = len(sources) == 1 and sources[0].is_dir()
    tag = "" if single_folder else "." + hashlib.sha1("|".join(map(str, sources)).encode()).hexdigest()[:8]
    report = ScanReport(split=split)
    # folder sources: the cache sits by their labels folder, and is checked before any path is listed
    candidates = _cache_candidates(Path(_label_root(sources[0])), tag) if all(s.is_dir() for s in sources) else None
    # under torchrun, the ranks of one launch on a node check once: the first to take the lock checks (and scans if
    # need be, holding the lock); the others read the cache while they wait, and take its verdict when they get it
    launch = node_launch() if cache and candidates else None
    with contextlib.ExitStack() as held:
        read: list[tuple[Path, list[int], dict[str, np.ndarray]]] = []

        def read_while_waiting() -> None:
            for path in candidates or ():
                got = _read_cache(path, meta)
                if got is not None:
                    read.append((path, got[1], got[0]))
                    return

        lock = held.enter_context(_scan_lock(candidates, read_while_waiting)) if launch else None  # type: ignore
        vouched = _vouched(lock, launch) if lock and launch else None
        if vouched is not None:
            held.close()
            lock = None
            if read and read[0][:2] == vouched:  # what it read while waiting is what the verdict is for
                path, _, cached = read[0]
                report.cache_hit, report.cache_path, report.checked_by_another_rank = True, str(path), True
                return _to_index(cached, PathList(cached["files"].tobytes()), cached["stats"][:, 0], report, cfg)
        for path in sorted(candidates or (), key=lambda p: vouched is None or p != vouched[0]) if cache else ():
            with _opened_cache(path, meta) as got:
                cached: dict[str, np.ndarray] = {}
                if got is None or not _read_arrays(got[0], _CHECK_KEYS, cached):
                    continue
                z, file_id = got
                files = PathList(cached["files"].tobytes())
                shared = vouched is not None and (path, file_id) == vouched

                def read_rest() -> bool:  # the result arrays, read while the check runs
                    return _read_arrays(z, [k for k in z.files if k not in cached], cached)

                if read_rest() if shared else _still_valid(cached, files, workers, read_rest):
                    if lock is not None and launch:
                        _vouch(lock, launch, path)
                    report.cache_hit, report.cache_path, report.checked_by_another_rank = True, str(path), shared
                    return _to_index(cached, files, cached["stats"][:, 0], report, cfg)

        listings: dict[str, str] = {}  # every folder listed: its listing digest, taken before any file is stat'ed
        listed = list_images(sources, cfg.origin, split, listings)
        if not listed:
            where = ", ".join(map(str, sources))
            raise DataConfigError(f"{cfg.origin}: '{split}' has no images ({where}; suffixes {', '.join(IMG_FORMATS)})")
        unique = list(dict.fromkeys(listed))  # listed is sorted: duplicates dropped, the order kept
        label_list = label_paths(unique)
        found_labels = _list_labels(sources, list(listings), listings)
        im_files, label_files = PathList.from_paths(unique), PathList.from_paths(label_list)
        stats = np.concatenate(_stat_paths([(im_files, None), (label_files, None)], workers)[0], 1)
        found = {
            "listings": np.array(json.dumps(listings)),
            "listed_twice": np.array(len(listed) - len(unique)),
            "orphans": np.array(json.dumps(_orphan_labels(found_labels, _by_folder(label_list)))),
        }
        if candidates is None:
            candidates = _cache_candidates(Path(label_list[0]).parent, tag)

        def scan() -> dict[str, np.ndarray]:
            return _scan(im_files, label_files, stats, cfg.nc, verify, workers, progress, split, cfg.kpt_shape)

        if not cache:
            return _to_index({**scan(), **found}, im_files, stats[:, 0], report, cfg)
        # one scan per node (or shared file system): the other processes wait, then read it (held already by a rank)
        with _scan_lock(candidates) as lock:
            hit = arrays = None
            for path in candidates:
                got = _read_cache(path, meta)
                if got is not None and got[0]["files"].tobytes() == im_files.blob \
                        and np.array_equal(got[0]["stats"], stats):
                    hit, arrays = path, got[0]
                    break
            # written after a scan, and after a hit whose listings changed (a file that is no image added beside them)
            if hit is None or any(str(arrays[k]) != str(v) for k, v in found.items()):
                arrays = {**(scan() if arrays is None else {k: arrays[k] for k in _SCAN_KEYS}), **found}
                written = _save_cache(candidates, {**arrays, "version": np.array(CACHE_VERSION), "meta": np.array(meta),
                                                   "files": np.frombuffer(im_files.blob, np.uint8),
                                                   "label_files": np.frombuffer(label_files.blob, np.uint8),
                                                   "stats": stats})
                report.cache_path = str(written) if written else None
            valid = report.cache_path or hit
            if lock is not None and launch and valid:
                _vouch(lock, launch, Path(valid))
    if hit is not None:
        report.cache_hit, report.cache_path = True, str(hit)
    return _to_index(arrays, im_files, stats[:, 0], report, cfg)


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


def _to_index(arrays: dict[str, np.ndarray], im_files: PathList, im_bytes: np.ndarray, report: ScanReport,
              cfg: DataConfig) -> DatasetIndex:
    """The usable samples of a scan's arrays (:func:`_scan_arrays` and the listing's: ``listed_twice``,
    ``orphans``), with the report's counts and problems."""
    ok = arrays["ok"]
    keep = np.flatnonzero(ok)
    state = arrays["state"][keep]
    report.images = len(ok)
    report.corrupt = int(len(ok) - len(keep))
    report.found, report.missing, report.empty = (int((state == s).sum()) for s in (_FOUND, _MISSING, _EMPTY))
    listed_twice = int(arrays["listed_twice"])
    if listed_twice:
        report.problems.append(Problem(str(cfg.sources(report.split)[0]), "duplicate_image",
                                       f"{listed_twice} image path(s) listed twice"))
    report.duplicate += listed_twice + int(arrays["duplicates"][keep].sum())
    report.rows_dropped = int(arrays["rows_dropped"][keep].sum())
    report.problems.extend(Problem(*p) for p in json.loads(str(arrays["problems"])))
    orphans = json.loads(str(arrays["orphans"]))
    report.labels_without_image = len(orphans)
    report.problems.extend(Problem(p, "label_without_image", "label file has no matching image (ignored)") for p in orphans)
    labels = _arrays_labels(arrays)
    everything = len(keep) == len(ok)
    _log.info("%s", report.summary())
    return DatasetIndex(
        im_files=im_files if everything else im_files.subset(keep),
        labels=labels if everything else labels.subset(keep),
        shapes=np.ascontiguousarray(arrays["shapes"][keep], np.int32).reshape(-1, 2),
        names=list(cfg.names),
        report=report,
        im_bytes=np.ascontiguousarray(im_bytes[keep], np.int64),
        kpt_shape=cfg.kpt_shape,
    )
