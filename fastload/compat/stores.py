"""The store a compat layer's loader reads: the image folder (or ``.txt`` list) a trainer passes for a
split, opened as ``fastload.open_store`` would open a data.yaml naming it, or the matching split of a
data.yaml ``fastload convert`` wrote."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from fastload.data.config import DataConfig, load_data_config
from fastload.data.images import LoadRule
from fastload.store.base import Store
from fastload.store.factory import open_store
from fastload.store.kinds import KINDS

ANY_CLASS = 2**31 - 1  # nc when the trainer checks class ids itself (YOLOv9 checks labels against nc later)


def split_config(path: Any, *, owner: str, names: Sequence[str] = (), nc: int = ANY_CLASS,
                 kpt_shape: Sequence[int] | None = None, flip_idx: Sequence[int] | None = None) -> DataConfig:
    """A DataConfig whose ``train`` split is the image folder / list file(s) ``path`` a trainer passes (pose
    labels: the trainer's ``kpt_shape`` and ``flip_idx``)."""
    sources = [Path(p) for p in (path if isinstance(path, (list, tuple)) else [path])]
    for p in sources:
        if not p.exists():
            raise FileNotFoundError(f"{owner}: {p} does not exist (expected an image folder or a .txt list)")
    root = sources[0].parent if sources else Path.cwd()
    return DataConfig(yaml_path=None, root=root, splits={"train": sources}, names=list(names), nc=nc,
                      kpt_shape=None if kpt_shape is None else (int(kpt_shape[0]), int(kpt_shape[1])),
                      flip_idx=None if flip_idx is None else [int(k) for k in flip_idx])


def converted_split(converted: DataConfig, sources: list[Path], *, owner: str) -> str:
    """The split of a ``fastload convert`` config whose image sources are the ones the trainer passes."""
    want = sorted(str(p.resolve()) for p in sources)
    for split, paths in converted.splits.items():
        if sorted(str(Path(p).resolve()) for p in paths) == want:
            return split
    have = ", ".join(f"{s}: {[str(p) for p in ps]}" for s, ps in converted.splits.items())
    raise ValueError(f"{owner}: store={converted.origin} has no split with the images "
                     f"{[str(p) for p in sources]} (it has {have})")


def open_split_store(cfg: DataConfig, *, kind: str, imgsz: int, store: str, owner: str,
                     load_rule: LoadRule = "yolov9") -> Store:
    """Open the ``train`` split of ``cfg`` (from :func:`split_config`).

    ``store``: the layer's store option: ``auto`` (then ``kind``, what the trainer's cache argument asks
    for: ``auto``, ``ram`` or ``disk``), a store kind, or the data.yaml (or its folder) that ``fastload
    convert`` wrote, whose split with the same images is opened as ``kind`` asks. ``load_rule``: the loaded-image
    rule of the loader's recipe (a decoded store of another is refused, or skipped by ``auto``).
    """
    if store == "auto" or store in KINDS:
        return open_store(cfg, "train", kind=kind if store == "auto" else store, imgsz=imgsz, load_rule=load_rule)
    target = Path(store)
    if target.is_dir():
        target = target / "data.yaml"
    if not target.is_file():
        raise ValueError(f"{owner}: store={store!r} is neither a store kind (auto, {', '.join(KINDS)}) "
                         f"nor a data.yaml written by `fastload convert`")
    converted = load_data_config(target)
    split = converted_split(converted, cfg.splits["train"], owner=owner)
    return open_store(converted, split, kind=kind, imgsz=imgsz, load_rule=load_rule)
