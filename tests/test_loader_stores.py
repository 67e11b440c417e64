"""The loader reads every store kind (files, lmdb, encoded, disk, ram) and gives the same batches from each."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from fastload.fastloader import loader

IMGSZ = 128
KINDS = ("files", "lmdb", "encoded", "disk", "ram")


@pytest.fixture(scope="module")
def converted(synth_yaml, tmp_path_factory):
    """The synthetic set converted to lmdb, encoded, disk and ram stores (ram under a private shm root)."""
    from fastload.store.convert import convert

    root = Path("/dev/shm" if os.path.isdir("/dev/shm") else tmp_path_factory.mktemp("shm")) / f"fastload-test-loader-{os.getpid()}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FASTLOAD_SHM_DIR", str(root))
        out = tmp_path_factory.mktemp("stores")
        res = convert(synth_yaml, to="lmdb,encoded,disk,ram", out=out, imgsz=IMGSZ, progress=False, log=lambda *_: None)
        yield res.yaml_path
    shutil.rmtree(root, ignore_errors=True)


def run(yaml_path, kind, **kw):
    args = dict(imgsz=IMGSZ, batch_size=4, workers=1, augment=False, shuffle=False, store=kind)
    args.update(kw)
    with loader(yaml_path, **args) as fl:
        assert fl.store.kind == kind
        return [(b[0].clone(), b[1].clone(), b[2], b[3]) for b in fl]


@pytest.fixture(scope="module")
def from_files(converted):
    return run(converted, "files")


@pytest.mark.parametrize("kind", KINDS[1:])
def test_store_gives_same_batches_as_files(converted, from_files, kind):
    got = run(converted, kind)
    assert len(got) == len(from_files)
    for a, b in zip(from_files, got):
        assert a[2] == b[2] and a[3] == b[3]
        torch.testing.assert_close(a[1], b[1])
        if kind in ("lmdb", "encoded"):  # the source files' own bytes: decoded and resized as from the files
            assert torch.equal(a[0], b[0])
        diff = (a[0].int() - b[0].int()).abs()
        assert diff.float().mean() < 1.0  # same pixels up to resize rounding of the packed stores


def test_auto_prefers_ram_and_augments_identically_with_workers(converted):
    with loader(converted, imgsz=IMGSZ, batch_size=4, workers=0) as fl:
        assert fl.store.kind == "ram"
    a = run(converted, "ram", augment=True, shuffle=True, workers=0)
    b = run(converted, "ram", augment=True, shuffle=True, workers=2)
    for x, y in zip(a, b):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])


def test_coco128_from_files(coco128_yaml):
    with loader(coco128_yaml, imgsz=320, batch_size=16, workers=2, store="files") as fl:
        assert fl.dataset.n == 128  # two images without label files stay, as background
        assert sum(len(lb) == 0 for lb in fl.dataset.labels) >= 2
        for k, (imgs, targets, paths, shapes) in enumerate(fl):
            assert imgs.shape == (16, 3, 320, 320) and targets.shape[1] == 6
            if k == 1:
                break
