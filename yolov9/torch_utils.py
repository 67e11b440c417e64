"""Training helpers: device selection, seeding, parameter groups + optimiser, model EMA, LR schedules."""
from __future__ import annotations

import copy
import math
import os
import random
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn as nn

__all__ = ["select_device", "init_seeds", "rng_state", "set_rng_state", "de_parallel", "round_to_half_", "build_optimizer", "ModelEMA", "lr_lambda",
           "StepSettings", "TrainSchedule"]


def select_device(device: str | None = "", rank: int = -1) -> torch.device:
    """``''`` (CUDA if available, else CPU), ``'cpu'``, ``'0'``, ``'0,1'``, ``'cuda:1'``.

    Under DDP each process takes ``cuda:LOCAL_RANK``. A CUDA request on a machine without CUDA raises.
    """
    d = str(device or "").strip().lower().replace("cuda:", "")
    if d == "cpu":
        return torch.device("cpu")
    if d == "":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        ids = [0]
    else:
        try:
            ids = [int(x) for x in d.split(",") if x != ""]
        except ValueError:
            raise ValueError(f"--device {device!r}: expected 'cpu', '' or CUDA ids like '0' or '0,1'") from None
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device!r} asks for CUDA but torch.cuda.is_available() is False")
        if max(ids) >= torch.cuda.device_count():
            raise ValueError(f"--device {device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    local = int(os.environ.get("LOCAL_RANK", -1))
    idx = ids[local % len(ids)] if local >= 0 else ids[0]
    torch.cuda.set_device(idx)
    return torch.device("cuda", idx)


def init_seeds(seed: int = 0, deterministic: bool = False) -> None:
    """Seed python, numpy and torch (weights init, dropout); the loader has its own seeding."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def rng_state() -> dict:
    """This process's python, numpy, torch and CUDA generator states as tensors and plain values (what a
    ``torch.load(weights_only=True)`` checkpoint can hold; numpy's and python's tuples are not)."""
    version, mt, gauss_next = random.getstate()
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    return {"python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss_next": gauss_next},
            "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                      "cached_gaussian": float(cached_gaussian)},
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []}


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned (the CUDA states only where this process has initialised CUDA)."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state(("MT19937", npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_initialized():
        torch.cuda.set_rng_state_all(state["cuda"])


def de_parallel(model: nn.Module) -> nn.Module:
    """The bare model inside a DDP / DataParallel wrapper."""
    return model.module if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)) else model


@torch.no_grad()
def round_to_half_(model: nn.Module) -> nn.Module:
    """Round every floating-point parameter and buffer to fp16 precision, in place (they stay fp32).

    The official trainer does this once to a model it starts training (``model.half().float()``), after taking
    its EMA copy; doing the same gives a given seed the official starting point, bit for bit.
    """
    for t in [*model.parameters(), *model.buffers()]:
        if t.dtype.is_floating_point:
            t.copy_(t.half().float())
    return model


def build_optimizer(model: nn.Module, name: str = "SGD", lr: float = 0.01, momentum: float = 0.937,
                    decay: float = 5e-4) -> torch.optim.Optimizer:
    """Three parameter groups: 0 = biases (no decay), 1 = conv/linear weights (decay), 2 = norm weights (no decay).

    SGD is Nesterov; Adam/AdamW use ``betas=(momentum, 0.999)``.
    """
    biases, weights, norms = [], [], []
    norm_types = tuple(v for k, v in vars(nn).items() if "Norm" in k and isinstance(v, type))
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            if pname == "bias":
                biases.append(p)
            elif isinstance(module, norm_types):
                norms.append(p)
            else:
                weights.append(p)
    name_l = name.lower()
    if name_l == "sgd":
        opt = torch.optim.SGD(biases, lr=lr, momentum=momentum, nesterov=True)
    elif name_l == "adam":
        opt = torch.optim.Adam(biases, lr=lr, betas=(momentum, 0.999))
    elif name_l == "adamw":
        opt = torch.optim.AdamW(biases, lr=lr, betas=(momentum, 0.999), weight_decay=0.0)
    else:
        raise ValueError(f"--optimizer {name!r} is not supported (choose SGD, Adam or AdamW)")
    opt.add_param_group({"params": weights, "weight_decay": decay})
    opt.add_param_group({"params": norms, "weight_decay": 0.0})
    return opt


def lr_lambda(epochs: int, lrf: float, cosine: bool = False) -> Callable[[float], float]:
    """LR multiplier per epoch: linear from 1 to ``lrf`` or a half cosine from 1 to ``lrf``."""
    if cosine:
        return lambda x: ((1 - math.cos(x * math.pi / epochs)) / 2) * (lrf - 1) + 1
    return lambda x: max(1 - x / epochs, 0) * (1.0 - lrf) + lrf


@dataclass(frozen=True)
class StepSettings:
    """Optimiser settings for one batch: LR of each parameter group (biases, weights, norms), momentum,
    and how many batches' gradients are summed before the optimiser steps."""

    lrs: tuple[float, float, float]
    momentum: float
    accumulate: int


@dataclass(frozen=True)
class TrainSchedule:
    """YOLOv9's per-batch LR, momentum and accumulation, as a pure function of the batch and epoch index.

    Warm-up (the first ``max(round(warmup_epochs * batches_per_epoch), 100)`` batches): the bias LR falls
    linearly from ``warmup_bias_lr`` and the other LRs rise from 0, all towards ``lr0 * lf(epoch)``; momentum
    rises from ``warmup_momentum``; accumulation rises from 1 to ``nominal_batch / batch_size`` (rounded).

    After warm-up, epoch ``e`` runs at ``lr0 * lf(e - 1)``: the official trainer steps its ``LambdaLR`` at the end
    of each epoch from ``last_epoch = -1``, so the multiplier lags the epoch index by one. The rest of the
    epoch in which warm-up ends keeps the last warm-up LR, ``lr0 * lf(e)``. Being a pure function, the
    schedule needs no state in a checkpoint and resumes exactly.
    """

    epochs: int
    batches_per_epoch: int
    lr0: float
    lrf: float
    momentum: float
    warmup_epochs: float
    warmup_momentum: float
    warmup_bias_lr: float
    batch_size: int
    nominal_batch: int = 64
    accumulate: int | None = None  # None: max(round(nominal_batch / batch_size), 1)
    cosine: bool = False

    @classmethod
    def from_hyp(cls, hyp: dict, *, epochs: int, batches_per_epoch: int, batch_size: int, nominal_batch: int = 64,
                 accumulate: int | None = None, cosine: bool = False) -> "TrainSchedule":
        return cls(epochs=epochs, batches_per_epoch=batches_per_epoch, lr0=float(hyp["lr0"]), lrf=float(hyp["lrf"]),
                   momentum=float(hyp["momentum"]), warmup_epochs=float(hyp["warmup_epochs"]),
                   warmup_momentum=float(hyp["warmup_momentum"]), warmup_bias_lr=float(hyp["warmup_bias_lr"]),
                   batch_size=batch_size, nominal_batch=nominal_batch, accumulate=accumulate, cosine=cosine)

    @property
    def warmup_batches(self) -> int:
        return max(round(self.warmup_epochs * self.batches_per_epoch), 100)

    @property
    def steady_accumulate(self) -> int:
        """Batches per optimiser step after warm-up."""
        if self.accumulate is not None:
            return self.accumulate
        return max(round(self.nominal_batch / self.batch_size), 1)

    def lr_factor(self, epoch: float) -> float:
        return lr_lambda(self.epochs, self.lrf, self.cosine)(epoch)

    def at(self, ni: int, epoch: int) -> StepSettings:
        """Settings for batch ``ni`` (counted from the start of training), which belongs to ``epoch``."""
        nw = self.warmup_batches
        if ni <= nw:
            def ramp(start: float, end: float) -> float:
                return float(np.interp(ni, [0, nw], [start, end]))

            top = self.lr0 * self.lr_factor(epoch)
            rising = ramp(0.0, top)
            # The accumulation ramp ends at the unrounded nominal / batch ratio (or the explicit --accumulate).
            acc_end = self.accumulate if self.accumulate is not None else self.nominal_batch / self.batch_size
            return StepSettings((ramp(self.warmup_bias_lr, top), rising, rising),
                                ramp(self.warmup_momentum, self.momentum), max(1, round(ramp(1, acc_end))))
        warmup_epoch = nw // self.batches_per_epoch  # the epoch of the last warm-up batch
        factor = self.lr_factor(epoch if epoch == warmup_epoch else max(epoch - 1, 0))
        lr = self.lr0 * factor
        return StepSettings((lr, lr, lr), self.momentum, self.steady_accumulate)


class ModelEMA:
    """Exponential moving average of the weights (and BN buffers); decay ramps up as ``d * (1 - exp(-n / tau))``."""

    def __init__(self, model: nn.Module, decay: float = 0.9999, tau: float = 2000, updates: int = 0) -> None:
        self.ema = copy.deepcopy(de_parallel(model)).eval()
        self.updates = updates
        self.decay_fn = lambda n: decay * (1 - math.exp(-n / tau))
        for p in self.ema.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.updates += 1
        d = self.decay_fn(self.updates)
        msd = de_parallel(model).state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(d).add_(msd[k].detach(), alpha=1 - d)
