"""``fastload demo``: the whole product on an embedded synthetic dataset, end to end, in about a minute.

Generates a synthetic YOLO dataset, converts it to an LMDB and a RAM store, loads augmented YOLOv9
batches the stock way (the official loader's algorithm) and with fastload from the image files and
from each store, prints images/s with each row's ratio to the stock row, and saves a preview of one
batch with its boxes and class names drawn.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

import fastload
from fastload.cli.errors import UsageError, image_size, whole

# (row, what it measures) in the order the table prints them; "stock" is the baseline of the ratios.
ROWS: tuple[tuple[str, str], ...] = (
    ("stock", "the official YOLOv9 loader's algorithm on the image files: every sample decodes the images it "
              "draws, pastes them on a 2s x 2s canvas, warps it, applies HSV; a fresh collate per batch"),
    ("files", "fastload on the same image files: each image decoded once, then reused from the decode cache"),
    ("lmdb", "fastload on the lmdb store: the same encoded images in one file, decoded once"),
    ("ram", "fastload on the ram store: images decoded at conversion, read from shared memory"),
)


def register(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("demo", help=help_text, description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--out", type=Path, default=Path("fastload_demo"), help="working folder (default: ./fastload_demo)")
    p.add_argument("--images", type=whole(2), default=192, help="synthetic training images (default: 192)")
    p.add_argument("--imgsz", type=image_size, default=640, help="output image size (default: 640)")
    p.add_argument("--batch", type=whole(1), default=32, help="batch size (default: 32)")
    p.add_argument("--workers", type=whole(0), default=2, help="loader worker processes of every row (default: 2)")
    p.add_argument("--keep-ram", action="store_true", help="leave the RAM store in /dev/shm afterwards")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # imported when the command runs: `fastload --help` stays light
    from fastload.data.synthetic import make_synthetic_dataset
    from fastload.store import shm
    from fastload.store.convert import convert

    if args.images < 2 * args.batch:
        raise UsageError(f"--images ({args.images}) must be at least two batches (--batch {args.batch}): "
                         f"epoch 1 is timed after one warm-up batch")
    out: Path = args.out
    print(f"[1/4] synthetic dataset: {args.images} train images -> {out / 'dataset'}")
    source_yaml = make_synthetic_dataset(out / "dataset", n_train=args.images, n_val=max(8, args.images // 8), seed=0)

    print("[2/4] converting to lmdb and ram stores")
    result = convert(source_yaml, to=("lmdb", "ram"), out=out / "stores", imgsz=args.imgsz, splits="train",
                     workers=args.workers)
    try:
        print(f"[3/4] loading augmented batches (batch {args.batch}, workers {args.workers}, imgsz {args.imgsz})")
        rates, preview_batch = {}, None
        for row, _ in ROWS:
            make = _stock(result.yaml_path, args) if row == "stock" else _fastload(result.yaml_path, row, args)
            rates[row], batch = measure(make)
            if row == "ram":
                preview_batch = batch
        print(format_table(rates, args))
        preview = out / "preview.jpg"
        save_preview(preview_batch, preview, _names(result.yaml_path))
        print(f"[4/4] preview of one augmented batch with its boxes: {preview}")
    finally:
        ram_segment = result.stores.get("train", {}).get("ram")
        if ram_segment and not args.keep_ram:
            shm.remove(Path(ram_segment), force=True)
            print(f"removed the demo's RAM store {ram_segment} (--keep-ram keeps it)")
    return 0


def _names(data_yaml: Path) -> list[str]:
    # imported when the command runs: `fastload --help` stays light
    from fastload.data.config import load_data_config

    return list(load_data_config(data_yaml).names)


def _fastload(data_yaml: Path, store: str, args: argparse.Namespace) -> Callable[[], Any]:
    return lambda: fastload.loader(data_yaml, "train", imgsz=args.imgsz, batch_size=args.batch, store=store,
                                   workers=args.workers, seed=0)


def _stock(data_yaml: Path, args: argparse.Namespace) -> Callable[[], Any]:
    # imported when the command runs: `fastload --help` stays light
    from fastload.bench.stock import StockDataset, stock_loader
    from fastload.data.images import loaded_shape
    from fastload.store import open_store

    def make() -> Any:
        with open_store(data_yaml, "train", kind="files") as files:
            loaded = np.array([loaded_shape(int(h), int(w), args.imgsz) for h, w in files.shapes], np.int64)
            dataset = StockDataset(files.im_files, files.labels, args.imgsz, None, loaded_shapes=loaded)
        return stock_loader(dataset, batch_size=args.batch, workers=args.workers)

    return make


def measure(make_loader: Callable[[], Iterable]) -> tuple[tuple[float, float], tuple]:
    """Images/s of one loader over epoch 1 after its first batch (worker start-up and the first batch in
    flight are left out, the same for every row) and over the whole of epoch 2; and that first batch."""
    loader = make_loader()
    try:
        batches = iter(loader)
        first = next(batches)
        first = (first[0].clone(), first[1].clone(), first[2], first[3])
        start, n1 = time.perf_counter(), 0
        for imgs, *_ in batches:
            n1 += imgs.shape[0]
        mid = time.perf_counter()
        n2 = sum(imgs.shape[0] for imgs, *_ in loader)  # iterating again is the next epoch
        end = time.perf_counter()
        return (n1 / (mid - start), n2 / (end - mid)), first
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()
        del loader  # a DataLoader's persistent workers stop with it


def format_table(rates: dict[str, tuple[float, float]], args: argparse.Namespace) -> str:
    """The images/s table with each row's ratio to the stock row, and one line per row saying what it measures."""
    base = rates["stock"]
    lines = [f"\n  {'loader':<8}{'epoch 1':>10}{'vs stock':>10}{'epoch 2':>10}{'vs stock':>10}"]
    for row, _ in ROWS:
        e1, e2 = rates[row]
        lines.append(f"  {row:<8}{e1:>10.0f}{e1 / base[0]:>9.2f}x{e2:>10.0f}{e2 / base[1]:>9.2f}x")
    lines.append(f"\n  images/s of scratch-high augmentation (mosaic, mixup, perspective warp, HSV, flips) at imgsz "
                 f"{args.imgsz}, batch {args.batch}, {args.workers} workers per row; epoch 1 after its first batch, "
                 f"epoch 2 whole:")
    lines += [f"  {row:<8}{what}" for row, what in ROWS]
    lines.append("  (`fastload bench DATA` measures each stage on your own data)\n")
    return "\n".join(lines)


def save_preview(batch: tuple, path: Path, names: list[str], columns: int = 4, max_images: int = 16) -> None:
    """Save up to ``max_images`` images of a YOLOv9 batch in a grid with their boxes and class names drawn."""
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
            label = names[int(cls)] if 0 <= int(cls) < len(names) else str(int(cls))
            cv2.rectangle(tile, (x0, y0), (x1, y1), (0, 255, 0), 2)
            (tw, th), base = cv2.getTextSize(label, cv2.FONT_HERSHEY_SIMPLEX, 0.5, 1)
            ty = max(y0, th + base + 2)  # the name sits on the box's top edge, inside the image
            cv2.rectangle(tile, (x0, ty - th - base - 2), (x0 + tw + 4, ty), (0, 255, 0), -1)
            cv2.putText(tile, label, (x0 + 2, ty - base - 1), cv2.FONT_HERSHEY_SIMPLEX, 0.5, (0, 0, 0), 1)
        r, c = divmod(i, columns)
        grid[r * h:(r + 1) * h, c * w:(c + 1) * w] = tile
    path.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(path), grid, [cv2.IMWRITE_JPEG_QUALITY, 85])
