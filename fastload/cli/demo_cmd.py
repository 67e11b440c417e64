"""``fastload demo``: the whole product on an embedded synthetic dataset, end to end, in about a minute.

Generates a synthetic YOLO dataset, converts it to an LMDB and a RAM store, loads augmented
YOLOv9 batches from the image files and from each store, prints a throughput table and saves a
preview of one batch with its boxes drawn.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

import fastload

STORES = ("files", "lmdb", "ram")


def register(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("demo", help=help_text, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("fastload_demo"), help="working folder (default: ./fastload_demo)")
    p.add_argument("--images", type=int, default=192, help="synthetic training images (default: 192)")
    p.add_argument("--imgsz", type=int, default=640, help="output image size (default: 640)")
    p.add_argument("--batch", type=int, default=32, help="batch size (default: 32)")
    p.add_argument("--workers", type=int, default=2, help="loader worker processes (default: 2)")
    p.add_argument("--batches", type=int, default=6, help="timed batches per store (default: 6)")
    p.add_argument("--keep-ram", action="store_true", help="leave the RAM store in /dev/shm afterwards")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # imported when the command runs: `fastload --help` stays light
    from fastload.data.synthetic import make_synthetic_dataset
    from fastload.store import shm
    from fastload.store.convert import convert

    out: Path = args.out
    print(f"[1/4] synthetic dataset: {args.images} train images -> {out / 'dataset'}")
    source_yaml = make_synthetic_dataset(out / "dataset", n_train=args.images, n_val=max(8, args.images // 8), seed=0)

    print("[2/4] converting to lmdb and ram stores")
    result = convert(source_yaml, to=("lmdb", "ram"), out=out / "stores", imgsz=args.imgsz, splits="train",
                     workers=args.workers)
    try:
        print(f"[3/4] loading augmented batches (batch {args.batch}, workers {args.workers}, imgsz {args.imgsz})")
        rows, preview_batch = [], None
        for store in STORES:
            rate, batch = measure(result.yaml_path, store, args)
            rows.append((store, rate))
            if preview_batch is None:
                preview_batch = batch
        _print_table(rows, args)
        preview = out / "preview.jpg"
        _save_preview(preview_batch, preview)
        print(f"[4/4] preview of one augmented batch with its boxes: {preview}")
    finally:
        ram_segment = result.stores.get("train", {}).get("ram")
        if ram_segment and not args.keep_ram:
            shm.remove(Path(ram_segment), force=True)
            print(f"removed the demo's RAM store {ram_segment} (--keep-ram keeps it)")
    return 0


def measure(data_yaml: Path, store: str, args: argparse.Namespace) -> tuple[float, tuple]:
    """Images/s of full scratch-high augmentation from one store, after one warm-up batch."""
    loader = fastload.loader(data_yaml, "train", imgsz=args.imgsz, batch_size=args.batch, store=store,
                             workers=args.workers, seed=0)
    try:
        batches = iter(loader)
        first = next(batches)
        first = (first[0].clone(), first[1].clone(), first[2], first[3])
        done, start = 0, time.perf_counter()
        for _ in range(args.batches):
            try:
                imgs = next(batches)[0]
            except StopIteration:  # the next epoch: iterating again reshuffles
                batches = iter(loader)
                imgs = next(batches)[0]
            done += imgs.shape[0]
        return done / (time.perf_counter() - start), first
    finally:
        loader.close()


def _print_table(rows: list[tuple[str, float]], args: argparse.Namespace) -> None:
    base = rows[0][1]
    print(f"\n  {'store':<8}{'images/s':>10}{'vs files':>10}")
    for store, rate in rows:
        print(f"  {store:<8}{rate:>10.0f}{rate / base:>9.2f}x")
    print(f"  (mosaic + mixup + HSV + flips, batch {args.batch}, {args.workers} workers; "
          f"`fastload bench` measures each stage)\n")


def _save_preview(batch: tuple, path: Path, columns: int = 4, max_images: int = 16) -> None:
    """Save up to ``max_images`` images of a YOLOv9 batch in a grid with their boxes and class ids drawn."""
    # imported when the command runs: `fastload --help` stays light
    import cv2

    imgs, targets = batch[0][:max_images], batch[1].numpy()
    n, _, h, w = imgs.shape
    rows = (n + columns - 1) // columns
    grid = np.full((rows * h, columns * w, 3), 255, np.uint8)
    for i in range(n):
        tile = np.ascontiguousarray(imgs[i].permute(1, 2, 0).numpy()[:, :, ::-1])  # RGB -> BGR for cv2
        for _, cls, xc, yc, bw, bh in targets[targets[:, 0] == i]:
            x0, y0 = int((xc - bw / 2) * w), int((yc - bh / 2) * h)
            x1, y1 = int((xc + bw / 2) * w), int((yc + bh / 2) * h)
            cv2.rectangle(tile, (x0, y0), (x1, y1), (0, 255, 0), 2)
            cv2.putText(tile, str(int(cls)), (x0 + 2, max(y0 - 3, 10)), cv2.FONT_HERSHEY_SIMPLEX, 0.5, (0, 255, 0), 1)
        r, c = divmod(i, columns)
        grid[r * h:(r + 1) * h, c * w:(c + 1) * w] = tile
    path.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(path), grid, [cv2.IMWRITE_JPEG_QUALITY, 85])
