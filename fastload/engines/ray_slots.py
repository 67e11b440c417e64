"""Shared-memory slots for the Ray actors that run on the loader's own node (``RayOptions(delivery="auto")``).

Through Ray's object store, a batch is rendered into the actor's buffer, copied into the store, and
mapped by the consumer: a copy and a store round trip per batch (``benchmarks/ray_overhead.py`` prints
their cost). An actor on the consumer's node can instead render straight into a slot of a file in
shared memory that the consumer maps too, and return only the small parts (targets, shapes, gains);
the consumer's ``imgs`` is a view of the slot, as with ``engine="cpu"``'s workers. Actors on other
nodes keep the object store.

The consumer owns the file: a segment ``fastload-rayslots-<pid>-<token>`` under the shm root, held by
its PID through :mod:`fastload.store.shm`, so a consumer killed with SIGKILL leaves a segment that the
next stale cleanup removes. Its slots are free, in flight (a task was sent to write it), lent (a
delivered batch some tensor of the consumer still uses: free again once the last one is gone, see
:mod:`~fastload.engines.slot_ledger`) or draining (a task of an abandoned epoch that may still be
writing it; freed once its result is ready). When no slot is free, the task goes through the object
store instead, so slot accounting never blocks or corrupts a batch.

No torch here: the actors import this module.
"""
from __future__ import annotations

import mmap
import os
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np

from fastload.engines.cpu_render import batch_view
from fastload.engines.slot_ledger import SlotLedger
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
    """The consumer's side: the slot file, and which slot is free, in flight, lent or draining.

    Args:
        n_slots, slot_bytes: the file's layout (batches in flight plus spare slots for the batches the
            consumer holds, the largest batch).
        node_id: this process's Ray node (actors elsewhere cannot map the file).
        ray: the ``ray`` module (to see which abandoned tasks have finished).

    Raises:
        OSError: the shared-memory filesystem cannot hold the file (the engine then uses the object store).
    """

    def __init__(self, n_slots: int, slot_bytes: int, node_id: str, ray: Any) -> None:
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
        self._ray = ray
        self._ledger = SlotLedger(n_slots)
        self._draining: list[tuple[Any, int]] = []

    def take(self) -> int | None:
        """A free slot for a new task, or None (the task then goes through the object store)."""
        if not self._ledger.n_free and self._draining:
            refs = [ref for ref, _ in self._draining]
            ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
            done = set(ready)
            for ref, slot in self._draining:
                if ref in done:
                    self._ledger.give_back(slot)
            self._draining = [(ref, slot) for ref, slot in self._draining if ref not in done]
        return self._ledger.take()

    def give_back(self, slot: int | None) -> None:
        """A slot whose task will never write it (its actor is dead and its replacement writes elsewhere)."""
        if slot is not None:
            self._ledger.give_back(slot)

    def drop(self, ref: Any, slot: int | None) -> None:
        """An abandoned task: its slot is free once ``ref`` is ready (the actor may still be writing it)."""
        if slot is not None:
            self._draining.append((ref, slot))

    def lend(self, slot: int, b: int, h: int, w: int, layout: str) -> np.ndarray:
        """The batch an actor wrote into ``slot``, as a view for the consumer (``[b, h, w, 3]`` or
        ``[b, 3, h, w]``); the slot is free again once this view and everything built on it are gone."""
        return self._ledger.lend(slot, batch_view(self.slots[slot], b, h, w, layout))

    @property
    def n_lent(self) -> int:
        """Slots whose delivered batch the consumer still uses."""
        return self._ledger.n_lent

    def close(self) -> None:
        """Drop this process's hold on the file (it is removed; views still in use keep their pages)."""
        self.slots = np.zeros((0, 0), np.uint8)
        self._ledger.clear()
        shm.release(self.segment)

