"""``data.yaml`` parsing, as YOLOv5/YOLOv9 users write it.

Accepted keys::

    path: ../datasets/coco      # dataset root; relative to the yaml's folder (absent: the yaml's folder)
    train: images/train2017     # a folder, a .txt list of image paths, or a list of those
    val: [val.txt, images/extra]
    test:                       # optional
    nc: 80                      # optional when names is given; must agree with it
    names: [person, ...]        # or {0: person, 1: bicycle}; absent with nc: class0, class1, ...
    kpt_shape: [17, 3]          # pose datasets: keypoints per row, values per keypoint (2: x y, 3: x y visibility)
    flip_idx: [0, 2, 1, ...]    # pose: the keypoint each keypoint becomes in a left-right flip (a permutation)
    download: ...               # NEVER executed (a one-line notice says so)
    fastload:                   # written by `fastload convert`: split -> kind -> store path
      train: {lmdb: stores/train.lmdb}

Every problem raises :class:`DataConfigError` naming the yaml file and the key.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

__all__ = ["DataConfig", "DataConfigError", "load_data_config", "SPLITS"]

SPLITS: tuple[str, ...] = ("train", "val", "test")
_log = logging.getLogger("fastload.data")
_download_notice_given = False


class DataConfigError(ValueError):
    """A data.yaml (or dict) that cannot be used; the message names the file and the problem."""


@dataclass
class DataConfig:
    """A resolved data.yaml.

    ``splits`` maps each present split to its sources (folders or ``.txt`` list files, absolute
    or relative to the current directory when the config came from a dict without ``path``);
    ``stores`` is ``{split: {kind: path}}`` from the ``fastload:`` key.
    """

    yaml_path: Path | None
    root: Path
    splits: dict[str, list[Path]]
    names: list[str]
    nc: int
    stores: dict[str, dict[str, Path]] = field(default_factory=dict)
    raw: dict = field(default_factory=dict)
    kpt_shape: tuple[int, int] | None = None  # (K, D) of pose labels; None: no keypoints
    flip_idx: list[int] | None = None

    @property
    def origin(self) -> str:
        """How error messages name this config: the yaml path, or ``<dict>``."""
        return str(self.yaml_path) if self.yaml_path else "<dict>"

    def sources(self, split: str) -> list[Path]:
        """The sources of ``split``; raises :class:`DataConfigError` naming the yaml and key when absent."""
        if split not in self.splits:
            present = ", ".join(self.splits) or "none"
            raise DataConfigError(f"{self.origin}: no '{split}' key (splits present: {present})")
        return self.splits[split]


def _fail(origin: str, message: str) -> DataConfigError:
    return DataConfigError(f"{origin}: {message}")


def _resolve_root(raw: Mapping[str, Any], base: Path, origin: str) -> Path:
    """Dataset root: ``path`` relative to the yaml's folder, with YOLOv5's cwd-relative reading as fallback."""
    value = raw.get("path")
    if value in (None, ""):
        return base
    if not isinstance(value, (str, os.PathLike)):
        raise _fail(origin, f"'path' must be a string, got {type(value).__name__}")
    p = Path(os.path.expanduser(str(value)))
    if p.is_absolute():
        return p
    beside = base / p
    # YOLOv5/v9 resolve a relative `path` against the repo/cwd (`path: ../datasets/coco` in
    # yolov9/data/coco.yaml); honour that when the yaml-relative folder does not exist.
    if not beside.exists() and p.exists():
        return Path(os.path.abspath(p))
    return Path(os.path.normpath(beside))


def _parse_names(raw: Mapping[str, Any], origin: str) -> tuple[list[str], int]:
    names = raw.get("names")
    nc = raw.get("nc")
    if nc is not None:
        if isinstance(nc, bool) or not isinstance(nc, int) or nc < 1:
            raise _fail(origin, f"'nc' must be a positive integer, got {nc!r}")
    if names is None:
        if nc is None:
            raise _fail(origin, "neither 'names' nor 'nc' is given")
        return [f"class{i}" for i in range(nc)], nc
    if isinstance(names, Mapping):
        try:
            keys = sorted(int(k) for k in names)
        except (TypeError, ValueError):
            raise _fail(origin, f"'names' dict keys must be class ids 0..n-1, got {list(names)!r}") from None
        if keys != list(range(len(keys))):
            raise _fail(origin, f"'names' dict keys must be 0..{len(keys) - 1} without gaps, got {keys}")
        by_id = {int(k): v for k, v in names.items()}
        names_list = [str(by_id[i]) for i in keys]
    elif isinstance(names, (list, tuple)):
        names_list = [str(n) for n in names]
    else:
        raise _fail(origin, f"'names' must be a list or a {{id: name}} dict, got {type(names).__name__}")
    if not names_list:
        raise _fail(origin, "'names' is empty")
    if nc is not None and nc != len(names_list):
        raise _fail(origin, f"'nc' is {nc} but 'names' lists {len(names_list)} classes; make them agree (or drop 'nc')")
    return names_list, len(names_list)


def _parse_keypoints(raw: Mapping[str, Any], origin: str) -> tuple[tuple[int, int] | None, list[int] | None]:
    """``kpt_shape`` as (K, D) with K >= 1 and D 2 or 3, and ``flip_idx`` as a permutation of 0..K-1 (only with it)."""
    shape, flip = raw.get("kpt_shape"), raw.get("flip_idx")
    if shape is None:
        if flip is not None:
            raise _fail(origin, "'flip_idx' is given without 'kpt_shape'; add kpt_shape: [K, D] (pose labels) or "
                                "drop it")
        return None, None
    if (not isinstance(shape, (list, tuple)) or len(shape) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in shape)
            or shape[0] < 1 or shape[1] not in (2, 3)):
        raise _fail(origin, f"'kpt_shape' must be [K, D]: K >= 1 keypoints of D = 2 (x y) or 3 (x y visibility) "
                            f"values, got {shape!r}")
    k = int(shape[0])
    if flip is None:
        return (k, int(shape[1])), None
    if (not isinstance(flip, (list, tuple)) or sorted(flip) != list(range(k))
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in flip)):
        raise _fail(origin, f"'flip_idx' must list each keypoint 0..{k - 1} once (kpt_shape has {k}), got {flip!r}")
    return (k, int(shape[1])), [int(v) for v in flip]


def _parse_split(value: Any, root: Path, key: str, origin: str) -> list[Path]:
    items = value if isinstance(value, (list, tuple)) else [value]
    out: list[Path] = []
    for item in items:
        if not isinstance(item, (str, os.PathLike)) or str(item).strip() == "":
            raise _fail(origin, f"'{key}' entries must be folder or .txt paths, got {item!r}")
        p = Path(os.path.expanduser(str(item).strip()))
        out.append(p if p.is_absolute() else Path(os.path.normpath(root / p)))
    return out


def _parse_stores(value: Any, base: Path, origin: str) -> dict[str, dict[str, Path]]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _fail(origin, f"'fastload' must map split -> kind -> store path, got {type(value).__name__}")
    stores: dict[str, dict[str, Path]] = {}
    for split, kinds in value.items():
        if kinds is None:
            continue
        if not isinstance(kinds, Mapping):
            raise _fail(origin, f"'fastload.{split}' must map kind -> store path, got {kinds!r}")
        stores[str(split)] = {}
        for kind, p in kinds.items():
            if not isinstance(p, (str, os.PathLike)):
                raise _fail(origin, f"'fastload.{split}.{kind}' must be a path, got {p!r}")
            q = Path(os.path.expanduser(str(p)))
            stores[str(split)][str(kind)] = q if q.is_absolute() else Path(os.path.normpath(base / q))
    return stores


def _notice_download(origin: str) -> None:
    """YOLOv5/v9 may execute `download:` (a URL or a Python/bash script); fastload never does."""
    global _download_notice_given
    if not _download_notice_given:
        _download_notice_given = True
        _log.warning("%s: 'download' key ignored (fastload never downloads or runs scripts)", origin)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """``line L, column C: <problem>`` of a YAML error (PyYAML's own message spans several lines)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + " ".join(str(problem).split())


def load_data_config(data: str | os.PathLike | Mapping[str, Any] | DataConfig) -> DataConfig:
    """Parse a data.yaml path (or an already-loaded dict) into a :class:`DataConfig`.

    Relative paths in a yaml resolve against the yaml's folder; in a dict against the current
    directory. Raises :class:`DataConfigError` for an unreadable file or bad keys.
    """
    if isinstance(data, DataConfig):
        return data
    if isinstance(data, Mapping):
        raw = dict(data)
        yaml_path = None
        base = Path.cwd()
        origin = "<dict>"
    elif isinstance(data, (str, os.PathLike)):
        yaml_path = Path(os.path.abspath(os.path.expanduser(str(data))))
        origin = str(yaml_path)
        if not yaml_path.is_file():
            raise DataConfigError(f"{origin}: data yaml not found")
        try:
            raw = yaml.safe_load(yaml_path.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise DataConfigError(f"{origin}: not valid YAML ({_yaml_problem(exc)}); fix the syntax there") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise DataConfigError(f"{origin}: cannot read the yaml ({exc})") from None
        if raw is None:
            raise DataConfigError(f"{origin}: the file is empty; a data.yaml needs 'train' and/or 'val', and 'names'")
        if not isinstance(raw, dict):
            raise DataConfigError(f"{origin}: expected a mapping of keys, got {type(raw).__name__}")
        base = yaml_path.parent
    else:
        raise DataConfigError(f"data must be a yaml path, dict or DataConfig, got {type(data).__name__}")

    if raw.get("download") is not None:
        _notice_download(origin)
    root = _resolve_root(raw, base, origin)
    names, nc = _parse_names(raw, origin)
    splits = {k: _parse_split(raw[k], root, k, origin) for k in SPLITS if raw.get(k) not in (None, "", [])}
    if "train" not in splits and "val" not in splits:
        raise _fail(origin, "no 'train' or 'val' key (each a folder, a .txt list, or a list of those)")
    stores = _parse_stores(raw.get("fastload"), base, origin)
    kpt_shape, flip_idx = _parse_keypoints(raw, origin)
    return DataConfig(yaml_path=yaml_path, root=root, splits=splits, names=names, nc=nc, stores=stores, raw=raw,
                      kpt_shape=kpt_shape, flip_idx=flip_idx)
