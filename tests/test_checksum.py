"""The crc32 every store record and staged file carries: whichever implementation computes it (ISA-L when
installed, else zlib), the values are zlib's, so stores written with one read with the other."""
from __future__ import annotations

import zlib

import numpy as np

from fastload.data.checksum import crc32, record_checksum


def test_crc32_equals_zlib_on_buffers_and_continuations():
    rng = np.random.default_rng(0)
    for size in (0, 1, 7, 64, 4097, 640 * 480 * 3):
        data = rng.integers(0, 256, size, np.uint8).tobytes()
        assert crc32(data) == zlib.crc32(data)
        assert crc32(data, 12345) == zlib.crc32(data, 12345)
        half = size // 2
        assert crc32(data[half:], crc32(data[:half])) == zlib.crc32(data)


def test_record_checksum_covers_pixels_then_labels():
    pixels = np.arange(5 * 7 * 3, dtype=np.uint8).reshape(5, 7, 3)
    labels = np.array([[1, 0.5, 0.5, 0.2, 0.1]], np.float32)
    expected = zlib.crc32(labels.tobytes(), zlib.crc32(pixels.tobytes()))
    assert record_checksum(pixels, labels) == expected  # an array
    assert record_checksum(pixels.tobytes(), labels) == expected  # its bytes
    assert record_checksum(pixels[:, ::-1].copy(), labels) != expected  # other pixels
    assert record_checksum(pixels, labels + 1) != expected  # other labels
