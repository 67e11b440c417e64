"""What every augmentation engine implements, and the small pieces they share.

An engine turns a list of dataset indices into YOLOv9 batches. It never decides *what* to draw:
the :class:`fastload.augment.params.ParamSampler` does (one record per output sample, a pure
function of ``(seed, epoch, index)``); engines only apply records, so the CPU, PyTorch and DALI
engines produce the same boxes for the same seed. The loader owns the order
(:func:`fastload.order.epoch_indices`) and hands each engine a :class:`StoreView` (the store as the
loader sees it: after ``min_items`` filtering and ``single_cls``).
"""
from __future__ import annotations

import abc
from typing import Any, Iterator, NamedTuple, Sequence

import numpy as np
import torch

from fastload.store.base import Sample, Store


HSV_MODES = ("worker", "consumer", "defer")


class Batch(NamedTuple):
    """One YOLOv9 batch; unpacks as ``imgs, targets, paths, shapes``.

    imgs: ``uint8 [B, 3, H, W]`` RGB (may be a channels-last view, see the engine's ``layout``).
    targets: ``float32 [N, 6]`` rows ``(index in batch, cls, xc, yc, w, h)`` normalised to ``W, H``.
    paths: the source image path of every sample.
    shapes: per sample ``None`` (mosaic) or ``((h0, w0), ((h / h0, w / w0), (padw, padh)))``.
    """

    imgs: torch.Tensor
    targets: torch.Tensor
    paths: tuple[str, ...]
    shapes: tuple[Any, ...]


class Engine(abc.ABC):
    """Applies sampled augmentation records to images and collates YOLOv9 batches.

    Args:
        store: the loader's :class:`StoreView` (indices are loader indices).
        sampler: the :class:`~fastload.augment.params.ParamSampler` (built for the same indices).
        batch_size: samples per batch; ``iter_batches`` cuts its indices into chunks of this size
            (the last one may be smaller).
        workers: CPU worker processes (engine-specific meaning for GPU engines).
        device: where ``imgs`` should live (``None``: CPU).
        hsv: ``"worker"`` (applied while rendering), ``"consumer"`` (applied to the whole batch
            where it is consumed, on ``device``, by :func:`fastload.augment.functional.torch_ops.apply_hsv_batch`)
            or ``"defer"`` (not applied; :attr:`last_gains` holds the ``float32 [B, 3]`` gains of the
            latest batch for the caller to apply on its own device).
    """

    name: str = ""

    def __init__(
        self,
        store: Store,
        sampler: Any,
        *,
        batch_size: int,
        workers: int = 0,
        device: str | torch.device | None = None,
        hsv: str = "worker",
        **options: Any,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if hsv not in HSV_MODES:
            raise ValueError(f"hsv must be one of {', '.join(HSV_MODES)}, got {hsv!r}")
        self.store = store
        self.sampler = sampler
        self.batch_size = int(batch_size)
        self.workers = int(workers)
        self.device = torch.device(device) if device is not None else None
        self.hsv = hsv
        self.options = options
        self.last_gains: torch.Tensor | None = None
        self.mosaic_closed = False
        self._closed = False

    @abc.abstractmethod
    def iter_batches(self, epoch: int, indices: np.ndarray) -> Iterator[Batch]:
        """Yield the batches of ``indices`` (loader indices, already ordered and sharded) for ``epoch``.

        Implementations call :meth:`_check_open` first.
        """

    def expect_next(self, epoch: int, indices: np.ndarray) -> None:
        """A hint, given before an iteration: the one after it will most likely be
        ``iter_batches(epoch, indices)``. An engine may start rendering those batches while the
        current epoch ends (the same batches it would render later) and must drop that work when the
        next call differs. The default ignores the hint.
        """

    def close_mosaic(self) -> None:
        """Mosaic and mixup off from now on (YOLOv9 ``--close-mosaic``).

        Takes effect from the next batch the engine plans; an engine whose records are drawn in
        other processes overrides this to tell them (or reads :attr:`mosaic_closed` when it plans).
        """
        self.sampler.close_mosaic()
        self.mosaic_closed = True

    def _check_open(self) -> None:
        """Raise if :meth:`close` ran (its workers, buffers or pipeline are gone)."""
        if self._closed:
            raise RuntimeError(f"this {self.name or type(self).__name__} engine was closed")

    def close(self) -> None:
        """Release workers, buffers and device memory. Idempotent: :meth:`_release` runs once."""
        if self._closed:
            return
        self._closed = True
        self._release()

    def _release(self) -> None:
        """The engine's own clean-up, called once by :meth:`close`."""

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- helpers shared by engines ------------------------------------------------------------------


def chunks(indices: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """Consecutive batches of ``indices``; the last may be shorter."""
    indices = np.asarray(indices, np.int64)
    return [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]


def collate_targets(labels: Sequence[np.ndarray]) -> np.ndarray:
    """YOLOv9 ``targets``: ``float32 [N, 6]`` with the sample's position in the batch prepended."""
    rows = [
        np.concatenate([np.full((len(lb), 1), k, np.float32), np.asarray(lb, np.float32).reshape(-1, 5)], 1)
        for k, lb in enumerate(labels)
        if len(lb)
    ]
    return np.concatenate(rows, 0) if rows else np.zeros((0, 6), np.float32)


def shapes_to_tuple(shapes: Any) -> Any:
    """Normalise a YOLOv9 ``shapes`` entry (lists after a trip through msgpack) back to tuples."""
    if shapes is None:
        return None
    (h0, w0), ((rh, rw), (pw, ph)) = shapes
    return ((int(h0), int(w0)), ((float(rh), float(rw)), (float(pw), float(ph))))


class StoreView(Store):
    """The store as the loader sees it: a subset of its samples, with (possibly remapped) labels.

    Engines index it with loader indices ``0..len(view)-1``; :attr:`base_indices` maps them to the
    underlying store. Reads go to the base store (its own fast paths included); any attribute the
    view does not define (backend-specific arrays, device tensors) is looked up on the base store.
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
        idx = self.base_indices.tolist()
        self.im_files = [base.im_files[i] for i in idx]
        self.labels = list(labels) if labels is not None else [base.labels[i] for i in idx]
        if len(self.labels) != len(idx):
            raise ValueError(f"{len(self.labels)} label arrays for a view of {len(idx)} samples")
        self.shapes = np.asarray(base.shapes, np.int32).reshape(-1, 2)[self.base_indices]
        self.names = list(base.names)
        self.meta = dict(base.meta)

    # the base store's identity, so engines can pick their fast path by kind
    kind = property(lambda self: self.base.kind)  # type: ignore[assignment]
    decoded = property(lambda self: self.base.decoded)  # type: ignore[assignment]
    imgsz = property(lambda self: self.base.imgsz)  # type: ignore[assignment]
    path = property(lambda self: self.base.path)  # type: ignore[assignment]

    def read_image(self, i: int) -> Sample:
        return self.base.read_image(int(self.base_indices[self.check_index(i)]))

    def load(self, i: int, imgsz: int | None = None, *, reduced: bool = False, shrink: str = "area") -> np.ndarray:
        return self.base.load(int(self.base_indices[self.check_index(i)]), imgsz, reduced=reduced, shrink=shrink)

    def close(self) -> None:
        self.base.close()

    def __getattr__(self, name: str) -> Any:
        # only called for attributes not found normally; never forward private/dunder lookups
        # (pickling and copy probe those before __init__ ran)
        if name.startswith("_") or name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def __repr__(self) -> str:
        return f"StoreView({self.base!r}, n={len(self)})"
