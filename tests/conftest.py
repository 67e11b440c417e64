"""Shared fixtures: the real coco128 set (skipped with a reason where it is absent) and small synthetic sets."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COCO128 = Path(os.environ.get("FASTLOAD_COCO128", REPO.parent / "shared" / "datasets" / "coco128"))


@pytest.fixture(scope="session")
def coco128_yaml() -> Path:
    """Path to ../shared/datasets/coco128/coco128.yaml; skips when the folder is absent (a user's machine)."""
    yaml_path = COCO128 / "coco128.yaml"
    if not yaml_path.is_file():
        pytest.skip(f"coco128 not found at {yaml_path} (set FASTLOAD_COCO128 to its folder)")
    return yaml_path


@pytest.fixture(scope="session")
def synth_yaml(tmp_path_factory) -> Path:
    """A small synthetic dataset (JPEG and PNG, odd sizes, some empty labels) shared by the session."""
    from fastload.data.synthetic import make_synthetic_dataset

    out = tmp_path_factory.mktemp("synth")
    return make_synthetic_dataset(out, n_train=24, n_val=8, nc=3, seed=0)
