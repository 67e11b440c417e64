"""The store as a loader sees it: a subset of another store's samples, with its own labels.

:func:`fastload.loader` drops images (``min_items``) and rewrites labels (``single_cls``) without
touching the store it opened: it wraps that store in a :class:`StoreView` and hands the view to the
engine, which indexes it with loader indices ``0 .. len(view) - 1``.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from fastload.data.images import LoadRule, ShrinkFilter
from fastload.data.labels import FlatLabels
from fastload.data.paths import PathList
from fastload.store.base import ReadAhead, ResidentImages, Sample, Shards, Store


class StoreView(Store):
    """Samples ``base_indices`` of ``base``, with ``labels`` replacing the base store's when given.

    Reads go to the base store (its own fast paths included). The view has the base store's
    identity (``kind``, ``decoded``, ``imgsz``, ``path``), so engines pick their path by kind, and
    :meth:`resident_images` re-indexes the base store's device-resident images to view indices.

    Attributes beyond :class:`Store`'s:
        base: the underlying store (closing the view closes it).
        base_indices: ``int64 [n]``: view index ``i`` is sample ``base_indices[i]`` of ``base``.
    """

    def __init__(
        self,
        base: Store,
        indices: np.ndarray | None = None,
        labels: Sequence[np.ndarray] | None = None,
    ) -> None:
        super().__init__()
        self.base = base
        n = len(base)
        self.base_indices = np.arange(n, dtype=np.int64) if indices is None else np.asarray(indices, np.int64)
        if len(self.base_indices) and (self.base_indices.min() < 0 or self.base_indices.max() >= n):
            raise IndexError(f"store view indices out of range for {base!r}")
        every = len(self.base_indices) == n and bool((self.base_indices == np.arange(n)).all())
        # the base's own per-image arrays when the view keeps every sample: nothing per image is copied
        if every:
            self.im_files = base.im_files
        elif isinstance(base.im_files, PathList):
            self.im_files = base.im_files.subset(self.base_indices)
        else:
            self.im_files = [base.im_files[i] for i in self.base_indices.tolist()]
        if labels is None:
            base_labels = FlatLabels.from_arrays(base.labels)
            self.labels = base_labels if every else base_labels.subset(self.base_indices)
        else:
            self.labels = FlatLabels.from_arrays(labels)
        if len(self.labels) != len(self.base_indices):
            raise ValueError(f"{len(self.labels)} label arrays for a view of {len(self.base_indices)} samples")
        self.shapes = np.asarray(base.shapes, np.int32).reshape(-1, 2)[self.base_indices]
        self.names = list(base.names)
        self.meta = dict(base.meta)
        self.kind = base.kind
        self.decoded = base.decoded
        self.imgsz = base.imgsz
        self.load_rule = base.load_rule
        self.path = base.path

    def read_image(self, i: int) -> Sample:
        return self.base.read_image(int(self.base_indices[self.check_index(i)]))

    def shards(self) -> Shards | None:
        layout = self.base.shards()
        return None if layout is None else Shards(layout.ids[self.base_indices], layout.window)

    def read_ahead(self, indices: np.ndarray) -> ReadAhead | None:
        return self.base.read_ahead(self.base_indices[np.asarray(indices, np.int64)])

    def read_encoded(self, i: int) -> bytes:
        return self.base.read_encoded(int(self.base_indices[self.check_index(i)]))

    def load(self, i: int, imgsz: int | None = None, *, reduced: bool = False,
             shrink: ShrinkFilter = "area", decoder: str | None = None, rule: LoadRule = "yolov9") -> np.ndarray:
        # the decoder and rule only when chosen: a base whose load() predates the keywords keeps working without them
        chosen = ({} if decoder is None else {"decoder": decoder}) | ({} if rule == "yolov9" else {"rule": rule})
        return self.base.load(int(self.base_indices[self.check_index(i)]), imgsz, reduced=reduced, shrink=shrink,
                              **chosen)

    def nbytes(self, i: int) -> int:
        return self.base.nbytes(int(self.base_indices[self.check_index(i)]))

    def resident_images(self) -> ResidentImages | None:
        res = self.base.resident_images()
        if res is None:
            return None
        return ResidentImages(res.pixels, res.offsets[self.base_indices], res.hw[self.base_indices], res.device)

    def close(self) -> None:
        self.base.close()

    def __repr__(self) -> str:
        return f"StoreView({self.base!r}, n={len(self)})"
