"""The GPU-resident store (``store="gpu"``): every loaded image of a split in device memory.

:class:`GpuStore` keeps every *loaded* image (long side ``imgsz``) of a split on a torch device as
one flat ``uint8 [P, 3]`` tensor of HWC pixel rows plus per-image offsets, the same layout as the
packed disk/ram store, so the GPU engine draws tiles straight from it and never decodes during
training (:meth:`GpuStore.resident_images`). It is filled once from another store: a packed store
(disk/ram) is copied through pinned staging chunks; an encoded store (files/lmdb) is decoded on the
device by :func:`fastload.data.torch_images.decode_on_device`. Before allocating, the store checks
that the decoded set fits ``share`` of the device's free memory (default 80 %) and otherwise
refuses with the numbers. On a CPU device it works the same way (tests, or a fallback), using host
memory.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np
import psutil
import torch

from fastload.data.images import LoadRule, check_load_rule, loaded_shape
from fastload.data.labels import FlatLabels
from fastload.data.device import resolve_device
from fastload.data.torch_images import decode_on_device
from fastload.store.base import ResidentImages, Store, StoreError
from fastload.store.writing import decoded_shrink

__all__ = ["GpuStore"]

LOG = logging.getLogger(__name__)
_GIB = float(1 << 30)


# ------------------------------------------------------------------------------------------- the store
def _fits(needed: int, device: torch.device, share: float) -> tuple[bool, int]:
    """(fits, allowed bytes): ``share`` of the free memory of ``device`` (host RAM for the CPU)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
    else:
        free = psutil.virtual_memory().available
    allowed = int(free * share)
    return needed <= allowed, allowed


class GpuStore(Store):
    """Every loaded image of a split resident on a torch device; decoding is skipped entirely.

    Args:
        base: the store to fill from (any kind; its labels, shapes, names and files are shared).
        device: torch device (default: the current CUDA device, else the CPU).
        imgsz: long side of the loaded images (default: ``base.imgsz``; required for encoded stores).
        share: largest fraction of the device's currently free memory the pixels may take.
        chunk_bytes: host staging size for copies and decode batches.
        load_rule: the loaded-image rule of its images (:data:`fastload.data.images.LoadRule`); a decoded
            ``base`` must have been made with it. Shrunk once as a disk store of that rule is.

    Attributes beyond :class:`Store`'s: ``pixels`` (``uint8 [P, 3]`` on ``device``), ``px_offsets``
    (``int64 [N]`` first pixel row of each image), ``hw`` (``int64 [N, 2]`` loaded sizes),
    ``device``, ``base``.

    Raises :class:`StoreError` when the decoded set does not fit (the message gives both sizes).
    """

    kind = "gpu"
    decoded = True

    def __init__(
        self,
        base: Store,
        *,
        device: str | torch.device | None = None,
        imgsz: int | None = None,
        share: float = 0.8,
        chunk_bytes: int = 256 << 20,
        load_rule: LoadRule = "yolov9",
    ) -> None:
        super().__init__()
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self.base = base
        try:
            self.device = resolve_device(device, "store='gpu'", instead="device='cpu' or another store")
        except RuntimeError as e:  # a store's errors are StoreErrors
            raise StoreError(str(e)) from None
        self.imgsz = int(imgsz or base.imgsz or 0) or None
        if self.imgsz is None:
            raise StoreError(f"store='gpu' from {base!r} needs imgsz (the base store is encoded)")
        if base.decoded and base.imgsz not in (None, self.imgsz):
            raise StoreError(f"{base!r} holds images at imgsz={base.imgsz}, the GPU store was asked for {self.imgsz}")
        self.load_rule = check_load_rule(load_rule)
        base.check_load_rule(load_rule)
        self.path = base.path
        self.labels = FlatLabels.from_arrays(base.labels)  # the base's (with any points), not copied
        self.shapes = np.asarray(base.shapes, np.int32).reshape(-1, 2)
        self.im_files = list(base.im_files)
        self.names = list(base.names)
        self.hw = np.array([loaded_shape(int(h), int(w), self.imgsz, load_rule) for h, w in self.shapes], np.int64).reshape(-1, 2)
        sizes = self.hw[:, 0] * self.hw[:, 1]
        self.px_offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64) if len(sizes) else sizes
        total_px = int(sizes.sum())
        needed = total_px * 3
        ok, allowed = _fits(needed, self.device, share)
        if not ok:
            raise StoreError(
                f"store='gpu': {len(self)} images at imgsz={self.imgsz} need {needed / _GIB:.2f} GiB, but only "
                f"{allowed / _GIB:.2f} GiB ({share:.0%} of the free memory of {self.device}) may be used; "
                f"use store='ram' or 'disk', a smaller imgsz, or raise share="
            )
        self.meta = dict(base.meta, load_rule=load_rule, gpu={"device": str(self.device), "bytes": needed, "share": share})
        self.pixels = torch.empty((total_px, 3), dtype=torch.uint8, device=self.device)
        self._chunk = int(chunk_bytes)
        self._fill()

    # -- filling ------------------------------------------------------------------------------------
    def _staging(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")

    def _fill(self) -> None:
        base, rule = self.base, self.load_rule
        n = len(self)
        if n == 0:
            return
        if base.decoded:  # packed disk/ram: read_image is a view of the mapped pixels
            self._fill_arrays(lambda i: np.asarray(base.load(i, self.imgsz, rule=rule)))
        elif self.device.type == "cuda":
            self._fill_decode()
        else:  # CPU device: the CPU decoder is the reference, use it
            self._fill_arrays(lambda i: base.load(i, self.imgsz, shrink=decoded_shrink(rule), rule=rule))

    def _fill_arrays(self, get: Callable[[int], np.ndarray]) -> None:
        """Copy loaded HWC arrays one staging chunk at a time."""
        i, n = 0, len(self)
        while i < n:
            j, nbytes = i, 0
            while j < n and (j == i or nbytes + int(self.hw[j].prod()) * 3 <= self._chunk):
                nbytes += int(self.hw[j].prod()) * 3
                j += 1
            stage = self._staging(nbytes)
            view = stage.numpy()
            o = 0
            for k in range(i, j):
                img = get(k)
                want = (int(self.hw[k, 0]), int(self.hw[k, 1]), 3)
                if img.shape != want:
                    raise StoreError(f"{self.im_files[k]}: loaded image is {img.shape}, expected {want}")
                view[o : o + img.size] = img.reshape(-1)
                o += img.size
            start = int(self.px_offsets[i]) * 3
            self.pixels.view(-1)[start : start + nbytes].copy_(stage, non_blocking=True)
            i = j
        self._sync()

    def _fill_decode(self, batch: int = 64) -> None:
        """Decode an encoded store on the device, ``batch`` images per nvJPEG call."""
        n = len(self)
        for i in range(0, n, batch):
            ks = list(range(i, min(n, i + batch)))
            bufs = [bytes(self.base.read_image(k)) for k in ks]
            imgs = decode_on_device(bufs, [self.im_files[k] for k in ks], [tuple(self.hw[k]) for k in ks], self.device,
                                    shrink=decoded_shrink(self.load_rule))
            for k, img in zip(ks, imgs):
                o = int(self.px_offsets[k])
                rows = img.permute(1, 2, 0).reshape(-1, 3)
                self.pixels[o : o + rows.shape[0]].copy_(rows)
        self._sync()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- Store interface ------------------------------------------------------------------------------
    def image_rows(self, i: int) -> torch.Tensor:
        """Loaded image ``i`` as ``uint8 [h*w, 3]`` rows on the device (a view, no copy)."""
        i = self.check_index(i)
        o = int(self.px_offsets[i])
        return self.pixels[o : o + int(self.hw[i].prod())]

    def image_tensor(self, i: int) -> torch.Tensor:
        """Loaded image ``i`` as an HWC ``uint8`` tensor on the device (a view)."""
        h, w = (int(v) for v in self.hw[self.check_index(i)])
        return self.image_rows(i).view(h, w, 3)

    def resident_images(self) -> ResidentImages:
        """The device-resident pixels, offsets and loaded sizes of every image (no copy)."""
        return ResidentImages(self.pixels, self.px_offsets, self.hw, self.device)

    def read_image(self, i: int) -> np.ndarray:
        """Loaded image ``i`` copied to host memory (slow path for generic consumers)."""
        return self.image_tensor(i).cpu().numpy()

    def nbytes(self, i: int) -> int:
        return int(self.hw[self.check_index(i)].prod()) * 3

    def close(self) -> None:
        self.pixels = torch.empty((0, 3), dtype=torch.uint8, device=self.device)
        self.base.close()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a GpuStore lives in device memory and cannot be sent to another process")
