"""The image decoders ``fastload bench`` compares; each maps encoded bytes to an RGB HWC uint8 array.

``available_decoders(imgsz)`` lists every decoder with either a callable or the reason it is
unavailable (an optional package that is not installed), so the report can say why a row is
missing. ``fastload`` and ``reduced`` also resize to the loaded shape: they are the per-read work of
the loader (``Store.load``) and its reduced-DCT alternative, the figures the bottleneck model uses.
"""
from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from typing import Callable

import cv2
import numpy as np
import torch
from PIL import Image

from fastload.data.images import decode_image, decode_loaded, resize_long_side

DecodeFn = Callable[[bytes], np.ndarray]

# In report order; "fastload" is the loader's own path and must stay first among the resizing ones.
DECODERS: tuple[str, ...] = ("fastload", "reduced", "cv2", "pil", "torchvision", "turbojpeg")

DESCRIPTIONS = {
    "fastload": "fastload decode_image + resize to imgsz (what the loader does per read)",
    "reduced": "reduced-DCT JPEG decode (1/2..1/8 scale when >= 2x imgsz) + resize",
    "cv2": "cv2.imdecode to RGB",
    "pil": "PIL Image.open().convert('RGB')",
    "torchvision": "torchvision.io.decode_image (CPU)",
    "turbojpeg": "PyTurboJPEG (JPEG only; other formats via cv2)",
}


@dataclass
class Decoder:
    name: str
    fn: DecodeFn | None
    unavailable: str = ""
    description: str = ""


def _cv2() -> DecodeFn:
    flag = getattr(cv2, "IMREAD_COLOR_RGB", None)

    def decode(buf: bytes) -> np.ndarray:
        arr = np.frombuffer(buf, np.uint8)
        if flag is not None:
            img = cv2.imdecode(arr, flag)
        else:
            img = cv2.imdecode(arr, cv2.IMREAD_COLOR)
            img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB) if img is not None else None
        if img is None:
            raise ValueError("cv2.imdecode failed")
        return img

    return decode


def _pil() -> DecodeFn:
    def decode(buf: bytes) -> np.ndarray:
        with Image.open(io.BytesIO(buf)) as im:
            return np.asarray(im.convert("RGB"))

    return decode


def _torchvision() -> DecodeFn:
    # torchvision loads its model zoo and torch._dynamo when first imported (2 s of CPU): imported here, only where
    # its decoder is measured, not by every process that imports the bench (the CLI, the tests' stock replay)
    from torchvision.io import ImageReadMode, decode_image as tv_decode_image

    def decode(buf: bytes) -> np.ndarray:
        with warnings.catch_warnings():  # torchvision >= 0.29 warns on every call (TorchCodec migration)
            warnings.simplefilter("ignore", DeprecationWarning)
            t = tv_decode_image(torch.frombuffer(bytearray(buf), dtype=torch.uint8), mode=ImageReadMode.RGB)
        return t.permute(1, 2, 0).numpy()

    return decode


def _turbojpeg() -> DecodeFn:
    from turbojpeg import TJPF_RGB, TurboJPEG  # optional: pip install PyTurboJPEG (needs libturbojpeg)

    tj = TurboJPEG()
    fallback = _cv2()

    def decode(buf: bytes) -> np.ndarray:
        if buf[:2] == b"\xff\xd8":
            return tj.decode(buf, pixel_format=TJPF_RGB)
        return fallback(buf)

    return decode


def _fastload(imgsz: int) -> DecodeFn:
    return lambda buf: resize_long_side(decode_image(buf), imgsz)


def _reduced(imgsz: int) -> DecodeFn:
    return lambda buf: decode_loaded(buf, imgsz, reduced=True)


def available_decoders(imgsz: int, names: tuple[str, ...] | list[str] | None = None) -> list[Decoder]:
    """The requested decoders (default: all), each with its function or why it is unavailable."""
    names = list(names) if names else list(DECODERS)
    unknown = [n for n in names if n not in DECODERS]
    if unknown:
        raise ValueError(f"unknown decoder(s) {unknown}; choose from {', '.join(DECODERS)}")
    makers: dict[str, Callable[[], DecodeFn]] = {
        "fastload": lambda: _fastload(imgsz),
        "reduced": lambda: _reduced(imgsz),
        "cv2": _cv2,
        "pil": _pil,
        "torchvision": _torchvision,
        "turbojpeg": _turbojpeg,
    }
    out = []
    for name in names:
        try:
            out.append(Decoder(name, makers[name](), description=DESCRIPTIONS[name]))
        except Exception as e:  # ImportError, or a library present without its shared object
            out.append(Decoder(name, None, f"{type(e).__name__}: {e}", DESCRIPTIONS[name]))
    return out
