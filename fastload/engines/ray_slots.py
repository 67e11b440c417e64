"""Shared-memory slots for the Ray actors that run on the loader's own node (``RayOptions(delivery="auto")``).

Through Ray's object store, a batch is rendered into the actor's buffer, copied into the store, and
mapped by the consumer: a copy and a store round trip per batch (``benchmarks/ray_overhead.py`` prints
their cost). An actor on the consumer's node can instead render straight into a slot of a file in
shared memory that the consumer maps too, and return only the small parts (targets, shapes, gains);
the consumer's ``imgs`` is a view of the slot, as with ``engine="cpu"``'s workers. Actors on other
nodes keep the object store.

The consumer owns the file: a segment ``fastload-rayslots-<pid>-<token>`` under the shm root, held by
its PID through :mod:`fastload.store.shm`, so a consumer killed with SIGKILL leaves a segment that the
next stale cleanup removes. Its slots are free, in flight (a task was sent to write it), held (a
delivered batch the consumer may still read: the ``keep`` latest ones) or draining (a task of an
abandoned epoch that may still be writing it; freed once its result is ready). When no slot is free,
the task goes through the object store instead, so slot accounting never blocks or corrupts a batch.

No torch here: the actors import this module.
"""
from __future__ import annotations

import collections
import mmap
import os
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np

from fastload.store import shm
from fastload.store.kinds import SHM_PREFIX, shm_root
from fastload.store.space import fmt_bytes

PREFIX = SHM_PREFIX + "rayslots-"
_DATA = "slots.bin"


@dataclass(frozen=True)
class SlotFile:
    """What an actor needs to write into the consumer's slots: the consumer's Ray node, the file, its layout."""

    node_id: str
    path: str
    n_slots: int
    slot_bytes: int


def map_slot_file(spec: SlotFile) -> np.ndarray:
    """``uint8 [n_slots, slot_bytes]``: the slots of ``spec``'s file, shared (writes are seen by every process
    that maps it)."""
    fd = os.open(spec.path, os.O_RDWR)
    try:
        m = mmap.mmap(fd, spec.n_slots * spec.slot_bytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    return np.frombuffer(m, np.uint8).reshape(spec.n_slots, spec.slot_bytes)


class SlotPool:
    """The consumer's side: the slot file, and which slot is free, in flight, held or draining.

    Args:
        n_slots, slot_bytes: the file's layout (batches in flight plus ``keep``, the largest batch).
        node_id: this process's Ray node (actors elsewhere cannot map the file).
        keep: how many of the latest delivered batches stay valid.
        ray: the ``ray`` module (to see which abandoned tasks have finished).

    Raises:
        OSError: the shared-memory filesystem cannot hold the file (the engine then uses the object store).
    """

    def __init__(self, n_slots: int, slot_bytes: int, node_id: str, keep: int, ray: Any) -> None:
        shm.cleanup_stale(prefix=PREFIX)
        segment = shm_root() / f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        nbytes = n_slots * slot_bytes
        try:
            shm.acquire(segment, lambda seg: shm.build_reserved(seg, _DATA, nbytes, {"what": "ray batch slots"}),
                        info={"what": "ray batch slots", "bytes": nbytes})
        except OSError as e:
            raise OSError(f"cannot reserve {fmt_bytes(nbytes)} for {n_slots} batch slots in {segment.parent}: "
                          f"{e.strerror or e}") from None
        self.segment = segment
        self.spec = SlotFile(node_id, str(segment / _DATA), n_slots, slot_bytes)
        self.slots = map_slot_file(self.spec)
        self.keep = keep
        self._ray = ray
        self._free = collections.deque(range(n_slots))
        self._held: collections.deque[int | None] = collections.deque()
        self._draining: list[tuple[Any, int]] = []

    def take(self) -> int | None:
        """A free slot for a new task, or None (the task then goes through the object store)."""
        if not self._free and self._draining:
            refs = [ref for ref, _ in self._draining]
            ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
            done = set(ready)
            self._free.extend(slot for ref, slot in self._draining if ref in done)
            self._draining = [(ref, slot) for ref, slot in self._draining if ref not in done]
        return self._free.popleft() if self._free else None

    def give_back(self, slot: int | None) -> None:
        """A slot whose task will never write it (its actor is dead and its replacement writes elsewhere)."""
        if slot is not None:
            self._free.append(slot)

    def drop(self, ref: Any, slot: int | None) -> None:
        """An abandoned task: its slot is free once ``ref`` is ready (the actor may still be writing it)."""
        if slot is not None:
            self._draining.append((ref, slot))

    def delivered(self, slot: int | None) -> None:
        """A batch is handed to the consumer (from ``slot``, or from the object store when None): the slots
        of batches older than the ``keep`` latest become free."""
        while len(self._held) >= self.keep:
            old = self._held.popleft()
            if old is not None:
                self._free.append(old)
        self._held.append(slot)

    def close(self) -> None:
        """Drop this process's hold on the file (it is removed; views still in use keep their pages)."""
        self.slots = np.zeros((0, 0), np.uint8)
        self._free.clear()
        shm.release(self.segment)

