"""`fastload demo` runs end to end on the embedded synthetic dataset and leaves nothing in /dev/shm."""
from __future__ import annotations

import re
from pathlib import Path

import cv2

from fastload.cli import main


def test_demo_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--images", "24", "--imgsz", "256", "--batch", "8", "--batches", "2"]) == 0
    printed = capsys.readouterr().out
    rates = dict(re.findall(r"^\s+(files|lmdb|ram)\s+(\d+)\s", printed, flags=re.M))
    assert set(rates) == {"files", "lmdb", "ram"} and all(int(v) > 0 for v in rates.values())
    preview = cv2.imread(str(out / "preview.jpg"))
    assert preview is not None and preview.shape == (2 * 256, 4 * 256, 3)  # 8 images in a 4-column grid
    segment = re.search(r"ram store for train: (\S+)", printed).group(1)
    assert not Path(segment).exists(), "the demo must free its RAM store"
