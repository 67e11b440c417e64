"""One Ultralytics run for tests/test_compat_ultralytics.py, in its own process (Ultralytics keeps global
settings and callbacks): ``python ultralytics_run.py DATA_YAML OUT_DIR``.

Trains yolov9t (built from its yaml, no weights; thinned to one RepNCSP repeat in each RepNCSPELAN4, written to
OUT_DIR as a user's own config: the trainer deep-copies and saves the model each epoch) for 2 epochs with
``close_mosaic=1``, ``cache="ram"`` and rect validation through :class:`FastloadTrainer`, whose first batch fails as out of GPU memory would (Ultralytics
retries the epoch at half the batch with new loaders), draws its label plot (from ``dataset.labels``), then
validates the run's best.pt twice, with Ultralytics' own validation loader and with
:class:`FastloadValidator`, and writes ``OUT_DIR/summary.json``.
The environment (set by the test) keeps it offline: YOLO_OFFLINE, YOLO_CONFIG_DIR in the test's folder.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from official_helpers import thinned  # (this script's folder, tests/, is first on sys.path)


def main(data: str, out: Path) -> None:
    torch.set_num_threads(1)
    import ultralytics
    from ultralytics import YOLO

    from fastload.compat.ultralytics import FastloadTrainer, FastloadValidator

    class OneOutOfMemoryTrainer(FastloadTrainer):
        """FastloadTrainer whose first training batch fails as out of GPU memory would: Ultralytics then halves the
        batch and rebuilds both loaders (its retry of the first epoch). Keeps every loader it built."""

        built: list = []
        failed = False

        def get_dataloader(self, *args, **kwargs):
            loader = super().get_dataloader(*args, **kwargs)
            self.built.append(loader)
            return loader

        def preprocess_batch(self, batch):
            if not OneOutOfMemoryTrainer.failed:
                OneOutOfMemoryTrainer.failed = True
                raise RuntimeError("CUDA out of memory (raised by the test)")
            return super().preprocess_batch(batch)

    common = {"data": data, "imgsz": 64, "device": "cpu", "workers": 0, "verbose": False}
    config = Path(ultralytics.__file__).parent / "cfg" / "models" / "v9" / "yolov9t.yaml"
    thin = thinned(config.read_text())
    assert thin.count(", 1]] #") == 7, "yolov9t.yaml: expected 7 RepNCSPELAN4 with 3 repeats"
    (out / "yolov9t-thin.yaml").write_text(thin)
    model = YOLO(str(out / "yolov9t-thin.yaml"))
    stores: dict[str, str] = {}
    closed_after_epoch_1: list[bool] = []

    def note_closed(trainer) -> None:  # on_train_epoch_end: which loaders the retry left open
        if not closed_after_epoch_1:
            closed_after_epoch_1.extend(ld.loader.closed for ld in trainer.built)

    def note_stores(trainer) -> None:  # on_train_end: before the trainer closes its loaders
        stores.update(train=trainer.train_loader.stats()["store"], val=trainer.test_loader.stats()["store"])

    model.add_callback("on_train_end", note_stores)
    model.add_callback("on_train_epoch_end", note_closed)
    # plots=False: Ultralytics' metric plots cost seconds; its label plot (from dataset.labels) is drawn below
    model.train(**common, epochs=2, batch=8, close_mosaic=1, cache="ram", project=str(out / "runs"), name="train",
                exist_ok=True, plots=False, amp=False, pretrained=False, trainer=OneOutOfMemoryTrainer,
                fastload_batch_log=str(out / "batches.jsonl"))  # the default recipe: Ultralytics' own
    trainer = model.trainer
    trainer.plot_training_labels()
    best = Path(trainer.best)
    summary = {"save_dir": str(trainer.save_dir), "best": str(best),
               "train_loader": type(trainer.train_loader).__name__, "val_loader": type(trainer.test_loader).__name__, "stores": stores,
               "batch": trainer.batch_size, "closed_after_epoch_1": closed_after_epoch_1}
    for name, validator in (("ultralytics", None), ("fastload", FastloadValidator)):
        extra = {"validator": validator, "fastload_workers": 0} if validator else {}
        metrics = YOLO(str(best)).val(**common, batch=8, plots=False, project=str(out / "runs"), name=f"val_{name}",
                                      exist_ok=True, **extra)
        summary[name] = {"results": {k: float(v) for k, v in metrics.results_dict.items()},
                         "seen": int(metrics.seen) if hasattr(metrics, "seen") else None,
                         "nt": [int(x) for x in getattr(metrics, "nt_per_class", [])]}
    (out / "summary.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
