"""fastload.compat.yolov9.create_dataloader: the official signature, return value and trainer hooks."""
from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest

from fastload.compat.yolov9 import create_dataloader

# argument order of WongKinYiu/yolov9 utils/dataloaders.py create_dataloader
OFFICIAL = ["path", "imgsz", "batch_size", "stride", "single_cls", "hyp", "augment", "cache", "pad", "rect",
            "rank", "workers", "image_weights", "close_mosaic", "quad", "min_items", "prefix", "shuffle"]


def test_signature_matches_official():
    assert list(inspect.signature(create_dataloader).parameters) == OFFICIAL


def test_train_loader_as_train_dual_uses_it(synth_yaml):
    train_path = Path(synth_yaml).parent / "images" / "train"
    # the positional call of train_dual.py
    loader, dataset = create_dataloader(str(train_path), 96, 8, 32, False, hyp=None, augment=True, cache=None,
                                        rect=False, rank=-1, workers=2, image_weights=False, close_mosaic=True,
                                        quad=False, prefix="train: ", shuffle=True, min_items=0)
    try:
        labels = np.concatenate(dataset.labels, 0)
        assert int(labels[:, 0].max()) < 3
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


def test_reduced_decode_env_switch(synth_yaml, monkeypatch):
    train_path = str(Path(synth_yaml).parent / "images" / "train")
    for value, want in (("1", True), ("0", False)):
        monkeypatch.setenv("FASTLOAD_REDUCED_DECODE", value)
        loader, _ = create_dataloader(train_path, 64, 4, 32, workers=0)
        try:
            assert loader.engine.renderer.reduced_decode is want
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


def test_unsupported_options_raise(synth_yaml):
    p = str(Path(synth_yaml).parent / "images" / "train")
    with pytest.raises(ValueError, match="image_weights"):
        create_dataloader(p, 64, 4, 32, image_weights=True)
    with pytest.raises(ValueError, match="quad"):
        create_dataloader(p, 64, 4, 32, quad=True)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        create_dataloader(p + "_missing", 64, 4, 32)
