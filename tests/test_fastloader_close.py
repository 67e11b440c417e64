"""FastLoader.close() closes only the store the loader opened: a store passed in stays the caller's.

A ram store is the case that matters: closing it releases the process's hold on the shared-memory
segment, and an unpinned segment is removed with its last holder.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from fastload.fastloader import loader
from fastload.store import open_store, shm

IMGSZ = 64
ARGS = dict(imgsz=IMGSZ, batch_size=4, workers=0, augment=False, shuffle=False)


def holds(segment: Path) -> bool:
    """Whether this process is registered as a live holder of the ram segment."""
    return any(s.path == segment and os.getpid() in s.live for s in shm.list_segments())


@pytest.mark.parametrize("how", ["data", "store"])
def test_caller_store_stays_open(synth_yaml, shm_root, how):
    store = open_store(synth_yaml, kind="ram", imgsz=IMGSZ)  # built on demand, not pinned
    segment = Path(store.path)
    try:
        fl = loader(store, **ARGS) if how == "data" else loader(synth_yaml, store=store, **ARGS)
        with fl:
            assert fl.store is store
            next(iter(fl))
        assert holds(segment), "the loader released the caller's hold on its ram store"
        assert store.read_image(0).shape[2] == 3
        # and a second loader over the same store still works
        with loader(store, **ARGS) as fl2:
            imgs = next(iter(fl2))[0]
        assert imgs.shape[0] == 4
    finally:
        store.close()
    assert not holds(segment)
    assert not segment.exists(), "the caller's close() should remove the unpinned segment"


def test_loader_closes_the_store_it_opened(synth_yaml, shm_root):
    with loader(synth_yaml, store="ram", **ARGS) as fl:
        segment = Path(fl.store.path)
        next(iter(fl))
        assert holds(segment)
    assert not holds(segment)
    assert not segment.exists()


def test_failed_build_leaves_caller_store_open(synth_yaml, shm_root):
    store = open_store(synth_yaml, kind="ram", imgsz=IMGSZ)
    try:
        with pytest.raises(ValueError, match="unknown engine"):
            loader(store, engine="nope", **ARGS)
        assert holds(Path(store.path))
    finally:
        store.close()
