"""Dataset description and scanning: data.yaml, YOLO labels, image decoding, the split index, synthetic data.

The public surface (see ``docs/design.md``)::

    cfg = load_data_config("coco128.yaml")         # DataConfig
    index = build_index(cfg, "train")               # DatasetIndex (cached, validated)
    img = read_image_file(index.im_files[0])        # RGB HWC uint8, EXIF applied
    img = resize_long_side(img, 640)                # the YOLOv9 "loaded" image
"""
from __future__ import annotations

from fastload.data.config import DataConfig, DataConfigError, load_data_config
from fastload.data.images import (
    CorruptImageError,
    decode_image,
    decode_image_reduced,
    decode_loaded,
    loaded_shape,
    probe_shape,
    read_image_file,
    resize_long_side,
)
from fastload.data.index import DatasetIndex, ScanReport, build_index
from fastload.data.labels import FlatLabels, ImageLabels, Problem, img2label_path, parse_labels, read_label_file
from fastload.data.synthetic import make_synthetic_dataset

__all__ = [
    "DataConfig",
    "DataConfigError",
    "load_data_config",
    "CorruptImageError",
    "decode_image",
    "decode_image_reduced",
    "decode_loaded",
    "loaded_shape",
    "probe_shape",
    "read_image_file",
    "resize_long_side",
    "DatasetIndex",
    "ScanReport",
    "build_index",
    "FlatLabels",
    "ImageLabels",
    "Problem",
    "img2label_path",
    "parse_labels",
    "read_label_file",
    "make_synthetic_dataset",
]
