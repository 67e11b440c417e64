"""Train a YOLOv9 / GELAN detector on fastload batches.

Single process::

    python -m yolov9.train --data data.yaml --cfg yolov9-s.yaml --hyp hyp.scratch-high.yaml --epochs 100 --batch 16

DDP (one process per GPU, or per CPU slot with gloo)::

    torchrun --nproc_per_node 2 -m yolov9.train --data data.yaml --cfg yolov9-s.yaml --batch 64 --device 0,1

Flags follow YOLOv9's ``train_dual.py``; additions: ``--loader cpu|gpu|dali``, ``--store``, ``--accumulate``,
``--amp/--no-amp``, ``--amp-dtype``, ``--save-period-steps``. Each epoch reports the data-wait fraction (time blocked on the loader /
step time), images/s and, on NVIDIA GPUs, mean NVML utilisation, in the progress bar and in ``results.csv``.

Preemption: SIGTERM or SIGINT (Ctrl-C) saves ``last.pt`` at the next optimizer step and exits with status
128 + the signal's number (143, 130) after one line naming the checkpoint and the ``--resume`` command; a
second signal stops at once. ``--save-period-steps N`` also saves it every N optimizer steps. ``--resume``
of a checkpoint taken mid-epoch continues at the batch after it (docs/training.md).
"""
from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from fastload.augment.params import PARTNERS
from fastload.cli.errors import OneLineParser, UsageError, add_debug_flag, run_reported

from .checkpoint import jsonable, read_checkpoint, save_checkpoint
from .loss import DetectionLoss
from .models.yolo import DetectionModel, resolve_cfg
from .throughput import GpuUtilSampler, StepTimer, fmt_util
from .torch_utils import (ModelEMA, TrainSchedule, build_optimizer, de_parallel, init_seeds, rng_state,
                          round_to_half_, select_device, set_rng_state)
from .val import evaluate, fitness, make_val_loader

__all__ = ["parse_args", "train", "main", "init_seed", "RESULTS_COLUMNS"]

LOG = logging.getLogger("yolov9.train")
NBS = 64  # nominal batch size: weight decay and the default accumulation are scaled to it
RESULTS_COLUMNS = [
    "epoch", "train/box_loss", "train/cls_loss", "train/dfl_loss", "metrics/precision", "metrics/recall",
    "metrics/mAP_0.5", "metrics/mAP_0.5:0.95", "val/box_loss", "val/cls_loss", "val/dfl_loss",
    "x/lr0", "x/lr1", "x/lr2", "data_wait_frac", "images_per_s", "gpu_util", "epoch_time_s",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The ``train_dual.py`` flags plus fastload's; unknown flags are an error (argparse)."""
    p = _parser()
    return _check_parsed(p, p.parse_args(argv))


def _parser() -> OneLineParser:
    p = OneLineParser(prog="python -m yolov9.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", default="", help="initial weights: a checkpoint from this trainer or a state_dict")
    p.add_argument("--cfg", default="", help="model config: a yaml path or a bundled name (yolov9-s, gelan-c, ...); "
                   "required unless --weights or --resume names a checkpoint of this trainer, which records it")
    p.add_argument("--data", required=True, help="data.yaml")
    p.add_argument("--hyp", default=None, help="hyp yaml (default: YOLOv9 hyp.scratch-high values)")
    p.add_argument("--epochs", type=int, default=None, help="total epochs (default 100; with --resume: extend to N)")
    p.add_argument("--batch-size", "--batch", dest="batch_size", type=int, default=16,
                   help="total batch size over all DDP processes")
    p.add_argument("--imgsz", "--img", "--img-size", dest="imgsz", type=int, default=640, help="train/val image size")
    p.add_argument("--rect", action="store_true", help="rectangular training batches (no mosaic, no shuffle)")
    p.add_argument("--resume", nargs="?", const=True, default=False, help="resume the latest run, or a given last.pt")
    p.add_argument("--nosave", action="store_true", help="only save the final checkpoint")
    p.add_argument("--noval", action="store_true", help="only validate after the final epoch")
    p.add_argument("--cache", nargs="?", const="ram", default=None, choices=("ram", "disk"),
                   help="use the ram/disk store written by `fastload convert` (same as --store ram|disk)")
    p.add_argument("--device", default="", help="cuda device(s), e.g. 0 or 0,1, or cpu")
    p.add_argument("--multi-scale", action="store_true",
                   help="resize each batch to a random size within +/- 50%% of --imgsz (a multiple of the stride)")
    p.add_argument("--single-cls", action="store_true", help="train all classes as one")
    p.add_argument("--optimizer", default="SGD", choices=("SGD", "Adam", "AdamW", "LION"), help="optimiser")
    p.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm under DDP (CUDA only)")
    p.add_argument("--workers", type=int, default=8, help="loader worker processes per DDP rank")
    p.add_argument("--project", default="runs/train")
    p.add_argument("--name", default="exp")
    p.add_argument("--exist-ok", action="store_true")
    p.add_argument("--cos-lr", action="store_true", help="cosine LR schedule")
    p.add_argument("--label-smoothing", type=float, default=0.0)
    p.add_argument("--patience", type=int, default=100, help="early stopping: epochs without improvement (0: off)")
    p.add_argument("--freeze", nargs="+", type=int, default=[0], help="freeze the first N layers, or layer indices")
    p.add_argument("--save-period", type=int, default=-1, help="also save epoch{N}.pt every N epochs")
    p.add_argument("--save-period-steps", type=int, default=None, metavar="N",
                   help="also save last.pt every N optimizer steps, for a mid-epoch --resume (default 0: off; "
                        "with --resume: the saved run's value)")
    p.add_argument("--seed", type=int, default=0, help="weights initialisation seed (and, by default, the data seed)")
    p.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--min-items", type=int, default=0, help="drop training images with fewer labels")
    p.add_argument("--close-mosaic", type=int, default=0, help="switch mosaic off for the last N epochs")
    # fastload additions
    p.add_argument("--loader", choices=("cpu", "gpu", "dali"), default="cpu", help="fastload augmentation engine")
    p.add_argument("--store", default=None, help="fastload store: auto, files, lmdb, encoded, disk, ram (default auto)")
    p.add_argument("--partners", choices=PARTNERS, default=None,
                   help="where mosaic partners are drawn from (fastload.loader's partners=; default: the loader's "
                        "plan, docs/augmentation.md)")
    p.add_argument("--data-seed", type=int, default=None,
                   help="seed of the epoch order and augmentation (default: --seed); the official trainer's data "
                        "stream does not depend on its --seed, so fix this to compare seeds as it does")
    p.add_argument("--accumulate", type=int, default=None, help="optimizer step every N batches "
                   "(default max(round(64 / batch), 1))")
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, default=True, help="mixed precision on CUDA")
    p.add_argument("--amp-dtype", choices=("fp16", "bf16"), default="fp16", help="autocast dtype on CUDA")
    add_debug_flag(p, top=True)
    return p


def _check_parsed(p: argparse.ArgumentParser, opt: argparse.Namespace) -> argparse.Namespace:
    if opt.optimizer == "LION":
        p.error("--optimizer LION is not implemented here; use SGD, Adam or AdamW")
    if opt.cache and opt.store and opt.store != opt.cache:
        p.error(f"--cache {opt.cache} contradicts --store {opt.store}")
    if opt.batch_size < 1 or opt.imgsz < 32:
        p.error("--batch-size must be >= 1 and --imgsz >= 32")
    if opt.accumulate is not None and opt.accumulate < 1:
        p.error("--accumulate must be >= 1")
    if opt.save_period_steps is not None and opt.save_period_steps < 0:
        p.error("--save-period-steps must be >= 0 (0: off)")
    if opt.save_period_steps and opt.nosave:
        p.error("--save-period-steps contradicts --nosave (only the final checkpoint)")
    return opt


def check_options(opt: argparse.Namespace) -> None:
    """Refuse, before anything is created, the options that cannot work here: UsageError (exit 2) for an
    option, DataConfigError / ValueError (exit 1) for a data or hyp file."""
    from fastload.augment.hyp import load_hyp
    from fastload.data.config import load_data_config

    if not opt.cfg and not opt.weights and not opt.resume:
        raise UsageError("--cfg is required: give a model yaml or a bundled name (yolov9-s, gelan-c, ...), "
                         "or --weights with a checkpoint of this trainer")
    if opt.cfg:
        try:
            resolve_cfg(opt.cfg)
        except FileNotFoundError as e:
            raise UsageError(f"--cfg: {e}") from None
    if opt.weights and not opt.resume and not Path(opt.weights).is_file():
        raise UsageError(f"--weights {opt.weights}: no such file")
    if opt.imgsz % 32:
        lo, hi = opt.imgsz // 32 * 32, (opt.imgsz // 32 + 1) * 32
        raise UsageError(f"--imgsz {opt.imgsz} is not a multiple of 32 (the models' largest stride); use "
                         + (f"{lo} or {hi}" if lo >= 32 else f"{hi}"))
    device = str(opt.device).strip().lower()
    if device not in ("", "cpu") and not torch.cuda.is_available():
        raise UsageError(f"--device {opt.device} asks for CUDA, but no CUDA GPU is visible here "
                         f"(torch.cuda.is_available() is False); use --device cpu or leave --device out")
    load_data_config(opt.data)
    load_hyp(opt.hyp)


def _remove_empty_run(opt: argparse.Namespace) -> None:
    """A run that failed before writing anything leaves no ``runs/train/expN`` behind."""
    save_dir = getattr(opt, "save_dir", None)
    if not save_dir or opt.resume or opt.exist_ok:
        return  # a resumed run's folder, or one that may have existed before, is never removed
    root = Path(save_dir)
    if root.is_dir() and not any(p.is_file() for p in root.rglob("*")):
        shutil.rmtree(root, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------
def _increment_path(path: Path, exist_ok: bool) -> Path:
    if exist_ok or not path.exists():
        return path
    for n in range(2, 10000):
        cand = path.with_name(f"{path.name}{n}")
        if not cand.exists():
            return cand
    raise RuntimeError(f"no free run directory next to {path}")


def _latest_last(project: Path) -> Path:
    runs = sorted(project.glob("**/last.pt"), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise FileNotFoundError(f"--resume: no last.pt found under {project}")
    return runs[-1]


class _Dist:
    """DDP process info from torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE)."""

    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", -1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", -1))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.enabled = self.rank >= 0 and self.world > 1

    @property
    def main(self) -> bool:
        return self.rank in (-1, 0)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def broadcast_obj(self, obj: Any) -> Any:
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_obj(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank (one entry in a single process)."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def max(self, value: int, device: torch.device) -> int:
        """The largest ``value`` of all ranks, on every rank (e.g. a signal one rank got: all stop at one step)."""
        if not self.enabled:
            return value
        box = torch.tensor([value], device=device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        return int(box.item())


class _StopRequest:
    """SIGTERM and SIGINT, while training, ask it to save and stop at the next optimizer step.

    The first one is recorded (``signum``) and the previous handlers come back, so that a second one acts
    as it would have (Ctrl-C: KeyboardInterrupt; SIGTERM: the process ends) for a run that must stop now.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopRequest:
        if threading.current_thread() is threading.main_thread():  # Python takes handlers there only
            self._previous = {s: signal.signal(s, self._record) for s in self.SIGNALS}
        return self

    def _record(self, signum: int, _frame: Any) -> None:
        self.signum = signum
        self._restore()

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # None: a handler set outside Python
        self._previous = {}

    def __exit__(self, *exc: object) -> None:
        self._restore()


def _check_resumable(path: Path, meta: dict, epochs: int, world: int) -> None:
    """Refuse, before anything is built, a resume with nothing left to train or with another number of
    processes in the middle of an epoch (each rank's share of the epoch's batches depends on it)."""
    progress = meta.get("progress") or {"epoch": int(meta["epoch"]) + 1, "batch": 0}
    if progress["epoch"] >= epochs:
        raise ValueError(f"{path}: training to {epochs} epochs is already finished "
                         f"(give --epochs N > {progress['epoch']} to extend it)")
    if progress["batch"] and progress["world_size"] != world:
        raise ValueError(f"{path}: saved in epoch {progress['epoch']} after batch {progress['batch']} by "
                         f"{progress['world_size']} process(es), resumed by {world}; continue that epoch with "
                         f"torchrun --nproc_per_node {progress['world_size']}")


def init_seed(seed: int, rank: int = -1) -> int:
    """The global seed a process starts from, as in the official trainer: ``--seed`` itself in a single process
    (rank -1), ``seed + 1 + rank`` under DDP. It decides the initial weights (DDP then broadcasts rank 0's)."""
    return seed + 1 + rank


def _freeze(model: nn.Module, freeze: list[int]) -> list[str]:
    layers = list(range(freeze[0])) if len(freeze) == 1 else list(freeze)
    prefixes = [f"model.{x}." for x in layers]
    frozen = []
    for k, v in model.named_parameters():
        if any(k.startswith(p) for p in prefixes):
            v.requires_grad_(False)
            frozen.append(k)
    return frozen


def _transfer(model: nn.Module, sd: dict[str, torch.Tensor]) -> int:
    """Load the tensors whose name and shape match (a different nc leaves the class convs fresh)."""
    own = model.state_dict()
    fit = {k: v for k, v in sd.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(fit, strict=False)
    return len(fit)


# ----------------------------------------------------------------------------------------------------------
def train(opt: argparse.Namespace) -> dict:
    """Run a training job; returns the last epoch's metrics and the run directory (on rank 0), and on every
    rank ``stopped_by``: the number of the signal that stopped it after saving ``last.pt`` (None: finished)."""
    with _StopRequest() as stop_request:
        return _train(opt, stop_request)


# The options a resumed run takes from its own command line when given (--epochs: to extend the run); every other
# option is the saved run's. _RESUME_OWN adds those the resume sets itself or that do not shape the run.
_RESUME_TAKES = ("device", "workers", "save_period_steps")
_RESUME_OWN = frozenset({*_RESUME_TAKES, "epochs", "resume", "weights", "project", "local_rank", "debug"})


def _refuse_other_options(opt: argparse.Namespace, saved: dict, last: Path) -> None:
    """A resume continues the saved run with its options: refuse a flag given with another value than the
    run's (it would be dropped). ``--data``, required on every command line, must name the run's file."""
    defaults = _parser()
    differ = []
    for key, value in sorted(vars(opt).items()):
        if key in _RESUME_OWN or key not in saved or value == saved[key]:
            continue
        if key == "data" and Path(value).resolve() == Path(saved[key]).resolve():
            continue
        if key != "data" and value == defaults.get_default(key):
            continue  # not given (or given as the default): the saved value applies
        differ.append(f"--{key.replace('_', '-')} {value} (the run's: {saved[key]})")
    if differ:
        raise ValueError(f"--resume {last} continues that run with its own options, and these differ: "
                         f"{'; '.join(differ)}. Drop them, or start a new run from its weights with --weights {last}")


def _train(opt: argparse.Namespace, stop_request: _StopRequest) -> dict:
    import fastload
    from fastload.augment.hyp import load_hyp
    from fastload.data.config import load_data_config
    from fastload.engines.factory import engine_class
    from fastload.store.factory import check_recorded

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ddp = _Dist()
    cli_epochs = opt.epochs
    resume_ckpt = None
    if opt.resume:
        last = Path(opt.resume) if isinstance(opt.resume, str) else _latest_last(Path(opt.project))
        resume_ckpt = read_checkpoint(last)
        saved = resume_ckpt["meta"].get("opt")
        if not saved:
            raise ValueError(f"{last}: no training options recorded, cannot resume")
        _refuse_other_options(opt, saved, last)
        keep = {k: getattr(opt, k) for k in _RESUME_TAKES if getattr(opt, k) is not None}
        opt = argparse.Namespace(**{**vars(opt), **saved, **keep})
        opt.resume, opt.weights, opt.save_dir = str(last), str(last), str(last.parent.parent)
        opt.epochs = cli_epochs if cli_epochs is not None else saved["epochs"]
        _check_resumable(last, resume_ckpt["meta"], opt.epochs, ddp.world)
    opt.epochs = 100 if opt.epochs is None else opt.epochs
    opt.save_period_steps = opt.save_period_steps or 0  # None: not given (and not recorded by older checkpoints)
    if not opt.cfg and not opt.weights:
        raise ValueError("give --cfg (a model yaml or bundled name) and/or --weights")

    device = select_device(opt.device) if not ddp.enabled else None
    if ddp.enabled:
        cuda = torch.cuda.is_available() and str(opt.device).lower() != "cpu"
        if cuda:
            torch.cuda.set_device(ddp.local_rank)
            device = torch.device("cuda", ddp.local_rank)
        else:
            device = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo")
        if opt.batch_size % ddp.world:
            raise ValueError(f"--batch-size {opt.batch_size} must be a multiple of WORLD_SIZE {ddp.world}")
    if opt.sync_bn and device.type != "cuda":
        raise ValueError("--sync-bn needs CUDA DDP (SyncBatchNorm has no CPU implementation)")
    cuda = device.type == "cuda"
    amp = bool(opt.amp) and cuda
    amp_dtype = torch.bfloat16 if opt.amp_dtype == "bf16" else torch.float16

    # Run directory (rank 0 decides, the others follow).
    if getattr(opt, "save_dir", None) and opt.resume:
        save_dir = Path(opt.save_dir)
    else:
        save_dir = _increment_path(Path(opt.project) / opt.name, opt.exist_ok) if ddp.main else None
        save_dir = Path(ddp.broadcast_obj(str(save_dir) if save_dir else None))
    opt.save_dir = str(save_dir)
    wdir = save_dir / "weights"
    if ddp.main:
        wdir.mkdir(parents=True, exist_ok=True)

    init_seeds(init_seed(opt.seed, ddp.rank))
    hyp = load_hyp(opt.hyp)
    hyp["label_smoothing"] = float(opt.label_smoothing)
    data_cfg = load_data_config(opt.data)
    # a store kind the yaml records none of fails here, not after the model is built (seconds for the larger ones):
    # the train split's, and the val split's where this rank validates
    store = opt.store or opt.cache or "auto"
    for split in ("train", "val") if ddp.main else ("train",):
        check_recorded(data_cfg, split, store)
    nc = 1 if opt.single_cls else int(data_cfg.nc)
    names = ["item"] if opt.single_cls else list(data_cfg.names)

    # Model.
    if opt.weights:
        ckpt = resume_ckpt or read_checkpoint(opt.weights)
        cfg = opt.cfg or ckpt["meta"].get("cfg")
        if not cfg:
            raise ValueError(f"{opt.weights}: no model config recorded; give --cfg")
        model = DetectionModel(cfg, nc=nc)
        n_loaded = _transfer(model, ckpt["model"])
        if ddp.main:
            LOG.info(f"transferred {n_loaded}/{len(model.state_dict())} tensors from {opt.weights}")
    else:
        ckpt = None
        model = DetectionModel(opt.cfg, nc=nc)
    model.names = names
    model.to(device)
    if opt.freeze != [0]:
        _freeze(model, opt.freeze)
    gs = max(int(model.stride.max()), 32)
    if opt.imgsz % gs:
        raise ValueError(f"--imgsz {opt.imgsz} must be a multiple of the max stride {gs}")

    # Optimiser: decay scaled to the effective batch, as YOLOv9 does.
    accumulate = opt.accumulate or max(round(NBS / opt.batch_size), 1)
    hyp["weight_decay"] = float(hyp["weight_decay"]) * opt.batch_size * accumulate / NBS
    optimizer = build_optimizer(model, opt.optimizer, hyp["lr0"], hyp["momentum"], hyp["weight_decay"])
    ema = ModelEMA(model) if ddp.main else None
    if resume_ckpt is None:
        round_to_half_(model)  # as the official trainer, after the EMA copy: the same seed, the same start
    scaler = torch.amp.GradScaler("cuda", enabled=amp and amp_dtype == torch.float16)

    best_fitness = 0.0
    # where the run continues: the epoch, the batches of it done, and what the loop carries from batch to batch
    progress = {"epoch": 0, "batch": 0, "opt_steps": 0, "last_opt_step": -1, "mloss": None, "loader": None,
                "world_size": ddp.world, "best_epoch": -1, "stale": 0, "multi_rng": None}
    if resume_ckpt is not None:
        meta = resume_ckpt["meta"]
        if resume_ckpt.get("optimizer"):
            optimizer.load_state_dict(resume_ckpt["optimizer"])
        if ema is not None and resume_ckpt.get("ema") is not None:
            ema.ema.load_state_dict(resume_ckpt["ema"])
            ema.updates = int(meta.get("ema_updates", 0))
        if resume_ckpt.get("scaler") and scaler.is_enabled():
            scaler.load_state_dict(resume_ckpt["scaler"])
        # a checkpoint of an older version records the finished epoch only: the next one starts afresh
        progress = meta.get("progress") or dict(progress, epoch=int(meta["epoch"]) + 1,
                                                opt_steps=int(meta.get("ema_updates", 0)))
        best_fitness = float(meta.get("best_fitness", 0.0))
    start_epoch = progress["epoch"]

    if ddp.enabled:
        if opt.sync_bn:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if cuda else None, output_device=device.index if cuda else None)

    # Data.
    per_rank = opt.batch_size // ddp.world
    train_loader = fastload.loader(
        opt.data, split="train", imgsz=opt.imgsz, batch_size=per_rank, hyp=hyp, augment=True, store=store,
        engine=opt.loader, **engine_class(opt.loader).renderer_keywords(opt.workers),  # workers, or Ray actors
        shuffle=True, rect=opt.rect, stride=gs, partners=opt.partners,
        seed=opt.seed if opt.data_seed is None else opt.data_seed,
        rank=ddp.rank, world_size=ddp.world, min_items=opt.min_items, single_cls=opt.single_cls,
        device=device if cuda else None,
        hsv_on="consumer" if cuda else None)  # None: the engine's default
    # the run's partners, as the loader planned them (saved with the options): a resume keeps them even where this
    # machine's decoded cache would plan otherwise
    opt.partners = train_loader.plan.partners
    val_loader = None
    if ddp.main:
        val_loader = make_val_loader(opt.data, opt.imgsz, max(per_rank * 2, 1), workers=min(opt.workers, 4),
                                     stride=gs, single_cls=opt.single_cls, store=store, engine=opt.loader,
                                     device=device)
    nb = len(train_loader)
    schedule = TrainSchedule.from_hyp(hyp, epochs=opt.epochs, batches_per_epoch=nb, batch_size=opt.batch_size,
                                      nominal_batch=NBS, accumulate=opt.accumulate, cosine=opt.cos_lr)
    loss_fn = DetectionLoss(de_parallel(model), hyp)
    timer = StepTimer()
    gpu = GpuUtilSampler(device.index if cuda else None)
    meta_base = {"cfg": de_parallel(model).yaml, "nc": nc, "names": names, "hyp": hyp,
                 "opt": {k: v for k, v in vars(opt).items() if k not in ("local_rank",)}}
    results: dict = {}
    csv_path = save_dir / "results.csv"
    if ddp.main and not csv_path.exists():
        with open(csv_path, "w", newline="") as f:
            csv.writer(f).writerow(RESULTS_COLUMNS)
    if ddp.main:
        LOG.info(f"{opt.cfg or opt.weights}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
                 f"{nb} batches/epoch x {per_rank} x {ddp.world} rank(s), accumulate {accumulate}, "
                 f"device {device}, AMP {'off' if not amp else opt.amp_dtype}, loader {opt.loader}, run {save_dir}")

    multi_rng = np.random.default_rng(opt.seed)
    if resume_ckpt is not None:
        if progress["loader"] is not None:  # mid-epoch: the loader hands out the batches after the saved one
            train_loader.load_state_dict(progress["loader"])
        if progress["multi_rng"] is not None:
            multi_rng.bit_generator.state = progress["multi_rng"]
        rngs = resume_ckpt.get("rng")
        if rngs and len(rngs) == ddp.world:  # another world size (at an epoch's end): each rank's seed stays
            set_rng_state(rngs[max(ddp.rank, 0)])
        LOG.info(f"resuming {opt.resume} at epoch {start_epoch}, batch {progress['batch']}/{nb}, optimizer step "
                 f"{progress['opt_steps']}, to {opt.epochs} epochs" + (f" (rank {ddp.rank})" if ddp.enabled else ""))
    opt_steps, last_opt_step = int(progress["opt_steps"]), int(progress["last_opt_step"])
    stale, best_epoch = int(progress["stale"]), int(progress["best_epoch"])
    last = wdir / "last.pt"

    def progress_at(epoch: int, batch: int, mloss: torch.Tensor) -> dict:
        """Where a checkpoint taken now continues: after ``batch`` batches of ``epoch``."""
        mid = 0 < batch  # a checkpoint at an epoch's start needs no loader state (and takes any world size)
        return {"epoch": epoch, "batch": batch, "opt_steps": opt_steps, "last_opt_step": last_opt_step,
                "mloss": mloss.tolist() if mid else None, "loader": train_loader.state_dict() if mid else None,
                "world_size": ddp.world, "best_epoch": best_epoch, "stale": stale,
                "multi_rng": multi_rng.bit_generator.state}

    def checkpoint(epoch_done: int, progress_now: dict, rngs: list[dict], **meta: Any) -> dict:
        """``save_checkpoint``'s keywords for the run as it is now (rank 0's: it holds the EMA)."""
        return dict(model=de_parallel(model), ema=ema.ema, optimizer=optimizer, rng=rngs,
                    scaler=scaler if scaler.is_enabled() else None,
                    meta=dict(meta_base, epoch=epoch_done, best_fitness=best_fitness, ema_updates=ema.updates,
                              progress=progress_now, **meta))

    stopped_by, stopped_at = 0, None  # a signal's number, and (epoch, batches of it done) where it saved and stopped
    try:
        for epoch in range(start_epoch, opt.epochs):
            first = progress["batch"] if epoch == start_epoch else 0  # batches of this epoch done before a resume
            t_epoch = time.perf_counter()
            model.train()
            train_loader.set_epoch(epoch)
            if opt.close_mosaic and epoch >= opt.epochs - opt.close_mosaic:
                train_loader.close_mosaic()  # idempotent; also right after a resume past the switch
            mloss = torch.tensor(progress["mloss"], device=device) if first else torch.zeros(3, device=device)
            timer.reset()
            gpu.start()
            optimizer.zero_grad()
            batches = timer.wrap(train_loader)
            if ddp.main:
                from tqdm import tqdm

                batches = tqdm(batches, total=nb, initial=first, bar_format="{l_bar}{bar:10}{r_bar}", file=sys.stderr)
            for i, (imgs, targets, _paths, _shapes) in enumerate(batches, start=first):
                ni = i + nb * epoch
                imgs = imgs.to(device, non_blocking=True).float().div_(255)
                targets = targets.to(device, non_blocking=True)
                step = schedule.at(ni, epoch)
                for g, lr in zip(optimizer.param_groups, step.lrs):
                    g["lr"] = lr
                    if "momentum" in g:  # SGD only: the official warm-up leaves Adam's betas alone
                        g["momentum"] = step.momentum
                if opt.multi_scale:
                    sz = int(multi_rng.uniform(opt.imgsz * 0.5, opt.imgsz * 1.5 + gs)) // gs * gs
                    sf = sz / max(imgs.shape[2:])
                    if sf != 1:
                        ns = [math.ceil(x * sf / gs) * gs for x in imgs.shape[2:]]
                        imgs = nn.functional.interpolate(imgs, size=ns, mode="bilinear", align_corners=False)
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp):
                    pred = model(imgs)
                loss, items = loss_fn(pred, targets)
                if ddp.enabled:
                    loss = loss * ddp.world  # DDP averages gradients over ranks
                scaler.scale(loss).backward()
                stepped = ni - last_opt_step >= step.accumulate
                if stepped:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad()
                    if ema is not None:
                        ema.update(model)
                    last_opt_step = ni
                    opt_steps += 1
                mloss = (mloss * i + items) / (i + 1)
                if ddp.main:
                    mem = f"{torch.cuda.memory_reserved(device) / 1e9:.3g}G" if cuda else "cpu"
                    batches.set_description(
                        f"{epoch}/{opt.epochs - 1} {mem} box {mloss[0]:.4f} cls {mloss[1]:.4f} dfl {mloss[2]:.4f} "
                        f"inst {targets.shape[0]} {imgs.shape[-1]} wait {100 * timer.wait_frac:.0f}% "
                        f"{timer.images_per_s * ddp.world:.1f} img/s gpu {fmt_util(gpu.current())}")
                # only after an optimizer step: no gradients are pending, so the checkpoint is the whole state
                if not stepped:
                    continue
                stopped_by = ddp.max(stop_request.signum or 0, device)
                if stopped_by or (opt.save_period_steps and opt_steps % opt.save_period_steps == 0):
                    rngs = ddp.gather_obj(rng_state())
                    if ddp.main:
                        save_checkpoint(last, **checkpoint(epoch - 1, progress_at(epoch, i + 1, mloss), rngs))
                        LOG.info(f"\nsaved {last} in epoch {epoch} after batch {i + 1}/{nb} (optimizer step {opt_steps})")
                if stopped_by:
                    stopped_at = (epoch, i + 1)
                    break
            if ddp.main:
                batches.close()
            util = gpu.stop()
            if stopped_at is not None:
                break
            lrs = [g["lr"] for g in optimizer.param_groups]
            final = epoch + 1 == opt.epochs
            stop, improved = False, False
            if ddp.main:
                if not opt.noval or final:
                    results = evaluate(ema.ema, val_loader, device, loss_fn=DetectionLoss(ema.ema, hyp),
                                       amp=amp, amp_dtype=amp_dtype, single_cls=opt.single_cls)
                else:
                    results = {"precision": 0.0, "recall": 0.0, "mAP50": 0.0, "mAP50-95": 0.0,
                               "box_loss": 0.0, "cls_loss": 0.0, "dfl_loss": 0.0}
                fi = fitness(results)
                if fi > best_fitness or best_epoch < 0:
                    best_fitness, best_epoch, stale = max(fi, best_fitness), epoch, 0
                    improved = True
                else:
                    stale += 1
                row = [epoch, *mloss.tolist(), results["precision"], results["recall"], results["mAP50"],
                       results["mAP50-95"], results["box_loss"], results["cls_loss"], results["dfl_loss"], *lrs,
                       round(timer.wait_frac, 4), round(timer.images_per_s * ddp.world, 2),
                       "n/a" if util is None else round(util, 1), round(time.perf_counter() - t_epoch, 2)]
                with open(csv_path, "a", newline="") as f:
                    csv.writer(f).writerow([f"{v:.6g}" if isinstance(v, float) else v for v in row])
                LOG.info(f"epoch {epoch}: P {results['precision']:.3f} R {results['recall']:.3f} "
                         f"mAP50 {results['mAP50']:.3f} mAP50-95 {results['mAP50-95']:.3f} | data wait "
                         f"{100 * timer.wait_frac:.1f}% | {timer.images_per_s * ddp.world:.1f} img/s | "
                         f"GPU util {fmt_util(util)}")
            stopped_by = ddp.max(stop_request.signum or 0, device)  # one since the last step (during validation, say)
            rngs = ddp.gather_obj(rng_state())
            if ddp.main:
                if not opt.nosave or final or stopped_by:
                    kw = checkpoint(epoch, progress_at(epoch + 1, 0, mloss), rngs, results=results)
                    save_checkpoint(last, **kw)
                    if improved:
                        save_checkpoint(wdir / "best.pt", **kw)
                    if opt.save_period > 0 and (epoch + 1) % opt.save_period == 0:
                        save_checkpoint(wdir / f"epoch{epoch}.pt", **kw)
                stop = opt.patience > 0 and stale >= opt.patience
                if stop:
                    LOG.info(f"early stop: no improvement for {opt.patience} epochs (best epoch {best_epoch})")
            if stopped_by and not final:
                stopped_at = (epoch + 1, 0)
                break
            if ddp.broadcast_obj(stop):
                break
    finally:
        train_loader.close()
        if val_loader is not None:
            val_loader.close()
        if ddp.enabled and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    if ddp.main:
        results = dict(results, save_dir=str(save_dir))
        with open(save_dir / "opt.json", "w") as f:
            json.dump(jsonable(vars(opt)), f, indent=1)
        if stopped_at is not None:
            epoch, batch = stopped_at
            where = f"in epoch {epoch} after batch {batch}/{nb}" if batch else f"at the end of epoch {epoch - 1}"
            launcher = f"torchrun --nproc_per_node {ddp.world} -m yolov9.train" if ddp.enabled else "python -m yolov9.train"
            LOG.info(f"stopped by {signal.Signals(stopped_by).name}: saved {last} {where}; continue with: "
                     f"{launcher} --data {opt.data} --resume {last}")
    return dict(results, stopped_by=stopped_by if stopped_at is not None else None)


def main(argv: list[str] | None = None) -> int:
    """The command line: one stderr line and exit 1 (2 for an option) on failure, the traceback with --debug;
    128 + N when signal N stopped the run after saving a checkpoint to resume."""
    opt = parse_args(argv)

    def checked_train() -> int:
        check_options(opt)
        try:
            stopped_by = train(opt)["stopped_by"]
        except BaseException:
            _remove_empty_run(opt)
            raise
        return 128 + stopped_by if stopped_by else 0

    return run_reported("yolov9.train", checked_train, debug=opt.debug)


if __name__ == "__main__":
    sys.exit(main())
