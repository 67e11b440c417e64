"""Sanity benchmark: train a small YOLOv9 config on the synthetic shapes dataset on CPU and check it learns.

Writes a synthetic dataset (``fastload.data.synthetic``), trains with ``python -m yolov9.train``'s code path,
then reports the best validation mAP@0.5, the wall time, and the per-epoch data-wait fraction and images/s
from ``results.csv``. Exit status 1 when the best mAP@0.5 is below ``--target``.

    python benchmarks/train_synthetic.py                 # defaults: the stated sanity figure (a few CPU minutes)
    python benchmarks/train_synthetic.py --epochs 40 --target 0.8 --imgsz 192
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cfg", default="gelan-t.yaml", help="model config (bundled name or path)")
    p.add_argument("--width", type=float, default=0.5, help="width_multiple applied to --cfg")
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--imgsz", type=int, default=128)
    p.add_argument("--n-train", type=int, default=96)
    p.add_argument("--n-val", type=int, default=24)
    p.add_argument("--nc", type=int, default=3)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--target", type=float, default=0.5, help="required best mAP@0.5 on the val split")
    p.add_argument("--out", default=None, help="work folder (default: a temporary one)")
    p.add_argument("--seed", type=int, default=0, help="training seed (weights init, loader order and augmentation)")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the synthetic dataset")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (1 is fastest on a small, shared CPU; raise it on a free machine)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from fastload.data.synthetic import make_synthetic_dataset
    from yolov9.models import load_cfg
    from yolov9.train import parse_args as train_args
    from yolov9.train import train

    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="yolov9-synth-"))
    work.mkdir(parents=True, exist_ok=True)
    data = make_synthetic_dataset(work / "data", n_train=args.n_train, n_val=args.n_val, nc=args.nc,
                                  seed=args.data_seed)
    cfg = load_cfg(args.cfg)
    cfg["width_multiple"] = args.width
    cfg.pop("yaml_file", None)
    cfg_path = work / "model.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, default_flow_style=None))
    # scratch-high with a short warm-up and no mixup: the run is only a few hundred optimizer steps.
    hyp = {"warmup_epochs": 1.0, "mixup": 0.0, "scale": 0.5}
    hyp_path = work / "hyp.yaml"
    hyp_path.write_text(yaml.safe_dump(hyp))
    opt = train_args(["--data", str(data), "--cfg", str(cfg_path), "--hyp", str(hyp_path), "--epochs",
                      str(args.epochs), "--batch", str(args.batch), "--imgsz", str(args.imgsz), "--workers",
                      str(args.workers), "--device", args.device, "--project", str(work / "runs"), "--name", "synth",
                      "--accumulate", "1", "--close-mosaic", str(max(args.epochs // 4, 1)), "--seed", str(args.seed),
                      "--exist-ok"])
    t0 = time.perf_counter()
    train(opt)
    wall = time.perf_counter() - t0
    rows = list(csv.DictReader(open(work / "runs" / "synth" / "results.csv")))
    best = max(float(r["metrics/mAP_0.5"]) for r in rows)
    best95 = max(float(r["metrics/mAP_0.5:0.95"]) for r in rows)
    summary = {
        "cfg": args.cfg, "width": args.width, "epochs": args.epochs, "imgsz": args.imgsz, "batch": args.batch,
        "n_train": args.n_train, "n_val": args.n_val, "best_mAP50": round(best, 4), "best_mAP50_95": round(best95, 4),
        "wall_s": round(wall, 1), "target_mAP50": args.target,
        "data_wait_frac": [float(r["data_wait_frac"]) for r in rows],
        "images_per_s": [float(r["images_per_s"]) for r in rows],
        "run_dir": str(work / "runs" / "synth"),
    }
    print(json.dumps(summary, indent=1))
    ok = best >= args.target
    print(f"{'PASS' if ok else 'FAIL'}: best mAP@0.5 {best:.3f} (target {args.target}) in {wall:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
