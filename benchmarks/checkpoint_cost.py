"""What one ``--save-period-steps`` checkpoint of ``python -m yolov9.train`` costs: seconds and bytes per save.

For each model config (80 classes), the trainer's state is built as it is after an optimizer step: model,
EMA, SGD with its momentum buffers, the generator states and a loader state. Then, in alternating rounds,
it is saved as the trainer does (``yolov9.checkpoint.save_checkpoint``: tensors copied to the CPU, written to
a temporary file, fsynced, renamed, the folder fsynced) and, beside it, with a plain ``torch.save`` of the
same dict to the same folder (what the atomic write adds is the difference). Medians over the rounds. The
training time lost to ``--save-period-steps N`` is one save per N optimizer steps.

    PYTHONPATH=$PWD python3 benchmarks/checkpoint_cost.py --cfg yolov9-t yolov9-s --rounds 5
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import fastload
from fastload.data.synthetic import make_synthetic_dataset
from yolov9.checkpoint import save_checkpoint
from yolov9.models.yolo import DetectionModel
from yolov9.torch_utils import ModelEMA, build_optimizer, rng_state


def trainer_state(cfg: str, loader_state: dict) -> dict:
    """The keywords of ``save_checkpoint`` for ``cfg`` after one SGD step (momentum buffers exist)."""
    model = DetectionModel(cfg, nc=80)
    ema = ModelEMA(model)
    optimizer = build_optimizer(model, "SGD", 0.01, 0.937, 5e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    ema.update(model)
    progress = {"epoch": 3, "batch": 812, "opt_steps": 4000, "last_opt_step": 7359, "mloss": [0.1, 0.2, 0.3],
                "loader": loader_state, "world_size": 1, "best_epoch": 2, "stale": 0, "multi_rng": None}
    return dict(model=model, ema=ema.ema, optimizer=optimizer, scaler=None, rng=[rng_state()],
                meta={"epoch": 2, "cfg": model.yaml, "nc": 80, "ema_updates": ema.updates, "progress": progress})


def plain_save(path: Path, kw: dict) -> None:
    """The same content as ``save_checkpoint``, written in place with ``torch.save`` and no fsync."""
    torch.save({"model": kw["model"].state_dict(), "ema": kw["ema"].state_dict(),
                "optimizer": kw["optimizer"].state_dict(), "scaler": None, "rng": kw["rng"], "meta": kw["meta"]}, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cfg", nargs="+", default=["yolov9-t", "yolov9-s"], help="model configs (bundled names)")
    ap.add_argument("--rounds", type=int, default=5, help="saves of each kind per model, alternating")
    ap.add_argument("--dir", default=None, help="folder to write to (default: a temporary folder under /tmp)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        data = make_synthetic_dataset(Path(tmp) / "data", n_train=8, n_val=1, nc=80, seed=0)
        with fastload.loader(data, imgsz=64, batch_size=2, workers=0) as loader:
            next(iter(loader))
            loader_state = loader.state_dict()
        print("| model | checkpoint MB | save_checkpoint s | torch.save in place s | ratio |")
        print("|---|---:|---:|---:|---:|")
        for cfg in args.cfg:
            kw = trainer_state(cfg, loader_state)
            atomic, plain = [], []
            path = Path(tmp) / "last.pt"
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                save_checkpoint(path, **kw)
                t1 = time.perf_counter()
                plain_save(Path(tmp) / "plain.pt", kw)
                t2 = time.perf_counter()
                atomic.append(t1 - t0)
                plain.append(t2 - t1)
            a, b = statistics.median(atomic), statistics.median(plain)
            print(f"| {cfg} | {path.stat().st_size / 1e6:.1f} | {a:.3f} | {b:.3f} | {a / b:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
