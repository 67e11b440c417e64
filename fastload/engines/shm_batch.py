"""A ring of reusable shared-memory batch buffers.

Workers render every sample of a batch straight into a slot; only the slot number and the small
targets travel back through a pipe. The consumer gets a tensor *view* of the slot, so a batch costs
no collate copy and, because slots are reused, no page faults on fresh memory (the stock loader's
``torch.stack`` pays for both on every batch; ``benchmarks/loader_throughput.py`` compares the two).
A slot is reused only once no tensor of the batch delivered from it is left.

The buffers are anonymous ``MAP_SHARED`` mappings created before the workers are forked, so parent
and children see the same pages with no file names to leak and nothing to clean up after a crash.
"""
from __future__ import annotations

import mmap

import numpy as np
import torch

from fastload.engines.cpu_render import batch_view
from fastload.engines.slot_ledger import SlotLedger


class SlotRing:
    """``n_slots`` buffers of ``slot_bytes`` each, shared with forked children.

    A slot is taken for a task (:meth:`acquire`), and after delivery either lent to the caller with
    :meth:`lend` (free again once every tensor of the batch is gone: :class:`~fastload.engines.slot_ledger.SlotLedger`)
    or copied out with :meth:`copy` (free again at once).

    Layouts (``layout`` argument of the view helpers):
      ``"nhwc"``: samples are written HWC; a delivered tensor is the ``[B, 3, H, W]`` permuted view,
        a channels-last tensor (``.to(device)`` copies it as one dense block and keeps the format).
      ``"nchw"``: samples are written CHW; a delivered tensor is a contiguous ``[B, 3, H, W]``.
    """

    def __init__(self, n_slots: int, slot_bytes: int) -> None:
        if n_slots < 1 or slot_bytes < 1:
            raise ValueError(f"need at least one non-empty slot, got {n_slots} x {slot_bytes} bytes")
        self.n_slots = int(n_slots)
        self.slot_bytes = int(slot_bytes)
        self._maps = [mmap.mmap(-1, self.slot_bytes, flags=mmap.MAP_SHARED) for _ in range(self.n_slots)]
        self._arrays = [np.frombuffer(m, np.uint8) for m in self._maps]
        self._ledger = SlotLedger(self.n_slots)

    # -- slot bookkeeping (consumer side only; lent slots come back by themselves, from any thread) ---------
    def acquire(self) -> int | None:
        """A free slot number, or None when every slot is in flight or used by a delivered batch."""
        return self._ledger.take()

    def release(self, slot: int) -> None:
        """An acquired slot that is not delivered (its render failed, or its epoch was abandoned)."""
        self._ledger.give_back(slot)

    @property
    def n_free(self) -> int:
        return self._ledger.n_free

    @property
    def n_lent(self) -> int:
        """Slots whose delivered batch some tensor still uses."""
        return self._ledger.n_lent

    # -- views ----------------------------------------------------------------------------------------
    def array(self, slot: int, b: int, h: int, w: int, layout: str = "nhwc") -> np.ndarray:
        """Numpy view of slot ``slot`` as ``[b, h, w, 3]`` (nhwc) or ``[b, 3, h, w]`` (nchw), to render into."""
        return batch_view(self._arrays[slot], b, h, w, layout)

    def lend(self, slot: int, b: int, h: int, w: int, layout: str = "nhwc") -> torch.Tensor:
        """``uint8 [b, 3, h, w]`` tensor sharing memory with the slot, which is reused only once this tensor
        and every tensor sharing its memory are gone."""
        return _as_batch(torch.from_numpy(self._ledger.lend(slot, self.array(slot, b, h, w, layout))), layout)

    def copy(self, slot: int, b: int, h: int, w: int, layout: str = "nhwc") -> torch.Tensor:
        """``uint8 [b, 3, h, w]`` tensor with its own copy of the slot's batch (same memory order); the slot
        is free again at once."""
        out = _as_batch(torch.from_numpy(self.array(slot, b, h, w, layout).copy()), layout)
        self._ledger.give_back(slot)
        return out

    def close(self) -> None:
        """Drop our references; a mapping is unmapped once no tensor uses it any more."""
        self._arrays = []
        self._maps = []
        self._ledger.clear()


def _as_batch(pixels: torch.Tensor, layout: str) -> torch.Tensor:
    """The ``[b, 3, h, w]`` batch of a slot's numpy-shaped pixels (a permuted view for nhwc)."""
    return pixels.permute(0, 3, 1, 2) if layout == "nhwc" else pixels
