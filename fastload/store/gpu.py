"""The GPU-resident store (``store="gpu"``) and the device-side decode it shares with the GPU engine.

:class:`GpuStore` keeps every *loaded* image (long side ``imgsz``) of a split on a torch device as
one flat ``uint8 [P, 3]`` tensor of HWC pixel rows plus per-image offsets, the same layout as the
packed disk/ram store, so the GPU engine draws tiles straight from it and never decodes during
training. It is filled once from another store: a packed store (disk/ram) is copied through
pinned staging chunks; an encoded store (files/lmdb) is decoded on the device (nvJPEG through
``torchvision.io.decode_jpeg``; other formats on the CPU) and resized with :func:`resize_loaded`.
Before allocating, the store checks that the decoded set fits ``share`` of the device's free
memory (default 80 %) and otherwise refuses with the numbers. On a CPU device it works the same way
(tests, or a fallback), using host memory.

Device decode helpers (also used by ``engine="gpu"``):

* :func:`decode_on_device`: encoded bytes -> loaded CHW uint8 tensors on ``device`` (EXIF
  orientation applied, JPEGs batched through nvJPEG on CUDA, libjpeg on CPU; non-JPEG and
  undecodable-on-device images fall back to the CPU decoder, whose errors name the file).
* :func:`resize_loaded`: the YOLOv9 loaded resize on a tensor with OpenCV's weights.
"""
from __future__ import annotations

import functools
import logging
import math
import warnings
from typing import Any, Callable, Sequence

import numpy as np
import torch

from fastload.data.images import CorruptImageError, jpeg_is_complete, loaded_shape, probe_header
from fastload.store.base import Store, StoreError

__all__ = ["GpuStore", "open_gpu_store", "decode_on_device", "resize_loaded", "resize_weights", "default_device"]

LOG = logging.getLogger(__name__)
_EXACT = 1e-9
_RESIZE_COEF = 2048.0  # OpenCV INTER_RESIZE_COEF_SCALE: cv2.resize's 11-bit bilinear weights
_GIB = float(1 << 30)


def default_device() -> torch.device:
    """The current CUDA device when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ------------------------------------------------------------------------------------------- resize
@functools.lru_cache(maxsize=4096)
def _weights(n_in: int, n_out: int, area: bool) -> np.ndarray:
    w = np.zeros((n_out, n_in), np.float64)
    s = n_in / n_out
    if n_in == n_out:
        np.fill_diagonal(w, 1.0)
    elif area and n_out < n_in:
        # INTER_AREA shrink: output i averages the input cells [i*s, (i+1)*s), weighted by overlap
        for i in range(n_out):
            a, b = i * s, (i + 1) * s
            for j in range(int(math.floor(a)), min(int(math.ceil(b - _EXACT)), n_in)):
                w[i, j] = (min(b, j + 1) - max(a, j)) / s
    else:
        # INTER_LINEAR: sample (i + 0.5) * s - 0.5, clamped to the borders, 11-bit weights
        for i in range(n_out):
            f = (i + 0.5) * s - 0.5
            j = int(math.floor(f))
            f -= j
            if j < 0:
                j, f = 0, 0.0
            if j >= n_in - 1:
                j, f = n_in - 1, 0.0
            w0 = round((1.0 - f) * _RESIZE_COEF) / _RESIZE_COEF
            w[i, j] += w0
            w[i, min(j + 1, n_in - 1)] += 1.0 - w0
    w.setflags(write=False)
    return w


def resize_weights(n_in: int, n_out: int, *, area: bool) -> np.ndarray:
    """``float64 [n_out, n_in]`` 1-D resampling matrix equal to OpenCV's ``cv2.resize`` weights.

    ``area=True``: ``INTER_AREA`` box-overlap weights when shrinking; otherwise (and when
    enlarging) ``INTER_LINEAR`` with OpenCV's 11-bit weights. Equal sizes give the identity.
    """
    if n_in < 1 or n_out < 1:
        raise ValueError(f"resize sizes must be >= 1, got {n_in} -> {n_out}")
    return _weights(int(n_in), int(n_out), bool(area))


def resize_loaded(img: torch.Tensor, hw: Sequence[int], *, shrink: str = "area") -> torch.Tensor:
    """Resize a CHW uint8 tensor to ``hw`` as :meth:`fastload.store.base.Store.load` does with OpenCV.

    INTER_LINEAR when the image grows; when it shrinks INTER_AREA (``shrink="area"``, YOLOv9
    validation) or INTER_LINEAR (``"linear"``, YOLOv9 training); ``img`` itself when the size
    already matches. Two float32 matrix products with separable weights, then rounding: equal to
    OpenCV up to 1 grey level (its fixed-point rounding).
    """
    h, w = int(hw[0]), int(hw[1])
    h0, w0 = int(img.shape[-2]), int(img.shape[-1])
    if (h0, w0) == (h, w):
        return img
    if shrink not in ("area", "linear"):
        raise ValueError(f"shrink must be 'area' or 'linear', got {shrink!r}")
    area = shrink == "area" and h * w <= h0 * w0  # as fastload.data.images.resize_to
    dev = img.device
    wy = torch.from_numpy(resize_weights(h0, h, area=area).astype(np.float32)).to(dev, non_blocking=True)
    wx = torch.from_numpy(resize_weights(w0, w, area=area).astype(np.float32)).to(dev, non_blocking=True)
    f = img.to(torch.float32)
    # contract the axis that shrinks most first: the second product is then the smaller one
    if h0 * w <= w0 * h:
        out = torch.matmul(wy, torch.matmul(f, wx.T))
    else:
        out = torch.matmul(torch.matmul(wy, f), wx.T)
    return out.add_(0.5).floor_().clamp_(0, 255).to(torch.uint8)


# ------------------------------------------------------------------------------------------- decode
def _orient(img: torch.Tensor, orientation: int) -> torch.Tensor:
    """EXIF orientation on a CHW tensor (same cases as :func:`fastload.data.images.apply_orientation`)."""
    if orientation == 2:
        return img.flip(-1)
    if orientation == 3:
        return img.flip(-1).flip(-2)
    if orientation == 4:
        return img.flip(-2)
    if orientation == 5:
        return img.transpose(-1, -2)
    if orientation == 6:
        return torch.rot90(img, -1, (-2, -1))
    if orientation == 7:
        return img.transpose(-1, -2).flip(-1).flip(-2)
    if orientation == 8:
        return torch.rot90(img, 1, (-2, -1))
    return img


def _cpu_decode(buf: bytes, path: str | None) -> torch.Tensor:
    from fastload.data.images import decode_image

    return torch.from_numpy(np.ascontiguousarray(decode_image(buf, path))).permute(2, 0, 1)


def _jpeg_batch(bufs: list[bytes], device: torch.device) -> list[torch.Tensor] | None:
    """One batched ``decode_jpeg`` call (nvJPEG on CUDA); None when it fails (caller decodes one by one)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in bufs]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torchvision >= 0.29 marks its decoders deprecated
            out = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:
        return None
    return list(out)


def decode_on_device(
    bufs: Sequence[bytes],
    paths: Sequence[str | None],
    loaded_hw: Sequence[Sequence[int]] | None,
    device: torch.device | str,
    *,
    shrink: str = "area",
) -> list[torch.Tensor]:
    """Decode encoded images to RGB CHW uint8 tensors on ``device`` (EXIF orientation applied).

    Args:
        bufs: encoded file bytes.
        paths: the file of every buffer (named in errors).
        loaded_hw: resize each image to this ``(h, w)`` (its loaded shape) with :func:`resize_loaded`;
            None keeps the decoded size.
        shrink: the filter when an image shrinks, ``"area"`` or ``"linear"`` (see :func:`resize_loaded`).
        device: where the images go; JPEGs are decoded there (nvJPEG on CUDA), other formats on the
            CPU and uploaded.

    Raises :class:`fastload.data.images.CorruptImageError` naming the file of an undecodable image.
    """
    device = torch.device(device)
    out: list[torch.Tensor | None] = [None] * len(bufs)
    jpeg_k: list[int] = []
    orient: dict[int, int] = {}
    for k, buf in enumerate(bufs):
        fmt, _, _, orientation = probe_header(buf, paths[k])
        if fmt == "jpeg":
            if not jpeg_is_complete(buf):
                raise CorruptImageError(paths[k], "truncated JPEG (no end-of-image marker after the last scan)")
            jpeg_k.append(k)
            orient[k] = orientation
        else:
            out[k] = _cpu_decode(bytes(buf), paths[k]).to(device, non_blocking=True)
    if jpeg_k:
        decoded = _jpeg_batch([bytes(bufs[k]) for k in jpeg_k], device)
        for j, k in enumerate(jpeg_k):
            img = decoded[j] if decoded is not None else None
            if img is None:  # the batch failed: find the culprit (CMYK, damaged...) one by one
                one = _jpeg_batch([bytes(bufs[k])], device)
                img = one[0] if one is not None else _cpu_decode(bytes(bufs[k]), paths[k]).to(device)
            out[k] = _orient(img, orient[k])
    result = []
    for k, img in enumerate(out):
        assert img is not None
        if loaded_hw is not None:
            img = resize_loaded(img, loaded_hw[k], shrink=shrink)
        result.append(img)
    return result


# ------------------------------------------------------------------------------------------- the store
def _fits(needed: int, device: torch.device, share: float) -> tuple[bool, int]:
    """(fits, allowed bytes): ``share`` of the free memory of ``device`` (host RAM for the CPU)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
    else:
        import psutil

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
    ) -> None:
        super().__init__()
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self.base = base
        self.device = torch.device(device) if device is not None else default_device()
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise StoreError(f"store='gpu' on {self.device}: CUDA is not available here (use device='cpu' or another store)")
        self.imgsz = int(imgsz or base.imgsz or 0) or None
        if self.imgsz is None:
            raise StoreError(f"store='gpu' from {base!r} needs imgsz (the base store is encoded)")
        if base.decoded and base.imgsz not in (None, self.imgsz):
            raise StoreError(f"{base!r} holds images at imgsz={base.imgsz}, the GPU store was asked for {self.imgsz}")
        self.path = base.path
        self.labels = list(base.labels)
        self.shapes = np.asarray(base.shapes, np.int32).reshape(-1, 2)
        self.im_files = list(base.im_files)
        self.names = list(base.names)
        self.hw = np.array([loaded_shape(int(h), int(w), self.imgsz) for h, w in self.shapes], np.int64).reshape(-1, 2)
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
        self.meta = dict(base.meta, gpu={"device": str(self.device), "bytes": needed, "share": share})
        self.pixels = torch.empty((total_px, 3), dtype=torch.uint8, device=self.device)
        self._chunk = int(chunk_bytes)
        self._fill()

    # -- filling ------------------------------------------------------------------------------------
    def _staging(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")

    def _fill(self) -> None:
        base = self.base
        n = len(self)
        if n == 0:
            return
        if base.decoded:  # packed disk/ram: read_image is a view of the mapped pixels
            self._fill_arrays(lambda i: np.asarray(base.load(i, self.imgsz)))
        elif self.device.type == "cuda":
            self._fill_decode()
        else:  # CPU device: the CPU decoder is the reference, use it
            self._fill_arrays(lambda i: base.load(i, self.imgsz))

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
            imgs = decode_on_device(bufs, [self.im_files[k] for k in ks], [tuple(self.hw[k]) for k in ks], self.device)
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


def open_gpu_store(data: Any, split: str = "train", imgsz: int = 640, *, base: str = "auto", **kwargs: Any) -> GpuStore:
    """``open_store(..., kind="gpu")``: fill a :class:`GpuStore` from the best host store of ``data``.

    ``base`` picks the host store kind (default ``auto``: ram > disk > lmdb > files); ``kwargs`` go
    to :class:`GpuStore` (``device``, ``share``).
    """
    from fastload.store.factory import open_store

    host = open_store(data, split=split, kind=base, imgsz=imgsz)
    try:
        return GpuStore(host, imgsz=imgsz, **kwargs)
    except BaseException:
        host.close()
        raise
