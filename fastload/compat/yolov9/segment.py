"""``create_dataloader`` with the official ``utils/segment/dataloaders.py`` signature, backed by
:func:`fastload.loader` with ``task="segment"``: what ``segment/train.py``, ``segment/train_dual.py``,
``segment/val.py`` and ``segment/val_dual.py`` import (one line changed, or the launcher)."""
from __future__ import annotations

from typing import Any

from fastload.compat.yolov9.dataloader import build


def create_dataloader(
    path: Any,
    imgsz: int,
    batch_size: int,
    stride: int,
    single_cls: bool = False,
    hyp: Any = None,
    augment: bool = False,
    cache: Any = False,
    pad: float = 0.0,
    rect: bool = False,
    rank: int = -1,
    workers: int = 8,
    image_weights: bool = False,
    close_mosaic: bool = False,
    quad: bool = False,
    prefix: str = "",
    shuffle: bool = False,
    mask_downsample_ratio: int = 1,
    overlap_mask: bool = False,
    **fastload_options: Any,
) -> tuple[Any, Any]:
    """YOLOv9's ``utils.segment.dataloaders.create_dataloader`` backed by :func:`fastload.loader`.

    Returns ``(loader, dataset)``; the loader yields :class:`~fastload.engines.base.SegmentBatch`
    ``(imgs, targets, paths, shapes, masks)`` as the official ``LoadImagesAndLabelsAndMasks.collate_fn`` does:
    masks at ``1 / mask_downsample_ratio`` of the image (``--mask-ratio``), one overlap mask per image with
    ``overlap_mask`` (the trainer's default; ``--no-overlap``: one per instance), its targets then ordered by
    decreasing mask area. The other arguments, ``fastload_options`` and what the trainer touches are as in
    :func:`fastload.compat.yolov9.create_dataloader` (the segment loader has no ``min_items``).
    """
    return build(path, imgsz, batch_size, stride, single_cls=single_cls, hyp=hyp, augment=augment, cache=cache, pad=pad,
                 rect=rect, rank=rank, workers=workers, image_weights=image_weights, quad=quad, min_items=0,
                 prefix=prefix, shuffle=shuffle, fastload_options=fastload_options,
                 task_keywords={"task": "segment", "mask_ratio": int(mask_downsample_ratio),
                                "overlap_mask": bool(overlap_mask)})
