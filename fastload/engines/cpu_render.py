"""Rendering one whole batch on the CPU: the work a CPU worker (or the main process) does per task.

:meth:`BatchRenderer.render` is the per-batch entry point: it samples the batch's records with
:meth:`~fastload.augment.params.ParamSampler.sample_batch` (a pure function of ``(seed, epoch,
index)`` and, with ``partners="batch"``, of the batch's indices, so the result does not depend on
which process renders it), draws every sample straight into the batch buffer with
:func:`fastload.augment.pipeline.render_sample` and moves the boxes of the whole batch with
:func:`fastload.augment.boxes.batch_targets`. With ``partners="batch"`` every image the batch reads
is one of its own, so each is loaded (decoded) once per batch, before drawing.

Damaged records: every record is drawn with :meth:`~fastload.augment.params.ParamSampler.first_usable`,
which takes the sample's own draw when all the images it reads load, else the first replacement draw
whose images do (a pure function of ``(seed, epoch, index, attempt)``, so the batch is the same in any
process). A record whose image fails its check (:class:`~fastload.store.base.DamagedRecordError`) is
remembered by this process (never read again) and reported once in :attr:`SlotResult.damaged`; with
``strict=True`` the error is raised instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from fastload.augment.geometry import LoadedPolygons
from fastload.augment.functional.tiles import AxisKernel, check_axis_kernel
from fastload.augment.params import ParamSampler, image_of
from fastload.augment.pipeline import render_sample
from fastload.augment.task_labels import TaskLabels
from fastload.data.images import ShrinkFilter
from fastload.data.labels import FlatLabels
from fastload.engines.shm_cache import DecodeCache
from fastload.store.base import DamagedRecords, Store

if TYPE_CHECKING:  # a name for annotations only: importing engines.base would load torch into Ray actors
    from fastload.engines.base import Layout


def batch_view(flat: np.ndarray, b: int, h: int, w: int, layout: str) -> np.ndarray:
    """The first ``b*h*w*3`` bytes of the flat uint8 buffer ``flat`` as ``[b, h, w, 3]`` (nhwc) or ``[b, 3, h, w]``
    (nchw): the batch buffers the renderer draws into (shared slots, an actor's reused buffer)."""
    n = b * h * w * 3
    if n > flat.size:
        raise ValueError(f"batch {b}x{h}x{w}x3 does not fit a {flat.size}-byte slot")
    return flat[:n].reshape((b, h, w, 3) if layout == "nhwc" else (b, 3, h, w))


@dataclass
class SlotResult:
    """What rendering a batch into a slot returns besides the pixels (which are in the slot)."""

    hw: tuple[int, int]
    targets: np.ndarray  # float32 [N, 6]
    extra: np.ndarray | None  # the task's array beside the targets (TaskLabels.batch), None for detection
    shapes: list[Any]
    gains: np.ndarray | None  # float32 [B, 3] HSV gains still to apply (hsv_on consumer/defer), else None
    images: np.ndarray  # int64 [B] the image each sample shows (a replacement's when its own was damaged)
    replaced: int  # samples of the batch drawn again because an image they read was damaged
    damaged: list[list[Any]]  # DamagedRecordError.fields() of each damaged record this process met first here


class BatchRenderer:
    """Everything a process needs to render batches; built once, before the workers fork.

    Args:
        store: the loader's store view.
        sampler: the parameter sampler (its ``imgsz`` is the long side of loaded images).
        cache: the shared decoded-image cache for encoded stores (None: decode on every read).
        hsv_in_worker: apply the HSV gains while rendering (False: return them for the consumer).
        layout: ``"nhwc"`` (render straight into the slot) or ``"nchw"`` (render into a scratch
            image, then one transposing copy into the CHW slot).
        reduced_decode: decode large JPEGs at a reduced DCT scale (see :meth:`Store.load`).
        axis_kernel: ``"warp"``, ``"resize"`` or None (the faster for the installed OpenCV), see
            :func:`fastload.augment.functional.tiles.default_axis_kernel`.
        shrink: the filter encoded stores are shrunk to the loaded size with, ``"area"`` or ``"linear"``
            (see :meth:`Store.load`).
        strict: raise :class:`~fastload.store.base.DamagedRecordError` at the first damaged record
            (False: replace the samples that read it, see the module docstring).
        task_labels: what the batches carry beside the boxes (detection by default).
    """

    def __init__(
        self,
        store: Store,
        sampler: ParamSampler,
        *,
        cache: DecodeCache | None = None,
        hsv_in_worker: bool = True,
        layout: Layout = "nhwc",
        reduced_decode: bool = False,
        axis_kernel: AxisKernel | None = None,
        shrink: ShrinkFilter = "area",
        strict: bool = False,
        jpeg_decoder: str | None = None,
        task_labels: TaskLabels = TaskLabels(),
    ) -> None:
        self.store = store
        self.sampler = sampler
        self.imgsz = int(sampler.imgsz)
        self.cache = cache
        self.hsv_in_worker = hsv_in_worker
        self.layout = layout
        self.reduced_decode = bool(reduced_decode)
        self.axis_kernel = check_axis_kernel(axis_kernel)
        self.shrink = shrink
        # only when chosen: a Store subclass whose load() predates the keyword keeps working without it
        self._decoder = {} if jpeg_decoder is None else {"decoder": jpeg_decoder}
        self._rule = {} if sampler.load_rule == "yolov9" else {"rule": sampler.load_rule}  # (the same)
        self.labels = FlatLabels.from_arrays(store.labels)  # (a view's already are: no copy)
        self.task_labels = task_labels
        self.loaded_polygons = LoadedPolygons()  # of self.labels, kept between batches
        self._scratch: np.ndarray | None = None
        self.decodes = 0  # encoded images this process decoded (cache misses included, hits not)
        self.damaged = DamagedRecords(strict)

    # -- images ---------------------------------------------------------------------------------------
    def _load(self, i: int) -> np.ndarray:
        if not self.store.decoded:
            self.decodes += 1
        return self.store.load(int(i), self.imgsz, reduced=self.reduced_decode, shrink=self.shrink,
                               **self._decoder, **self._rule)

    def get_image(self, i: int) -> np.ndarray:
        """Loaded RGB HWC uint8 image of loader index ``i`` (decoded stores: a zero-copy view)."""
        if self.cache is not None and not self.store.decoded:
            return self.cache.get(int(i), self._load)
        return self._load(i)

    # -- state that the consumer may change between epochs ------------------------------------------------
    def sync(self, mosaic_closed: bool) -> None:
        """Bring this process's sampler copy in line with the consumer's (forked workers hold copies)."""
        if mosaic_closed:  # closing is idempotent: no need to remember it
            self.sampler.close_mosaic()

    # -- the work ------------------------------------------------------------------------------------------
    def _draw(self, epoch: int, ids: np.ndarray, params: list, out: np.ndarray, h: int, w: int) -> list:
        """Draw the samples ``ids`` (their records ``params``, replaced in place when one reads a damaged image)
        into ``out``; returns each record's labels moved before its pixels (:meth:`TaskLabels.move`)."""
        by_batch = self.sampler.partners == "batch"
        moved = []
        loaded: dict[int, np.ndarray] = {}
        if by_batch:  # every source is one of the batch's own images: load each once
            for i in dict.fromkeys(image_of(ids, len(self.sampler.loaded_shapes)).tolist()):  # ids may be sample ids
                self.damaged.load_into(i, loaded, self.get_image)
        for k, sample_id in enumerate(ids.tolist()):
            images = loaded if by_batch else {}  # a sample's own images, dropped once it is drawn
            p = params[k] = self.sampler.first_usable(epoch, sample_id, lambda r: self.damaged.load_all(r.sources, images, self.get_image),
                                                      ids if by_batch else None, record=params[k])
            # the labels first: copy-paste's pixel mask is filled from outlines found while moving them
            moved.append(self.task_labels.move(p, self.labels, self.sampler.recipe, self.loaded_polygons))
            if self.layout == "nhwc":
                render_sample(p, images.__getitem__, out=out[k], hsv=self.hsv_in_worker, axis_kernel=self.axis_kernel,
                              labels=self.labels.image, moved=moved[-1])
            else:
                if self._scratch is None or self._scratch.shape != (h, w, 3):
                    self._scratch = np.empty((h, w, 3), np.uint8)
                img = render_sample(p, images.__getitem__, out=self._scratch, hsv=self.hsv_in_worker,
                                    axis_kernel=self.axis_kernel, labels=self.labels.image, moved=moved[-1])
                np.copyto(out[k], img.transpose(2, 0, 1))
            if not by_batch and self.cache is not None:  # the sample is drawn: its images are not read again
                self.cache.release()
        return moved

    def render(self, epoch: int, indices: np.ndarray, slot_array: Callable[[int, int, int], np.ndarray]) -> SlotResult:
        """Render ``indices`` into the batch buffer given by ``slot_array(b, h, w)`` (a numpy view).

        All samples of a batch must share one output size (square ``imgsz`` in training, the rect
        batch shape in validation).
        """
        params = self.sampler.sample_batch(epoch, indices)
        hws = {tuple(int(v) for v in p.image.out_hw) for p in params}
        if len(hws) != 1:
            raise ValueError(f"samples of one batch have different output sizes {sorted(hws)} (indices {list(indices)})")
        h, w = hws.pop()
        try:
            moved = self._draw(epoch, np.asarray(indices, np.int64), params, slot_array(len(params), h, w), h, w)
        finally:
            if self.cache is not None:  # the batch is drawn: none of its images is read again
                self.cache.release()
        gains = None
        if not self.hsv_in_worker:
            gains = np.array([p.hsv_gain for p in params], np.float32).reshape(-1, 3)
        targets, extra = self.task_labels.batch(params, self.labels, self.sampler.recipe, self.loaded_polygons, moved)
        return SlotResult((h, w), targets, extra, [p.shapes for p in params], gains,
                          np.array([p.index for p in params], np.int64), sum(p.attempt > 0 for p in params),
                          self.damaged.take_found())

