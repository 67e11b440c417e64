"""Trainer CLI: flag handling, an end-to-end epoch with checkpoints / results.csv / val / detect, 2-process DDP + resume."""
from __future__ import annotations

import csv
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

from fastload.augment.hyp import load_hyp
from yolov9.models import load_cfg
from yolov9.torch_utils import TrainSchedule
from yolov9.train import RESULTS_COLUMNS, parse_args

import preloaded
from preloaded import base_env

REPO = Path(__file__).resolve().parents[1]


def _logged_lrs(row: dict) -> list[float]:
    return [float(row[f"x/lr{j}"]) for j in range(3)]


def _schedule_lrs(epochs: int, nb: int, batch: int, ni: int, epoch: int) -> list[float]:
    sched = TrainSchedule.from_hyp(load_hyp(None), epochs=epochs, batches_per_epoch=nb, batch_size=batch)
    return list(sched.at(ni, epoch).lrs)


@pytest.fixture(scope="module")
def tiny_cfg(tmp_path_factory) -> Path:
    """YOLOv9-T (dual head) at a quarter width: the full PGI path at CPU-test cost."""
    cfg = load_cfg("yolov9-t.yaml")
    cfg["width_multiple"] = 0.25
    cfg.pop("yaml_file", None)
    path = tmp_path_factory.mktemp("cfg") / "yolov9-tiny.yaml"
    path.write_text(yaml.safe_dump(cfg, default_flow_style=None))
    return path


@pytest.fixture(scope="module")
def small_synth(tmp_path_factory) -> Path:
    from fastload.data.synthetic import make_synthetic_dataset

    return make_synthetic_dataset(tmp_path_factory.mktemp("synth"), n_train=8, n_val=4, nc=3, seed=1,
                                  min_size=96, max_size=200)


@pytest.fixture
def run_python(preloaded_python):
    """``run_python(ARGS, cwd)``: ``python ARGS`` there, forked from the pre-loaded interpreter (tests/preloaded.py:
    torch imported once, not in each run; torchrun's ranks too, through ``PYTHON_EXEC``); asserts exit 0 and
    returns the completed process."""
    def run(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
        env = {**base_env(REPO), "PYTHON_EXEC": preloaded_python.python}
        res = preloaded.run(preloaded_python, args, cwd, env, timeout=timeout)
        assert res.returncode == 0, f"{args}\nstdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-5000:]}"
        return res

    return run


def test_cli_rejects_unknown_flag(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--data", "d.yaml", "--bogus-flag", "1"])
    assert e.value.code == 2
    assert "unrecognized arguments: --bogus-flag" in capsys.readouterr().err


def test_cli_rejects_unsupported_choices(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--data", "d.yaml", "--optimizer", "LION"])
    assert "LION is not implemented" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--data", "d.yaml", "--loader", "tpu"])


def test_cli_accepts_train_dual_flags():
    opt = parse_args(["--weights", "", "--cfg", "yolov9-s.yaml", "--data", "d.yaml", "--hyp", "h.yaml",
                      "--epochs", "3", "--batch", "8", "--img", "320", "--rect", "--resume", "--nosave", "--noval",
                      "--cache", "--device", "cpu", "--multi-scale", "--single-cls", "--optimizer", "AdamW",
                      "--sync-bn", "--workers", "2", "--project", "p", "--name", "n", "--exist-ok", "--cos-lr",
                      "--label-smoothing", "0.1", "--patience", "5", "--freeze", "10", "--save-period", "1",
                      "--seed", "3", "--min-items", "1", "--close-mosaic", "2", "--loader", "gpu", "--store", "ram",
                      "--accumulate", "4", "--no-amp", "--data-seed", "7"])
    assert (opt.batch_size, opt.imgsz, opt.cache, opt.resume, opt.amp, opt.accumulate) == (8, 320, "ram", True, False, 4)
    assert (opt.seed, opt.data_seed) == (3, 7)
    assert parse_args(["--data", "d.yaml", "--batch-size", "4", "--imgsz", "256"]).batch_size == 4


def test_sync_bn_on_cpu_fails_clearly(small_synth, tiny_cfg, tmp_path):
    from yolov9.train import train

    opt = parse_args(["--data", str(small_synth), "--cfg", str(tiny_cfg), "--sync-bn", "--device", "cpu",
                      "--project", str(tmp_path)])
    with pytest.raises(ValueError, match="sync-bn"):
        train(opt)


@pytest.mark.slow
def test_train_epoch_val_detect(small_synth, tiny_cfg, tmp_path, run_python):
    """One epoch end to end: weights_only checkpoints, results.csv with data-wait columns, val and detect CLIs."""
    run_python(["-m", "yolov9.train", "--data", str(small_synth), "--cfg", str(tiny_cfg), "--epochs", "1", "--batch", "4",
          "--imgsz", "96", "--workers", "1", "--device", "cpu", "--project", str(tmp_path / "runs"),
          "--name", "e2e", "--close-mosaic", "1", "--save-period", "1"], cwd=tmp_path)
    run = tmp_path / "runs" / "e2e"
    for name in ("last.pt", "best.pt", "epoch0.pt"):
        ckpt = torch.load(run / "weights" / name, map_location="cpu", weights_only=True)
        assert set(ckpt) >= {"model", "ema", "optimizer", "meta"}
        assert ckpt["meta"]["epoch"] == 0 and ckpt["meta"]["nc"] == 3
    rows = list(csv.DictReader(open(run / "results.csv")))
    assert list(rows[0]) == RESULTS_COLUMNS and len(rows) == 1
    assert 0.0 <= float(rows[0]["data_wait_frac"]) <= 1.0 and float(rows[0]["images_per_s"]) > 0
    assert rows[0]["gpu_util"] == "n/a"  # CPU run: no NVML figure
    # the LRs of the epoch's last batch (8 images, batch 4: batch 1) are the schedule's
    assert _logged_lrs(rows[0]) == pytest.approx(_schedule_lrs(1, 2, 4, 1, 0), rel=1e-5)
    img_dir = Path(small_synth).parent / "images" / "val"
    with ThreadPoolExecutor(max_workers=2) as pool:  # independent: val and detect run side by side (two cores)
        val = pool.submit(run_python, ["-m", "yolov9.val", "--data", str(small_synth), "--weights",
                                 str(run / "weights" / "best.pt"), "--imgsz", "96", "--batch", "4", "--workers", "0",
                                 "--device", "cpu"], cwd=tmp_path)
        detect = pool.submit(run_python, ["-m", "yolov9.detect", "--weights", str(run / "weights" / "last.pt"), "--source",
                                    str(img_dir), "--imgsz", "96", "--conf-thres", "0.001", "--device", "cpu",
                                    "--project", str(tmp_path / "det"), "--save-txt"], cwd=tmp_path)
        assert "mAP50-95" in val.result().stdout
        detect.result()
    outs = sorted((tmp_path / "det" / "exp").glob("*.*"))
    assert len(outs) == len(list(img_dir.iterdir()))


@pytest.mark.slow
def test_ddp_two_process_cpu_then_resume(small_synth, tiny_cfg, tmp_path, run_python):
    """torchrun, 2 CPU processes (gloo): 2 steps each, a checkpoint; then resume it to a second epoch."""
    common = ["--data", str(small_synth), "--batch", "4", "--imgsz", "96", "--workers", "0", "--device", "cpu",
              "--project", str(tmp_path / "runs"), "--name", "ddp"]
    res = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "yolov9.train",
                "--cfg", str(tiny_cfg), "--epochs", "1", *common], cwd=tmp_path)
    assert "2 batches/epoch x 2 x 2 rank(s)" in res.stderr  # 8 images / 2 ranks / 2 per rank
    last = tmp_path / "runs" / "ddp" / "weights" / "last.pt"
    ckpt = torch.load(last, map_location="cpu", weights_only=True)
    assert ckpt["meta"]["epoch"] == 0
    assert ckpt["meta"]["opt"]["batch_size"] == 4
    assert ckpt["meta"]["ema_updates"] >= 1
    run_python(["-m", "yolov9.train", "--data", str(small_synth), "--resume", str(last), "--epochs", "2",
          "--workers", "0", "--device", "cpu"], cwd=tmp_path)
    ckpt2 = torch.load(last, map_location="cpu", weights_only=True)
    assert ckpt2["meta"]["epoch"] == 1 and ckpt2["meta"]["ema_updates"] > ckpt["meta"]["ema_updates"]
    rows = list(csv.DictReader(open(tmp_path / "runs" / "ddp" / "results.csv")))
    assert [int(r["epoch"]) for r in rows] == [0, 1]
    # the resumed epoch continues the schedule (2 batches per epoch of 4 per rank x 2 ranks, total batch 4)
    assert _logged_lrs(rows[1]) == pytest.approx(_schedule_lrs(2, 2, 4, 3, 1), rel=1e-5)
    with pytest.raises(AssertionError, match="already finished"):  # nothing left to resume: a clear error
        run_python(["-m", "yolov9.train", "--data", str(small_synth), "--resume", str(last), "--workers", "0",
              "--device", "cpu"], cwd=tmp_path)
