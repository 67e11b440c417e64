"""`fastload demo` runs end to end on the embedded synthetic dataset, compares every row with the stock
algorithm, labels the preview's boxes with class names, and leaves nothing in /dev/shm."""
from __future__ import annotations

import re
from pathlib import Path

import cv2

from fastload.cli import main


def test_demo_runs_end_to_end(tmp_path, capsys, monkeypatch):
    drawn: list[str] = []
    put_text = cv2.putText
    monkeypatch.setattr(cv2, "putText", lambda img, text, *a, **k: (drawn.append(text), put_text(img, text, *a, **k))[1])
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--images", "16", "--imgsz", "128", "--batch", "4", "--workers", "1"]) == 0
    printed = capsys.readouterr().out
    rows = {m[0]: m[1:] for m in re.findall(r"^  (stock|files|lmdb|ram)\s+(\d+)\s+([\d.]+)x\s+(\d+)\s+([\d.]+)x$",
                                              printed, flags=re.M)}
    assert list(rows) == ["stock", "files", "lmdb", "ram"], printed
    assert rows["stock"][1] == rows["stock"][3] == "1.00"  # the baseline of the ratios
    for e1, r1, e2, r2 in rows.values():
        assert int(e1) > 0 and int(e2) > 0 and float(r1) > 0 and float(r2) > 0
    assert re.search(r"^  stock   the official YOLOv9 loader's algorithm", printed, flags=re.M)  # what the row is
    preview = cv2.imread(str(out / "preview.jpg"))
    assert preview is not None and preview.shape == (128, 4 * 128, 3)  # 4 images in a 4-column grid
    assert drawn and set(drawn) <= {"square", "circle", "triangle"}  # class names, not numbers
    segment = re.search(r"ram store for train: (\S+)", printed).group(1)
    assert not Path(segment).exists(), "the demo must free its RAM store"


def test_demo_needs_two_batches(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--images", "8", "--batch", "8"]) == 2
    assert "--images (8) must be at least two batches" in capsys.readouterr().err
