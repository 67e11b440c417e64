"""Helpers shared by the store tests: a planted-faults dataset and a CLI runner for the store commands."""
from __future__ import annotations

import argparse
import importlib
import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest

STORE_COMMANDS = ("convert", "stage", "unstage", "verify", "info")


def run_cli(argv: list[str]) -> int:
    """Run one store sub-command through its own parser (independent of the other commands' modules)."""
    parser = argparse.ArgumentParser(prog="fastload")
    sub = parser.add_subparsers()
    for name in STORE_COMMANDS:
        importlib.import_module(f"fastload.cli.{name}_cmd").register(sub, name)
    args = parser.parse_args(argv)
    return int(args.func(args))


def make_faults_dataset(root: Path, n_good: int = 6) -> tuple[Path, dict[str, str]]:
    """A small dataset with one of each planted fault; returns its yaml and {fault: file it is in}."""
    from fastload.data.synthetic import make_synthetic_dataset

    yaml_path = make_synthetic_dataset(root, n_train=n_good, n_val=2, nc=3, seed=1, max_size=160)
    im_dir, lb_dir = root / "images" / "train", root / "labels" / "train"
    rng = np.random.default_rng(0)

    def jpeg(h: int = 40, w: int = 50) -> bytes:
        return cv2.imencode(".jpg", rng.integers(0, 255, (h, w, 3), np.uint8))[1].tobytes()

    faults: dict[str, str] = {}
    whole = jpeg()
    (im_dir / "f_truncated.jpg").write_bytes(whole[: len(whole) // 2])
    faults["truncated"] = str(im_dir / "f_truncated.jpg")
    (im_dir / "f_zero.jpg").write_bytes(b"")
    faults["zero_bytes"] = str(im_dir / "f_zero.jpg")
    (im_dir / "f_png.jpg").write_bytes(cv2.imencode(".png", rng.integers(0, 255, (30, 20, 3), np.uint8))[1].tobytes())
    faults["png_as_jpg"] = str(im_dir / "f_png.jpg")
    for stem, text in {
        "f_class99": "99 0.5 0.5 0.2 0.2\n0 0.5 0.5 0.2 0.2\n",
        "f_x17": "1 1.7 0.5 0.2 0.2\n",
        "f_4cols": "1 0.5 0.5 0.2\n",
        "f_text": "person 0.5 0.5 0.2 0.2\n",
    }.items():
        (im_dir / f"{stem}.jpg").write_bytes(jpeg())
        (lb_dir / f"{stem}.txt").write_text(text)
        faults[stem[2:]] = str(lb_dir / f"{stem}.txt")
    for name in ("f_truncated", "f_zero", "f_png"):
        (lb_dir / f"{name}.txt").write_text("0 0.5 0.5 0.1 0.1\n")
    return yaml_path, faults


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def isolated_shm(monkeypatch, name: str) -> Path:
    """Point FASTLOAD_SHM_DIR at a private folder under /dev/shm (or the tmp dir) for one test."""
    import os
    import uuid

    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    root = base / f"fltest-{name}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    root.mkdir()
    monkeypatch.setenv("FASTLOAD_SHM_DIR", str(root))
    return root


@pytest.fixture
def shm_root(monkeypatch, request):
    """A private shm root for one test, removed afterwards."""
    root = isolated_shm(monkeypatch, request.node.name[:24].replace("[", "_").replace("]", ""))
    yield root
    shutil.rmtree(root, ignore_errors=True)
