"""Epoch order and DDP sharding (DistributedSampler semantics)."""
from __future__ import annotations

import numpy as np
import pytest

from fastload.order import epoch_indices, epoch_permutation, rect_order


@pytest.mark.parametrize("n,ws", [(10, 1), (10, 2), (10, 3), (7, 4), (2, 5), (64, 8)])
def test_shards_equal_disjoint_and_covering(n, ws):
    parts = [epoch_indices(n, 3, seed=1, rank=r, world_size=ws) for r in range(ws)]
    per = -(-n // ws)
    assert all(len(p) == per for p in parts)
    allidx = np.concatenate(parts)
    assert set(allidx.tolist()) == set(range(n))  # covering
    # disjoint up to the wrap-around padding: exactly per*ws - n duplicates
    assert len(allidx) - len(set(allidx.tolist())) == per * ws - n


@pytest.mark.parametrize("n,ws", [(10, 3), (7, 4), (64, 8)])
def test_drop_last_has_no_duplicates(n, ws):
    parts = [epoch_indices(n, 0, rank=r, world_size=ws, drop_last=True) for r in range(ws)]
    assert all(len(p) == n // ws for p in parts)
    allidx = np.concatenate(parts)
    assert len(set(allidx.tolist())) == len(allidx)


def test_deterministic_per_seed_and_epoch():
    a = epoch_indices(100, 5, seed=7)
    assert np.array_equal(a, epoch_indices(100, 5, seed=7))
    assert not np.array_equal(a, epoch_indices(100, 6, seed=7))
    assert not np.array_equal(a, epoch_indices(100, 5, seed=8))
    assert sorted(a.tolist()) == list(range(100))
    assert np.array_equal(epoch_permutation(100, 5, seed=7), a)


def test_no_shuffle_is_identity_and_rank_minus_one():
    assert np.array_equal(epoch_indices(5, 9, shuffle=False), np.arange(5))
    assert np.array_equal(epoch_indices(6, 0, shuffle=False, rank=1, world_size=2), [1, 3, 5])


def test_order_stream_differs_from_sample_zero_stream():
    # SeedSequence([s, e]) == SeedSequence([s, e, 0]); the order must not reuse sample 0's stream
    plain = np.random.Generator(np.random.PCG64(np.random.SeedSequence([0, 0, 0]))).permutation(50)
    assert not np.array_equal(plain, epoch_permutation(50, 0, seed=0))


def test_bad_rank_arguments():
    with pytest.raises(ValueError):
        epoch_indices(10, 0, rank=2, world_size=2)
    with pytest.raises(ValueError):
        epoch_indices(10, 0, rank=-1, world_size=2)
    with pytest.raises(ValueError):
        epoch_indices(10, 0, world_size=0)


def test_rect_order_whole_batches_round_robin():
    sorted_idx = np.array([5, 2, 7, 0, 1, 3, 6, 4, 8])
    b0 = rect_order(sorted_idx, 4)
    assert [b.tolist() for b in b0] == [[5, 2, 7, 0], [1, 3, 6, 4], [8]]
    r0 = rect_order(sorted_idx, 4, rank=0, world_size=2)
    r1 = rect_order(sorted_idx, 4, rank=1, world_size=2)
    assert [b.tolist() for b in r0] == [[5, 2, 7, 0], [8]]
    assert [b.tolist() for b in r1] == [[1, 3, 6, 4]]


def test_shard_order_visits_shards_in_turn_and_is_the_same_for_every_rank_count():
    shards = np.repeat(np.arange(7), [5, 3, 6, 4, 5, 2, 5])  # 30 positions in 7 shards of unequal sizes
    for window in (1, 2):
        order = epoch_indices(30, 4, seed=9, shards=shards, window=window)
        assert sorted(order.tolist()) == list(range(30))
        seen = shards[order]
        # each run of `window` shards (in the order they first come up) is visited whole before the next starts
        firsts = list(dict.fromkeys(seen.tolist()))
        for b in range(0, 7, window):
            span = np.flatnonzero(np.isin(seen, firsts[b:b + window]))
            assert span.max() - span.min() + 1 == len(span), (window, seen)
        for world_size in (2, 3, 5):  # ranks stride the same global order, as the plain one
            parts = [epoch_indices(30, 4, seed=9, shards=shards, window=window, rank=r, world_size=world_size)
                     for r in range(world_size)]
            assert np.array_equal(np.stack(parts, axis=1).reshape(-1), order)
    assert np.array_equal(epoch_indices(30, 4, seed=9, shards=shards), epoch_indices(30, 4, seed=9, shards=shards))
    assert not np.array_equal(epoch_indices(30, 4, seed=9, shards=shards), epoch_indices(30, 5, seed=9, shards=shards))
    with pytest.raises(ValueError, match="window must be >= 1"):
        epoch_indices(30, 0, shards=shards, window=0)
