"""Image decoding, header probing and the YOLOv9 "loaded image" resize.

Everything returns **RGB, HWC, uint8, C-contiguous** arrays with the EXIF orientation applied
(as ``cv2.imread`` does for the YOLOv9 loader): grayscale is expanded to 3 channels, alpha is
dropped and 16-bit samples are scaled to 8 bits.

The real format is found from the magic bytes, never from the file name, so a PNG saved as
``.jpg`` still decodes.  JPEG orientation and size are read by a small marker walker (no
decoder involved), so the common no-EXIF case costs a few microseconds; other formats fall
back to PIL's lazy header reader only when they may carry EXIF.

JPEG decoder choice: ``cv2.imdecode`` is the default: it returns HWC directly, needs no torch in
every worker, and torchvision 0.29 deprecates its image decoders (``fastload bench --stages decode``
compares the decoders on your own data). :func:`set_jpeg_decoder` or
``FASTLOAD_JPEG_DECODER=torchvision|pil|cv2`` (read when a JPEG is decoded) choose another.
"""
from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import Literal, get_args

import cv2
import numpy as np
from PIL import Image

__all__ = [
    "CorruptImageError",
    "IMG_FORMATS",
    "sniff_format",
    "probe_shape",
    "probe_header",
    "jpeg_is_complete",
    "jpeg_first_scan",
    "apply_orientation",
    "decode_image",
    "set_jpeg_decoder",
    "jpeg_decoder",
    "decode_image_reduced",
    "decode_loaded",
    "read_image_file",
    "loaded_shape",
    "loaded_shapes",
    "resize_long_side",
    "resize_to",
    "shrink_filter",
    "ShrinkFilter",
    "SHRINK_FILTERS",
    "LoadRule",
    "LOAD_RULES",
    "check_load_rule",
    "rule_shrink",
]

# File suffixes that count as images when a folder is scanned (YOLOv5/v9 list).
IMG_FORMATS: tuple[str, ...] = ("bmp", "dng", "jpeg", "jpg", "mpo", "png", "tif", "tiff", "webp", "pfm")

_JPEG_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_ORIENTATION_TAG = 0x0112


class CorruptImageError(ValueError):
    """An image that cannot be used: empty, truncated, unknown format or undecodable."""

    def __init__(self, path: str | os.PathLike | None, reason: str) -> None:
        self.path = None if path is None else str(path)
        self.reason = reason
        super().__init__(f"{self.path or '<bytes>'}: {reason}")


# ----------------------------------------------------------------------------- format sniffing
def _as_bytes(buf: bytes | bytearray | memoryview | np.ndarray) -> bytes | bytearray:
    """Encoded bytes as an object with ``rfind`` (lmdb memoryviews and numpy slices are copied once)."""
    if isinstance(buf, (bytes, bytearray)):
        return buf
    if isinstance(buf, np.ndarray):
        return buf.tobytes()
    return bytes(buf)


def sniff_format(buf: bytes | bytearray | memoryview) -> str | None:
    """The image format named by the magic bytes: jpeg, png, bmp, tiff, webp, gif, pfm or None."""
    head = bytes(buf[:12])
    if head[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if head[:2] == b"BM":
        return "bmp"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "tiff"  # also DNG, which is TIFF-based
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if head[:2] in (b"PF", b"Pf") and head[2:3] in (b"\n", b"\r", b" "):
        return "pfm"
    return None


# ----------------------------------------------------------------------------- EXIF / headers
def _tiff_orientation(tiff: bytes) -> int:
    """Orientation (1..8) from a TIFF structure (the body of an EXIF block); 1 when absent."""
    if len(tiff) < 8:
        return 1
    order = {b"II": "little", b"MM": "big"}.get(tiff[:2])
    if order is None:
        return 1
    ifd = int.from_bytes(tiff[4:8], order)
    if ifd + 2 > len(tiff):
        return 1
    count = int.from_bytes(tiff[ifd : ifd + 2], order)
    for k in range(count):
        entry = ifd + 2 + 12 * k
        if entry + 12 > len(tiff):
            break
        if int.from_bytes(tiff[entry : entry + 2], order) == _ORIENTATION_TAG:
            value = int.from_bytes(tiff[entry + 8 : entry + 10], order)
            return value if 1 <= value <= 8 else 1
    return 1


def _jpeg_markers(buf: bytes, to_scan: bool = False) -> tuple[int, int, int, int] | None:
    """Walk JPEG markers: ``(h, w, orientation, sos)`` or None when no frame header is found.

    Stops at the frame header (SOF) unless ``to_scan``, then at the first start-of-scan (SOS)
    whose offset is ``sos`` (-1 when not reached). Costs microseconds: only segment headers
    are touched, never the entropy-coded data.
    """
    n = len(buf)
    pos = 2
    orientation = 1
    size: tuple[int, int] | None = None
    while pos + 4 <= n:
        if buf[pos] != 0xFF:
            break  # lost sync: not a well-formed marker stream
        marker = buf[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            pos += 2
            continue
        if marker in (0xDA, 0xD9):  # scan (or end) reached
            return None if size is None else (*size, orientation, pos if marker == 0xDA else -1)
        seg_len = (buf[pos + 2] << 8) | buf[pos + 3]
        body = pos + 4
        if marker == 0xE1 and size is None and buf[body : body + 6] == b"Exif\x00\x00":
            orientation = _tiff_orientation(buf[body + 6 : pos + 2 + seg_len])
        elif marker in _JPEG_SOF and size is None:
            if body + 5 > n:
                return None
            size = ((buf[body + 1] << 8) | buf[body + 2], (buf[body + 3] << 8) | buf[body + 4])
            if not to_scan:
                return (*size, orientation, -1)
        pos += 2 + seg_len
    return None if size is None else (*size, orientation, -1)


def _png_chunk_exif(buf: bytes) -> bool:
    """True when a PNG carries an eXIf chunk (cheap test before asking PIL)."""
    return buf.find(b"eXIf") != -1


def _pil_header(buf: bytes, path: str | None) -> tuple[int, int, int]:
    """(h, w, orientation) via PIL's lazy header reader (no pixel decode)."""
    try:
        with Image.open(io.BytesIO(buf)) as im:
            w, h = im.size
            orientation = int(im.getexif().get(_ORIENTATION_TAG, 1) or 1)
    except Exception as exc:  # PIL raises many types for bad headers
        raise CorruptImageError(path, f"unreadable image header ({type(exc).__name__}: {exc})") from None
    return h, w, orientation if 1 <= orientation <= 8 else 1


def probe_header(buf: bytes, path: str | None = None) -> tuple[str, int, int, int]:
    """(format, h, w, orientation) of an encoded image without decoding its pixels.

    ``h, w`` are the stored (pre-orientation) size. Raises :class:`CorruptImageError` for empty
    input, an unknown format or an unreadable header.
    """
    buf = _as_bytes(buf)
    if len(buf) == 0:
        raise CorruptImageError(path, "empty file (0 bytes)")
    fmt = sniff_format(buf)
    if fmt is None:
        raise CorruptImageError(path, f"not a known image format (first bytes {bytes(buf[:8])!r})")
    if fmt == "jpeg":
        hdr = _jpeg_markers(buf)
        if hdr is None:
            raise CorruptImageError(path, "JPEG without a readable frame header")
        h, w, orientation, _ = hdr
    elif fmt == "png":
        if len(buf) < 24 or buf[12:16] != b"IHDR":
            raise CorruptImageError(path, "PNG without an IHDR header")
        w = int.from_bytes(buf[16:20], "big")
        h = int.from_bytes(buf[20:24], "big")
        orientation = _pil_header(buf, path)[2] if _png_chunk_exif(buf) else 1
    elif fmt == "bmp" and len(buf) >= 26:
        w = abs(int.from_bytes(buf[18:22], "little", signed=True))
        h = abs(int.from_bytes(buf[22:26], "little", signed=True))
        orientation = 1
    elif fmt == "gif" and len(buf) >= 10:
        w = int.from_bytes(buf[6:8], "little")
        h = int.from_bytes(buf[8:10], "little")
        orientation = 1
    else:  # tiff, webp, pfm and short bmp/gif: PIL reads these headers lazily
        h, w, orientation = _pil_header(buf, path)
    if h <= 0 or w <= 0:
        raise CorruptImageError(path, f"image header says size {w}x{h}")
    return fmt, h, w, orientation


def probe_shape(buf: bytes, path: str | None = None) -> tuple[int, int]:
    """``(h, w)`` of an encoded image **after** EXIF orientation, read from the header only."""
    _, h, w, orientation = probe_header(buf, path)
    return (w, h) if orientation >= 5 else (h, w)


def jpeg_is_complete(buf: bytes) -> bool:
    """True when a JPEG has an end-of-image marker (FFD9) after its first scan starts.

    Inside entropy-coded data every 0xFF is followed by 0x00 or a restart marker, so an FFD9
    after the first SOS can only be the real end of image (an EXIF thumbnail's EOI sits before
    it); bytes after it (camera trailers) are allowed. A truncated file has none. The search
    runs from the end, so a complete file costs microseconds.
    """
    hdr = _jpeg_markers(buf, to_scan=True)
    return hdr is not None and hdr[3] > 0 and buf.rfind(b"\xff\xd9") > hdr[3]


def jpeg_first_scan(buf: bytes) -> int:
    """Offset of a JPEG's first start-of-scan marker, or -1 when ``buf`` does not reach it."""
    hdr = _jpeg_markers(buf, to_scan=True)
    return -1 if hdr is None else hdr[3]


def apply_orientation(img: np.ndarray, orientation: int) -> np.ndarray:
    """Apply an EXIF orientation (1..8) so the image displays upright (PIL ``exif_transpose``)."""
    if orientation == 2:
        img = cv2.flip(img, 1)
    elif orientation == 3:
        img = cv2.rotate(img, cv2.ROTATE_180)
    elif orientation == 4:
        img = cv2.flip(img, 0)
    elif orientation == 5:
        img = cv2.transpose(img)
    elif orientation == 6:
        img = cv2.rotate(img, cv2.ROTATE_90_CLOCKWISE)
    elif orientation == 7:
        img = cv2.rotate(cv2.transpose(img), cv2.ROTATE_180)
    elif orientation == 8:
        img = cv2.rotate(img, cv2.ROTATE_90_COUNTERCLOCKWISE)
    return img


# ----------------------------------------------------------------------------- decoding
def _to_rgb_uint8(img: np.ndarray, bgr: bool) -> np.ndarray:
    """Normalise a decoded array to RGB HWC uint8 (gray->3ch, drop alpha, 16-bit/float->8-bit)."""
    if img.dtype == np.uint16:
        img = cv2.convertScaleAbs(img, alpha=1.0 / 257.0)
    elif img.dtype != np.uint8:
        f = img.astype(np.float32)
        scale = 255.0 if float(np.nanmax(f, initial=0.0)) <= 1.0 else 1.0
        img = np.clip(np.nan_to_num(f) * scale + 0.5, 0, 255).astype(np.uint8)
    if img.ndim == 2 or img.shape[2] == 1:
        return cv2.cvtColor(img.reshape(img.shape[:2]), cv2.COLOR_GRAY2RGB)
    if img.shape[2] == 2:  # gray + alpha
        return cv2.cvtColor(np.ascontiguousarray(img[:, :, 0]), cv2.COLOR_GRAY2RGB)
    if img.shape[2] == 4:
        return cv2.cvtColor(img, cv2.COLOR_BGRA2RGB if bgr else cv2.COLOR_RGBA2RGB)
    if bgr:
        return cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
    return np.ascontiguousarray(img)


def _decode_jpeg_default(buf: bytes, flags: int) -> np.ndarray | None:
    return cv2.imdecode(np.frombuffer(buf, np.uint8), flags | cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION)


def _decode_jpeg_torchvision(buf: bytes, flags: int) -> np.ndarray | None:
    if flags:  # reduced decodes are a cv2 (libjpeg scale_denom) feature
        return _decode_jpeg_default(buf, flags)
    # torch: only this opt-in decoder needs it; the store tools (convert, stage, info) stay torch-free
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    t = decode_jpeg(torch.frombuffer(bytearray(buf), dtype=torch.uint8), mode=ImageReadMode.RGB)
    return t.permute(1, 2, 0).contiguous().numpy()


def _decode_jpeg_pil(buf: bytes, flags: int) -> np.ndarray | None:
    if flags:
        return _decode_jpeg_default(buf, flags)
    with Image.open(io.BytesIO(buf)) as im:
        return np.asarray(im.convert("RGB"))


_JPEG_DECODERS = {"cv2": _decode_jpeg_default, "torchvision": _decode_jpeg_torchvision, "pil": _decode_jpeg_pil}
JPEG_DECODERS: tuple[str, ...] = tuple(_JPEG_DECODERS)
_chosen_decoder: str | None = None  # set_jpeg_decoder()'s choice; None: the environment's, else cv2


def set_jpeg_decoder(name: str | None) -> None:
    """Choose the JPEG decoder of this process: ``cv2`` (default), ``torchvision`` or ``pil``; it
    takes precedence over ``$FASTLOAD_JPEG_DECODER``. ``None`` goes back to the environment's choice."""
    global _chosen_decoder
    if name is not None and name not in _JPEG_DECODERS:
        raise ValueError(f"unknown JPEG decoder {name!r}; choose from {sorted(_JPEG_DECODERS)}")
    _chosen_decoder = name


def jpeg_decoder() -> str:
    """Name of the JPEG decoder in use: :func:`set_jpeg_decoder`'s choice, else
    ``$FASTLOAD_JPEG_DECODER`` (read on every call), else ``cv2``."""
    if _chosen_decoder is not None:
        return _chosen_decoder
    name = os.environ.get("FASTLOAD_JPEG_DECODER", "cv2").lower()
    if name not in _JPEG_DECODERS:
        raise ValueError(f"FASTLOAD_JPEG_DECODER={name!r} is not a JPEG decoder; choose from {sorted(_JPEG_DECODERS)}")
    return name


def _decode_other_pil(buf: bytes) -> np.ndarray | None:
    """Fallback for formats the cv2 build cannot read (e.g. GIF): first frame, RGB."""
    try:
        with Image.open(io.BytesIO(buf)) as im:
            im.seek(0)
            if im.mode in ("I;16", "I;16B", "I;16L", "I"):
                return _to_rgb_uint8(np.asarray(im).astype(np.uint16), bgr=False)
            return np.asarray(im.convert("RGB"))
    except Exception:
        return None


def _decode(buf: bytes, path: str | None, reduce: int = 1, decoder: str | None = None) -> tuple[np.ndarray, int, int, int]:
    """Decode to RGB uint8 HWC with orientation applied; also returns the stored (h0, w0, orientation).

    ``reduce`` in {1, 2, 4, 8} asks for a 1/reduce-scale DCT decode (JPEG only; ignored otherwise).
    ``decoder``: the JPEG decoder (None: :func:`jpeg_decoder`, the process's choice).
    """
    fmt, h0, w0, orientation = probe_header(buf, path)
    if fmt == "jpeg":
        if not jpeg_is_complete(buf):
            raise CorruptImageError(path, "truncated JPEG (no end-of-image marker after the last scan)")
        # the REDUCED_GRAYSCALE_k values are the bare scale bits; the colour bits come from the decoder
        flags = {1: 0, 2: cv2.IMREAD_REDUCED_GRAYSCALE_2, 4: cv2.IMREAD_REDUCED_GRAYSCALE_4, 8: cv2.IMREAD_REDUCED_GRAYSCALE_8}[
            reduce
        ]
        try:
            img = _JPEG_DECODERS[decoder or jpeg_decoder()](buf, flags)
        except Exception as exc:
            raise CorruptImageError(path, f"JPEG decode failed ({type(exc).__name__}: {exc})") from None
        if img is None:
            raise CorruptImageError(path, "JPEG decode failed")
        if img.ndim == 2 or img.shape[2] != 3:
            img = _to_rgb_uint8(img, bgr=False)
    else:
        img = cv2.imdecode(np.frombuffer(buf, np.uint8), cv2.IMREAD_UNCHANGED)
        if img is not None:
            img = _to_rgb_uint8(img, bgr=True)
        else:
            img = _decode_other_pil(buf)
        if img is None:
            raise CorruptImageError(path, f"{fmt.upper()} decode failed (truncated or damaged file)")
    if img.size == 0:
        raise CorruptImageError(path, "decoded to an empty image")
    if orientation != 1:
        img = np.ascontiguousarray(apply_orientation(img, orientation))
    return img, h0, w0, orientation


def decode_image(buf: bytes, path: str | None = None, *, decoder: str | None = None) -> np.ndarray:
    """Decode encoded image bytes to an RGB HWC uint8 array, EXIF orientation applied; JPEGs with
    ``decoder`` (one of :data:`JPEG_DECODERS`; None: :func:`jpeg_decoder`, the process's choice).

    Raises :class:`CorruptImageError` (naming ``path``) for empty, truncated, unknown or
    undecodable input.
    """
    return _decode(_as_bytes(buf), path, decoder=decoder)[0]


def _reduce_factor(h: int, w: int, target: int) -> int:
    """Largest power-of-two DCT scale (<= 8) that keeps the long side >= target."""
    long_side = max(h, w)
    factor = 1
    while factor < 8 and long_side >= 2 * factor * target:
        factor *= 2
    return factor


def decode_image_reduced(buf: bytes, imgsz: int, path: str | None = None, *, decoder: str | None = None) -> np.ndarray:
    """Decode a JPEG at 1/2, 1/4 or 1/8 scale when its long side is at least 2x ``imgsz``.

    The result's long side stays >= ``imgsz`` (so a following resize still shrinks) and is
    cheaper to decode than the full image (``benchmarks/reduced_decode.py`` measures by how much).
    Other formats decode at full size. ``decoder``: as in :func:`decode_image`.
    """
    buf = _as_bytes(buf)
    if sniff_format(buf) != "jpeg":
        return _decode(buf, path, decoder=decoder)[0]
    _, h0, w0, _ = probe_header(buf, path)
    return _decode(buf, path, _reduce_factor(h0, w0, imgsz), decoder)[0]


def decode_loaded(buf: bytes, imgsz: int, path: str | None = None, *, reduced: bool = True,
                  shrink: ShrinkFilter = "area", rule: LoadRule = "yolov9") -> np.ndarray:
    """Decode and resize to the *loaded* shape ``loaded_shape(h0, w0, imgsz, rule)`` in one call.

    With ``reduced=True`` large JPEGs use a reduced-scale DCT decode first; the output shape is
    identical either way (pixel values differ slightly from a full decode + the same resize).
    ``shrink``: the filter when the image shrinks (see :func:`resize_to`; the ``"ultralytics"`` rule
    always uses INTER_LINEAR).
    """
    buf = _as_bytes(buf)
    _, h0, w0, orientation = probe_header(buf, path)
    factor = _reduce_factor(h0, w0, imgsz) if reduced and sniff_format(buf) == "jpeg" else 1
    img = _decode(buf, path, factor)[0]
    oh, ow = (w0, h0) if orientation >= 5 else (h0, w0)
    return resize_to(img, loaded_shape(oh, ow, imgsz, rule), enlarge=max(oh, ow) < imgsz, shrink=rule_shrink(shrink, rule))


def read_image_file(path: str | os.PathLike) -> np.ndarray:
    """Read and decode an image file (RGB HWC uint8, EXIF applied); errors name the file."""
    p = Path(path)
    try:
        buf = p.read_bytes()
    except OSError as exc:
        raise CorruptImageError(str(p), f"cannot read file ({exc.strerror or exc})") from None
    return decode_image(buf, str(p))


# ----------------------------------------------------------------------------- the loaded-image resize
# The filter YOLOv9's ``load_image`` shrinks with: INTER_AREA for validation, INTER_LINEAR in training
# (``augment=True``); enlarging is always INTER_LINEAR.
ShrinkFilter = Literal["area", "linear"]
SHRINK_FILTERS: dict[str, int] = {"area": cv2.INTER_AREA, "linear": cv2.INTER_LINEAR}

#: Whose ``load_image`` makes the loaded image (long side ``imgsz``, aspect kept): ``"yolov9"`` truncates
#: the sizes (``int(w0 * r)``) and shrinks with INTER_AREA in validation, INTER_LINEAR in training;
#: ``"ultralytics"`` (Ultralytics 8.4) rounds them up (``ceil(w0 * r)``, at most ``imgsz``) and always
#: resizes with INTER_LINEAR. The augmentation recipe of the same name chooses it.
LoadRule = Literal["yolov9", "ultralytics"]
LOAD_RULES: tuple[str, ...] = get_args(LoadRule)


def check_load_rule(rule: str) -> LoadRule:
    """``rule`` when it is one of :data:`LOAD_RULES`, else ``ValueError`` naming them."""
    if rule not in LOAD_RULES:
        raise ValueError(f"the loaded-image rule must be one of {', '.join(LOAD_RULES)}, got {rule!r}")
    return rule  # type: ignore[return-value]


def shrink_filter(augment: bool, rule: LoadRule = "yolov9") -> ShrinkFilter:
    """The name (``"linear"`` / ``"area"``) of the filter ``rule``'s ``load_image`` shrinks with
    (YOLOv9: INTER_LINEAR in training, INTER_AREA in validation; Ultralytics: INTER_LINEAR always)."""
    return rule_shrink("linear" if augment else "area", rule)


def rule_shrink(shrink: ShrinkFilter, rule: LoadRule) -> ShrinkFilter:
    """The filter an image shrinks with under ``rule``: ``shrink`` for YOLOv9's, INTER_LINEAR for Ultralytics'."""
    return "linear" if check_load_rule(rule) == "ultralytics" else shrink


def loaded_shape(h0: int, w0: int, imgsz: int, rule: LoadRule = "yolov9") -> tuple[int, int]:
    """``(h, w)`` of the *loaded* image: long side ``imgsz``, aspect kept, unchanged when ``r == 1``.

    ``r = imgsz / max(h0, w0)``; ``rule="yolov9"``: YOLOv9's ``load_image`` sizes, ``int(h0 * r)`` and
    ``int(w0 * r)`` (truncated float64 products, as the official code computes them; at least 1);
    ``rule="ultralytics"``: Ultralytics 8.4's, ``ceil(h0 * r)`` and ``ceil(w0 * r)``, each at most ``imgsz``.
    """
    h0, w0 = int(h0), int(w0)
    if max(h0, w0) == imgsz:
        return h0, w0
    r = imgsz / max(h0, w0)
    if check_load_rule(rule) == "ultralytics":
        return min(math.ceil(h0 * r), imgsz), min(math.ceil(w0 * r), imgsz)
    return max(1, int(h0 * r)), max(1, int(w0 * r))


def loaded_shapes(hw: np.ndarray, imgsz: int, rule: LoadRule = "yolov9") -> np.ndarray:
    """:func:`loaded_shape` of every row of ``int [n, 2]`` (h0, w0) at once: ``int64 [n, 2]``, the same values
    (the same float64 products, truncated or rounded up)."""
    hw = np.asarray(hw, np.int64).reshape(-1, 2)
    long = np.maximum(hw[:, 0], hw[:, 1])
    np.maximum(long, 1, out=long)
    prod = hw * (imgsz / long)[:, None]  # in place from here: a million rows are read at every loader open
    if check_load_rule(rule) == "ultralytics":
        np.minimum(np.ceil(prod, out=prod), imgsz, out=prod)
    else:
        np.maximum(np.trunc(prod, out=prod), 1, out=prod)
    out = prod.astype(np.int64)
    same = long == imgsz
    out[same] = hw[same]
    return out


def resize_to(img: np.ndarray, hw: tuple[int, int], *, enlarge: bool | None = None,
              shrink: ShrinkFilter = "area") -> np.ndarray:
    """Resize to exactly ``hw``: INTER_LINEAR when enlarging, the ``shrink`` filter otherwise.

    ``shrink``: ``"area"`` (INTER_AREA, YOLOv9 validation) or ``"linear"`` (INTER_LINEAR, YOLOv9
    training, and Ultralytics always); see :func:`shrink_filter`.
    """
    h, w = hw
    if img.shape[0] == h and img.shape[1] == w:
        return img
    if enlarge is None:
        enlarge = h * w > img.shape[0] * img.shape[1]
    try:
        interp = cv2.INTER_LINEAR if enlarge else SHRINK_FILTERS[shrink]
    except KeyError:
        raise ValueError(f"shrink must be one of {', '.join(SHRINK_FILTERS)}, got {shrink!r}") from None
    return cv2.resize(img, (w, h), interpolation=interp)


def resize_long_side(img: np.ndarray, imgsz: int, *, shrink: ShrinkFilter = "area",
                     rule: LoadRule = "yolov9") -> np.ndarray:
    """Resize an original image to its loaded shape (see :func:`loaded_shape`); no-op when r == 1.
    ``rule="ultralytics"`` always resizes with INTER_LINEAR, whatever ``shrink`` says."""
    h0, w0 = img.shape[:2]
    if max(h0, w0) == imgsz:
        return img
    return resize_to(img, loaded_shape(h0, w0, imgsz, rule), enlarge=max(h0, w0) < imgsz, shrink=rule_shrink(shrink, rule))
