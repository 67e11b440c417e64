"""``fastload stage`` / ``unstage``: copy a dataset or a store onto a RAM disk (or any fast path).

Staging a ``data.yaml`` copies the images and label files of its splits (keeping their layout
under the dataset root) and writes ``<target>/data.yaml`` pointing at the copy. Staging a store
folder (an lmdb/disk store or a ``fastload convert`` output folder) copies it as it is; the
relative store paths in a copied ``data.yaml`` then point at the copy.

Staging ``s3://bucket/prefix`` (a store uploaded by ``fastload convert --out URL``) downloads the objects its
manifest lists with parallel ranged reads (:mod:`fastload.store.objects`), each checked against the
manifest's size and crc32, then checks every record of every store (:func:`~fastload.store.verify.verify_target`).

Either way the staged ``data.yaml`` is self-contained: its ``path`` is the staged folder (the split keys still
name the source images, which the compat layers match stores by), so the loader, ``fastload info`` and
``fastload verify`` on it work once the source images are gone or on another machine.

Free space is checked first (``os.statvfs``); the copy goes into a hidden temporary sibling, every
file is read back and compared (size + crc32) and only then renamed to the target. A marker file
``.fastload-staged.json`` records what was staged; :func:`unstage` refuses to delete a folder
without it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import yaml
from tqdm import tqdm

from fastload.data.checksum import crc32, file_crc32
from fastload.data.config import DataConfig, load_data_config
from fastload.data.index import list_images
from fastload.data.labels import img2label_path
from fastload.store import shm
from fastload.store.base import StoreError
from fastload.store.kinds import shm_root
from fastload.store.objects.manifest import fetch, read_manifest
from fastload.store.objects.urls import is_url
from fastload.store.packed import replace_dir
from fastload.store.space import fmt_bytes, free_bytes
from fastload.store.verify import verify_target

MARKER = ".fastload-staged.json"
CHUNK = 8 << 20


@dataclasses.dataclass
class StageResult:
    path: Path
    yaml_path: Path | None
    files: int
    nbytes: int
    seconds: float


def _copy_file(src: Path, dst: Path) -> tuple[int, int]:
    """Copy ``src`` to ``dst`` returning (size, crc32 of what was read)."""
    crc, size = 0, 0
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        while chunk := fi.read(CHUNK):
            crc = crc32(chunk, crc)
            size += len(chunk)
            fo.write(chunk)
    return size, crc


def _dataset_files(cfg: DataConfig, splits: Sequence[str]) -> tuple[list[tuple[Path, Path]], dict[str, Any]]:
    """(source, path relative to the dataset root) of every image and label file, and the new split values."""
    root = Path(cfg.root).resolve()
    pairs: dict[Path, Path] = {}
    split_values: dict[str, Any] = {}

    def rel(p: Path) -> Path:
        try:
            return p.resolve().relative_to(root)
        except ValueError:
            raise StoreError(
                f"{p} is outside the dataset root {root}; staging keeps files under the root only"
            ) from None

    for split in splits:
        sources = cfg.sources(split)
        images = list_images(sources, cfg.origin, split)
        for f in images:
            p = Path(f)
            pairs[p] = rel(p)
            lp = Path(img2label_path(f))
            if lp.is_file():
                pairs[lp] = rel(lp)
        if all(Path(s).is_dir() for s in sources):
            vals = [str(rel(Path(s))) for s in sources]
            split_values[split] = vals[0] if len(vals) == 1 else vals
        else:  # list files: a new list of the staged paths, relative to the staged root
            split_values[split] = ("list", split, [str(rel(Path(f))) for f in images])
    return sorted(pairs.items(), key=lambda kv: str(kv[1])), split_values


def store_files(src: Path) -> list[tuple[Path, Path]]:
    """(file, path relative to ``src``) of every file a store folder (or a convert output folder) is made of:
    what staging copies and an upload sends (lock files and the staged marker left out)."""
    return [(p, p.relative_to(src)) for p in sorted(src.rglob("*")) if p.is_file() and p.name not in (".convert.lock", "lock.mdb", MARKER)]


def stage(
    source: str | Path,
    to: str | Path,
    *,
    splits: Sequence[str] | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> StageResult:
    """Copy a dataset (``data.yaml``) or a store folder to ``to`` and verify the copy."""
    t0 = time.perf_counter()
    if is_url(source):
        if splits:
            raise StoreError(f"splits apply to a data.yaml; the store at {source} is staged whole")
        return _stage_url(str(source), Path(to).absolute(), progress=progress, log=log, t0=t0)
    source, to = Path(source), Path(to).absolute()
    _check_target(to)
    is_yaml = source.is_file() and source.suffix in (".yaml", ".yml")
    cfg = None
    split_values: dict[str, Any] = {}
    if is_yaml:
        cfg = load_data_config(source)
        wanted = list(splits) if splits else list(cfg.splits)
        files, split_values = _dataset_files(cfg, wanted)
    elif source.is_dir():
        files = store_files(source)
    elif not source.exists():
        raise StoreError(f"cannot stage {source}: it does not exist; give a data.yaml or a store folder")
    else:
        raise StoreError(f"cannot stage {source}: give a data.yaml or a store folder")
    if not files:
        raise StoreError(f"nothing to stage in {source}")

    total = sum(p.stat().st_size for p, _ in files)
    _check_room(source, to, total)
    tmp = _staging_folder(to)
    try:
        sums: list[tuple[Path, int, int]] = []
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"stage -> {to}", disable=not progress) as bar:
            for src, rel in files:
                try:
                    size, crc = _copy_file(src, tmp / rel)
                except OSError as e:  # the copy so far is removed below: say where and why
                    room = f" ({fmt_bytes(free_bytes(to.parent))} free on {to.parent})" if e.errno == errno.ENOSPC else ""
                    raise StoreError(f"staging {source} to {to} stopped at {src}: {e.strerror or e}{room}; "
                                     f"nothing was kept") from None
                sums.append((rel, size, crc))
                bar.update(size)
        os.sync()
        for rel, size, crc in sums:  # read every copy back: a bad RAM disk or a racing writer shows here
            got = file_crc32(tmp / rel)
            if got != (size, crc):
                raise StoreError(f"staged copy of {rel} differs from the source (size/crc32 {got} != {(size, crc)})")
        yaml_path = None
        if cfg is not None:
            yaml_path = _write_staged_yaml(cfg, tmp, to, split_values)
        elif (source / "data.yaml").is_file():
            _point_yaml_at_copy(tmp / "data.yaml", source / "data.yaml", to, str(source.resolve()))
        _publish(tmp, to, str(source.resolve()), len(files), total)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if yaml_path is None and (to / "data.yaml").is_file():
        yaml_path = to / "data.yaml"
    elif yaml_path is not None:
        yaml_path = to / yaml_path.name
    log(f"staged {len(files)} files ({fmt_bytes(total)}) to {to}; verified" + (f"; data yaml: {yaml_path}" if yaml_path else ""))
    return StageResult(to, yaml_path, len(files), total, time.perf_counter() - t0)


def _check_target(to: Path) -> None:
    if to.exists() and not (to / MARKER).is_file():
        raise StoreError(f"{to} exists and was not staged by fastload; choose another target or remove it yourself")


def _check_room(source: str | Path, to: Path, total: int) -> None:
    free = free_bytes(to.parent)
    needed = total + (4 << 20)
    if needed > free:
        raise StoreError(
            f"not enough space to stage {source} at {to}: needs {fmt_bytes(needed)}, "
            f"{fmt_bytes(free)} free on {to.parent}"
        )


def _staging_folder(to: Path) -> Path:
    """A fresh hidden sibling of ``to`` that the copy is written into before it is renamed to ``to``."""
    tmp = to.with_name(f".{to.name}.staging-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _publish(tmp: Path, to: Path, source: str, files: int, total: int) -> None:
    """Mark the verified copy ``tmp`` as staged from ``source`` and rename it to ``to`` (replacing a staged copy)."""
    (tmp / MARKER).write_text(
        json.dumps({"source": source, "files": files, "bytes": total,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "pid": os.getpid()}, indent=1)
    )
    replace_dir(tmp, to)


def _stage_url(url: str, to: Path, *, progress: bool, log: Callable[[str], None], t0: float) -> StageResult:
    """Stage the store uploaded at ``url``: download every object (parallel ranged reads, each checked against
    the manifest's size and crc32), check every record of every store in it, then rename into place."""
    _check_target(to)
    manifest = read_manifest(url)
    _check_room(url, to, manifest.nbytes)
    tmp = _staging_folder(to)
    try:
        with tqdm(total=manifest.nbytes, unit="B", unit_scale=True, desc=f"stage -> {to}", disable=not progress) as bar:
            stats = fetch(manifest, tmp, progress=bar.update)
        yaml_path = tmp / "data.yaml"
        damaged = [r for r in verify_target(yaml_path if yaml_path.is_file() else tmp) if not r.ok]
        if damaged:  # the first failure, its first damaged records, the download's folder named as the URL
            first = "; ".join(line.strip() for line in damaged[0].format().splitlines()[:3])
            raise StoreError(f"staging {url}: {first.replace(str(tmp), url)} ({len(damaged)} store(s) failed); "
                             f"nothing was kept")
        if yaml_path.is_file():
            _point_yaml_at_copy(yaml_path, yaml_path, to, url)
        _publish(tmp, to, url, len(manifest.objects), manifest.nbytes)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    retried = f", {stats.retries} request(s) retried" if stats.retries else ""
    staged_yaml = to / "data.yaml" if (to / "data.yaml").is_file() else None
    log(f"staged {len(manifest.objects)} objects ({fmt_bytes(manifest.nbytes)}) from {url} to {to}{retried}; "
        f"every record verified" + (f"; data yaml: {staged_yaml}" if staged_yaml else ""))
    return StageResult(to, staged_yaml, len(manifest.objects), manifest.nbytes, time.perf_counter() - t0)


def _write_staged_yaml(cfg: DataConfig, tmp: Path, final: Path, split_values: dict[str, Any]) -> Path:
    raw = {k: v for k, v in dict(cfg.raw).items() if k not in ("fastload", "download")}
    raw["path"] = str(final)
    for split, value in split_values.items():
        if isinstance(value, tuple):  # ("list", split, [relative image paths])
            list_name = f"{split}.txt"
            (tmp / list_name).write_text("".join(f"./{p}\n" for p in value[2]))
            raw[split] = list_name
        else:
            raw[split] = value
    for split in list(raw):
        if split in ("train", "val", "test") and split not in split_values:
            raw.pop(split)  # a split that was not staged would point at nothing
    raw["names"] = list(cfg.names)
    raw["nc"] = int(cfg.nc)
    out = tmp / "data.yaml"
    out.write_text(f"# staged by `fastload stage` from {cfg.origin}\n" + yaml.safe_dump(raw, sort_keys=False, allow_unicode=True))
    return out


def _point_yaml_at_copy(copied: Path, original: Path, final: Path, source: str) -> None:
    """Rewrite ``copied``, the ``data.yaml`` of a staged store folder that will be ``final``, so that the copy is
    self-contained: its ``path`` (the dataset root) is ``final``, not the source's root, which may be gone or on
    another machine. The split keys keep naming the source images, absolute (resolved as ``original``, the
    yaml before staging, resolves them): the compat layers find a split's store by those paths, and ``fastload
    info`` describes a split whose images are gone from its store's index."""
    cfg = load_data_config(original)
    raw = dict(cfg.raw)
    raw["path"] = str(final)
    for split, sources in cfg.splits.items():
        paths = [str(p) for p in sources]
        raw[split] = paths[0] if len(paths) == 1 else paths
    copied.write_text(f"# staged by `fastload stage` from {source}: the stores under `fastload:` are in this folder\n"
                      + yaml.safe_dump(raw, sort_keys=False, allow_unicode=True))


def unstage(path: str | Path, *, force: bool = False, log: Callable[[str], None] = print) -> None:
    """Remove a staged copy (it must carry the marker) or a ram store segment under the shm root."""
    path = Path(path).absolute()
    if (path / MARKER).is_file():
        shutil.rmtree(path)
        log(f"removed staged copy {path}")
        return
    if path.parent == shm_root().absolute() and shm.holders_path(path).exists():  # a ram store
        shm.remove(path, force=force)
        log(f"removed ram store {path}")
        return
    if not path.exists():
        raise StoreError(f"{path} does not exist")
    raise StoreError(f"{path} was not staged by fastload (no {MARKER} in it); refusing to remove it")


def list_staged(root: str | Path) -> Iterable[Path]:
    """Staged copies directly under ``root`` (e.g. /dev/shm)."""
    root = Path(root)
    with contextlib.suppress(OSError):
        for p in root.iterdir():
            if (p / MARKER).is_file():
                yield p
