"""Each store kind's size on disk beside the rule docs/stores.md states for it (issue 36, item 4).

Converts one split of a dataset to lmdb, encoded and disk (``--imgsz``) in a temporary folder, and prints per
store the measured bytes, the bytes its rule predicts from the source files, and both per image and over the
source JPEG/PNG bytes:

* ``encoded``: the source bytes + a 24-byte index row (offset, length, crc) + labels and paths;
* ``lmdb``: each image in its own overflow pages, ``4096 * ceil((bytes + 16) / 4096)``, + about 0.4 KB of
  B-tree leaves, record and index per image (labels, path);
* ``disk``: ``3 * h * w`` of the loaded image (long side ``imgsz``, small images enlarged, as YOLOv9's
  ``load_image``) + labels and paths.

    python benchmarks/store_sizes.py ../shared/datasets/coco128/data.yaml --imgsz 640
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fastload.data.images import loaded_shape  # noqa: E402
from fastload.data.index import build_index  # noqa: E402
from fastload.store.lmdb_store import lmdb_bytes  # noqa: E402

PACKED_PER_IMAGE = 24  # a packed store's offset, length and crc per record


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def predicted(kind: str, im_bytes: np.ndarray, shapes: np.ndarray, imgsz: int, side: int) -> int:
    """What the rule of ``kind`` says the store's bytes are; ``side``: labels and paths (every store holds them)."""
    if kind == "encoded":
        return int(im_bytes.sum()) + PACKED_PER_IMAGE * len(im_bytes) + side
    if kind == "lmdb":  # the rule the converter checks free space with
        return lmdb_bytes(im_bytes) + side
    loaded = np.array([loaded_shape(int(h), int(w), imgsz) for h, w in shapes], np.int64).reshape(-1, 2)
    return int(3 * loaded.prod(1).sum()) + PACKED_PER_IMAGE * len(im_bytes) + side


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", type=Path)
    ap.add_argument("--split", default="train")
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--to", default="encoded,lmdb,disk")
    a = ap.parse_args(argv)
    index = build_index(a.data, a.split, progress=False)
    n = len(index)
    src = int(index.im_bytes.sum())
    side = int(index.labels.rows.nbytes) + sum(len(f) for f in index.im_files)
    print(f"{a.data} [{a.split}]: {n} images, {src / n:.0f} source bytes/image, imgsz {a.imgsz}")
    print(f"{'store':<8} {'measured B/img':>15} {'rule B/img':>11} {'error':>7} {'x source':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in a.to.split(","):
            subprocess.run([sys.executable, "-m", "fastload", "convert", str(a.data), "--to", kind, "--out", tmp,
                            "--split", a.split, "--imgsz", str(a.imgsz), "--no-progress", "--force"],
                           check=True, stdout=subprocess.DEVNULL, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
            store = Path(tmp) / yaml.safe_load((Path(tmp) / "data.yaml").read_text())["fastload"][a.split][kind]
            got = tree_bytes(store)
            rule = predicted(kind, index.im_bytes, index.shapes, a.imgsz, side)
            print(f"{kind:<8} {got / n:>15.0f} {rule / n:>11.0f} {100 * (rule - got) / got:>+6.1f}% {got / src:>8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
