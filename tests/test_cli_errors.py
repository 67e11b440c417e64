"""The bad-input matrix: every CLI command and the trainer, run as a user runs them (a subprocess), on bad
inputs. Each must exit non-zero when it could not do its job (1: the data or the machine, 2: the command
line) and 0 when it could; say it in one stderr line naming the file or option and what to do; show no
traceback unless --debug or FASTLOAD_DEBUG=1; and leave nothing half-written that opens.

The cases run in one module fixture, then one test per case checks its result. Most call the command's
``main(argv)`` in this process, in the case's environment and working directory, with its output captured (what
they check is the report, and each fresh interpreter cost about 0.5 s of CPU, an import of torch for the trainer).
The cases marked ``fresh_process`` run as a user runs them, a subprocess of ``python -m fastload`` (or of the
trainer), concurrently with the others: one of every command (the console entry point, its exit status and its
streams), and the ``--debug`` / ``FASTLOAD_DEBUG=1`` ones (the traceback the console shows).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

from fastload.store import open_store
from fastload.store.base import StoreError
from preloaded import base_env
from store_helpers import isolated_shm

REPO = Path(__file__).resolve().parents[1]
FASTLOAD = [sys.executable, "-m", "fastload"]
TRAIN = [sys.executable, "-m", "yolov9.train"]


@dataclass
class Case:
    """One command line on one bad input and what must come out of it."""

    id: str
    argv: list[str]  # {name} placeholders are filled from the `files` fixture
    rc: int
    says: tuple[str, ...]  # all in the one report line
    stream: str = "stderr"  # verify reports damaged stores on stdout, as its normal output
    env: dict[str, str] = field(default_factory=dict)
    traceback: bool = False  # --debug / FASTLOAD_DEBUG=1
    fresh_process: bool = False  # start it as a subprocess instead of calling the command's main() here


CASES = [
    # data.yaml problems, through every command that reads one
    Case("convert-missing-yaml", [*FASTLOAD, "convert", "{missing}", "--out", "{tmp}/o1"], 1, ("{missing}", "not found"),
         fresh_process=True),
    Case("convert-yaml-syntax", [*FASTLOAD, "convert", "{syntax}", "--out", "{tmp}/o2"], 1,
         ("{syntax}", "not valid YAML (line 4, column", "fix the syntax")),
    Case("convert-nc-names", [*FASTLOAD, "convert", "{ncnames}", "--out", "{tmp}/o3"], 1, ("{ncnames}", "'nc' is 2", "agree")),
    Case("convert-empty-yaml", [*FASTLOAD, "convert", "{empty}", "--out", "{tmp}/o4"], 1, ("{empty}", "the file is empty")),
    Case("convert-wrong-types", [*FASTLOAD, "convert", "{types}", "--out", "{tmp}/o5"], 1, ("{types}", "'names' must be a list")),
    Case("convert-not-utf8", [*FASTLOAD, "convert", "{binary}", "--out", "{tmp}/o6"], 1, ("{binary}", "cannot read the yaml")),
    Case("convert-missing-train-folder", [*FASTLOAD, "convert", "{notrain}", "--out", "{tmp}/o7"], 1,
         ("'train' source", "images/nope does not exist")),
    Case("convert-unknown-kind", [*FASTLOAD, "convert", "{good}", "--to", "tape", "--out", "{tmp}/o8"], 2,
         ("--to 'tape'", "unknown store kind", "lmdb, encoded, disk, ram")),
    Case("convert-quality-out-of-range", [*FASTLOAD, "convert", "{good}", "--quality", "0"], 2, ("--quality", "1..100")),
    Case("convert-unknown-option", [*FASTLOAD, "convert", "{good}", "--bogus"], 2, ("unrecognized arguments: --bogus", "--help")),
    Case("convert-into-another-datasets-folder", [*FASTLOAD, "convert", "{other}", "--to", "lmdb", "--out", "{stores}"], 1,
         ("{stores} holds the stores of another dataset", "--force")),
    Case("verify-yaml-syntax", [*FASTLOAD, "verify", "{syntax}"], 1, ("fastload verify: {syntax}", "not valid YAML")),
    Case("verify-nc-names", [*FASTLOAD, "verify", "{ncnames}"], 1, ("fastload verify: {ncnames}", "'nc' is 2")),
    Case("info-nc-names", [*FASTLOAD, "info", "{ncnames}"], 1, ("fastload info: {ncnames}", "'nc' is 2")),
    Case("info-missing-yaml", [*FASTLOAD, "info", "{missing}"], 1, ("{missing}", "not found"), fresh_process=True),
    Case("stage-missing-yaml", [*FASTLOAD, "stage", "{missing}", "--to", "{tmp}/staged"], 1, ("{missing}", "does not exist"),
         fresh_process=True),
    Case("bench-missing-train-folder", [*FASTLOAD, "bench", "{notrain}", "--seconds", "0.1"], 1,
         ("cannot bench {notrain} [train]", "images/nope does not exist")),
    Case("bench-missing-yaml", [*FASTLOAD, "bench", "{missing}"], 1, ("{missing}", "not found")),
    Case("bench-unknown-stage", [*FASTLOAD, "bench", "{good}", "--stages", "telepathy"], 2, ("telepathy", "choose from")),
    # damaged, unfinished and foreign stores
    Case("verify-truncated-lmdb", [*FASTLOAD, "verify", "{truncated}", "--no-progress"], 1,
         ("FAILED {truncated}", "data.mdb is truncated", "copy it again"), stream="stdout", fresh_process=True),
    Case("info-truncated-lmdb", [*FASTLOAD, "info", "{truncated}"], 1, ("data.mdb is truncated",)),
    Case("verify-newer-schema", [*FASTLOAD, "verify", "{newer}", "--no-progress"], 1,
         ("FAILED {newer}", "written by a newer fastload", "upgrade fastload"), stream="stdout"),
    Case("info-newer-schema", [*FASTLOAD, "info", "{newer}"], 1, ("{newer}", "written by a newer fastload")),
    Case("verify-unfinished-store", [*FASTLOAD, "verify", "{partial}", "--no-progress"], 1,
         ("FAILED {partial}", "interrupted conversion"), stream="stdout"),
    Case("verify-not-a-store", [*FASTLOAD, "verify", "{foreign}", "--no-progress"], 1,
         ("FAILED {foreign}", "not a fastload store"), stream="stdout"),
    Case("verify-folder-of-an-interrupted-conversion", [*FASTLOAD, "verify", "{tmp}", "--no-progress"], 1,
         ("FAILED {partial}", "interrupted conversion", "--out {tmp} --resume"), stream="stdout"),
    Case("info-folder-of-an-interrupted-conversion", [*FASTLOAD, "info", "{tmp}"], 1,
         ("{tmp} holds no data.yaml", "{partial} is an interrupted conversion", "--out {tmp} --resume")),
    Case("stage-onto-a-foreign-folder", [*FASTLOAD, "stage", "{good}", "--to", "{foreign}"], 1,
         ("{foreign} exists and was not staged by fastload", "choose another target")),
    Case("unstage-foreign-folder", [*FASTLOAD, "unstage", "{foreign}"], 1, ("{foreign} was not staged by fastload",),
         fresh_process=True),
    # the other commands' options
    Case("synth-negative-count", [*FASTLOAD, "synth", "{tmp}/s", "--n-train", "-1"], 2, ("argument --n-train", "must be >= 0, got -1"),
         fresh_process=True),
    Case("monitor-missing-program", [*FASTLOAD, "monitor", "--", "/nonexistent/trainer"], 2,
         ("'/nonexistent/trainer'", "not an executable file"), fresh_process=True),
    Case("demo-too-few-images", [*FASTLOAD, "demo", "--images", "4", "--batch", "4", "--out", "{tmp}/demo"], 2,
         ("--images (4) must be at least two batches",), fresh_process=True),
    # the trainer (its runs go to {tmp}/runs/train: a failed run must leave no expN there)
    Case("train-without-cfg", [*TRAIN, "--data", "{good}"], 2, ("--cfg is required", "yolov9-s", "--weights")),
    Case("train-missing-yaml", [*TRAIN, "--data", "{missing}", "--cfg", "gelan-t"], 1, ("{missing}", "not found")),
    Case("train-unknown-cfg", [*TRAIN, "--data", "{good}", "--cfg", "gelan-x"], 2, ("--cfg", "gelan-x not found", "gelan-t")),
    Case("train-cuda-without-gpu", [*TRAIN, "--data", "{good}", "--cfg", "gelan-t", "--device", "0"], 2,
         ("--device 0 asks for CUDA", "use --device cpu")),
    Case("train-imgsz-not-stride-multiple", [*TRAIN, "--data", "{good}", "--cfg", "gelan-t", "--imgsz", "300"], 2,
         ("--imgsz 300 is not a multiple of 32", "288 or 320")),
    Case("train-yaml-syntax", [*TRAIN, "--data", "{syntax}", "--cfg", "gelan-t"], 1, ("{syntax}", "not valid YAML")),
    Case("train-store-not-converted", [*TRAIN, "--data", "{good}", "--cfg", "gelan-t", "--imgsz", "64", "--device", "cpu",
                                       "--store", "lmdb", "--workers", "0", "--epochs", "1"], 1,
         ("no lmdb store recorded", "fastload convert")),
    # --debug / FASTLOAD_DEBUG=1 show the traceback instead
    Case("convert-debug", [*FASTLOAD, "convert", "{missing}", "--debug"], 1, ("DataConfigError", "not found"), traceback=True,
         fresh_process=True),
    Case("verify-env-debug", [*FASTLOAD, "verify", "{syntax}"], 1, ("DataConfigError",), env={"FASTLOAD_DEBUG": "1"},
         traceback=True, fresh_process=True),
    Case("train-debug", [*TRAIN, "--data", "{good}", "--cfg", "gelan-x", "--debug"], 1, ("UsageError", "gelan-x"), traceback=True),
]


def _case_env(case: Case) -> dict[str, str]:
    """What a case sets in its environment, in either way of running it."""
    return {"FASTLOAD_DEBUG": "", **case.env}


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**base_env(REPO), "FASTLOAD_DEBUG": "", **(extra or {})}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """A tiny dataset converted to lmdb (+ a second dataset), and one file of each bad kind."""
    from fastload.data.synthetic import make_synthetic_dataset
    from fastload.store.convert import convert

    tmp = tmp_path_factory.mktemp("bad")
    good = make_synthetic_dataset(tmp / "good", n_train=4, n_val=2, seed=1, max_size=96)
    other = make_synthetic_dataset(tmp / "other", n_train=3, n_val=2, seed=2, max_size=96)
    stores = tmp / "stores"
    convert(good, "lmdb", out=stores, imgsz=64, workers=1, progress=False, log=lambda *_: None)
    f = {"tmp": tmp, "good": good, "other": other, "stores": stores, "missing": tmp / "missing.yaml"}
    texts = {"syntax": "path: .\nnames: [a, b]\ntrain: [images/train\nval: images/val\n",
             "ncnames": f"path: {good.parent}\ntrain: images/train\nnc: 2\nnames: [a]\n",
             "empty": "", "types": "train: 3\nnames: 5\n",
             "notrain": f"path: {good.parent}\ntrain: images/nope\nval: images/val\nnames: [a, b, c]\n"}
    for name, text in texts.items():
        (tmp / f"{name}.yaml").write_text(text)
        f[name] = tmp / f"{name}.yaml"
    f["binary"] = tmp / "binary.yaml"
    f["binary"].write_bytes(b"names: [\xff\xfe]\ntrain: images\n")
    # a cut copy of the lmdb store, one from a newer fastload, and an interrupted conversion
    f["truncated"] = tmp / "cut.lmdb"
    shutil.copytree(stores / "train.lmdb", f["truncated"])
    mdb = f["truncated"] / "data.mdb"
    os.truncate(mdb, mdb.stat().st_size // 2)
    f["newer"] = tmp / "newer.disk"
    convert(good, "disk", out=tmp / "d", imgsz=64, workers=1, progress=False, log=lambda *_: None)
    shutil.copytree(tmp / "d" / "train-64.disk", f["newer"])
    meta = json.loads((f["newer"] / "meta.json").read_text())
    (f["newer"] / "meta.json").write_text(json.dumps({**meta, "schema": meta["schema"] + 1}))
    f["partial"] = tmp / "train.lmdb.partial"
    shutil.copytree(stores / "train.lmdb", f["partial"])
    f["foreign"] = tmp / "mine"
    (f["foreign"] / "notes.txt").parent.mkdir()
    (f["foreign"] / "notes.txt").write_text("not fastload's")
    return {k: str(v) for k, v in f.items()}


def _argv(case: Case, files: dict[str, str]) -> list[str]:
    argv = [a.format(**files) for a in case.argv]
    if argv[:3] == TRAIN:
        argv += ["--project", str(Path(files["tmp"]) / "runs" / "train")]
    return argv


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` updated with ``env`` for the duration (a case's FASTLOAD_DEBUG, as its subprocess would get)."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run_here(argv: list[str], cwd: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``main(argv)`` of the fastload CLI or the trainer in this process, in ``cwd`` with ``env`` added to the
    environment, with its output captured. (The subprocesses started meanwhile name their own cwd and env.)"""
    from fastload.cli import main as fastload_main
    from yolov9.train import main as train_main

    out, err = io.StringIO(), io.StringIO()
    main, args = (train_main, argv[3:]) if argv[:3] == TRAIN else (fastload_main, argv[3:])
    with contextlib.chdir(cwd), _environment(env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(args)
        except SystemExit as e:  # argparse
            rc = e.code
        except Exception:  # what the console would show: a traceback and exit 1
            traceback.print_exc()
            rc = 1
    return subprocess.CompletedProcess(argv, rc, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def results(files) -> dict[str, subprocess.CompletedProcess]:
    spawned = [c for c in CASES if c.fresh_process]
    # their environments taken before the cases run here change this process's (FASTLOAD_DEBUG)
    envs = {c.id: _env(c.env) for c in spawned}

    def run(case: Case) -> subprocess.CompletedProcess:
        return subprocess.run(_argv(case, files), cwd=files["tmp"], env=envs[case.id], capture_output=True, text=True,
                              timeout=300)

    import torch

    threads = torch.get_num_threads()
    # one intra-op thread for the trainer cases here (torch work in this process): the
    # subprocesses beside them, and the suite's other worker, hold the other cores (see one_torch_thread)
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=3) as pool:
            running = pool.map(run, spawned)
            here = {c.id: _run_here(_argv(c, files), files["tmp"], _case_env(c))  # while the processes run
                    for c in CASES if not c.fresh_process}
            return {**dict(zip([c.id for c in spawned], running)), **here}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, files, results):
    done = results[case.id]
    shown = f"rc {done.returncode}\nstdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-4000:]}"
    assert done.returncode == case.rc, shown
    if case.traceback:
        assert "Traceback (most recent call last)" in done.stderr, shown
        assert all(s in done.stderr for s in case.says), shown
        return
    assert "Traceback" not in done.stderr + done.stdout, shown
    err = done.stderr.strip().splitlines()
    if case.stream == "stderr":
        assert len(err) == 1, f"one line on stderr\n{shown}"
        line = err[0]
    else:
        assert not err, shown
        line = next((ln for ln in done.stdout.splitlines() if ln.startswith("FAILED")), "")
    for s in case.says:
        assert s.format(**files) in line, shown


def test_nothing_half_written_opens(files, results):
    """The failed conversions wrote no store, the refused one left the folder as it was, and failed trainer
    runs left no run folder."""
    tmp = Path(files["tmp"])
    for out in ("o1", "o2", "o3", "o4", "o5", "o6", "o7", "o8"):
        assert not (tmp / out / "data.yaml").exists() and not list((tmp / out).glob("*.lmdb*"))
    with open_store(files["stores"], "train", kind="lmdb") as s:
        assert len(s) == 4  # still the first dataset's store
    assert not (tmp / "runs" / "train").exists() or not any((tmp / "runs" / "train").iterdir())
    assert not (tmp / "staged").exists() and not (tmp / "s" / "data.yaml").exists()


def test_trainer_help_says_when_cfg_is_needed_and_what_multi_scale_does(capsys):
    from yolov9.train import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "required unless --weights or --resume names a checkpoint" in text
    assert "resize each batch to a random size within +/- 50% of --imgsz" in text


def test_output_pipe_closed_early_is_quiet(files):
    """`fastload info ... | head`: the reader goes away before the output is written."""
    proc = subprocess.Popen([*FASTLOAD, "info", files["good"], "--json"], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141 and err == "", err


def test_ram_store_removed_under_a_running_loader(files, tmp_path, monkeypatch):
    """`fastload unstage --force` while a loader reads: the loader keeps its mapping and finishes the epoch."""
    shm_root = isolated_shm(monkeypatch, "ramgone")
    try:
        import fastload
        from fastload.store.convert import convert

        res = convert(files["good"], "ram", out=tmp_path / "o", imgsz=64, splits="train", workers=1, progress=False,
                      log=lambda *_: None)
        # the loader in this process (torch is imported here already), the unstage a user's other shell runs
        ram = res.stores["train"]["ram"]
        with fastload.loader(res.yaml_path, imgsz=64, batch_size=1, store="ram", workers=1) as fl:
            batches = iter(fl)
            images = len(next(batches)[0])
            done = subprocess.run([*FASTLOAD, "unstage", "--force", str(ram)], env=_env(), capture_output=True,
                                  text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            images += sum(len(b[0]) for b in batches)
        assert images == 4
        assert not Path(res.stores["train"]["ram"]).exists()
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)


# The CLI with its writers wrapped (here, in the test, not in the library): at the writer call the test chose
# (a record converted, a file staged) the child says so on a pipe and waits there for the signal, so that
# SIGINT lands in the middle of the work at that point, however fast the machine.
PAUSED_CLI = """
import os, sys, time
from fastload.cli import main
from fastload.store import stage
from fastload.store.lmdb_store import LmdbWriter
from fastload.store.packed import PackedWriter

pause_at, ready_fd = int(sys.argv[1]), int(sys.argv[2])
calls = 0

def paused(original):
    def wrapper(*args, **kwargs):
        global calls
        calls += 1
        if calls == pause_at:
            os.write(ready_fd, b"!")
            while True:  # until SIGINT's KeyboardInterrupt
                time.sleep(0.01)
        return original(*args, **kwargs)
    return wrapper

LmdbWriter.add_many, PackedWriter.add = paused(LmdbWriter.add_many), paused(PackedWriter.add)
stage._copy_file = paused(stage._copy_file)
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.parametrize("command", ["convert", "stage"])
def test_ctrl_c_at_random_points_leaves_nothing_that_opens(command, files, tmp_path):
    """SIGINT at seeded random points of the work: exit 130 with one line (or 0 when the work was already
    done), and the target is complete or absent; never a store that opens half-written, never a lock file."""
    # the writer call each run stops at, of the 8 that convert makes (one lmdb commit per split, 6 disk records)
    # and the 12 of stage (one per copied file)
    pause_points = random.Random(15).sample(range(1, 9), 3)
    outcomes = []
    for k, pause_at in enumerate(pause_points):
        target = tmp_path / f"{command}{k}"
        if command == "convert":
            argv = [*FASTLOAD, "convert", files["good"], "--to", "lmdb,disk", "--imgsz", "64", "--out", str(target),
                    "--workers", "1", "--no-progress"]
        else:
            argv = [*FASTLOAD, "stage", files["good"], "--to", str(target)]
        ready, ready_w = os.pipe()
        argv = [sys.executable, "-c", PAUSED_CLI, str(pause_at), str(ready_w), *argv[len(FASTLOAD):]]
        # SIGINT as in a terminal: a suite started in the background (`cmd &` in a script) runs with SIGINT
        # ignored, which a child inherits; Python then never raises KeyboardInterrupt and the work completes
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=_env({"PYTHONUNBUFFERED": "1"}), pass_fds=(ready_w,),
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        os.close(ready_w)
        try:
            paused = os.read(ready, 1) == b"!"  # b"" once the child exited: it finished before that call
        finally:
            os.close(ready)
        if paused:
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        outcomes.append(proc.returncode)
        assert proc.returncode in (0, 130) and "Traceback" not in err, err
        assert (proc.returncode == 130) == paused, err  # a paused run is stopped by the signal, any other finishes
        if proc.returncode == 130:
            assert err.strip().splitlines()[-1].endswith(f"fastload {command}: interrupted"), err
        if command == "convert":
            assert not (target / ".convert.lock").exists()
            for store in [p for p in target.iterdir() if p.suffix in (".lmdb", ".disk")]:
                open_store(store, imgsz=64).close()  # whatever has its final name is complete
            for partial in target.glob("*.partial"):
                with pytest.raises(StoreError, match="interrupted"):
                    open_store(partial)
        else:
            assert not list(tmp_path.glob(f".{target.name}.staging*"))
            assert (proc.returncode == 130) == (not target.exists())
    assert 130 in outcomes, f"no run was interrupted: {outcomes}"
