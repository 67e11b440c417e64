"""The official ``segment/train.py`` (../shared/upstream/yolov9, a temporary copy) trains 2 epochs on the CPU both
ways on a small synthetic segment set: with its own loader, and unmodified through the no-edit launcher
(``python -m fastload.compat.yolov9 segment/train.py ...``), whose batch log says what the trainer received.

The model is the smallest the official configs allow for segmentation: ``models/detect/gelan-t.yaml`` with its
detection head replaced by the ``Segment`` head of ``models/segment/gelan-c-seg.yaml`` (the official segment
configs are all the c size, too slow for the suite), written into the copy as a user's config would be. Both runs
start once for the module, in parallel, forked from the interpreter that has torch imported (tests/preloaded.py).
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
from official_helpers import (SEGMENT_README_IMPORT, Run, copy_upstream, official_env, python, run_all)

pytestmark = pytest.mark.slow

N_TRAIN, N_VAL = 8, 4
SEGMENT_SCRIPTS = ("segment/train.py", "segment/train_dual.py", "segment/val.py", "segment/val_dual.py")
TINY_SEG = "models/segment/gelan-t-seg.yaml"


def _tiny_segment_config(checkout: Path) -> None:
    """gelan-t's layers with gelan-c-seg's head (``Segment, [nc, 32, 256]``, its proto width scaled to gelan-t's)."""
    lines = (checkout / "models" / "detect" / "gelan-t.yaml").read_text().splitlines()
    heads = [k for k, line in enumerate(lines) if "DDetect, [nc]]" in line]
    assert len(heads) == 1, "models/detect/gelan-t.yaml: expected one DDetect head"
    lines[heads[0]] = "   [[15, 18, 21], 1, Segment, [nc, 32, 64]],  # Segment(P3, P4, P5)"
    (checkout / TINY_SEG).write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, preloaded_python):
    tmp = tmp_path_factory.mktemp("official_segment")
    stock = copy_upstream(tmp / "yolov9_unmodified")
    _tiny_segment_config(stock)
    data = make_synthetic_dataset(tmp / "data", n_train=N_TRAIN, n_val=N_VAL, seed=4, min_size=64, max_size=160,
                                  task="segment")
    config = yaml.safe_load(Path(data).read_text())
    config["path"] = str(Path(data).parent)  # the official check_dataset reads a relative path from its checkout
    Path(data).write_text(yaml.safe_dump(config, sort_keys=False))
    project = tmp / "runs"

    def train(name: str) -> list[str]:
        return ["--data", str(data), "--cfg", TINY_SEG, "--weights", "", "--img", "64", "--batch", "4", "--epochs",
                "2", "--device", "cpu", "--noplots", "--noval", "--hyp", "data/hyps/hyp.scratch-high.yaml", "--workers", "1",
                "--project", str(project), "--name", name, "--exist-ok"]

    batch_log = str(tmp / "launcher.jsonl")
    both = [
        Run("official", [python(), "segment/train.py", *train("official")], stock, official_env(tmp)),
        Run("launcher", [python(), "-m", "fastload.compat.yolov9", "segment/train.py", *train("launcher"),
                         "--fastload-batch-log", batch_log], stock, official_env(tmp)),
    ]
    run_all([both], tmp / "logs", server=preloaded_python)
    out = {r.name: r for r in both}
    out["tmp"], out["project"] = tmp, project  # type: ignore[assignment]
    return out


def _seg_losses(project: Path, name: str) -> list[float]:
    """The ``train/seg_loss`` of each epoch in the run's results.csv (its rows may hold more values than names)."""
    with open(project / name / "results.csv") as f:
        rows = list(csv.reader(f))
    column = [c.strip() for c in rows[0]].index("train/seg_loss")
    return [float(row[column]) for row in rows[1:]]


def test_segment_train_runs_2_epochs_with_its_own_loader(runs):
    out = runs["official"].check()
    assert "2 epochs completed" in out and "fastload" not in out
    losses = _seg_losses(runs["project"], "official")
    assert len(losses) >= 2 and all(math.isfinite(v) and v > 0 for v in losses[:2])  # (then the final validation)


def test_launcher_runs_an_unmodified_segment_train_on_fastload_segment_batches(runs):
    out = runs["launcher"].check()
    assert "segment/train.py with fastload's create_dataloader" in out and "2 epochs completed" in out
    assert f"fastload: segment, {N_TRAIN} images" in out and f"fastload: segment, {N_VAL} images" in out
    lines = [json.loads(line) for line in Path(runs["tmp"], "launcher.jsonl").read_text().splitlines()]
    train = [x for x in lines if x["split"] == "train"]
    assert sorted({x["epoch"] for x in train}) == [0, 1]
    assert all(sum(x["n"] for x in train if x["epoch"] == e) == N_TRAIN for e in (0, 1))
    assert all(x["mosaic"] == x["n"] for x in train)  # scratch-high: every sample a mosaic
    val = [x for x in lines if x["split"] == "val"]  # --noval: the last epoch's, then best.pt's
    assert val and not any(x["augment"] for x in val)
    losses = _seg_losses(runs["project"], "launcher")
    assert len(losses) >= 2 and all(math.isfinite(v) and v > 0 for v in losses[:2])  # (then the final validation)


def test_the_readme_switch_of_the_segment_scripts(tmp_path):
    """The one line docs/official-trainer.md shows for the scripts of segment/: each has it once to switch."""
    edited = copy_upstream(tmp_path / "yolov9_edited", switch_import=SEGMENT_SCRIPTS)
    for script in SEGMENT_SCRIPTS:
        text = (edited / script).read_text()
        ast.parse(text)
        assert text.count(SEGMENT_README_IMPORT) == 1, script
    assert SEGMENT_README_IMPORT in (Path(__file__).resolve().parents[1] / "docs" / "official-trainer.md").read_text()
