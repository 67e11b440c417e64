"""fastload.data.synthetic and `fastload synth`: exact boxes, the file mix, determinism."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fastload.data.config import load_data_config
from fastload.data.images import read_image_file, sniff_format
from fastload.data.labels import parse_labels
from fastload.data.synthetic import FIXED_SIZES, class_names, make_synthetic_dataset


def _luma(img: np.ndarray) -> np.ndarray:
    return img.astype(np.float64) @ np.array([0.299, 0.587, 0.114])


def _pixel_boxes(labels: np.ndarray, h: int, w: int) -> np.ndarray:
    """Pixel-edge boxes x0, y0, x1, y1 (exclusive) from normalised YOLO rows."""
    xc, yc, bw, bh = labels[:, 1] * w, labels[:, 2] * h, labels[:, 3] * w, labels[:, 4] * h
    return np.round(np.stack([xc - bw / 2, yc - bh / 2, xc + bw / 2, yc + bh / 2], 1)).astype(int)


def test_boxes_are_the_exact_extent_of_the_shapes(synth_yaml):
    root = synth_yaml.parent
    checked = 0
    for split in ("train", "val"):
        for im in sorted((root / "images" / split).glob("*.png")):  # lossless: pixel-exact check
            img = read_image_file(im)
            h, w = img.shape[:2]
            y = _luma(img)
            labels = parse_labels((root / "labels" / split / f"{im.stem}.txt").read_text(), 3).labels
            for x0, y0, x1, y1 in _pixel_boxes(labels, h, w):
                assert 0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h
                ring = np.zeros((h, w), bool)
                ring[max(0, y0 - 1) : y1 + 1, max(0, x0 - 1) : x1 + 1] = True
                ring[y0:y1, x0:x1] = False
                bg = np.median(y[ring])
                assert np.abs(y[ring] - bg).max() < 35, f"{im.name}: shape pixels outside box {x0, y0, x1, y1}"
                for edge in (y[y0, x0:x1], y[y1 - 1, x0:x1], y[y0:y1, x0], y[y0:y1, x1 - 1]):
                    assert np.abs(edge - bg).max() > 45, f"{im.name}: box {x0, y0, x1, y1} edge touches no shape"
                checked += 1
    assert checked >= 10


def test_boxes_never_overlap(synth_yaml):
    for lf in sorted((synth_yaml.parent / "labels" / "train").glob("*.txt")):
        lab = parse_labels(lf.read_text(), 3).labels
        b = _pixel_boxes(lab, 1000, 1000)
        for i in range(len(b)):
            for j in range(i + 1, len(b)):
                ix = min(b[i, 2], b[j, 2]) - max(b[i, 0], b[j, 0])
                iy = min(b[i, 3], b[j, 3]) - max(b[i, 1], b[j, 1])
                assert ix <= 0 or iy <= 0, lf.name


def test_file_mix_sizes_and_yaml(synth_yaml):
    cfg = load_data_config(synth_yaml)
    assert cfg.names == ["square", "circle", "triangle"] and cfg.nc == 3
    train = sorted((synth_yaml.parent / "images" / "train").iterdir())
    assert len(train) == 24 and len(list((synth_yaml.parent / "images" / "val").iterdir())) == 8
    kinds = {"jpeg": 0, "png": 0, "gray": 0, "rgba": 0}
    for f in train:
        buf = f.read_bytes()
        fmt = sniff_format(buf)
        kinds[fmt] += 1
        if fmt == "png":
            color_type = buf[25]  # IHDR colour type: 0 gray, 2 RGB, 6 RGBA
            kinds["gray"] += color_type == 0
            kinds["rgba"] += color_type == 6
    assert kinds["jpeg"] > 0 and kinds["png"] > 0 and kinds["gray"] >= 2 and kinds["rgba"] >= 1
    shapes = [read_image_file(f).shape[:2] for f in train[: len(FIXED_SIZES)]]
    assert shapes == list(FIXED_SIZES)
    empties = [f for f in (synth_yaml.parent / "labels" / "train").glob("*.txt") if not f.read_text().strip()]
    assert 1 <= len(empties) <= 4


def test_deterministic_for_a_seed(tmp_path):
    def files(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    a = files(make_synthetic_dataset(tmp_path / "a", n_train=6, n_val=2, seed=5).parent)
    b = files(make_synthetic_dataset(tmp_path / "b", n_train=6, n_val=2, seed=5).parent)
    c = files(make_synthetic_dataset(tmp_path / "c", n_train=6, n_val=2, seed=6).parent)
    assert a == b and a != c


def test_more_classes_and_bad_arguments(tmp_path):
    assert class_names(5) == ["square", "circle", "triangle", "square1", "circle1"]
    y = make_synthetic_dataset(tmp_path / "d", n_train=12, n_val=0, nc=5, seed=0, min_size=32, max_size=64)
    cls = np.concatenate([parse_labels(f.read_text(), 5).labels[:, 0] for f in (y.parent / "labels" / "train").glob("*.txt")])
    assert cls.max() <= 4 and len(np.unique(cls)) >= 3
    with pytest.raises(ValueError):
        make_synthetic_dataset(tmp_path / "e", nc=0)


def test_cli_synth(tmp_path, capsys):
    import argparse

    from fastload.cli import synth_cmd

    parser = argparse.ArgumentParser(prog="fastload")
    synth_cmd.register(parser.add_subparsers(), "write a synthetic dataset")
    args = parser.parse_args(["synth", str(tmp_path / "cli"), "--n-train", "4", "--n-val", "2", "--nc", "2", "--seed", "1", "--max-size", "128"])
    rc = args.func(args)
    assert rc == 0 and "data.yaml" in capsys.readouterr().out
    cfg = load_data_config(tmp_path / "cli" / "data.yaml")
    assert cfg.nc == 2 and len(list((tmp_path / "cli" / "images" / "train").iterdir())) == 4


def test_synth_cli_plants_faults_that_the_index_reports(tmp_path, capsys):
    from fastload.cli import main
    from fastload.data.index import build_index

    assert main(["synth", str(tmp_path / "ds"), "--n-train", "4", "--n-val", "0", "--plant-faults"]) == 0
    assert capsys.readouterr().out.count("planted ") == 7
    report = build_index(tmp_path / "ds" / "data.yaml", "train", cache=False, progress=False).report
    assert report.corrupt == 2 and report.rows_dropped == 4
    assert len(report.problems) == 7
