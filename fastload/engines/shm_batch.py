"""A ring of reusable shared-memory batch buffers.

Workers render every sample of a batch straight into a slot; only the slot number and the small
targets travel back through a pipe. The consumer gets a tensor *view* of the slot, so a batch costs
no collate copy and, because slots are reused, no page faults on fresh memory (the stock loader's
``torch.stack`` pays for both on every batch; ``benchmarks/loader_throughput.py`` compares the two).

The buffers are anonymous ``MAP_SHARED`` mappings created before the workers are forked, so parent
and children see the same pages with no file names to leak and nothing to clean up after a crash.
"""
from __future__ import annotations

import collections
import mmap

import numpy as np
import torch

from fastload.engines.cpu_render import batch_view


class SlotRing:
    """``n_slots`` buffers of ``slot_bytes`` each, shared with forked children.

    Layouts (``layout`` argument of the view helpers):
      ``"nhwc"``: samples are written HWC; :meth:`tensor` returns the ``[B, 3, H, W]`` permuted view,
        a channels-last tensor (``.to(device)`` copies it as one dense block and keeps the format).
      ``"nchw"``: samples are written CHW; :meth:`tensor` returns a contiguous ``[B, 3, H, W]``.
    """

    def __init__(self, n_slots: int, slot_bytes: int) -> None:
        if n_slots < 1 or slot_bytes < 1:
            raise ValueError(f"need at least one non-empty slot, got {n_slots} x {slot_bytes} bytes")
        self.n_slots = int(n_slots)
        self.slot_bytes = int(slot_bytes)
        self._maps = [mmap.mmap(-1, self.slot_bytes, flags=mmap.MAP_SHARED) for _ in range(self.n_slots)]
        self._arrays = [np.frombuffer(m, np.uint8) for m in self._maps]
        self._free: collections.deque[int] = collections.deque(range(self.n_slots))

    # -- slot bookkeeping (consumer side only) ------------------------------------------------------
    def acquire(self) -> int | None:
        """A free slot number, or None when every slot is in flight or held by the consumer."""
        return self._free.popleft() if self._free else None

    def release(self, slot: int) -> None:
        if slot in self._free:
            raise RuntimeError(f"slot {slot} released twice")
        self._free.append(slot)

    @property
    def n_free(self) -> int:
        return len(self._free)

    # -- views ----------------------------------------------------------------------------------------
    def array(self, slot: int, b: int, h: int, w: int, layout: str = "nhwc") -> np.ndarray:
        """Numpy view of slot ``slot`` as ``[b, h, w, 3]`` (nhwc) or ``[b, 3, h, w]`` (nchw)."""
        return batch_view(self._arrays[slot], b, h, w, layout)

    def tensor(self, slot: int, b: int, h: int, w: int, layout: str = "nhwc") -> torch.Tensor:
        """``uint8 [b, 3, h, w]`` tensor sharing memory with the slot."""
        t = torch.from_numpy(self.array(slot, b, h, w, layout))
        return t.permute(0, 3, 1, 2) if layout == "nhwc" else t

    def close(self) -> None:
        """Drop our references; the mappings are unmapped once no tensor view uses them any more."""
        self._arrays = []
        self._maps = []
        self._free.clear()
