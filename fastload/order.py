"""Which samples each rank visits in which order, epoch by epoch.

One pure function, :func:`epoch_indices`, with ``torch.utils.data.DistributedSampler`` semantics:
every rank gets the same number of indices, the ranks' parts are disjoint and together cover the
whole (shuffled) dataset; when the dataset does not split evenly the permutation is padded by
wrapping around (a few samples are seen twice) or, with ``drop_last``, its tail is dropped. The
permutation depends only on ``(seed, epoch)``, so every rank computes the same one without talking
to the others, and a resumed run replays it exactly.

:func:`rect_order` is the validation counterpart: images sorted by aspect ratio, grouped into
fixed batches, whole batches dealt out to ranks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# A spawn key keeps the order stream apart from the augmentation streams, which are seeded with
# SeedSequence([seed, epoch, index]): SeedSequence pads short entropy with zeros, so a plain
# SeedSequence([seed, epoch]) would equal the one of sample index 0.
_ORDER_STREAM = (0x6F72646572,)  # "order"
_SHARD_STREAM = (0x7368617264,)  # "shard": a shard-aware order is not a reshuffle of the plain one


def _normalise_rank(rank: int, world_size: int) -> tuple[int, int]:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if rank < 0:  # YOLOv9 passes rank=-1 for "not distributed"
        if world_size != 1:
            raise ValueError(f"rank={rank} with world_size={world_size}: give each process its rank")
        return 0, 1
    if rank >= world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    return rank, world_size


def epoch_permutation(n: int, epoch: int, *, seed: int = 0) -> np.ndarray:
    """The shuffled order of ``range(n)`` for ``epoch``: a function of ``(seed, epoch)`` only."""
    ss = np.random.SeedSequence([int(seed), int(epoch)], spawn_key=_ORDER_STREAM)
    return np.random.Generator(np.random.PCG64(ss)).permutation(n).astype(np.int64)


def shard_permutation(shards: np.ndarray, epoch: int, *, seed: int = 0, window: int = 1) -> np.ndarray:
    """The shuffled order of ``range(len(shards))`` for ``epoch`` when position ``p`` lives in shard ``shards[p]``
    (a store streamed in shards, :mod:`fastload.store.stream`): the shards are visited in an order permuted per
    epoch, and the positions of each run of ``window`` consecutive shards of that order are shuffled together,
    so an epoch needs about ``window`` shards at a time and its first positions come from the first ``window``
    shards. A function of ``(seed, epoch)``, the shard ids and ``window`` only."""
    shards = np.asarray(shards, np.int64).reshape(-1)
    if window < 1:
        raise ValueError(f"window must be >= 1 shard, got {window}")
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch)],
                                                                     spawn_key=_SHARD_STREAM)))
    ids, dense = np.unique(shards, return_inverse=True)
    visit = np.empty(len(ids), np.int64)
    visit[rng.permutation(len(ids))] = np.arange(len(ids))  # visit[s]: when shard s comes up
    block = visit[dense] // int(window)
    return np.lexsort((rng.random(len(shards)), block)).astype(np.int64)


def epoch_indices(
    n: int,
    epoch: int,
    *,
    seed: int = 0,
    shuffle: bool = True,
    rank: int = -1,
    world_size: int = 1,
    drop_last: bool = False,
    shards: np.ndarray | None = None,
    window: int = 1,
) -> np.ndarray:
    """The dataset indices rank ``rank`` visits in ``epoch``, in order (``int64 [m]``).

    Args:
        n: dataset length.
        epoch: epoch number; with ``shuffle`` each epoch has its own permutation.
        seed: the run's seed; all ranks must pass the same one.
        shuffle: permute (``False``: ``0..n-1`` in order).
        rank: this process's rank, ``-1`` when not distributed.
        world_size: number of ranks.
        drop_last: drop the tail so that ``n`` splits evenly instead of padding by wrap-around.
        shards, window: the shard of each position and the shuffle window, for a store read in shards: the
            permutation is then :func:`shard_permutation` (the same for every ``world_size``, as the plain one).

    Returns ``m = ceil(n / world_size)`` indices (``floor`` with ``drop_last``) for every rank;
    rank ``r`` takes positions ``r, r + world_size, ...`` of the padded permutation.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rank, world_size = _normalise_rank(rank, world_size)
    if shards is not None and len(shards) != n:
        raise ValueError(f"shards holds {len(shards)} shard ids for {n} positions")
    if not shuffle:
        order = np.arange(n, dtype=np.int64)
    elif shards is not None:
        order = shard_permutation(shards, epoch, seed=seed, window=window)
    else:
        order = epoch_permutation(n, epoch, seed=seed)
    if world_size == 1:
        return order
    if drop_last:
        per_rank = n // world_size
        order = order[: per_rank * world_size]
    else:
        per_rank = -(-n // world_size)
        pad = per_rank * world_size - n
        if pad and n:
            # wrap around as often as needed (tiny datasets can need more than one pass)
            order = np.concatenate([order, np.resize(order, pad)])
    return order[rank::world_size].copy()


def rect_order(
    sorted_indices: np.ndarray,
    batch_size: int,
    *,
    rank: int = -1,
    world_size: int = 1,
) -> list[np.ndarray]:
    """Validation batches for rect mode: fixed batches of the aspect-sorted order, dealt to ranks.

    Args:
        sorted_indices: dataset indices sorted by aspect ratio (the order the rect batch shapes were
            computed for); consecutive ``batch_size`` chunks share an output shape, so a batch is
            never split between ranks.
        batch_size: images per batch (the last batch may be smaller).
        rank, world_size: as for :func:`epoch_indices`; whole batches go round-robin, so ranks may
            differ by one batch (validation is normally run on rank 0 only).

    Returns the index arrays (one per batch) rank ``rank`` visits, in order.
    """
    rank, world_size = _normalise_rank(rank, world_size)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    sorted_indices = np.asarray(sorted_indices, np.int64)
    batches = [sorted_indices[i : i + batch_size] for i in range(0, len(sorted_indices), batch_size)]
    return batches[rank::world_size]


@dataclass(frozen=True)
class EpochOrder:
    """The image indices one rank renders in each epoch, in order, as a small picklable value: the
    :func:`epoch_indices` of these settings, less the incomplete last batch with ``drop_last``. What a
    parameter sampler that draws mosaic partners from recently visited images (``partners="recent"``)
    computes its window from, in any process, without being told the order."""

    n: int
    batch_size: int
    seed: int = 0
    shuffle: bool = True
    rank: int = -1
    world_size: int = 1
    drop_last: bool = False
    shards: np.ndarray | None = field(default=None, compare=False, repr=False)  # epoch_indices' shards and window
    window: int = 1

    def __call__(self, epoch: int) -> np.ndarray:
        idx = epoch_indices(self.n, epoch, seed=self.seed, shuffle=self.shuffle, rank=self.rank,
                            world_size=self.world_size, drop_last=self.drop_last, shards=self.shards,
                            window=self.window)
        if self.drop_last:
            idx = idx[: len(idx) // self.batch_size * self.batch_size]
        return idx
