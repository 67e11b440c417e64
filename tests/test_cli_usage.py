"""Usage errors of every sub-command: a bad option value exits 2 (as docs/stores.md's table says) with one
stderr line that names the command and the option, before any work is done (nothing on stdout, no folder
written). Each case calls ``main()`` in this process: a refused option costs no interpreter start-up."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from fastload.cli import COMMANDS, main
from fastload.data.synthetic import make_synthetic_dataset
from fastload.store.convert import convert

# (sub-command, argv after it, what the line must name); {yaml}, {store}, {tmp} are filled by the fixture.
CASES: list[tuple[str, list[str], str]] = [
    ("demo", ["--batch", "0", "--out", "{tmp}/demo"], "--batch"),
    ("demo", ["--imgsz", "0", "--out", "{tmp}/demo"], "--imgsz"),
    ("demo", ["--workers", "-1", "--out", "{tmp}/demo"], "--workers"),
    ("synth", ["{tmp}/synth", "--nc", "0"], "nc"),
    ("synth", ["{tmp}/synth", "--n-val", "x"], "--n-val"),
    ("convert", ["{yaml}", "--to", "lmbd", "--out", "{tmp}/c"], "lmbd"),
    ("convert", ["{yaml}", "--imgsz", "0", "--out", "{tmp}/c"], "--imgsz"),
    ("convert", ["{yaml}", "--workers", "0", "--out", "{tmp}/c"], "--workers"),
    ("convert", ["{yaml}", "--max-side", "-5", "--out", "{tmp}/c"], "--max-side"),
    ("convert", ["{yaml}", "--quality", "101", "--out", "{tmp}/c"], "--quality"),
    ("convert", ["{yaml}", "--to", "disk,ram", "--max-side", "64", "--out", "{tmp}/c"], "--max-side"),
    ("convert", ["{yaml}", "--split", "trian", "--out", "{tmp}/c"], "trian"),
    ("stage", ["{yaml}", "--to", "{tmp}/staged", "--split", "trian"], "trian"),
    ("unstage", ["--stale", "--force"], "--force"),
    ("verify", ["{store}", "--jsn"], "--jsn"),
    ("verify", [], "target"),
    ("info", ["{yaml}", "--split", "trian"], "trian"),
    ("info", ["{store}", "--split", "val"], "--split"),
    ("bench", ["{yaml}", "--stores", "lmbd"], "lmbd"),
    ("bench", ["{yaml}", "--engines", "cpux"], "cpux"),
    ("bench", ["{yaml}", "--seconds", "0"], "--seconds"),
    ("bench", ["{yaml}", "--batch", "0"], "--batch"),
    ("bench", ["{yaml}", "--workers", "-2"], "--workers"),
    ("bench", ["{yaml}", "--imgsz", "0"], "--imgsz"),
    ("monitor", ["--interval", "0", "--", "true"], "--interval"),
    ("monitor", ["--duration", "-1", "--", "true"], "--duration"),
    ("monitor", ["--gpus", "first", "--", "true"], "--gpus"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("usage")
    yaml_path = make_synthetic_dataset(tmp / "ds", n_train=3, n_val=1, seed=4, min_size=32, max_size=64)
    res = convert(yaml_path, "lmdb", out=tmp / "stores", splits="train", workers=1, progress=False,
                  log=lambda *_: None)
    return {"tmp": str(tmp), "yaml": str(yaml_path), "store": str(res.stores["train"]["lmdb"])}


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def test_every_command_is_walked():
    assert {name for name, _ in COMMANDS} == {command for command, _, _ in CASES}


@pytest.mark.parametrize("command, args, names", CASES, ids=[f"{c}-{' '.join(a)}" for c, a, _ in CASES])
def test_bad_option_value_exits_2_with_one_line(command, args, names, files):
    before = sorted(p.name for p in Path(files["tmp"]).iterdir())
    rc, out, err = _run([command, *(a.format(**files) for a in args)])
    shown = f"rc {rc}\nstdout:\n{out}\nstderr:\n{err}"
    assert rc == 2, shown
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, shown
    assert lines[0].startswith(f"fastload {command}: ") and names in lines[0], shown
    assert out == "", shown  # refused before any work
    assert sorted(p.name for p in Path(files["tmp"]).iterdir()) == before, shown  # and nothing written
