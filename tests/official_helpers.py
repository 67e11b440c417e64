"""Running the official YOLOv9 repository (../shared/upstream/yolov9, GPL-3.0, a test fixture) from
tests and from benchmarks/official_trainer.py.

It is copied to a temporary folder (read-only in CI) where only what a user would change changes:
the import line the README shows, and one numpy-compatibility patch (below). Its scripts run as
subprocesses on the CPU. Nothing of it is imported into the test process.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from preloaded import PreloadedProcess, PreloadedPython, base_env

REPO = Path(__file__).resolve().parents[1]
UPSTREAM = Path(os.environ.get("FASTLOAD_YOLOV9_UPSTREAM", REPO.parent / "shared" / "upstream" / "yolov9"))
STOCK_IMPORT = "from utils.dataloaders import create_dataloader"
README_IMPORT = "from fastload.compat.yolov9 import create_dataloader"
# the scripts of segment/ import the segment loader's
SEGMENT_STOCK_IMPORT = "from utils.segment.dataloaders import create_dataloader"
SEGMENT_README_IMPORT = "from fastload.compat.yolov9.segment import create_dataloader"


def require_upstream() -> Path:
    """The official checkout; skips with a reason where ../shared is absent (a user's machine)."""
    import pytest

    if not (UPSTREAM / "train_dual.py").is_file():
        pytest.skip(f"official YOLOv9 checkout not found at {UPSTREAM} (set FASTLOAD_YOLOV9_UPSTREAM)")
    return UPSTREAM


def copy_upstream(dst: Path, *, switch_import: Sequence[str] = (), src: Path | None = None) -> Path:
    """A writable copy of the official repository (``src``, default ../shared/upstream/yolov9) at ``dst``.

    ``switch_import``: scripts whose one ``from utils.dataloaders import create_dataloader`` line is
    replaced by the README's ``from fastload.compat.yolov9 import create_dataloader`` (those of ``segment/``: their
    ``from utils.segment.dataloaders import create_dataloader`` by ``from fastload.compat.yolov9.segment import
    create_dataloader``).

    numpy >= 2.4 removed ``np.trapz``, which the official ``utils/metrics.py`` calls as soon as a
    prediction matches a label; the copy calls ``np.trapezoid`` instead (the fix
    ../shared/upstream/README.md names). No other file changes.
    """
    shutil.copytree(src or require_upstream(), dst)
    for p in [dst, *dst.rglob("*")]:
        p.chmod(p.stat().st_mode | 0o200)
    metrics = dst / "utils" / "metrics.py"
    text = metrics.read_text()
    if "np.trapz(" in text and not hasattr(__import__("numpy"), "trapz"):
        metrics.write_text(text.replace("np.trapz(", "np.trapezoid("))
    for script in switch_import:
        path = dst / script
        stock, readme = ((SEGMENT_STOCK_IMPORT, SEGMENT_README_IMPORT) if script.startswith("segment/")
                         else (STOCK_IMPORT, README_IMPORT))
        lines = path.read_text().splitlines(keepends=True)
        hits = [k for k, line in enumerate(lines) if line.rstrip("\n") == stock]
        assert len(hits) == 1, f"{script}: expected one line {stock!r}, found {len(hits)}"
        lines[hits[0]] = readme + "\n"
        path.write_text("".join(lines))
    return dst


def thinned(model_yaml: str) -> str:
    """A YOLOv9/GELAN model yaml's text with each RepNCSPELAN4 at one RepNCSP repeat instead of three.

    Fewer layers, the same structure and heads: the trainers (official and Ultralytics') deep-copy the model for the
    EMA and pickle it whole in every checkpoint, which for yolov9-t's 1219 layers costs more CPU than its 2 epochs
    at --img 64."""
    return re.sub(r"(RepNCSPELAN4, \[\d+, \d+, \d+), 3\]", r"\1, 1]", model_yaml)


def thin_config(checkout: Path, config: str) -> str:
    """``config`` (an official model yaml of the checkout) :func:`thinned`, written beside it as ``NAME-thin.yaml``
    (a user's own config); returns its path relative to the checkout."""
    src = checkout / config
    text = thinned(src.read_text())
    assert text != src.read_text(), f"{config}: no RepNCSPELAN4 with 3 repeats"
    dst = src.with_name(src.stem + "-thin.yaml")
    dst.write_text(text)
    return str(dst.relative_to(checkout))


def coco_subset(coco_root: Path, dst: Path, n: int) -> Path:
    """A data.yaml over the first ``n`` coco128 images (linked) and their labels (copied: the official
    loader writes its labels.cache beside them); train and val are the same images, as in coco128."""
    import yaml

    src_images = coco_root / "images" / "train2017"
    (dst / "images").mkdir(parents=True)
    (dst / "labels").mkdir()
    for img in sorted(src_images.iterdir())[:n]:
        (dst / "images" / img.name).symlink_to(img)
        label = coco_root / "labels" / "train2017" / (img.stem + ".txt")
        if label.is_file():
            shutil.copyfile(label, dst / "labels" / label.name)
    names = yaml.safe_load((coco_root / "coco128.yaml").read_text())["names"]
    data = dst / "data.yaml"
    data.write_text(yaml.safe_dump({"path": str(dst), "train": "images", "val": "images", "nc": len(names),
                                    "names": names}, sort_keys=False))
    return data


def official_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The environment of an official process: fastload from this checkout, no network, one torch thread.

    YOLOV5_CONFIG_DIR holds a TrueType font named Arial.ttf (matplotlib's DejaVuSans), which the
    official code otherwise downloads; TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 lets torch >= 2.6 load its
    pickled checkpoints (only in these processes: fastload's own loads stay weights_only); one OpenMP
    thread, because two processes sharing two cores with two threads each spin-wait (~10x slower).
    """
    import matplotlib

    config = tmp / "yolov5_config"
    if not (config / "Arial.ttf").is_file():
        config.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf", config / "Arial.ttf")
    return {**base_env(REPO), "YOLOV5_CONFIG_DIR": str(config), "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1", **extra}


@dataclasses.dataclass
class Run:
    """One official process: its command, and once finished its exit status and output."""

    name: str
    argv: list[str]
    cwd: Path
    env: dict[str, str]
    # mostly waits (torchrun's ranks fail at once, then it polls every few seconds): run_all starts it at once,
    # beside the ``parallel`` others, instead of letting it hold one of their places
    waits: bool = False
    proc: subprocess.Popen | PreloadedProcess | None = None
    log_path: Path | None = None
    returncode: int | None = None
    output: str = ""
    seconds: float = 0.0
    _t0: float = 0.0

    def start(self, logs: Path, server: PreloadedPython | None = None) -> None:
        """Start the run; with ``server``, a run of ``python()`` is forked from that pre-loaded interpreter."""
        self.log_path = logs / f"{self.name}.log"
        self._t0 = time.perf_counter()
        if server is not None and self.argv[0] == python():
            self.proc = server.spawn(self.argv[1:], self.cwd, self.env, self.log_path)
            return
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(self.argv, cwd=self.cwd, env=self.env, stdout=out, stderr=subprocess.STDOUT)

    def finish(self, timeout: float) -> None:
        assert self.proc is not None and self.log_path is not None
        try:
            self.returncode = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.returncode = self.proc.wait()
        self.seconds = time.perf_counter() - self._t0
        self.output = self.log_path.read_text(errors="replace")

    def check(self) -> str:
        """The output, after asserting a zero exit status (the output's tail in the message otherwise)."""
        assert self.returncode == 0, f"{self.name} exited {self.returncode}:\n{self.output[-6000:]}"
        return self.output


def run_all(stages: Sequence[Sequence[Run]], logs: Path, *, parallel: int = 2, timeout: float = 400,
            server: PreloadedPython | None = None) -> None:
    """Run the stages one after the other, the runs of a stage ``parallel`` at a time (forked from ``server``
    where given), those that mostly wait (``Run.waits``) at once beside them; a run still going after ``timeout``
    seconds is killed (its exit status then says so)."""
    logs.mkdir(parents=True, exist_ok=True)
    for stage in stages:
        pending = list(stage)
        running: list[Run] = []
        while pending or running:
            for run in [r for r in pending if r.waits]:
                pending.remove(run)
                run.start(logs, server)
                running.append(run)
            while pending and sum(not r.waits for r in running) < parallel:
                run = pending.pop(0)
                run.start(logs, server)
                running.append(run)
            for run in list(running):
                assert run.proc is not None
                overdue = time.perf_counter() - run._t0 > timeout
                if run.proc.poll() is not None or overdue:
                    run.finish(timeout=0.1)
                    running.remove(run)
            time.sleep(0.05)  # a finished run's successor (or the next stage) starts within 50 ms, not 200


def python() -> str:
    return sys.executable
