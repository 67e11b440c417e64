"""Which shard of the data a trainer's process loads under DDP."""
from __future__ import annotations

import os


def shard_of(local_rank: int) -> tuple[int, int]:
    """``(rank, world_size)`` for :func:`fastload.loader`: the environment's ``RANK`` / ``WORLD_SIZE`` (as
    ``DistributedSampler`` reads them) when the trainer passes a ``local_rank`` other than -1, else ``(-1, 1)``."""
    if local_rank == -1:
        return -1, 1
    return int(os.environ.get("RANK", local_rank)), int(os.environ.get("WORLD_SIZE", "1"))
