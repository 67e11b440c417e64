"""A batch's labels for each loader task: the one place the engines turn records into targets and the task's
extra array (masks, keypoints or oriented boxes).

:meth:`TaskLabels.batch` is what a renderer calls once per batch, after drawing its pixels: detection moves the boxes
(:func:`~fastload.augment.boxes.batch_targets`, unchanged); the other tasks move every instance's points with
:func:`~fastload.augment.geometry.transform_geometry` and build what their batch carries from them. Masks are
rasterised here, in the renderer, once per batch, at the output size in each polygon's ``mask_ratio``-aligned box
and shrunk (:mod:`fastload.augment.masks`: the references' masks bit for bit, cheaper than their full-size fill;
filling at the reduced size is cheaper still but not the same masks, docs/augmentation.md measures the three).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from fastload.augment.boxes import batch_targets
from fastload.augment.geometry import LoadedPolygons, RecordGeometry, move_record, obb_xywhr, transform_geometry
from fastload.augment.masks import batch_masks
from fastload.augment.params import Recipe, SampleParams
from fastload.data.labels import FlatLabels

__all__ = ["TaskLabels"]


@dataclass(frozen=True)
class TaskLabels:
    """What a loader task's batches carry, and how to build it (:meth:`batch`).

    Attributes:
        task: ``"detect"``, ``"segment"``, ``"pose"`` or ``"obb"``.
        mask_ratio, overlap_mask: ``"segment"``: the masks' shrink factor, and overlap masks (one per image) or one
            mask per instance.
        kpt_count: ``"pose"``: keypoints per instance (the data yaml's ``kpt_shape[0]``; the shape of a batch
            without instances).
        flip_idx: ``"pose"``: the keypoint order after a flip (the data yaml's), None: unchanged.
    """

    task: str = "detect"
    mask_ratio: int = 4
    overlap_mask: bool = True
    kpt_count: int = 0
    flip_idx: tuple[int, ...] | None = None

    def move(self, record: SampleParams, labels: FlatLabels, recipe: Recipe, loaded: LoadedPolygons
             ) -> RecordGeometry | None:
        """``record``'s segments moved (:func:`~fastload.augment.geometry.move_record`) when its pixels need them: a
        record with copy-paste, whose pixel mask is filled from the pasted outlines found on the way (a renderer moves
        its labels before drawing it and hands them to :meth:`batch`); None for the others, which :meth:`batch`
        moves together (cheaper than one by one), and for the tasks without copy-paste."""
        if self.task != "segment":
            return None
        if all(image is None or image.copy_paste is None for image in (record.image, record.mixup)):
            return None
        return move_record(record, labels.image, recipe, self.task, loaded)  # type: ignore[arg-type]

    def batch(self, records: Sequence[SampleParams], labels: FlatLabels, recipe: Recipe,
              loaded: LoadedPolygons | None = None, moved: Sequence[RecordGeometry | None] | None = None
              ) -> tuple[np.ndarray, np.ndarray | None]:
        """``(targets, extra)`` of one batch of ``records`` (one output size), read from ``labels`` (loader indices);
        ``loaded``: the memo of ``labels``' resampled polygons the caller keeps between batches (None: none kept);
        ``moved``: each record's :meth:`move`, when the caller found them (None, for all or for one: moved here).

        ``targets``: float32 [N, 6] ``(position in the batch, cls, xc, yc, w, h)`` normalised to the output.
        ``extra``: None for ``"detect"``; ``"segment"``: the masks (:class:`~fastload.engines.base.SegmentBatch`;
        with ``overlap_mask`` each image's targets reordered by decreasing mask area, as the references reorder
        them); ``"pose"``: float32 [N, K, 3] keypoints normalised, flipped ones reordered through ``flip_idx``;
        ``"obb"``: float32 [N, 5] ``(xc, yc, w, h, angle)`` normalised.
        """
        if self.task == "detect":
            return batch_targets(records, labels), None
        geometry = transform_geometry(records, labels.image, recipe, self.task, loaded, moved)  # type: ignore[arg-type]
        h, w = geometry.out_hw
        if self.task == "segment":
            masks, order = batch_masks(geometry, len(records), self.mask_ratio, self.overlap_mask)
            owner = geometry.targets[:, 0].astype(np.intp)
            outlined = np.bincount(owner[np.diff(geometry.offsets) > 0], minlength=len(records))
            if (outlined == 0).any():  # the references give an image without polygons (no instance, or YOLOv9's box
                # rows) float zeros, and their collate's concatenation promotes the batch's masks to float32
                masks = masks.astype(np.float32)
            return geometry.targets[order], masks
        if self.task == "pose":
            k = int(np.diff(geometry.offsets)[0]) if len(geometry) else int(self.kpt_count)
            keypoints = geometry.flipped_points(self.flip_idx).reshape(len(geometry), k, 3).astype(np.float32)
            keypoints[..., 0] /= w
            keypoints[..., 1] /= h
            return geometry.targets, keypoints
        return geometry.targets, obb_xywhr(geometry)
