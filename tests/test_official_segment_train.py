"""The official ``segment/train.py`` and ``segment/train_dual.py`` (../shared/upstream/yolov9, a temporary copy) each
train 2 epochs on the CPU both ways on a small synthetic segment set: with their own loader, and unmodified through
the no-edit launcher (``python -m fastload.compat.yolov9 segment/train.py ...``), whose batch log says what the
trainer received.

The models are far smaller than the official segment configs (all the c size, too slow for the suite): the t
detection configs, thinned, with their heads replaced by the official segment heads (``_tiny_segment_configs``),
written into the copy as a user's config would be. The four runs start once for the module, two at a time, forked
from the interpreter that has torch imported (tests/preloaded.py).
"""
from __future__ import annotations

import ast
import csv
import json
import math
from pathlib import Path

import pytest
import yaml

from fastload.data.synthetic import make_synthetic_dataset
from official_helpers import (SEGMENT_README_IMPORT, Run, copy_upstream, official_env, python, run_all,
                              thinned)

pytestmark = pytest.mark.slow

N_TRAIN, N_VAL = 4, 4  # one batch of 4 an epoch
SEGMENT_SCRIPTS = ("segment/train.py", "segment/train_dual.py", "segment/val.py", "segment/val_dual.py")
TINY_SEG = "models/segment/gelan-t-seg.yaml"
TINY_DUAL_SEG = "models/segment/yolov9-t-dseg.yaml"


def _with_head(checkout: Path, detect_config: str, detect_head: str, head: list[str], config: str) -> None:
    """``config`` written into the checkout: ``detect_config``'s layers, each RepNCSPELAN4 with one RepNCSP repeat
    instead of three (fewer layers: the trainers deep-copy and save the model every epoch), and its one
    ``detect_head`` line replaced by ``head`` (a segment head and any layers it needs), as a user's config would be."""
    lines = thinned((checkout / detect_config).read_text()).splitlines()
    hits = [k for k, line in enumerate(lines) if detect_head in line]
    assert len(hits) == 1, f"{detect_config}: expected one {detect_head!r} head"
    lines[hits[0]:hits[0] + 1] = head
    (checkout / config).write_text("\n".join(lines) + "\n")


def _tiny_segment_configs(checkout: Path) -> None:
    """The two segment models of the runs, far smaller than the official ones (all the c size).

    gelan-t's layers with gelan-c-seg's head (``Segment, [nc, 32, 256]``, its proto width scaled to gelan-t's); and
    yolov9-t's layers (main and auxiliary branches) with yolov9-c-dseg's ``DualDSegment`` head, which also takes one
    proto feature map per branch: as in yolov9-c-dseg, each branch's P3 output through a RepNCSPELAN4, a 2x upsample
    and a 3x3 Conv, here 32 channels wide (c-dseg's are 256).
    """
    _with_head(checkout, "models/detect/gelan-t.yaml", "DDetect, [nc]]",
               ["   [[15, 18, 21], 1, Segment, [nc, 32, 64]],  # Segment(P3, P4, P5)"], TINY_SEG)
    _with_head(checkout, "models/detect/yolov9-t.yaml", "DualDDetect, [nc]]", [
        "   [28, 1, RepNCSPELAN4, [32, 32, 16, 1]],  # 29 (auxiliary P3 to its proto)",
        "   [-1, 1, nn.Upsample, [None, 2, 'nearest']],",
        "   [-1, 1, Conv, [32, 3, 1]],  # 31",
        "   [15, 1, RepNCSPELAN4, [32, 32, 16, 1]],  # 32 (main P3 to its proto)",
        "   [-1, 1, nn.Upsample, [None, 2, 'nearest']],",
        "   [-1, 1, Conv, [32, 3, 1]],  # 34",
        "   [[28, 25, 22, 15, 18, 21, 31, 34], 1, DualDSegment, [nc, 32, 32]],  # DualDSegment(P3, P4, P5)",
    ], TINY_DUAL_SEG)


# each trainer of segment/ and the tiny model it trains
TRAINERS = {"train": ("segment/train.py", TINY_SEG), "train_dual": ("segment/train_dual.py", TINY_DUAL_SEG)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, preloaded_python):
    tmp = tmp_path_factory.mktemp("official_segment")
    stock = copy_upstream(tmp / "yolov9_unmodified")
    _tiny_segment_configs(stock)
    data = make_synthetic_dataset(tmp / "data", n_train=N_TRAIN, n_val=N_VAL, seed=4, min_size=64, max_size=160,
                                  task="segment")
    config = yaml.safe_load(Path(data).read_text())
    config["path"] = str(Path(data).parent)  # the official check_dataset reads a relative path from its checkout
    Path(data).write_text(yaml.safe_dump(config, sort_keys=False))
    project = tmp / "runs"

    def run(trainer: str, way: str) -> Run:
        """``trainer`` run with its own loader (``way="official"``) or through the launcher (``"launcher"``)."""
        script, cfg = TRAINERS[trainer]
        name = f"{trainer}_{way}"
        argv = [script, "--data", str(data), "--cfg", cfg, "--weights", "", "--img", "64", "--batch", "4", "--epochs",
                "2", "--device", "cpu", "--noplots", "--noval", "--hyp", "data/hyps/hyp.scratch-high.yaml", "--workers",
                "1", "--project", str(project), "--name", name, "--exist-ok"]
        if way == "launcher":
            argv = ["-m", "fastload.compat.yolov9", *argv, "--fastload-batch-log", str(tmp / f"{name}.jsonl")]
        return Run(name, [python(), *argv], stock, official_env(tmp))

    every = [run(trainer, way) for trainer in TRAINERS for way in ("official", "launcher")]
    run_all([every], tmp / "logs", server=preloaded_python)
    out = {r.name: r for r in every}
    out["tmp"], out["project"] = tmp, project  # type: ignore[assignment]
    return out


def _seg_losses(project: Path, name: str) -> list[float]:
    """The ``train/seg_loss`` of each epoch in the run's results.csv (its rows may hold more values than names)."""
    with open(project / name / "results.csv") as f:
        rows = list(csv.reader(f))
    column = [c.strip() for c in rows[0]].index("train/seg_loss")
    return [float(row[column]) for row in rows[1:]]


@pytest.mark.parametrize("trainer", TRAINERS)
def test_segment_trainer_runs_2_epochs_with_its_own_loader(runs, trainer):
    out = runs[f"{trainer}_official"].check()
    assert "2 epochs completed" in out and "fastload" not in out
    losses = _seg_losses(runs["project"], f"{trainer}_official")
    assert len(losses) >= 2 and all(math.isfinite(v) and v > 0 for v in losses[:2])  # (then the final validation)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_launcher_runs_an_unmodified_segment_trainer_on_fastload_segment_batches(runs, trainer):
    out = runs[f"{trainer}_launcher"].check()
    assert f"{TRAINERS[trainer][0]} with fastload's create_dataloader" in out and "2 epochs completed" in out
    assert f"fastload: segment, {N_TRAIN} images" in out and f"fastload: segment, {N_VAL} images" in out
    lines = [json.loads(line) for line in Path(runs["tmp"], f"{trainer}_launcher.jsonl").read_text().splitlines()]
    train = [x for x in lines if x["split"] == "train"]
    assert sorted({x["epoch"] for x in train}) == [0, 1]
    assert all(sum(x["n"] for x in train if x["epoch"] == e) == N_TRAIN for e in (0, 1))
    assert all(x["mosaic"] == x["n"] for x in train)  # scratch-high: every sample a mosaic
    # overlap masks (the trainer's default) at mask_ratio 4, each batch with some instance's pixels
    assert all(x["masks"] == [x["n"], 16, 16] and x["mask_pixels"] > 0 for x in train)
    val = [x for x in lines if x["split"] == "val"]  # --noval: the last epoch's, then best.pt's
    assert val and not any(x["augment"] for x in val) and all(x["mask_pixels"] > 0 for x in val)
    losses = _seg_losses(runs["project"], f"{trainer}_launcher")
    assert len(losses) >= 2 and all(math.isfinite(v) and v > 0 for v in losses[:2])  # (then the final validation)


def test_the_readme_switch_of_the_segment_scripts(tmp_path):
    """The one line docs/official-trainer.md shows for the scripts of segment/: each has it once to switch."""
    edited = copy_upstream(tmp_path / "yolov9_edited", switch_import=SEGMENT_SCRIPTS)
    for script in SEGMENT_SCRIPTS:
        text = (edited / script).read_text()
        ast.parse(text)
        assert text.count(SEGMENT_README_IMPORT) == 1, script
    assert SEGMENT_README_IMPORT in (Path(__file__).resolve().parents[1] / "docs" / "official-trainer.md").read_text()
