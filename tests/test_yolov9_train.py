"""Trainer CLI: flag handling, an end-to-end run with checkpoints / results.csv / val / detect, SIGTERM mid-epoch and
--resume ending where the uninterrupted run ends, 2-process DDP stopped by SIGTERM and resumed."""
from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

from fastload.augment.hyp import load_hyp
from yolov9.models import load_cfg
from yolov9.torch_utils import TrainSchedule
from yolov9.train import RESULTS_COLUMNS, parse_args, train

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
    """YOLOv9-T (dual head) at a quarter width and one RepNCSP repeat in each RepNCSPELAN4 (depth 0.34): the full PGI
    path at CPU-test cost (per-layer overhead, not arithmetic, is most of a step at this width)."""
    cfg = load_cfg("yolov9-t.yaml")
    cfg["width_multiple"], cfg["depth_multiple"] = 0.25, 0.34
    cfg.pop("yaml_file", None)
    path = tmp_path_factory.mktemp("cfg") / "yolov9-tiny.yaml"
    path.write_text(yaml.safe_dump(cfg, default_flow_style=None))
    return path


@pytest.fixture(scope="module")
def small_synth(tmp_path_factory) -> Path:
    from fastload.data.synthetic import make_synthetic_dataset

    return make_synthetic_dataset(tmp_path_factory.mktemp("synth"), n_train=8, n_val=4, nc=3, seed=1,
                                  min_size=96, max_size=200)


def _env(server: preloaded.PreloadedPython) -> dict[str, str]:
    """A run's environment: torchrun's ranks (``PYTHON_EXEC``) are forked from the pre-loaded interpreter too."""
    return {**base_env(REPO), "PYTHON_EXEC": server.python}


def _run_ok(server: preloaded.PreloadedPython, args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    res = preloaded.run(server, args, cwd, _env(server), timeout=timeout)
    assert res.returncode == 0, f"{args}\nstdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-5000:]}"
    return res


@pytest.fixture
def run_python(preloaded_python):
    """``run_python(ARGS, cwd)``: ``python ARGS`` there, forked from the pre-loaded interpreter (tests/preloaded.py:
    torch imported once, not in each run; torchrun's ranks too, through ``PYTHON_EXEC``); asserts exit 0 and
    returns the completed process."""
    return lambda args, cwd, timeout=600: _run_ok(preloaded_python, args, cwd, timeout)


def _train_args(data: Path, cfg: Path, project: Path, name: str) -> list[str]:
    """One epoch of 4 batches (8 images, batch 2), last.pt also every 2 optimizer steps."""
    return ["-m", "yolov9.train", "--data", str(data), "--cfg", str(cfg), "--epochs", "1", "--batch", "2", "--imgsz", "64",
            "--workers", "0", "--device", "cpu", "--project", str(project), "--name", name, "--save-period", "1",
            "--save-period-steps", "2"]


@pytest.fixture(scope="module")
def trained(small_synth, tiny_cfg, tmp_path_factory, preloaded_python) -> tuple[Path, str]:
    """The run folder and stderr of an uninterrupted ``_train_args`` run: the end-to-end test's, and the one a
    run stopped by SIGTERM and resumed must end as."""
    root = tmp_path_factory.mktemp("trained")
    res = _run_ok(preloaded_python, _train_args(small_synth, tiny_cfg, root / "runs", "e2e"), root)
    return root / "runs" / "e2e", res.stderr


def _signal_after_line(proc: preloaded.PreloadedProcess, log: Path, line: str, signum: int, timeout: float = 300) -> None:
    """Send ``signum`` once ``line`` is in the run's log (polled: the log is a file), failing if it ends first."""
    deadline = time.monotonic() + timeout
    while not log.is_file() or line not in log.read_text(errors="replace"):  # the child creates it
        assert proc.poll() is None, f"the run ended before printing {line!r}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {line!r} within {timeout} s"
        time.sleep(0.01)
    os.kill(proc.pid, signum)


def _loss_rows(run: Path) -> list[list[str]]:
    return [[r[k] for k in RESULTS_COLUMNS[:4]] for r in csv.DictReader(open(run / "results.csv"))]


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
    opt = parse_args(["--data", str(small_synth), "--cfg", str(tiny_cfg), "--sync-bn", "--device", "cpu",
                      "--project", str(tmp_path)])
    with pytest.raises(ValueError, match="sync-bn"):
        train(opt)


@pytest.mark.slow
def test_train_epoch_val_detect(small_synth, trained, tmp_path, run_python):
    """One epoch end to end: weights_only checkpoints (also every 2 optimizer steps), results.csv with data-wait
    columns, val and detect CLIs."""
    trained, stderr = trained
    # the warm-up ramps the accumulation up from 1: optimizer steps after batches 0, 1 and 2 (of 0-3), a save after
    # the second
    periodic = [line for line in stderr.splitlines() if line.startswith("saved ")]
    assert [line.split(" in epoch ")[1] for line in periodic] == ["0 after batch 2/4 (optimizer step 2)"], periodic
    for name in ("last.pt", "best.pt", "epoch0.pt"):
        ckpt = torch.load(trained / "weights" / name, map_location="cpu", weights_only=True)
        assert set(ckpt) >= {"model", "ema", "optimizer", "rng", "meta"}
        assert ckpt["meta"]["epoch"] == 0 and ckpt["meta"]["nc"] == 3 and ckpt["meta"]["progress"]["opt_steps"] == 3
    rows = list(csv.DictReader(open(trained / "results.csv")))
    assert list(rows[0]) == RESULTS_COLUMNS and len(rows) == 1
    assert 0.0 <= float(rows[0]["data_wait_frac"]) <= 1.0 and float(rows[0]["images_per_s"]) > 0
    assert rows[0]["gpu_util"] == "n/a"  # CPU run: no NVML figure
    # the LRs of the epoch's last batch (8 images, batch 2: batch 3) are the schedule's
    assert _logged_lrs(rows[0]) == pytest.approx(_schedule_lrs(1, 4, 2, 3, 0), rel=1e-5)
    img_dir = Path(small_synth).parent / "images" / "val"
    with ThreadPoolExecutor(max_workers=2) as pool:  # independent: val and detect run side by side (two cores)
        val = pool.submit(run_python, ["-m", "yolov9.val", "--data", str(small_synth), "--weights",
                                 str(trained / "weights" / "best.pt"), "--imgsz", "64", "--batch", "4", "--workers", "0",
                                 "--device", "cpu"], cwd=tmp_path)
        detect = pool.submit(run_python, ["-m", "yolov9.detect", "--weights", str(trained / "weights" / "last.pt"),
                                    "--source", str(img_dir), "--imgsz", "64", "--conf-thres", "0.001", "--device", "cpu",
                                    "--project", str(tmp_path / "det"), "--save-txt"], cwd=tmp_path)
        assert "mAP50-95" in val.result().stdout
        detect.result()
    outs = sorted((tmp_path / "det" / "exp").glob("*.*"))
    assert len(outs) == len(list(img_dir.iterdir()))


@pytest.mark.slow
def test_sigterm_mid_epoch_then_resume_ends_as_uninterrupted(small_synth, tiny_cfg, trained, tmp_path, preloaded_python,
                                                            run_python):
    """SIGTERM saves last.pt at the next optimizer step and exits 143; --resume continues at the next batch (the
    loader's state) and the run ends with the uninterrupted run's model and EMA, tensor for tensor."""
    log = tmp_path / "train.log"
    proc = preloaded_python.spawn(_train_args(small_synth, tiny_cfg, tmp_path / "runs", "cut"), tmp_path,
                                  _env(preloaded_python), log)
    try:  # the trainer prints this after its handlers are in place, before its first batch
        _signal_after_line(proc, log, "4 batches/epoch", signal.SIGTERM)
        assert proc.wait(timeout=300) == 128 + signal.SIGTERM, log.read_text()[-3000:]
    finally:
        proc.kill()
    last = tmp_path / "runs" / "cut" / "weights" / "last.pt"
    said = [line for line in log.read_text().splitlines() if line.startswith("stopped by SIGTERM")]
    assert len(said) == 1 and said[0].endswith(f"python -m yolov9.train --data {small_synth} --resume {last}"), said
    progress = torch.load(last, map_location="cpu", weights_only=True)["meta"]["progress"]
    assert progress["batch"] > 0 and progress["loader"]["position"] == progress["batch"]  # saved mid-epoch
    resumed = run_python(["-m", "yolov9.train", "--resume", str(last), "--data", str(small_synth), "--workers", "0",
                          "--device", "cpu"], cwd=tmp_path)
    assert f"at epoch {progress['epoch']}, batch {progress['batch']}/4" in resumed.stderr
    trained, _ = trained
    want = torch.load(trained / "weights" / "last.pt", map_location="cpu", weights_only=True)
    got = torch.load(last, map_location="cpu", weights_only=True)
    for part in ("model", "ema"):
        assert list(got[part]) == list(want[part])
        unequal = [k for k in want[part] if not torch.equal(got[part][k], want[part][k])]
        assert not unequal, f"{part}: {len(unequal)} tensors differ from the uninterrupted run's, e.g. {unequal[:3]}"
    assert got["meta"]["progress"]["opt_steps"] == want["meta"]["progress"]["opt_steps"]
    assert _loss_rows(last.parent.parent) == _loss_rows(trained)  # the stopped epoch's running loss was kept


@pytest.mark.slow
def test_ddp_two_process_cpu_sigterm_then_resume(small_synth, tiny_cfg, tmp_path, preloaded_python, run_python):
    """torchrun, 2 CPU processes (gloo), 2 batches each per epoch: SIGTERM to torchrun (it passes it on to both ranks)
    saves a checkpoint after the first batch; another world size may not continue that epoch; torchrun --resume
    continues both ranks at the second batch and runs a second epoch."""
    common = ["--data", str(small_synth), "--batch", "4", "--imgsz", "64", "--workers", "0", "--device", "cpu", "--noval"]
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "yolov9.train"]
    log = tmp_path / "ddp.log"
    proc = preloaded_python.spawn([*torchrun, "--cfg", str(tiny_cfg), "--epochs", "1", *common, "--project",
                                   str(tmp_path / "runs"), "--name", "ddp"], tmp_path, _env(preloaded_python), log)
    try:  # 8 images / 2 ranks / 2 per rank; rank 0 prints it once both ranks have their handlers (after DDP's set-up)
        _signal_after_line(proc, log, "2 batches/epoch x 2 x 2 rank(s)", signal.SIGTERM)
        assert proc.wait(timeout=300) != 0
    finally:
        proc.kill()
    last = tmp_path / "runs" / "ddp" / "weights" / "last.pt"
    assert f"continue with: torchrun --nproc_per_node 2 -m yolov9.train --data {small_synth} --resume {last}" in log.read_text()
    ckpt = torch.load(last, map_location="cpu", weights_only=True)
    assert ckpt["meta"]["epoch"] == -1 and ckpt["meta"]["opt"]["batch_size"] == 4
    assert ckpt["meta"]["progress"]["batch"] == 1 and ckpt["meta"]["progress"]["world_size"] == 2
    assert len(ckpt["rng"]) == 2 and not torch.equal(ckpt["rng"][0]["torch"], ckpt["rng"][1]["torch"])  # each rank's
    with pytest.raises(ValueError, match=r"by 2 process\(es\), resumed by 1; continue that epoch with torchrun"):
        train(parse_args(["--data", str(small_synth), "--resume", str(last), "--device", "cpu"]))
    res = run_python([*torchrun, "--data", str(small_synth), "--resume", str(last), "--epochs", "2", "--workers", "0",
                      "--device", "cpu"], cwd=tmp_path)
    # both ranks share one stderr: a line may follow the other rank's unfinished progress line
    resumed = sorted(m.group(0) for m in re.finditer(r"resuming \S+ at [^(\n]*", res.stderr))
    assert resumed == [f"resuming {last} at epoch 0, batch 1/2, optimizer step 1, to 2 epochs "] * 2, res.stderr[-3000:]
    ckpt2 = torch.load(last, map_location="cpu", weights_only=True)
    assert ckpt2["meta"]["epoch"] == 1 and ckpt2["meta"]["ema_updates"] == ckpt2["meta"]["progress"]["opt_steps"] == 4
    rows = list(csv.DictReader(open(tmp_path / "runs" / "ddp" / "results.csv")))
    assert [int(r["epoch"]) for r in rows] == [0, 1]
    # the resumed epoch continues the schedule (2 batches per epoch of 2 per rank x 2 ranks, total batch 4)
    assert _logged_lrs(rows[1]) == pytest.approx(_schedule_lrs(2, 2, 4, 3, 1), rel=1e-5)
    with pytest.raises(ValueError, match="already finished"):  # nothing left to resume: a clear error
        train(parse_args(["--data", str(small_synth), "--resume", str(last), "--device", "cpu"]))
    # a flag the resumed run would drop (its options are the saved run's) is refused, naming both values
    with pytest.raises(ValueError, match=r"these differ: --batch-size 8 \(the run's: 4\); --data .*other\.yaml"):
        train(parse_args(["--data", str(tmp_path / "other.yaml"), "--resume", str(last), "--batch", "8"]))
