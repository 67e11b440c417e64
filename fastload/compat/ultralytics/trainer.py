"""``FastloadTrainer`` and ``FastloadValidator``: Ultralytics' trainer and validator of the model's task
(detect, segment, pose, obb) with loaders from :func:`fastload.loader`
(:func:`fastload.compat.ultralytics.loader.build_loader`).

``FastloadTrainer`` is the one entry point: constructed, it becomes the trainer of the task its arguments name
(``model.train(trainer=FastloadTrainer)`` passes the model's task), one of :data:`TRAINERS`, each a
``FastloadTrainer`` and the task's Ultralytics trainer (``FastloadSegmentationTrainer`` is a
``SegmentationTrainer``); a subclass of it is joined with the task's Ultralytics trainer the same way.
``FastloadValidator`` likewise (:data:`VALIDATORS`)."""
from __future__ import annotations

import functools
import os
from typing import Any, Mapping, TypeVar

import numpy as np
from ultralytics.cfg import get_cfg
from ultralytics.models.yolo.detect import DetectionTrainer, DetectionValidator
from ultralytics.models.yolo.obb import OBBTrainer, OBBValidator
from ultralytics.models.yolo.pose import PoseTrainer, PoseValidator
from ultralytics.models.yolo.segment import SegmentationTrainer, SegmentationValidator
from ultralytics.utils import DEFAULT_CFG, LOGGER, colorstr
from ultralytics.utils.plotting import plot_labels
from ultralytics.utils.torch_utils import unwrap_model

from fastload.compat.ultralytics.loader import (LoaderRequest, UltralyticsLoader, build_loader, check_arguments,
                                                served_task)
from fastload.compat.ultralytics.options import UltralyticsOptions, override_environment


def _take_fastload_overrides(overrides: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(Ultralytics' own arguments, the fastload_* overrides)``: Ultralytics refuses keys it does not know."""
    given = dict(overrides or {})
    mine = {k: given.pop(k) for k in list(given) if k.startswith("fastload_")}
    return given, mine


_Class = TypeVar("_Class", bound=type)


@functools.lru_cache(maxsize=None)
def _joined(cls: _Class, base: type) -> _Class:
    """``cls`` (a subclass of a fastload entry point) joined with the task's Ultralytics ``base``, named as ``cls``."""
    return type(cls.__name__, (cls, base), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                            "__doc__": cls.__doc__})


def _for_task(cls: _Class, entry: type, served: Mapping[str, type], ultralytics: Mapping[str, type],
              task: str) -> _Class:
    """The class an instance of ``cls`` is made of for ``task``: the entry point's class of the task, ``cls`` when it
    already is one of the task's Ultralytics class, else ``cls`` joined with it."""
    if cls is entry:
        return served[task]  # type: ignore[return-value]
    return cls if issubclass(cls, ultralytics[task]) else _joined(cls, ultralytics[task])


def _task(cfg: Any, overrides: Any) -> str:
    """The task the arguments name (the overrides', else the configuration's), refused in one line unless served."""
    task = dict(overrides or {}).get("task")
    if task is None:
        task = get_cfg(cfg).task
    return served_task(task)


class FastloadTrainer(DetectionTrainer):
    """Ultralytics' trainer of the model's task whose train and validation loaders are fastload's.

    ``YOLO("yolov9t.yaml").train(data="data.yaml", trainer=FastloadTrainer, ...)``, and as well for a segment,
    pose or obb model (``yolov8n-seg.yaml``...): the trainer is then the task's (:data:`TRAINERS`), its batches
    carry the task's labels (masks at ``mask_ratio``, ``overlap_mask``; keypoints; xywhr boxes). Every data argument
    keeps its meaning (``imgsz``, ``batch``, ``workers``, ``cache`` (ram: one shared-memory copy per
    machine), ``rect``, ``close_mosaic``, ``fraction``, ``single_cls``, ``classes``, the augmentation
    hyperparameters); one fastload cannot honour is refused with one line
    (:class:`~fastload.compat.ultralytics.loader.UnsupportedArgument`). fastload's options come as
    ``fastload_<name>=...`` overrides or ``FASTLOAD_*`` variables (:data:`~fastload.compat.ultralytics.options.OPTIONS`).
    """

    def __new__(cls, cfg: Any = DEFAULT_CFG, overrides: Mapping[str, Any] | None = None,
                _callbacks: dict | None = None) -> "FastloadTrainer":
        task = _task(cfg, _take_fastload_overrides(overrides)[0])
        return super().__new__(_for_task(cls, FastloadTrainer, TRAINERS, ULTRALYTICS_TRAINERS, task))

    def __init__(self, cfg: Any = DEFAULT_CFG, overrides: Mapping[str, Any] | None = None,
                 _callbacks: dict | None = None) -> None:
        own, mine = _take_fastload_overrides(overrides)
        self.fastload = UltralyticsOptions.resolve(mine)
        super().__init__(cfg, own, _callbacks)
        if self.ddp:  # Ultralytics restarts DDP ranks with its own arguments only: they read the variables
            os.environ.update(override_environment(mine))
        check_arguments(self.args, self.data, "train", self.fastload)  # refuse before the model is built

    def get_dataloader(self, dataset_path: Any, batch_size: int = 16, rank: int = 0,
                       mode: str = "train") -> UltralyticsLoader:
        """fastload's loader for ``mode`` (``train``: augmented, shuffled; ``val``: rect letterboxes).

        A validation loader replaces the trainer's previous one, which is closed first: Ultralytics rebuilds both
        loaders when it retries the first epoch at half the batch after running out of GPU memory, and closes only
        the training loader it replaces (the old one's workers and ram store would stay until collected)."""
        previous = getattr(self, "test_loader", None)
        if mode == "val" and isinstance(previous, UltralyticsLoader):
            previous.close()
        stride = max(int(unwrap_model(self.model).stride.max()), 32)
        req = LoaderRequest(dataset_path, batch_size, mode, rect=mode == "val" or bool(self.args.rect), stride=stride,
                            rank=rank, device=self.device)
        return _logged(mode, build_loader(self.args, self.data, req, self.fastload))

    def get_class_counts(self) -> np.ndarray:
        """Instances per class of the training labels, counted on fastload's packed labels (Ultralytics' own
        method builds an array per image)."""
        rows = self.train_loader.dataset.labels.flat.rows
        return np.bincount(rows[:, 0].astype(int), minlength=self.data["nc"]).astype(np.float32)

    def plot_training_labels(self) -> None:
        """Ultralytics' label plot, fed from fastload's packed labels rather than one array per image."""
        rows = self.train_loader.dataset.labels.flat.rows
        plot_labels(rows[:, 1:5], rows[:, 0], names=self.data["names"], save_dir=self.save_dir, on_plot=self.on_plot)


class FastloadValidator(DetectionValidator):
    """Ultralytics' validator of the model's task reading through fastload: ``model.val(data=...,
    validator=FastloadValidator)`` (fastload options as ``fastload_<name>`` arguments or ``FASTLOAD_*`` variables,
    as for :class:`FastloadTrainer`); constructed, it becomes the task's (:data:`VALIDATORS`)."""

    def __new__(cls, dataloader: Any = None, save_dir: Any = None, args: Any = None,
                _callbacks: dict | None = None) -> "FastloadValidator":
        task = _task(DEFAULT_CFG, _take_fastload_overrides(args)[0])
        return super().__new__(_for_task(cls, FastloadValidator, VALIDATORS, ULTRALYTICS_VALIDATORS, task))

    def __init__(self, dataloader: Any = None, save_dir: Any = None, args: Any = None,
                 _callbacks: dict | None = None) -> None:
        own, mine = _take_fastload_overrides(args)
        self.fastload = UltralyticsOptions.resolve(mine)
        super().__init__(dataloader, save_dir, own, _callbacks)

    def get_dataloader(self, dataset_path: Any, batch_size: int) -> UltralyticsLoader:
        req = LoaderRequest(dataset_path, batch_size, "val", rect=bool(self.args.rect), stride=int(self.stride),
                            device=self.device)
        # a standalone `model.val(validator=FastloadValidator)` says which loader serves it, as the trainer does
        return _logged("val", build_loader(self.args, self.data, req, self.fastload))


def _logged(mode: str, loader: UltralyticsLoader) -> UltralyticsLoader:
    """``loader``, its one-line summary written to Ultralytics' log (where its own loaders report theirs)."""
    LOGGER.info(f"{colorstr(f'{mode}: ')}{loader.summary}")
    return loader


class FastloadSegmentationTrainer(FastloadTrainer, SegmentationTrainer):
    """:class:`FastloadTrainer` of a segment model: Ultralytics' ``SegmentationTrainer``, fastload's loaders."""


class FastloadPoseTrainer(FastloadTrainer, PoseTrainer):
    """:class:`FastloadTrainer` of a pose model: Ultralytics' ``PoseTrainer``, fastload's loaders."""


class FastloadOBBTrainer(FastloadTrainer, OBBTrainer):
    """:class:`FastloadTrainer` of an obb model: Ultralytics' ``OBBTrainer``, fastload's loaders."""


class FastloadSegmentationValidator(FastloadValidator, SegmentationValidator):
    """:class:`FastloadValidator` of a segment model: Ultralytics' ``SegmentationValidator``."""


class FastloadPoseValidator(FastloadValidator, PoseValidator):
    """:class:`FastloadValidator` of a pose model: Ultralytics' ``PoseValidator``."""


class FastloadOBBValidator(FastloadValidator, OBBValidator):
    """:class:`FastloadValidator` of an obb model: Ultralytics' ``OBBValidator``."""


#: Ultralytics' trainer and validator of each task fastload serves.
ULTRALYTICS_TRAINERS: dict[str, type] = {"detect": DetectionTrainer, "segment": SegmentationTrainer,
                                         "pose": PoseTrainer, "obb": OBBTrainer}
ULTRALYTICS_VALIDATORS: dict[str, type] = {"detect": DetectionValidator, "segment": SegmentationValidator,
                                           "pose": PoseValidator, "obb": OBBValidator}
#: fastload's trainer and validator of each task.
TRAINERS: dict[str, type[FastloadTrainer]] = {"detect": FastloadTrainer, "segment": FastloadSegmentationTrainer,
                                              "pose": FastloadPoseTrainer, "obb": FastloadOBBTrainer}
VALIDATORS: dict[str, type[FastloadValidator]] = {
    "detect": FastloadValidator, "segment": FastloadSegmentationValidator, "pose": FastloadPoseValidator,
    "obb": FastloadOBBValidator}
