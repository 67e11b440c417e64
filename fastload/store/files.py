"""The baseline store: the original image files on disk, read as encoded bytes."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from fastload.data.config import DataConfig
from fastload.data.index import DatasetIndex, build_index
from fastload.data.labels import FlatLabels
from fastload.store.base import Store, StoreError, geometry_meta


class FileStore(Store):
    """Reads each sample's original file (JPEG/PNG/...) as bytes; labels come from the scan index."""

    kind = "files"
    decoded = False

    def __init__(
        self,
        im_files: Sequence[str],
        labels: Sequence[np.ndarray],
        shapes: np.ndarray,
        names: Sequence[str],
        meta: dict[str, Any] | None = None,
        path: str | None = None,
    ) -> None:
        super().__init__()
        if not (len(im_files) == len(labels) == len(shapes)):
            raise StoreError(
                f"files store: {len(im_files)} files, {len(labels)} label arrays, {len(shapes)} shapes differ"
            )
        self.im_files = [str(f) for f in im_files]
        self.labels = FlatLabels.from_arrays(labels)  # an index's labels as they are: no object per image
        self.shapes = np.asarray(shapes, np.int32).reshape(-1, 2)
        self.names = list(names)
        self.meta = dict(meta or {})
        self.path = path

    @classmethod
    def from_index(cls, index: DatasetIndex, path: str | None = None,
                   flip_idx: Sequence[int] | None = None) -> "FileStore":
        """Wrap a :class:`fastload.data.index.DatasetIndex` (only its valid images); ``flip_idx``: the data yaml's,
        recorded with pose labels (``meta["geometry"]``, as the converted stores record it)."""
        labels = FlatLabels.from_arrays(index.labels)
        meta = {"kind": cls.kind, "n": len(index.im_files), "names": list(index.names),
                **geometry_meta(labels, index.kpt_shape, flip_idx)}
        return cls(index.im_files, labels, index.shapes, index.names, meta=meta, path=path)

    @classmethod
    def from_config(cls, cfg: DataConfig, split: str = "train", **index_kw: Any) -> "FileStore":
        """Scan ``split`` of a :class:`DataConfig` (labels cache honoured) and wrap the result."""
        index_kw.setdefault("progress", False)
        index = build_index(cfg, split, **index_kw)
        source = cfg.splits.get(split)
        return cls.from_index(index, path=str(source[0]) if source else None, flip_idx=cfg.flip_idx)

    def read_image(self, i: int) -> bytes:
        i = self.check_index(i)
        try:
            return Path(self.im_files[i]).read_bytes()
        except OSError as e:
            raise self.damaged(i, "read", f"cannot read the file ({e.strerror or e})") from None
