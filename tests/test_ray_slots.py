"""The Ray engine's shared-memory batch slots without Ray: which slot is free, lent, in flight or draining,
the file's lifetime, and what another process writes being what this one reads.

A stand-in for ``ray.wait`` says which abandoned tasks have finished; the engine with real actors is
tested in test_engine_ray.py.
"""
from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch

from fastload.engines.cpu_render import batch_view
from fastload.engines.ray_slots import PREFIX, SlotPool, map_slot_file
from fastload.store import shm


class FakeRay:
    """``wait`` reports the refs in ``finished`` as ready."""

    def __init__(self) -> None:
        self.finished: set[str] = set()

    def wait(self, refs, num_returns, timeout, fetch_local):
        assert timeout == 0 and not fetch_local  # never blocks, never pulls a result
        return [r for r in refs if r in self.finished], [r for r in refs if r not in self.finished]


def _write(spec, slot, value):
    batch_view(map_slot_file(spec)[slot], 2, 4, 4, "nhwc")[...] = value


def test_slots_are_reused_once_their_batch_is_gone_and_abandoned_ones_once_finished(shm_root):
    ray = FakeRay()
    pool = SlotPool(4, 2 * 4 * 4 * 3, "node-a", ray=ray)
    try:
        taken = [pool.take() for _ in range(4)]
        assert sorted(taken) == [0, 1, 2, 3] and pool.take() is None  # all in flight: the task takes the store
        first = torch.from_numpy(pool.lend(taken[0], 2, 4, 4, "nhwc")).permute(0, 3, 1, 2)
        second = pool.lend(taken[1], 2, 4, 4, "nhwc")
        assert pool.take() is None and pool.n_lent == 2  # delivered batches stay the caller's while it holds them
        part = first[1]
        del first
        assert pool.take() is None  # a slice of the first batch still uses its slot
        del part
        assert pool.take() == taken[0] and pool.n_lent == 1  # free once no tensor of the batch is left
        del second
        assert pool.take() == taken[1] and pool.n_lent == 0
        pool.drop("ref-a", taken[2])  # an abandoned epoch: its actor may still be writing
        pool.drop("ref-b", taken[3])
        assert pool.take() is None
        ray.finished.add("ref-b")
        assert pool.take() == taken[3] and pool.take() is None  # free once its result is ready, not before
        pool.give_back(taken[2])  # a dead actor's slot whose batch is rendered elsewhere
        assert pool.take() == taken[2]
    finally:
        pool.close()


def test_another_process_writes_what_this_one_reads_and_close_removes_the_file(shm_root):
    pool = SlotPool(3, 2 * 4 * 4 * 3, "node-a", ray=FakeRay())
    segment = pool.segment
    assert segment.name.startswith(PREFIX) and shm.is_complete(segment)
    p = mp.get_context("spawn").Process(target=_write, args=(pool.spec, 1, 7))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    view = batch_view(pool.slots[1], 2, 4, 4, "nhwc")
    assert view.shape == (2, 4, 4, 3) and (view == 7).all() and not pool.slots[0].any() and not pool.slots[2].any()
    kept = view.copy()
    pool.close()
    assert not segment.exists() and not shm.holders_path(segment).exists()
    assert np.array_equal(kept, np.full((2, 4, 4, 3), 7, np.uint8))
    with pytest.raises(ValueError, match="does not fit"):
        batch_view(np.zeros(10, np.uint8), 1, 2, 2, "nhwc")
