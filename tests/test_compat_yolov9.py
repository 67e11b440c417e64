"""fastload.compat.yolov9: the official signature and return value, the trainer hooks, the options
(keyword > environment), the batch log, the device/HSV path and the launcher's mechanics.

The official scripts themselves run in tests/test_official_yolov9.py.
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from fastload.compat.yolov9 import CompatOptions, create_dataloader
from fastload.compat.yolov9.launcher import LaunchError, split_args
from fastload.store.base import StoreError
import preloaded
from preloaded import base_env
from store_helpers import assert_refused_as_in_process, refuse_every_render

# one intra-op thread (conftest's one_torch_thread): the loaders' torch work in this process spin-waits with two on the
# busy 2-core CI machine
pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO = Path(__file__).resolve().parents[1]

# argument order of WongKinYiu/yolov9 utils/dataloaders.py create_dataloader
OFFICIAL = ["path", "imgsz", "batch_size", "stride", "single_cls", "hyp", "augment", "cache", "pad", "rect",
            "rank", "workers", "image_weights", "close_mosaic", "quad", "min_items", "prefix", "shuffle"]


def train_dir(synth_yaml) -> str:
    return str(Path(synth_yaml).parent / "images" / "train")


def test_signature_matches_official():
    params = list(inspect.signature(create_dataloader).parameters)
    assert params[: len(OFFICIAL)] == OFFICIAL and params[len(OFFICIAL):] == ["fastload_options"]


def test_train_loader_as_train_dual_uses_it(synth_yaml):
    # the positional call of train_dual.py
    loader, dataset = create_dataloader(train_dir(synth_yaml), 96, 8, 32, False, hyp=None, augment=True, cache=None,
                                        rect=False, rank=-1, workers=2, image_weights=False, close_mosaic=True,
                                        quad=False, prefix="train: ", shuffle=True, min_items=0)
    try:
        labels = np.concatenate(dataset.labels, 0)
        assert int(labels[:, 0].max()) < 3
        assert loader.num_workers == min(os.cpu_count() or 1, 8, 2)  # the official rule
        nb = len(loader)
        assert nb == -(-dataset.n // 8)
        imgs, targets, paths, shapes = next(iter(loader))
        assert imgs.shape == (8, 3, 96, 96) and targets.shape[1] == 6
        dataset.mosaic = False  # --close-mosaic
        for imgs, targets, paths, shapes in loader:
            assert all(s is not None for s in shapes)
        loader.sampler.set_epoch(1)
    finally:
        loader.close()


def test_options_keyword_then_environment_then_default(monkeypatch):
    assert CompatOptions.resolve({}, {}) == CompatOptions()
    env = {"FASTLOAD_SEED": "7", "FASTLOAD_WORKERS": "3", "FASTLOAD_HSV": "worker", "FASTLOAD_REDUCED_DECODE": "1"}
    got = CompatOptions.resolve({"seed": 9}, env)
    assert (got.seed, got.num_workers, got.hsv, got.reduced_decode) == (9, 3, "worker", True)
    with pytest.raises(ValueError, match="FASTLOAD_HSV="):
        CompatOptions.resolve({}, {"FASTLOAD_HSV": "gpu"})
    with pytest.raises(TypeError, match="wokers"):
        CompatOptions.resolve({"wokers": 2}, {})


def test_options_reach_the_loader(synth_yaml, monkeypatch):
    p = train_dir(synth_yaml)
    monkeypatch.setenv("FASTLOAD_REDUCED_DECODE", "1")
    monkeypatch.setenv("FASTLOAD_WORKERS", "1")
    loader, _ = create_dataloader(p, 64, 4, 32, workers=8)
    try:
        assert loader.engine.renderer.reduced_decode is True and loader.num_workers == 1
    finally:
        loader.close()
    loader, _ = create_dataloader(p, 64, 4, 32, workers=8, reduced_decode=False, num_workers=0, seed=4)
    try:
        assert loader.engine.renderer.reduced_decode is False and loader.num_workers == 0 and loader.seed == 4
    finally:
        loader.close()


def test_partners_env_switch(synth_yaml, monkeypatch):
    """FASTLOAD_PARTNERS reaches the training loader's sampler; validation loaders draw no partners."""
    train_path = str(Path(synth_yaml).parent / "images" / "train")
    monkeypatch.setenv("FASTLOAD_PARTNERS", "batch")
    train, _ = create_dataloader(train_path, 64, 4, 32, augment=True, workers=0)
    val, _ = create_dataloader(train_path, 64, 4, 32, augment=False, rect=True, workers=0)
    try:
        assert train.engine.sampler.partners == "batch" and val.engine.sampler.partners == "dataset"
    finally:
        train.close()
        val.close()
    monkeypatch.setenv("FASTLOAD_PARTNERS", "epoch")
    with pytest.raises(ValueError, match="FASTLOAD_PARTNERS='epoch'"):
        create_dataloader(train_path, 64, 4, 32, augment=True, workers=0)


def test_val_loader_rect(synth_yaml):
    val_path = Path(synth_yaml).parent / "images" / "val"
    loader = create_dataloader(str(val_path), 96, 4, 32, False, hyp=None, cache=None, rect=True, rank=-1,
                               workers=2, pad=0.5, prefix="val: ")[0]
    try:
        seen = []
        for im, targets, paths, shapes in loader:
            assert im.shape[2] % 32 == 0 and im.shape[3] % 32 == 0
            assert all(s is not None for s in shapes)
            seen += paths
        assert len(seen) == loader.dataset.n
    finally:
        loader.close()


def test_unsupported_and_bad_options_raise(synth_yaml):
    p = train_dir(synth_yaml)
    with pytest.raises(ValueError, match="--quad"):
        create_dataloader(p, 64, 4, 32, quad=True)
    with pytest.raises(ValueError, match="--image-weights needs engine='cpu'"):
        create_dataloader(p, 64, 4, 32, image_weights=True, engine="gpu")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        create_dataloader(p + "_missing", 64, 4, 32)
    with pytest.raises(ValueError, match="neither a store kind"):
        create_dataloader(p, 64, 4, 32, store="no/such/data.yaml")


def test_device_path_consumer_hsv_equals_worker_hsv(synth_yaml):
    """Item 5 forced on the CPU: batches delivered on a device get their HSV there (consumer mode);
    they equal the worker-HSV batches within the README's +-1 level, boxes identical."""
    p = train_dir(synth_yaml)
    common = dict(hyp=None, augment=True, workers=1, shuffle=True, seed=2)
    ref_loader, _ = create_dataloader(p, 64, 6, 32, **common)  # no CUDA here: batches stay on the CPU, HSV in workers
    try:
        assert ref_loader.engine.settings.hsv_on == "worker" and ref_loader.engine.device is None
        ref = [(b[0].clone(), b[1].clone()) for b in ref_loader]
    finally:
        ref_loader.close()
    with pytest.warns(UserWarning, match="consumer"):
        dev_loader, _ = create_dataloader(p, 64, 6, 32, device="cpu", **common)
    try:
        assert dev_loader.engine.settings.hsv_on == "consumer" and dev_loader.engine.device == torch.device("cpu")
        got = [(b[0].clone(), b[1].clone()) for b in dev_loader]
    finally:
        dev_loader.close()
    assert len(ref) == len(got)
    for (a, ta), (b, tb) in zip(ref, got):
        assert torch.equal(ta, tb)
        d = (a.int() - b.int()).abs()
        assert int(d.max()) <= 1 and float((d > 0).float().mean()) < 1e-3


def test_batch_log_records_what_the_trainer_receives(synth_yaml, tmp_path):
    log = tmp_path / "batches.jsonl"
    loader, dataset = create_dataloader(train_dir(synth_yaml), 64, 8, 32, augment=True, shuffle=True, workers=0,
                                        prefix="\x1b[34mtrain: \x1b[0m", batch_log=str(log))
    try:
        assert len(loader) == -(-dataset.n // 8) and loader.num_workers == 0
        list(loader)
        dataset.mosaic = False
        list(loader)
    finally:
        loader.close()
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(lines) == 2 * len(loader)
    assert {x["split"] for x in lines} == {"train"} and all(x["augment"] for x in lines)
    first = [x for x in lines if x["epoch"] == 0]
    second = [x for x in lines if x["epoch"] == 1]
    assert sum(x["mosaic"] for x in first) > 0  # scratch-high: mosaic probability 1
    assert sum(x["mosaic"] for x in second) == 0
    assert sum(x["n"] for x in second) == dataset.n and all(x["hw"] == [64, 64] for x in lines)


def test_batches_held_by_the_trainer_never_change(synth_yaml, tmp_path):
    """Code around the official trainer holds batches (its plotting thread gets the first ones; a gradient
    accumulation helper or a "last batch" for logging keeps some): they never change while training goes on."""
    loader, _ = create_dataloader(train_dir(synth_yaml), 64, 4, 32, augment=True, shuffle=True, workers=2,
                                  num_workers=2, batch_log=str(tmp_path / "batches.jsonl"))
    try:
        held = [(imgs, imgs.clone(), targets, targets.clone()) for imgs, targets, _, _ in loader]
        loader.sampler.set_epoch(1)
        for _ in loader:
            pass
        assert len(held) == len(loader) > 2 and loader.stats()["batches_copied"] > 0  # more than keep=2 held
    finally:
        loader.close()
    for k, (imgs, imgs_then, targets, targets_then) in enumerate(held):
        unchanged = torch.equal(imgs, imgs_then) and torch.equal(targets, targets_then)
        assert unchanged, f"held batch {k} changed"


def test_an_error_in_a_loader_worker_reaches_the_trainer_as_the_line_it_is_in_process(synth_yaml, tmp_path, monkeypatch):
    """Through the drop-in (and its batch log), a fastload error a worker raises is the error of workers=0: its
    class and one line, the worker's traceback kept on it (issue 35)."""
    refuse_every_render(monkeypatch)
    for workers in (0, 2):
        loader, _ = create_dataloader(train_dir(synth_yaml), 64, 4, 32, augment=True, workers=workers,
                                      num_workers=workers, batch_log=str(tmp_path / "batches.jsonl"))
        try:
            with pytest.raises(StoreError) as info:
                next(iter(loader))
        finally:
            loader.close()
        assert_refused_as_in_process(info.value, workers)


def test_launcher_splits_fastload_flags():
    kw, rest = split_args(["train_dual.py", "--batch", "4", "--fastload-engine=cpu", "--fastload-workers", "2",
                           "--fastload-seed", "3", "--fastload-reduced-decode", "1", "--seed", "1"])
    assert kw == {"engine": "cpu", "num_workers": 2, "seed": 3, "reduced_decode": True}
    assert rest == ["train_dual.py", "--batch", "4", "--seed", "1"]
    with pytest.raises(LaunchError, match="unknown fastload flag --fastload-engin"):
        split_args(["x.py", "--fastload-engin", "cpu"])
    with pytest.raises(LaunchError, match="--fastload-hsv"):
        split_args(["x.py", "--fastload-hsv", "sometimes"])


@pytest.fixture
def launch(preloaded_python):
    """``launch(cwd, ARGS)``: ``python -m fastload.compat.yolov9 ARGS`` in ``cwd``, forked from the interpreter that
    has torch imported (tests/preloaded.py); returns the completed process."""
    def run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
        return preloaded.run(preloaded_python, ["-m", "fastload.compat.yolov9", *args], cwd, base_env(REPO), timeout=120)

    return run


def test_launcher_replaces_the_checkouts_create_dataloader(tmp_path, launch):
    """A miniature checkout (utils/dataloaders.py + a script importing from it, as train_dual.py does):
    the script sees fastload's function, gets its flags, and the launcher's flags reach create_dataloader."""
    (tmp_path / "utils").mkdir()
    (tmp_path / "utils" / "__init__.py").write_text("")
    (tmp_path / "utils" / "dataloaders.py").write_text("def create_dataloader(*a, **k):\n    raise SystemExit('stock')\n")
    (tmp_path / "script.py").write_text(textwrap.dedent("""
        import json, sys
        from utils.dataloaders import create_dataloader
        import fastload.compat.yolov9.dataloader as fl
        calls = []
        fl.create_dataloader = lambda *a, **k: calls.append(k)  # the launcher's wrapper calls this name
        create_dataloader('images', 64, 4, 32)
        print(json.dumps({"argv": sys.argv[1:], "name": __name__, "kw": calls[0]}))
    """))
    out = launch(tmp_path, "script.py", "--epochs", "2", "--fastload-engine", "cpu", "--seed", "5")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"argv": ["--epochs", "2", "--seed", "5"], "name": "__main__", "kw": {"engine": "cpu", "seed": 5}}
    assert "script.py with fastload's create_dataloader" in out.stderr


def test_launcher_replaces_the_segment_loader_of_a_script_in_segment(tmp_path, launch):
    """A script of segment/ (one folder below the checkout's root, as segment/train.py) that imports
    utils.segment.dataloaders gets fastload's segment create_dataloader there, and its detection one too."""
    (tmp_path / "utils" / "segment").mkdir(parents=True)
    for module in ("utils/__init__.py", "utils/segment/__init__.py"):
        (tmp_path / module).write_text("")
    for module in ("utils/dataloaders.py", "utils/segment/dataloaders.py"):
        (tmp_path / module).write_text("def create_dataloader(*a, **k):\n    raise SystemExit('stock')\n")
    (tmp_path / "segment").mkdir()
    (tmp_path / "segment" / "train.py").write_text(textwrap.dedent("""
        import json
        from utils.segment.dataloaders import create_dataloader
        import utils.dataloaders
        print(json.dumps([create_dataloader.__wrapped__.__module__,
                          utils.dataloaders.create_dataloader.__wrapped__.__module__]))
    """))
    out = launch(tmp_path, "segment/train.py")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["fastload.compat.yolov9.segment",
                                                               "fastload.compat.yolov9.dataloader"]


def test_launcher_refuses_unsupported_flags_in_one_line(tmp_path, launch):
    out = launch(tmp_path, "train_dual.py", "--quad", "--batch", "4")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "python -m fastload.compat.yolov9: error: --quad is not supported by fastload (the quad collate (4 images "
        "tiled into one) is not implemented); drop the flag"]
    out = launch(tmp_path, "missing.py")
    assert out.returncode == 2 and "no script missing.py" in out.stderr


def test_every_option_is_documented():
    from fastload.compat.yolov9 import OPTIONS

    page = (REPO / "docs" / "official-trainer.md").read_text()
    for opt in OPTIONS:
        assert f"`{opt.name}`" in page and f"`{opt.flag}`" in page and f"`{opt.env}`" in page, opt.name
