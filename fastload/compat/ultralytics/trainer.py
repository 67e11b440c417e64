"""``FastloadTrainer`` and ``FastloadValidator``: Ultralytics' detection trainer and validator with loaders
from :func:`fastload.loader` (:func:`fastload.compat.ultralytics.loader.build_loader`)."""
from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np
from ultralytics.models.yolo.detect import DetectionTrainer, DetectionValidator
from ultralytics.utils import DEFAULT_CFG, LOGGER, colorstr
from ultralytics.utils.plotting import plot_labels
from ultralytics.utils.torch_utils import unwrap_model

from fastload.compat.ultralytics.loader import LoaderRequest, UltralyticsLoader, build_loader, check_arguments
from fastload.compat.ultralytics.options import UltralyticsOptions, override_environment


def _take_fastload_overrides(overrides: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(Ultralytics' own arguments, the fastload_* overrides)``: Ultralytics refuses keys it does not know."""
    given = dict(overrides or {})
    mine = {k: given.pop(k) for k in list(given) if k.startswith("fastload_")}
    return given, mine


class FastloadTrainer(DetectionTrainer):
    """Ultralytics' ``DetectionTrainer`` whose train and validation loaders are fastload's.

    ``YOLO("yolov9t.yaml").train(data="data.yaml", trainer=FastloadTrainer, ...)``: every data argument
    keeps its meaning (``imgsz``, ``batch``, ``workers``, ``cache`` (ram: one shared-memory copy per
    machine), ``rect``, ``close_mosaic``, ``fraction``, ``single_cls``, ``classes``, the augmentation
    hyperparameters); one fastload cannot honour is refused with one line
    (:class:`~fastload.compat.ultralytics.loader.UnsupportedArgument`). fastload's options come as
    ``fastload_<name>=...`` overrides or ``FASTLOAD_*`` variables (:data:`~fastload.compat.ultralytics.options.OPTIONS`).
    """

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
    """Ultralytics' ``DetectionValidator`` reading through fastload: ``model.val(data=..., validator=FastloadValidator)``
    (fastload options as ``fastload_<name>`` arguments or ``FASTLOAD_*`` variables, as for :class:`FastloadTrainer`)."""

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
