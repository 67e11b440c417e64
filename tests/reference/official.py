"""Run the official YOLOv9 code (``../shared/upstream/yolov9``, GPL-3.0) as an external program.

Nothing of it is imported here or copied into the project: :func:`make_copy` copies the folder to a
temporary place (the original is read-only in CI) and changes only what today's packages require, and
:meth:`Official.run` / :meth:`Official.bridge` start its scripts, or our :mod:`official_bridge` script with the
copy on ``sys.path``, in their own processes. Used by the parity tests and ``benchmarks/trainer_parity.py``.
"""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import preloaded
from official_helpers import UPSTREAM, copy_upstream, official_env

BRIDGE = Path(__file__).with_name("official_bridge.py")


def available() -> bool:
    return (UPSTREAM / "train_dual.py").is_file()


def make_copy(dest: Path) -> Path:
    """A writable copy of the official repository at ``dest / "yolov9"`` (``official_helpers.copy_upstream``:
    the one numpy-compatibility patch, nothing else changed)."""
    if not available():
        raise FileNotFoundError(f"official YOLOv9 repository not found at {UPSTREAM}")
    return copy_upstream(dest / "yolov9", src=UPSTREAM)


@dataclass
class Official:
    """A prepared copy (``root``) and the environment its processes need; with ``server`` (one thread only), the
    processes are forked from that pre-loaded interpreter (tests/preloaded.py) instead of started afresh."""

    root: Path
    threads: int = 1
    server: preloaded.PreloadedPython | None = None

    @classmethod
    def create(cls, dest: Path, threads: int = 1, server: preloaded.PreloadedPython | None = None) -> "Official":
        return cls(make_copy(dest), threads, server)

    @property
    def env(self) -> dict[str, str]:
        """``official_helpers.official_env`` (its font, no network, pickled checkpoints only in these
        processes) with ``threads`` OpenMP/MKL threads."""
        return official_env(self.root.parent, OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads),
                            PYTHONUNBUFFERED="1")

    def run(self, script: str, *args: str, timeout: float | None = None, log: Path | None = None
            ) -> subprocess.CompletedProcess:
        """``python <script> args`` in the copy (``train.py``, ``val_dual.py``, ...); raises on failure."""
        return self._run([sys.executable, script, *args], timeout, log)

    def bridge(self, *args: str, timeout: float | None = None, log: Path | None = None
               ) -> subprocess.CompletedProcess:
        """Our ``official_bridge.py`` with the official code importable (see that file for the commands)."""
        return self._run([sys.executable, str(BRIDGE), "--root", str(self.root), *args], timeout, log)

    def _run(self, cmd: list[str], timeout: float | None, log: Path | None) -> subprocess.CompletedProcess:
        if self.server is not None and log is None:
            proc = preloaded.run(self.server, cmd[1:], self.root, self.env, timeout=timeout or 600)
            out = proc.stdout + proc.stderr
        elif log is None:
            proc = subprocess.run(cmd, cwd=self.root, env=self.env, capture_output=True, text=True, timeout=timeout)
            out = proc.stdout + proc.stderr
        else:
            with open(log, "w") as f:
                proc = subprocess.run(cmd, cwd=self.root, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                      text=True, timeout=timeout)
            out = log.read_text()
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd[1:3])} failed (exit {proc.returncode}):\n{out[-4000:]}")
        return proc
