"""Runs inside a process that has a copy of the official YOLOv9 code on ``sys.path`` (see ``official.py``).

It is our own script: it imports the official modules and calls them, the way a user's script would. The
official checkpoints are pickles, so they are opened only here, by torch's weights-only unpickler with the
official, torch and standard-library classes they name allowed (``_read_official``); everything this script writes is a dict of
plain tensors, strings and numbers that the project reads back with ``torch.load(weights_only=True)``.

Commands (``--root`` is the official copy):

* ``init CFG NC SEED OUT``: the model the official trainer starts from with ``--seed SEED`` (its seeding, its
  ``Model``, its fp16 rounding), as ``{"state": state_dict, "groups": [[param names] x 3]}`` with the
  parameter groups of its ``smart_optimizer`` (biases, decayed weights, norm weights).
* ``loss CFG NC WEIGHTS BATCH HYP OUT``: ``ComputeLoss`` (``utils.loss_tal`` or ``loss_tal_dual`` by the head) of
  the model with WEIGHTS (a state_dict, or the output of ``init``) on BATCH (``{"imgs", "targets"}``) with the hyp yaml, in train mode;
  writes ``{"loss", "items", "grad_norms"}``.
* ``metrics IN OUT``: ``process_batch`` of ``val.py`` and ``ap_per_class`` on per-image predictions and labels
  (``{"preds": [[n, 6]], "labels": [[m, 5] (cls, x1, y1, x2, y2)]}``), aggregated as ``val.py`` does; writes
  ``{"precision", "recall", "mAP50", "mAP50-95"}``.
* ``valbatches IMAGES IMGSZ BATCH PROBE OUT``: the batches of the official validation loader (``create_dataloader``
  with ``pad=0.5, rect=True`` as ``val.py`` builds it) for the images folder IMAGES, and what ``val.py`` makes of
  them: per image the labels and the PROBE boxes (``[n, 4]`` xyxy in the letterboxed input) mapped back to
  original pixels by its ``scale_boxes``.
* ``val SCRIPT WEIGHTS DATA IMGSZ BATCH WORKERS SAVE_DIR OUT``: the official ``val.py`` or ``val_dual.py``
  (SCRIPT) on an official checkpoint, on CPU without plots, as its command line runs it; writes its P, R,
  mAP50, mAP50-95 at full precision (its printed table has three digits).
* ``jobs FILE``: several of these commands in this one process (FILE: a JSON list of argument lists), which
  saves a start-up per command.
* ``export CKPT OUT``: an official checkpoint (EMA if present, else model) -> the project's checkpoint layout
  (``{"model": state_dict, "meta": {"cfg", "nc", "names"}}``, fp32).
* ``import WEIGHTS CFG OUT``: a project checkpoint or state_dict -> an official checkpoint (``{"model": Model}``,
  fp32) that ``val.py`` / ``val_dual.py`` load.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys

import numpy as np
import torch
import yaml


def _model(cfg: str, nc: int):
    from models.yolo import Model  # official code: on sys.path from main()

    return Model(cfg, ch=3, nc=nc)


def _read_plain(path: str) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def cmd_init(a: argparse.Namespace) -> None:
    from utils.general import init_seeds  # official code: on sys.path from main()
    from utils.torch_utils import smart_optimizer  # official code: on sys.path from main()

    init_seeds(a.seed + 1 - 1, deterministic=True)  # train.py: opt.seed + 1 + RANK, RANK -1 in one process
    model = _model(a.cfg, a.nc)
    model.half().float()  # train.py does this once before training (not on resume)
    names = {id(p): n for n, p in model.named_parameters()}
    opt = smart_optimizer(model, "SGD", 0.01, 0.937, 5e-4)
    groups = [[names[id(p)] for p in g["params"]] for g in opt.param_groups]
    torch.save({"state": {k: v.clone() for k, v in model.state_dict().items()}, "groups": groups}, a.out)


def cmd_loss(a: argparse.Namespace) -> None:
    model = _model(a.cfg, a.nc)
    weights = _read_plain(a.weights)
    model.load_state_dict(weights.get("state", weights), strict=True)
    with open(a.hyp) as f:
        model.hyp = yaml.safe_load(f)
    head = type(model.model[-1]).__name__
    if head.startswith("Dual"):
        from utils.loss_tal_dual import ComputeLoss  # official code: on sys.path from main()
    else:
        from utils.loss_tal import ComputeLoss  # official code: on sys.path from main()
    batch = _read_plain(a.batch)
    model.train()
    loss_fn = ComputeLoss(model)
    loss, items = loss_fn(model(batch["imgs"]), batch["targets"])
    loss.backward()
    grad_norms = {n: p.grad.norm() for n, p in model.named_parameters() if p.grad is not None}
    torch.save({"loss": loss.detach(), "items": items.detach(), "grad_norms": grad_norms}, a.out)


def cmd_metrics(a: argparse.Namespace) -> None:
    from utils.metrics import ap_per_class  # official code: on sys.path from main()
    from val import process_batch  # official code: on sys.path from main()

    data = _read_plain(a.inp)
    iouv = torch.linspace(0.5, 0.95, 10)
    stats = []
    for pred, labels in zip(data["preds"], data["labels"]):
        if len(pred) == 0:
            if len(labels):
                stats.append((torch.zeros(0, 10, dtype=torch.bool), torch.zeros(0), torch.zeros(0), labels[:, 0]))
            continue
        correct = process_batch(pred, labels, iouv) if len(labels) else torch.zeros(len(pred), 10, dtype=torch.bool)
        stats.append((correct, pred[:, 4], pred[:, 5], labels[:, 0]))
    stats = [torch.cat(x, 0).numpy() for x in zip(*stats)]
    out = {"precision": 0.0, "recall": 0.0, "mAP50": 0.0, "mAP50-95": 0.0}
    if len(stats) and stats[0].any():
        _, _, p, r, _, ap, _ = ap_per_class(*stats, names={})
        out = {"precision": float(p.mean()), "recall": float(r.mean()), "mAP50": float(ap[:, 0].mean()),
               "mAP50-95": float(np.mean(ap))}
    torch.save(out, a.out)


def cmd_valbatches(a: argparse.Namespace) -> None:
    from utils.dataloaders import create_dataloader  # official code: on sys.path from main()
    from utils.general import scale_boxes, xywh2xyxy  # official code: on sys.path from main()

    probe = _read_plain(a.probe)
    loader = create_dataloader(a.images, a.imgsz, a.batch, 32, False, pad=0.5, rect=True, workers=0)[0]
    out = []
    for imgs, targets, paths, shapes in loader:
        h, w = imgs.shape[2:]
        targets = targets.clone()
        targets[:, 2:] *= torch.tensor((w, h, w, h))  # as val.py: to input pixels
        gt, pr = [], []
        for si, shape in enumerate(shapes):
            lab = targets[targets[:, 0] == si, 1:]
            gt.append(scale_boxes(imgs[si].shape[1:], xywh2xyxy(lab[:, 1:5]), shape[0], shape[1]))
            pr.append(scale_boxes(imgs[si].shape[1:], probe.clone(), shape[0], shape[1]))
        plain = [[[float(v) for v in s[0]], [[float(v) for v in s[1][0]], [float(v) for v in s[1][1]]]] for s in shapes]
        out.append({"imgs": imgs, "paths": [str(p) for p in paths], "shapes": plain, "gt_native": gt,
                    "probe_native": pr})
    torch.save(out, a.out)


def cmd_val(a: argparse.Namespace) -> None:
    val = importlib.import_module(a.script.removesuffix(".py"))
    # What the script's __main__ does (parse_opt, then run(**vars(opt))); run() also reads that module-level opt.
    sys.argv = [a.script, "--data", a.data, "--weights", a.weights, "--imgsz", str(a.imgsz), "--batch-size",
                str(a.batch), "--device", "cpu", "--workers", str(a.workers), "--project", a.save_dir, "--name", "val",
                "--exist-ok"]
    val.opt = val.parse_opt()
    (p, r, map50, map5095, *_), _, _ = val.run(**vars(val.opt), plots=False)
    torch.save({"precision": float(p), "recall": float(r), "mAP50": float(map50), "mAP50-95": float(map5095)}, a.out)


# An official checkpoint pickles the whole model: the classes it may name are the official repository's own
# (models., utils.) and PyTorch's, NumPy's and the standard library's containers; anything else is refused.
_OFFICIAL_PICKLE_MODULES = ("models.", "utils.", "torch.", "numpy.", "collections.", "builtins.", "copyreg.",
                            "argparse.", "pathlib.", "_codecs.")


def _read_official(path: str) -> dict:
    """An official checkpoint, read by torch's weights-only unpickler with exactly the classes it names allowed,
    once each is known to come from the modules above (no other code can run while it is read)."""
    names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    foreign = [n for n in names if not n.startswith(_OFFICIAL_PICKLE_MODULES)]
    if foreign:
        raise SystemExit(f"{path}: names classes outside the official code, torch and the standard library: {foreign}")
    allowed = []
    for name in names:
        module, _, attr = name.rpartition(".")
        found = importlib.import_module(module)
        for part in attr.split("."):
            found = getattr(found, part)
        allowed.append(found)
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, map_location="cpu", weights_only=True)


def cmd_export(a: argparse.Namespace) -> None:
    ckpt = _read_official(a.ckpt)
    model = (ckpt.get("ema") or ckpt["model"]).float()
    names = model.names
    names = [names[k] for k in sorted(names)] if isinstance(names, dict) else list(names)
    meta = {"cfg": model.yaml, "nc": int(model.yaml["nc"]), "names": [str(n) for n in names],
            "source": f"official checkpoint {a.ckpt} (epoch {ckpt.get('epoch')})"}
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save({"model": sd, "ema": None, "optimizer": None, "scaler": None, "meta": meta}, a.out)


def cmd_import(a: argparse.Namespace) -> None:
    ckpt = _read_plain(a.weights)
    if "model" in ckpt and isinstance(ckpt["model"], dict):
        sd = ckpt["ema"] if ckpt.get("ema") is not None else ckpt["model"]
        meta = ckpt.get("meta") or {}
    else:
        sd, meta = ckpt, {}
    nc = meta.get("nc") or max((v.shape[0] for k, v in sd.items() if k.endswith("cv3.0.2.bias")), default=None)
    model = _model(a.cfg, int(nc))
    own = model.state_dict()
    model.load_state_dict({k: v for k, v in sd.items() if k in own}, strict=True)  # the project also stores strides
    model.nc = int(nc)  # attributes the official trainer attaches before saving, and val*.py reads
    if meta.get("names"):
        model.names = list(meta["names"])
    torch.save({"model": model.float(), "epoch": -1}, a.out)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True, help="the official copy (put first on sys.path)")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("jobs")
    s.add_argument("file")
    s = sub.add_parser("init")
    s.add_argument("cfg"), s.add_argument("nc", type=int), s.add_argument("seed", type=int), s.add_argument("out")
    s = sub.add_parser("loss")
    for name in ("cfg", "nc", "weights", "batch", "hyp", "out"):
        s.add_argument(name, type=int if name == "nc" else str)
    s = sub.add_parser("metrics")
    s.add_argument("inp"), s.add_argument("out")
    s = sub.add_parser("valbatches")
    for name in ("images", "imgsz", "batch", "probe", "out"):
        s.add_argument(name, type=int if name in ("imgsz", "batch") else str)
    s = sub.add_parser("val")
    for name in ("script", "weights", "data", "imgsz", "batch", "workers", "save_dir", "out"):
        s.add_argument(name, type=int if name in ("imgsz", "batch", "workers") else str)
    s = sub.add_parser("export")
    s.add_argument("ckpt"), s.add_argument("out")
    s = sub.add_parser("import")
    s.add_argument("weights"), s.add_argument("cfg"), s.add_argument("out")
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    sys.path.insert(0, a.root)
    if a.cmd == "jobs":
        with open(a.file) as f:
            todo = [p.parse_args(["--root", a.root, *job]) for job in json.load(f)]
    else:
        todo = [a]
    commands = {"init": cmd_init, "loss": cmd_loss, "metrics": cmd_metrics, "valbatches": cmd_valbatches,
                "val": cmd_val, "export": cmd_export, "import": cmd_import}
    for job in todo:
        commands[job.cmd](job)
    return 0


if __name__ == "__main__":
    sys.exit(main())
