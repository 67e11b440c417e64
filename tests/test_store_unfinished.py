"""An interrupted conversion is named, with the exact command that finishes it, by convert's own Ctrl-C report,
by `verify OUT` and by `info OUT`; running that command finishes it. A convert that fails leaves no --out folder
it created."""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastload.data.synthetic import make_synthetic_dataset
from fastload.store.encoded import EncodedWriter
from fastload.store.packed import PackedWriter
from fastload.store.verify import verify_target
from store_helpers import run_cli

REPO = Path(__file__).resolve().parents[1]

# `fastload convert` whose LMDB writer stops after its first transaction: it touches READY and waits there
# (wrapped here, in the test, not in the library), so that SIGINT lands mid-conversion without a timed guess.
STALLED_CLI = """
import sys, time
from pathlib import Path
from fastload.cli import main
from fastload.store import lmdb_store
from fastload.store.lmdb_store import LmdbWriter

lmdb_store.COMMIT_EVERY = 2
add_many = LmdbWriter.add_many

def add_then_wait(self, records):
    add_many(self, records)
    Path(sys.argv[1]).touch()
    time.sleep(120)

LmdbWriter.add_many = add_then_wait
sys.exit(main(sys.argv[2:]))
"""


@pytest.fixture(scope="module")
def data_yaml(tmp_path_factory) -> Path:
    return make_synthetic_dataset(tmp_path_factory.mktemp("unfinished"), n_train=6, n_val=2, seed=5,
                                  min_size=32, max_size=64)


def _finish_command(text: str) -> list[str]:
    """The argv after `fastload` in the first `fastload convert ...` quoted in ``text``."""
    start = text.index("`fastload convert ") + 1
    argv = shlex.split(text[start:text.index("`", start)])
    assert argv[0] == "fastload"
    return argv[1:]


def test_ctrl_c_names_the_partial_and_verify_info_say_how_to_finish(data_yaml, tmp_path, capsys):
    out = tmp_path / "out dir"  # a space: the printed command must quote it
    ready = tmp_path / "ready"
    argv = ["convert", str(data_yaml), "--to", "lmdb,disk", "--imgsz", "64", "--out", str(out), "--split", "train",
            "--workers", "1", "--no-progress"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               FASTLOAD_DEBUG="")
    # SIGINT as in a terminal, also when the suite itself runs in the background with SIGINT ignored
    proc = subprocess.Popen([sys.executable, "-c", STALLED_CLI, str(ready), *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), proc.communicate()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    partial = out / "train.lmdb.partial"
    lines = err.strip().splitlines()
    assert lines[-1] == "fastload convert: interrupted", err
    assert lines[-2].startswith(f"fastload convert: {partial} is an interrupted conversion"), err
    command = _finish_command(lines[-2])
    assert command == ["convert", str(data_yaml), "--to", "lmdb,disk", "--out", str(out), "--split", "train",
                       "--imgsz", "64", "--resume"]
    assert partial.is_dir() and not (out / "data.yaml").exists()

    capsys.readouterr()
    assert run_cli(["verify", str(out), "--no-progress"]) == 1
    verified = capsys.readouterr().out
    assert verified.startswith(f"FAILED {partial}: an interrupted conversion") and "not a fastload store" not in verified
    assert _finish_command(verified) == command
    assert run_cli(["info", str(out)]) == 1
    info = capsys.readouterr().err.strip()
    assert len(info.splitlines()) == 1 and f"{partial} is an interrupted conversion" in info
    assert "data yaml not found" not in info and _finish_command(info) == command

    assert run_cli([*command, "--no-progress"]) == 0
    assert "resuming train.lmdb: 2 of 6 records already written" in capsys.readouterr().out
    results = verify_target(out)
    assert [Path(r.path).name for r in results] == ["train.lmdb", "train-64.disk"] and all(r.ok for r in results)
    assert sorted(p.name for p in out.iterdir()) == ["data.yaml", "train-64.disk", "train.lmdb"]  # no note left


@pytest.mark.parametrize("kind,partial_name,options", [("disk", "train-64.disk.partial", ["--imgsz", "64"]),
                                                       ("encoded", "train.encoded.partial", [])])
def test_unfinished_disk_conversion_says_it_starts_over(data_yaml, tmp_path, monkeypatch, capsys, kind, partial_name,
                                                        options):
    """A disk (or encoded) store killed half-way (SIGKILL: nothing can clean up) next to finished ones: verify and
    info name it and give the command without --resume; that command replaces it."""
    writer = EncodedWriter if kind == "encoded" else PackedWriter
    out = tmp_path / "o"
    assert run_cli(["convert", str(data_yaml), "--to", "lmdb", "--out", str(out), "--no-progress"]) == 0

    def killed(self, *args, **kwargs):
        raise SystemExit(137)

    with monkeypatch.context() as m:  # a kill -9 mid-write: neither the writer nor convert gets to clean up
        m.setattr(writer, "add", killed)
        m.setattr(writer, "abort", lambda self: None)
        with pytest.raises(SystemExit):
            run_cli(["convert", str(data_yaml), "--to", kind, *options, "--out", str(out), "--no-progress"])
    partial = out / partial_name
    assert partial.is_dir()
    capsys.readouterr()
    assert run_cli(["verify", str(out), "--no-progress"]) == 1
    verified = capsys.readouterr().out
    assert f"OK {out / 'train.lmdb'}" in verified
    failed = [ln for ln in verified.splitlines() if ln.startswith("FAILED")]
    assert len(failed) == 1 and failed[0].startswith(f"FAILED {partial}: an interrupted conversion ({kind} store")
    assert "encoded/disk/ram conversions start over" in failed[0]
    command = _finish_command(failed[0])
    assert command == ["convert", str(data_yaml), "--to", kind, "--out", str(out), *options]
    assert run_cli(["info", str(out)]) == 0  # the yaml's stores are reported, and the unfinished one named
    assert f"UNFINISHED {partial}: an interrupted conversion" in capsys.readouterr().out
    assert run_cli([*command, "--no-progress"]) == 0
    assert not partial.exists() and all(r.ok for r in verify_target(out))


def test_failed_convert_leaves_no_out_folder_it_created(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"path: {tmp_path}\ntrain: images/nope\nnames: [a]\n")
    out = tmp_path / "new" / "stores"
    assert run_cli(["convert", str(bad), "--out", str(out), "--no-progress"]) == 1
    assert "images/nope does not exist" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    assert run_cli(["convert", str(bad), "--out", str(kept), "--no-progress"]) == 1
    assert kept.is_dir() and not any(kept.iterdir())  # it existed before: left as it was
