"""fastload.data.images: format sniffing, decoding to RGB uint8, EXIF orientation, corrupt input, loaded shapes."""
from __future__ import annotations

import io

import cv2
import numpy as np
import pytest
from PIL import Image, ImageOps

from fastload.data.images import (
    CorruptImageError,
    decode_image,
    decode_image_reduced,
    decode_loaded,
    jpeg_is_complete,
    loaded_shape,
    loaded_shapes,
    probe_shape,
    read_image_file,
    resize_long_side,
    shrink_filter,
    sniff_format,
)


def _quadrants(h: int = 60, w: int = 100) -> np.ndarray:
    """An asymmetric RGB image: four flat colours, so any wrong flip/rotation shows."""
    img = np.zeros((h, w, 3), np.uint8)
    img[: h // 2, : w // 2] = (230, 30, 30)
    img[: h // 2, w // 2 :] = (30, 230, 30)
    img[h // 2 :, : w // 2] = (30, 30, 230)
    img[h // 2 :, w // 2 :] = (230, 230, 30)
    return img


def _encode(img: np.ndarray, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    Image.fromarray(img).save(out, format=fmt, **kw)
    return out.getvalue()


@pytest.mark.parametrize(
    "fmt,name", [("JPEG", "jpeg"), ("PNG", "png"), ("BMP", "bmp"), ("TIFF", "tiff"), ("WEBP", "webp"), ("GIF", "gif")]
)
def test_every_format_decodes_to_rgb_uint8_and_probes(fmt, name):
    img = _quadrants()
    buf = _encode(img, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    assert sniff_format(buf) == name
    out = decode_image(buf)
    assert out.dtype == np.uint8 and out.shape == (60, 100, 3) and out.flags.c_contiguous
    assert probe_shape(buf) == (60, 100)
    diff = np.abs(out.astype(int) - img)
    if fmt == "JPEG":  # lossy, chroma subsampled at the colour edges
        assert diff.mean() < 5
    else:
        assert diff.max() == 0


def test_gray_rgba_and_16bit_png_become_rgb8():
    gray = np.tile(np.arange(50, dtype=np.uint8)[None] * 5, (20, 1))
    out = decode_image(cv2.imencode(".png", gray)[1].tobytes())
    assert out.shape == (20, 50, 3) and (out == gray[..., None]).all()

    rgba = np.dstack([_quadrants(), np.full((60, 100), 7, np.uint8)])
    out = decode_image(_encode(rgba, "PNG"))
    assert out.shape == (60, 100, 3) and (out == _quadrants()).all()

    g16 = (np.arange(40, dtype=np.uint16)[None].repeat(10, 0) * 1600).astype(np.uint16)
    out = decode_image(cv2.imencode(".png", g16)[1].tobytes())
    assert out.dtype == np.uint8 and out.shape == (10, 40, 3)
    assert np.abs(out[..., 0].astype(int) - np.round(g16 / 257.0)).max() <= 1


@pytest.mark.parametrize("orientation", range(1, 9))
def test_jpeg_exif_orientation_matches_pil_exif_transpose(orientation):
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = _encode(_quadrants(), "JPEG", exif=exif.tobytes(), quality=95)
    expected = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(buf))).convert("RGB"))
    out = decode_image(buf)
    assert out.shape == expected.shape
    assert probe_shape(buf) == expected.shape[:2]
    assert np.abs(out.astype(int) - expected).mean() < 3  # libjpeg builds differ by rounding only


def test_png_exif_orientation_is_applied():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 clockwise
    buf = _encode(_quadrants(), "PNG", exif=exif.tobytes())
    out = decode_image(buf)
    assert out.shape == (100, 60, 3) and probe_shape(buf) == (100, 60)
    assert (out == cv2.rotate(_quadrants(), cv2.ROTATE_90_CLOCKWISE)).all()


def test_corrupt_inputs_raise_with_the_path():
    good = _encode(_quadrants(), "JPEG")
    cases = {
        "empty": b"",
        "garbage": b"not an image at all",
        "truncated_jpeg": good[: len(good) // 2],
        "truncated_png": _encode(_quadrants(), "PNG")[:60],
    }
    for name, buf in cases.items():
        with pytest.raises(CorruptImageError) as err:
            decode_image(buf, f"/data/{name}.img")
        assert f"/data/{name}.img" in str(err.value) and err.value.reason


def test_jpeg_trailer_after_eoi_is_accepted_and_truncation_is_detected():
    good = _encode(_quadrants(), "JPEG")
    assert jpeg_is_complete(good) and jpeg_is_complete(good + b"\x00" * 300 + b"TRAILER")
    assert not jpeg_is_complete(good[:-2])
    assert decode_image(good + b"TRAILER").shape == (60, 100, 3)


def test_read_image_file_names_the_file(tmp_path):
    p = tmp_path / "zero.jpg"
    p.write_bytes(b"")
    with pytest.raises(CorruptImageError, match="zero.jpg"):
        read_image_file(p)
    with pytest.raises(CorruptImageError, match="nope.jpg"):
        read_image_file(tmp_path / "nope.jpg")


@pytest.mark.parametrize(
    "h0,w0,imgsz,expected",
    [(480, 640, 640, (480, 640)), (480, 640, 320, (240, 320)), (313, 97, 640, (640, 198)), (97, 313, 64, (19, 64)),
     (1, 1000, 640, (1, 640)), (333, 333, 640, (640, 640)),
     # YOLOv9 truncates int(w0 * r): 302x500 -> 386x640 (rounding gave 387), and 77 * (640 / 77) is
     # 639.999... in float64, so that long side becomes 639 in the official loader too
     (302, 500, 640, (386, 640)), (77, 50, 640, (639, 415))],
)
def test_loaded_shape(h0, w0, imgsz, expected):
    assert loaded_shape(h0, w0, imgsz) == expected


@pytest.mark.parametrize(
    "h0,w0,imgsz,expected",
    # Ultralytics rounds up (ceil(w0 * r), at most imgsz): 302x500 -> 387x640 where YOLOv9 gives 386x640
    [(480, 640, 320, (240, 320)), (302, 500, 640, (387, 640)), (77, 50, 640, (640, 416)), (97, 313, 64, (20, 64)),
     (480, 640, 640, (480, 640)), (1, 1000, 640, (1, 640))],
)
def test_loaded_shape_of_ultralytics_rule(h0, w0, imgsz, expected):
    assert loaded_shape(h0, w0, imgsz, "ultralytics") == expected


def test_ultralytics_rule_resizes_with_inter_linear_and_unknown_rule_is_refused():
    img = _quadrants(313, 97)
    down = resize_long_side(img, 100, rule="ultralytics")  # INTER_LINEAR even where YOLOv9 validation uses INTER_AREA
    assert down.shape[:2] == loaded_shape(313, 97, 100, "ultralytics") == (100, 31)
    assert (down == cv2.resize(img, (31, 100), interpolation=cv2.INTER_LINEAR)).all()
    assert shrink_filter(False, "ultralytics") == "linear" and shrink_filter(False) == "area"
    with pytest.raises(ValueError, match="loaded-image rule must be one of yolov9, ultralytics"):
        loaded_shape(313, 97, 100, "v5")


@pytest.mark.parametrize("rule", ["yolov9", "ultralytics"])
def test_loaded_shapes_equal_loaded_shape_of_every_row(rule):
    """The array form plans every image of a large dataset at once: the sizes of the scalar rule, row by row
    (sizes that truncate or round differently, long sides at, below and above imgsz, 1-pixel sides)."""
    rng = np.random.default_rng(5)
    shapes = np.concatenate([rng.integers(1, 4000, (3000, 2)), rng.integers(90, 170, (1000, 2)),
                             [[640, 640], [640, 1], [1, 640], [1, 1], [641, 3], [3, 641], [639, 639], [720, 1280]]])
    for imgsz in (32, 160, 640, 1280):
        expected = [loaded_shape(int(h), int(w), imgsz, rule) for h, w in shapes]
        assert loaded_shapes(shapes, imgsz, rule).tolist() == [list(hw) for hw in expected]
    assert loaded_shapes(np.zeros((0, 2), np.int64), 640, rule).shape == (0, 2)  # an empty split
    with pytest.raises(ValueError, match="loaded-image rule must be one of"):
        loaded_shapes(shapes, 640, "v5")


def test_resize_long_side_follows_loaded_shape_and_interpolation():
    img = _quadrants(313, 97)
    assert resize_long_side(img, 313) is img  # r == 1: untouched
    up = resize_long_side(img, 640)
    assert up.shape[:2] == loaded_shape(313, 97, 640)
    assert (up == cv2.resize(img, (up.shape[1], up.shape[0]), interpolation=cv2.INTER_LINEAR)).all()
    down = resize_long_side(img, 100)
    assert down.shape[:2] == loaded_shape(313, 97, 100)
    assert (down == cv2.resize(img, (down.shape[1], down.shape[0]), interpolation=cv2.INTER_AREA)).all()
    # YOLOv9 training (augment=True) shrinks with INTER_LINEAR
    down_train = resize_long_side(img, 100, shrink=shrink_filter(True))
    assert (down_train == cv2.resize(img, (down.shape[1], down.shape[0]), interpolation=cv2.INTER_LINEAR)).all()
    assert not (down_train == down).all()
    with pytest.raises(ValueError, match="shrink"):
        resize_long_side(img, 100, shrink="cubic")


def test_reduced_decode_keeps_enough_pixels_and_loaded_shape_is_exact():
    rng = np.random.default_rng(0)
    big = cv2.resize(rng.integers(0, 255, (90, 160, 3), dtype=np.uint8), (1280, 720), interpolation=cv2.INTER_CUBIC)
    buf = _encode(big, "JPEG", quality=90)
    red = decode_image_reduced(buf, 320)
    assert 320 <= max(red.shape[:2]) < 1280 and red.shape[2] == 3
    full = resize_long_side(decode_image(buf), 320)
    fast = decode_loaded(buf, 320)
    assert fast.shape == full.shape == (*loaded_shape(720, 1280, 320), 3)
    assert np.abs(fast.astype(int) - full).mean() < 4
    # not a JPEG, or small: same as a full decode
    assert decode_image_reduced(_encode(big, "PNG"), 320).shape == (720, 1280, 3)
    assert decode_image_reduced(buf, 1000).shape == (720, 1280, 3)


def test_buffer_types_and_decoder_choice():
    from fastload.data import images

    img = np.random.default_rng(1).integers(0, 255, (48, 64, 3), dtype=np.uint8)
    buf = _encode(img, "JPEG", quality=95)
    ref = decode_image(buf)
    assert (decode_image(memoryview(buf)) == ref).all()
    assert (decode_image(np.frombuffer(buf, np.uint8)) == ref).all()
    assert probe_shape(bytearray(buf)) == (48, 64)
    try:
        for name in ("torchvision", "pil"):
            images.set_jpeg_decoder(name)
            out = decode_image(buf)
            assert out.shape == ref.shape and out.dtype == np.uint8 and out.flags.c_contiguous
            assert np.abs(out.astype(int) - ref).mean() < 2
            with pytest.raises(CorruptImageError):
                decode_image(buf[: len(buf) // 2])
        with pytest.raises(ValueError):
            images.set_jpeg_decoder("nope")
    finally:
        images.set_jpeg_decoder(None)


def test_jpeg_decoder_environment_is_read_when_used(monkeypatch):
    from fastload.data import images

    monkeypatch.setenv("FASTLOAD_JPEG_DECODER", "pil")
    assert images.jpeg_decoder() == "pil"  # after import: read on use
    images.set_jpeg_decoder("cv2")
    try:
        assert images.jpeg_decoder() == "cv2"  # an explicit choice comes first
    finally:
        images.set_jpeg_decoder(None)
    monkeypatch.setenv("FASTLOAD_JPEG_DECODER", "nvjpeg")
    with pytest.raises(ValueError, match="FASTLOAD_JPEG_DECODER='nvjpeg'"):
        images.jpeg_decoder()
