"""Dump what the official YOLOv9 loader produces, for tests/test_official_batches.py (run as a subprocess).

    python official_batches.py CHECKOUT IMAGES OUT

imports the official ``utils.dataloaders`` from CHECKOUT (a temporary copy) and writes, without pickle:

* ``val_<name>.npz`` + ``val_<name>.json``: every batch of the official validation loader
  (``create_dataloader(..., rect, pad)`` as val.py calls it, no augmentation) for each configuration in
  :data:`VAL_CONFIGS`: images (uint8 BCHW, RGB as the official loader returns them), targets, shapes
  flattened to ``[h0, w0, rh, rw, padw, padh]``; the JSON holds the paths.
* ``loaded_<imgsz>.npz`` + ``.json``: ``load_image(i)`` of the official *training* dataset
  (``augment=True``) for every image, converted to RGB, with its path.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

VAL_CONFIGS = {  # name: (imgsz, batch, rect, pad)
    "rect640": (640, 16, True, 0.5),
    "square640": (640, 16, False, 0.0),
    "rect256": (256, 16, True, 0.5),
}
TRAIN_SIZES = (640, 256)


def main(checkout: str, images: str, out: str) -> None:
    sys.path.insert(0, checkout)
    import yaml
    from utils.dataloaders import LoadImagesAndLabels, create_dataloader

    out_dir = Path(out)
    for name, (imgsz, batch, rect, pad) in VAL_CONFIGS.items():
        loader = create_dataloader(images, imgsz, batch, 32, False, pad=pad, rect=rect, workers=0, prefix="")[0]
        arrays, paths = {}, []
        for k, (im, targets, batch_paths, shapes) in enumerate(loader):
            arrays[f"imgs_{k}"] = im.numpy()
            arrays[f"targets_{k}"] = targets.numpy()
            arrays[f"shapes_{k}"] = np.array([[*s[0], *s[1][0], *s[1][1]] for s in shapes], np.float64)
            paths.append(list(batch_paths))
        np.savez(out_dir / f"val_{name}.npz", **arrays)
        (out_dir / f"val_{name}.json").write_text(json.dumps(paths))
    hyp = yaml.safe_load((Path(checkout) / "data" / "hyps" / "hyp.scratch-high.yaml").read_text())
    for imgsz in TRAIN_SIZES:
        ds = LoadImagesAndLabels(images, imgsz, 16, augment=True, hyp=hyp)
        arrays = {}
        for i in range(len(ds)):
            im, _, hw = ds.load_image(i)
            assert im.shape[:2] == hw
            arrays[f"img_{i}"] = np.ascontiguousarray(im[:, :, ::-1])  # BGR -> RGB
        np.savez(out_dir / f"loaded_{imgsz}.npz", **arrays)
        (out_dir / f"loaded_{imgsz}.json").write_text(json.dumps(list(ds.im_files)))


if __name__ == "__main__":
    main(*sys.argv[1:4])
