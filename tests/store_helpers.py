"""Helpers shared by the store tests: a planted-faults dataset, a CLI runner for the store commands, and a store
error met by every render (in a loader's workers too)."""
from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator

import pytest

def run_cli(argv: list[str]) -> int:
    """``fastload ARGV`` in this process: the exit code, errors reported on stderr as the console shows them."""
    from fastload.cli import main

    return main(argv)


def make_faults_dataset(root: Path, n_good: int = 6) -> tuple[Path, dict[str, str]]:
    """A small dataset with one of each planted fault; returns its yaml and {fault: file it is in}."""
    from fastload.data.synthetic import make_synthetic_dataset, plant_faults

    yaml_path = make_synthetic_dataset(root, n_train=n_good, n_val=2, nc=3, seed=1, max_size=160)
    return yaml_path, {fault: str(path) for fault, path in plant_faults(root).items()}


def check_staged_copy_alone(staged: Path, sources: Path, capsys) -> None:
    """With the dataset folder ``sources`` removed, the staged copy ``staged`` still serves as a dataset: its
    data.yaml's ``path`` is the copy, ``fastload info`` describes its splits from their stores, the loader reads
    them."""
    import json

    import fastload

    shutil.rmtree(sources)
    capsys.readouterr()
    assert run_cli(["info", str(staged / "data.yaml"), "--json"]) == 0, capsys.readouterr().err
    info = json.loads(capsys.readouterr().out)
    assert info["splits"] and all(s["images"] > 0 and s["described_by"].startswith(str(staged))
                                  for s in info["splits"].values())
    assert run_cli(["verify", str(staged / "data.yaml"), "--no-progress"]) == 0
    with fastload.loader(staged / "data.yaml", imgsz=64, batch_size=2, workers=0) as loader:
        assert sum(len(paths) for _, _, paths, _ in loader) == info["splits"]["train"]["images"]


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def isolated_shm(monkeypatch, name: str) -> Path:
    """Point FASTLOAD_SHM_DIR at a private folder under /dev/shm (or the tmp dir) for one test."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    root = base / f"fltest-{name}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    root.mkdir()
    monkeypatch.setenv("FASTLOAD_SHM_DIR", str(root))
    return root


@contextlib.contextmanager
def converted_stores(yaml_path: Path, to: str, out: Path, *, imgsz: int, tag: str) -> Iterator[Path]:
    """Convert ``yaml_path`` to the stores ``to`` (e.g. ``"lmdb,ram"``) under ``out`` and yield the new yaml.

    Ram stores go to a private shm root (``/dev/shm/fastload-test-<tag>-<pid>``, or under ``out``
    without /dev/shm) that ``FASTLOAD_SHM_DIR`` points at while the block runs; it is removed after.
    """
    from fastload.store.convert import convert

    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else out / "shm"
    root = base / f"fastload-test-{tag}-{os.getpid()}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FASTLOAD_SHM_DIR", str(root))
        try:
            res = convert(yaml_path, to=to, out=out / "stores", imgsz=imgsz, progress=False, log=lambda *_: None)
            yield res.yaml_path
        finally:
            shutil.rmtree(root, ignore_errors=True)


REFUSED = "s3://bkt/set/pixels.bin: access denied (AccessDenied); check the credentials"


def refuse_every_render(monkeypatch) -> None:
    """Every batch render raises the StoreError of object storage refusing the credentials (:data:`REFUSED`), in
    this process and in the loader workers it forks afterwards (they inherit the patch)."""
    from fastload.engines.cpu_render import BatchRenderer
    from fastload.store.base import StoreError

    def refused(*_):
        raise StoreError(REFUSED)

    monkeypatch.setattr(BatchRenderer, "render", refused)


def assert_refused_as_in_process(err: BaseException, workers: int) -> None:
    """``err`` is the error :func:`refuse_every_render` gives with ``workers=0``: its class and its one line; from
    workers, with the worker's traceback kept on it."""
    from fastload.store.base import StoreError

    assert type(err) is StoreError and str(err) == REFUSED
    assert ("in refused" in err.worker_traceback) if workers else not hasattr(err, "worker_traceback")
