"""Which batch slots are free and which a delivered batch still uses: the bookkeeping shared by the CPU
engine's ring (:mod:`~fastload.engines.shm_batch`) and the Ray engine's slot file
(:mod:`~fastload.engines.ray_slots`).

A delivered batch is a view of a slot, and a slot may be written again only once nothing refers to that
view. :meth:`SlotLedger.lend` takes a fresh numpy view object made for one delivery and attaches a
finalizer to it. ``torch.from_numpy`` keeps that array alive for as long as the tensor's storage lives,
and every tensor made from it without a copy (a slice ``imgs[0]``, a permutation, ``.numpy()``, a
``.to("cpu")`` that returns it) shares that storage; so the finalizer runs when the last of them dies,
and puts the slot back on the free list. The caller never has to say it is done with a batch.

Finalizers run in whichever thread drops the last reference (a plotting thread), or in the garbage
collector, which may run in any thread, also in the middle of this process's own bookkeeping. So a slot
comes back with one deque append and one set discard, each atomic, and no lock: a lock that the
consumer held while a collection ran a finalizer in the same thread would deadlock.

No torch here: the Ray actors import :mod:`~fastload.engines.ray_slots`.
"""
from __future__ import annotations

import collections
import weakref

import numpy as np


def _returned(free: collections.deque[int], lent: set[int], slot: int) -> None:
    """A lent view died: its slot is free again. The append comes first, so that a slot is never missing
    from both sets (the consumer would see one slot fewer than it may use)."""
    free.append(slot)
    lent.discard(slot)


class SlotLedger:
    """Slot numbers ``0 .. n_slots - 1``: free, lent (a delivered view of it is alive) or neither (taken:
    a task is writing it, or the engine holds it for another reason).

    :meth:`take` and :meth:`give_back` are the engine's (one thread); the lent views come back by
    themselves, from any thread.
    """

    def __init__(self, n_slots: int) -> None:
        self.n_slots = int(n_slots)
        self._free: collections.deque[int] = collections.deque(range(self.n_slots))
        self._lent: set[int] = set()

    def take(self) -> int | None:
        """A free slot number, or None when every slot is taken or lent."""
        try:
            return self._free.popleft()
        except IndexError:
            return None

    def give_back(self, slot: int) -> None:
        """A taken slot that was not lent (its render failed, its batch was dropped, or it was copied)."""
        if slot in self._lent or slot in self._free:
            raise RuntimeError(f"slot {slot} released twice")
        self._free.append(slot)

    def lend(self, slot: int, view: np.ndarray) -> np.ndarray:
        """Hand ``view`` (a numpy view of taken slot ``slot``, made for this delivery alone and referred to
        by nothing else) out; the slot is free again once ``view`` and everything built on it are gone."""
        self._lent.add(slot)
        weakref.finalize(view, _returned, self._free, self._lent, slot).atexit = False
        return view

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_lent(self) -> int:
        """Slots that a delivered batch still uses."""
        return len(self._lent)

    def clear(self) -> None:
        """Forget every slot (the buffers are going away; views still alive keep their own memory)."""
        self._free.clear()
