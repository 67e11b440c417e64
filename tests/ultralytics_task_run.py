"""One Ultralytics segment, pose or obb run for tests/test_compat_ultralytics_tasks.py, in its own process
(Ultralytics keeps global settings and callbacks): ``python ultralytics_task_run.py TASK MODEL_YAML DATA_YAML OUT_DIR``.

Trains the model (built from its yaml, no weights) for 2 epochs with ``close_mosaic=1`` and ``cache="ram"`` twice:
with Ultralytics' own loaders (its task trainer) and through a subclass of :class:`FastloadTrainer` (which becomes
the task's trainer). To keep it short, validation and checkpoints at the last epoch only (``val=False``,
``save=False``) and no final evaluation of the best weights (both trainers skip it: this script validates the
weights itself). The fastload run's weights are then validated twice, with Ultralytics' own validation loader and
with :class:`FastloadValidator`, and ``OUT_DIR/summary.json`` is written.
The environment (set by the test) keeps it offline: YOLO_OFFLINE, YOLO_CONFIG_DIR in the test's folder.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def main(task: str, model_yaml: str, data: str, out: Path) -> None:
    torch.set_num_threads(1)
    from ultralytics import YOLO
    from ultralytics.models import yolo

    from fastload.compat.ultralytics import FastloadTrainer, FastloadValidator

    class NoFinalEval:
        def final_eval(self) -> None:
            """Skipped: the script validates the weights itself."""

    own_trainer = {"segment": yolo.segment.SegmentationTrainer, "pose": yolo.pose.PoseTrainer,
                   "obb": yolo.obb.OBBTrainer}[task]

    common = {"data": data, "imgsz": 64, "device": "cpu", "workers": 0, "verbose": False, "plots": False,
              "project": str(out / "runs"), "exist_ok": True}
    summary: dict = {}
    trainers = (("ultralytics", type("Own", (NoFinalEval, own_trainer), {})),
                ("fastload", type("Fastload", (NoFinalEval, FastloadTrainer), {})))
    for name, trainer in trainers:
        model = YOLO(model_yaml)
        model.train(**common, epochs=2, batch=8, close_mosaic=1, cache="ram", val=False, save=False, amp=False,
                    pretrained=False, name=f"train_{name}", trainer=trainer)
        t = model.trainer
        summary[name] = {"trainer": [c.__name__ for c in type(t).__mro__],
                         "loader": type(t.train_loader).__name__, "save_dir": str(t.save_dir),
                         "results": {k: float(v) for k, v in t.metrics.items()},
                         "labels": len(t.train_loader.dataset.labels)}
    weights = Path(summary["fastload"]["save_dir"]) / "weights" / "last.pt"
    for name, validator in (("ultralytics", None), ("fastload", FastloadValidator)):
        extra = {"validator": validator, "fastload_workers": 0} if validator else {}
        metrics = YOLO(str(weights)).val(**common, batch=8, name=f"val_{name}", **extra)
        summary[f"val_{name}"] = {k: float(v) for k, v in metrics.results_dict.items()}
    (out / "summary.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4]))
