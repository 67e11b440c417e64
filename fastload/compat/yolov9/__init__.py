"""fastload under the official YOLOv9 trainer (https://github.com/WongKinYiu/yolov9).

Two ways in, both feeding ``train_dual.py`` / ``train.py`` / ``val_dual.py`` / ``val.py`` of an
official checkout with :func:`create_dataloader` (same arguments, same ``(loader, dataset)``):

* change one import line of the script::

      from fastload.compat.yolov9 import create_dataloader     # was: from utils.dataloaders import ...

* or edit nothing and launch the script through fastload (every official flag passes through)::

      python -m fastload.compat.yolov9 train_dual.py --data data.yaml ... [--fastload-engine cpu ...]
      torchrun --nproc_per_node 8 -m fastload.compat.yolov9 train_dual.py ...

Options: :data:`~fastload.compat.yolov9.options.OPTIONS` (keywords of :func:`create_dataloader`,
``--fastload-*`` flags of the launcher, ``FASTLOAD_*`` environment variables as the fallback).
User guide: ``docs/official-trainer.md``.
"""
from fastload.compat.yolov9.dataloader import create_dataloader
from fastload.compat.yolov9.options import OPTIONS, CompatOptions

__all__ = ["create_dataloader", "CompatOptions", "OPTIONS"]
