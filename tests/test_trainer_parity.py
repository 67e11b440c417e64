"""The project trainer and evaluator against the official YOLOv9 code, piece by piece (issue #18).

Each test pins one discrepancy that ``benchmarks/trainer_parity.py`` found between ``python -m yolov9.train`` /
``yolov9.val`` and the official ``train.py`` / ``train_dual.py`` / ``val*.py``. The official side runs in its
own process from a temporary copy of ``../shared/upstream/yolov9`` (see ``tests/reference/official.py``), all
of it in one process per session (``official_results``); those tests skip where the folder is absent.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import fastload
from fastload.augment.hyp import load_hyp
from reference import official
from yolov9.boxes import xywh2xyxy
from yolov9.checkpoint import load_model, save_checkpoint
from yolov9.loss import DetectionLoss
from yolov9.metrics import DetectionMetrics
from yolov9.models import DetectionModel
from yolov9.torch_utils import TrainSchedule, build_optimizer, init_seeds, lr_lambda, round_to_half_
from yolov9.train import init_seed
from yolov9.val import boxes_to_original, make_val_loader

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODELS = ("gelan-t", "yolov9-t")
PROBE = torch.tensor([[0.0, 0.0, 40.0, 30.0], [15.5, 60.25, 150.0, 155.0], [100.0, 5.0, 190.0, 100.0]])
NC = 3
SEED = 1
SCRATCH_HIGH = {"lr0": 0.01, "lrf": 0.01, "momentum": 0.937, "warmup_epochs": 3.0, "warmup_momentum": 0.8,
                "warmup_bias_lr": 0.1}


# ------------------------------------------------------------------------------------------ LR schedule
def _official_loop_lrs(epochs: int, nb: int, batch: int, cosine: bool = False) -> list[tuple]:
    """(lrs, momentum, accumulate) per batch, driven the way the official loop drives torch's LambdaLR:
    scheduler created, then ``last_epoch = start_epoch - 1``, warm-up written into the groups per batch, one
    ``scheduler.step()`` after each epoch."""
    h = SCRATCH_HIGH
    lf = lr_lambda(epochs, h["lrf"], cosine)
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(3)]
    opt = torch.optim.SGD([params[0]], lr=h["lr0"], momentum=h["momentum"], nesterov=True)
    opt.add_param_group({"params": [params[1]]})
    opt.add_param_group({"params": [params[2]]})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda=lf)
    sched.last_epoch = -1
    nw = max(round(h["warmup_epochs"] * nb), 100)
    accumulate = max(round(64 / batch), 1)
    out = []
    for epoch in range(epochs):
        for i in range(nb):
            ni = i + nb * epoch
            if ni <= nw:
                accumulate = max(1, np.interp(ni, [0, nw], [1, 64 / batch]).round())
                for j, g in enumerate(opt.param_groups):
                    g["lr"] = np.interp(ni, [0, nw], [h["warmup_bias_lr"] if j == 0 else 0.0, g["initial_lr"] * lf(epoch)])
                    g["momentum"] = np.interp(ni, [0, nw], [h["warmup_momentum"], h["momentum"]])
            out.append((tuple(float(g["lr"]) for g in opt.param_groups), float(opt.param_groups[0]["momentum"]),
                        int(accumulate)))
        sched.step()
    return out


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
@pytest.mark.parametrize("nb, batch, cosine", [(16, 16, False), (7, 16, False), (40, 24, True)])
def test_schedule_matches_official_loop(nb, batch, cosine):
    # nb 16: warm-up (100 batches) ends inside epoch 6; nb 7: inside epoch 14; nb 40: inside epoch 2.
    epochs = 30
    sched = TrainSchedule.from_hyp(SCRATCH_HIGH, epochs=epochs, batches_per_epoch=nb, batch_size=batch, cosine=cosine)
    want = _official_loop_lrs(epochs, nb, batch, cosine)
    for ni, (lrs, mom, acc) in enumerate(want):
        got = sched.at(ni, ni // nb)
        assert got.lrs == pytest.approx(lrs, rel=1e-12, abs=1e-15), ni
        assert got.momentum == pytest.approx(mom) and got.accumulate == acc, ni


def test_schedule_lags_one_epoch_after_warmup():
    # The figures: epoch 7 runs at 0.00802 (lf(6)), epoch 29 at 0.00076 (lf(28)), not lf(7) / lf(29).
    sched = TrainSchedule.from_hyp(SCRATCH_HIGH, epochs=30, batches_per_epoch=16, batch_size=16)
    assert sched.at(7 * 16, 7).lrs[1] == pytest.approx(0.00802)
    assert sched.at(29 * 16 + 15, 29).lrs == pytest.approx((0.00076,) * 3)
    assert sched.at(100, 6).lrs[1] == pytest.approx(0.01 * lr_lambda(30, 0.01)(6))  # last warm-up batch
    assert sched.at(101, 6).lrs[1] == pytest.approx(0.01 * lr_lambda(30, 0.01)(6))  # rest of that epoch
    assert sched.at(16 * 16, 16).accumulate == 4


# ------------------------------------------------------------------------------------------ the official side
@pytest.fixture(scope="module")
def official_results(tmp_path_factory, synth_yaml, preloaded_python):
    """One official process computes everything the tests below compare with; returns its outputs."""
    if not official.available():
        pytest.skip(f"official YOLOv9 repository not found at {official.UPSTREAM}")
    work = tmp_path_factory.mktemp("official")
    off = official.Official.create(work, server=preloaded_python)  # the bridge forked: torch & co. imported once
    hyp_path = off.root / "data" / "hyps" / "hyp.scratch-high.yaml"
    with fastload.loader(synth_yaml, imgsz=160, batch_size=4, hyp=load_hyp(hyp_path), workers=0, seed=3) as ld:
        imgs, targets, _, _ = next(iter(ld))
    torch.save({"imgs": imgs.float() / 255, "targets": targets}, work / "batch.pt")
    preds, labels = _prediction_set()
    torch.save({"preds": [torch.from_numpy(p) for p in preds], "labels": [torch.from_numpy(l) for l in labels]},
               work / "preds.pt")
    project_ckpt = work / "project.pt"
    model = DetectionModel("yolov9-t", nc=NC)
    model.names = ["a", "b", "c"]
    save_checkpoint(project_ckpt, model=model, ema=model, meta={"cfg": model.yaml, "nc": NC, "names": model.names})
    jobs = []
    for m in MODELS:
        cfg = f"models/detect/{m}.yaml"
        jobs += [["init", cfg, str(NC), str(SEED), str(work / f"init-{m}.pt")],
                 ["loss", cfg, str(NC), str(work / f"init-{m}.pt"), str(work / "batch.pt"), str(hyp_path),
                  str(work / f"loss-{m}.pt")]]
    torch.save(PROBE, work / "probe.pt")
    for sub in ("images", "labels"):  # the official loader writes a label cache next to the labels: a copy
        shutil.copytree(synth_yaml.parent / sub / "val", work / "valset" / sub / "val")
    val_images = str(work / "valset" / "images" / "val")
    jobs += [["metrics", str(work / "preds.pt"), str(work / "metrics.pt")],
             ["valbatches", val_images, "160", "4", str(work / "probe.pt"), str(work / "valbatches.pt")],
             ["import", str(project_ckpt), "models/detect/yolov9-t.yaml", str(work / "as-official.pt")],
             ["export", str(work / "as-official.pt"), str(work / "back.pt")]]
    (work / "jobs.json").write_text(json.dumps(jobs))
    off.bridge("jobs", str(work / "jobs.json"), timeout=300)
    return {"work": work, "hyp": load_hyp(hyp_path), "project_model": model, "data": synth_yaml}


def _project_init(name: str) -> DetectionModel:
    init_seeds(init_seed(SEED))  # what yolov9.train does with --seed SEED in one process
    return round_to_half_(DetectionModel(name, nc=NC))


@pytest.mark.parametrize("name", MODELS)
def test_initial_weights_bn_buffers_and_groups_match_official(official_results, name):
    ref = torch.load(official_results["work"] / f"init-{name}.pt", weights_only=True)
    model = _project_init(name)
    sd = model.state_dict()
    assert set(ref["state"]) == set(sd) - {f"model.{len(model.model) - 1}.stride"}
    differ = [k for k, v in ref["state"].items() if not torch.equal(v, sd[k])]
    assert not differ, f"differ from the official start: {differ[:5]}"  # dual head: RNG order of cv4/cv5 vs dfl
    assert torch.all(model.model[0].bn.running_var == torch.tensor(0.9).half().float())  # the stride probe's trace
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [{names[id(p)] for p in g["params"]} for g in build_optimizer(model).param_groups]
    fixed = {n for n, p in model.named_parameters() if not p.requires_grad}  # DFL bins: never stepped by either
    assert [g - fixed for g in groups] == [set(g) - fixed for g in ref["groups"]]


@pytest.mark.parametrize("name", MODELS)
def test_loss_and_gradients_match_official_on_one_batch(official_results, name):
    work = official_results["work"]
    ref = torch.load(work / f"loss-{name}.pt", weights_only=True)
    batch = torch.load(work / "batch.pt", weights_only=True)
    model = DetectionModel(name, nc=NC)
    model.load_state_dict(torch.load(work / f"init-{name}.pt", weights_only=True)["state"], strict=False)
    model.train()
    loss, items = DetectionLoss(model, official_results["hyp"])(model(batch["imgs"]), batch["targets"])
    torch.testing.assert_close(items, ref["items"], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(loss.detach(), ref["loss"].reshape(loss.shape), rtol=1e-4, atol=1e-6)
    loss.backward()
    norms = {n: p.grad.norm() for n, p in model.named_parameters() if p.grad is not None}
    assert set(norms) == set(ref["grad_norms"])
    worst = max(abs(norms[n] - g).item() / max(g.item(), 1e-8) for n, g in ref["grad_norms"].items())
    assert worst < 1e-4  # measured 2e-6: float summation order only


def _prediction_set(seed: int = 0, n_images: int = 40, nc: int = 3) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """NMS-like outputs (float32, by descending score) and labels ``(cls, x1, y1, x2, y2)`` of a half-trained
    detector: jittered hits, duplicates, misses, wrong classes and background boxes."""
    rng = np.random.default_rng(seed)
    preds, labels = [], []
    for _ in range(n_images):
        n_gt = int(rng.integers(0, 7))
        xy = rng.uniform(0, 300, (n_gt, 2))
        gt = np.concatenate((xy, xy + rng.uniform(8, 150, (n_gt, 2))), 1)
        gcls = rng.integers(0, nc, n_gt)
        dets = []
        for b, c in zip(gt, gcls):
            for _ in range(int(rng.integers(0, 4))):
                jit = rng.normal(0, 0.12, 4) * np.r_[b[2:] - b[:2], b[2:] - b[:2]]
                dets.append([*(b + jit), rng.uniform(0.01, 1.0), c if rng.random() > 0.15 else rng.integers(0, nc)])
        for _ in range(int(rng.integers(0, 6))):
            xy = rng.uniform(0, 300, 2)
            dets.append([*xy, *(xy + rng.uniform(8, 100, 2)), rng.uniform(0.001, 0.5), rng.integers(0, nc)])
        det = np.array(dets, dtype=np.float32).reshape(-1, 6)
        preds.append(det[np.argsort(-det[:, 4], kind="stable")])
        labels.append(np.c_[gcls, gt].astype(np.float32))
    return preds, labels


def test_evaluator_matches_official_on_fixed_predictions(official_results):
    ref = torch.load(official_results["work"] / "metrics.pt", weights_only=True)
    preds, labels = _prediction_set()
    results = {}
    for protocol in ("yolo", "coco"):
        m = DetectionMetrics(protocol=protocol)
        for det, lab in zip(preds, labels):
            m.update(det, lab[:, 1:], lab[:, 0])
        results[protocol] = m.compute()
    for k in ("precision", "recall", "mAP50", "mAP50-95"):
        assert results["yolo"][k] == pytest.approx(ref[k], abs=1e-6), k  # the issue asks 1e-3; it is exact
    # The COCO protocol is a different measure (the 0.002-0.012 offset and its P/R operating point).
    assert abs(results["coco"]["mAP50-95"] - ref["mAP50-95"]) > 1e-3


def test_val_batches_and_box_mapping_match_official(official_results):
    # Same pixels and letterbox records (YOLOv9 truncates the loaded size: int(w0 * r)), and the "yolo" mapping
    # back to original pixels gives the official labels and predictions.
    ref = torch.load(official_results["work"] / "valbatches.pt", weights_only=True)
    loader = make_val_loader(official_results["data"], 160, 4, workers=0)
    try:
        batches = list(loader)
        labels = dict(zip(loader.dataset.im_files, loader.dataset.labels))
    finally:
        loader.close()
    assert len(batches) == len(ref)
    for (imgs, targets, paths, shapes), want in zip(batches, ref):
        assert [p.split("/")[-1] for p in paths] == [p.split("/")[-1] for p in want["paths"]]
        assert torch.equal(imgs, want["imgs"])
        h, w = imgs.shape[2:]
        for si, shape in enumerate(shapes):
            (h0, w0), ((gh, gw), (pw, ph)) = want["shapes"][si]
            assert shape[0] == (h0, w0) and shape[1][0] == pytest.approx((gh, gw)) and shape[1][1] == (pw, ph)
            gt = xywh2xyxy(targets[targets[:, 0] == si, 2:6] * torch.tensor((w, h, w, h)))
            probe = PROBE.clone()
            boxes_to_original(probe, gt, shape, "yolo")
            torch.testing.assert_close(gt, want["gt_native"][si], atol=2e-3, rtol=0)
            torch.testing.assert_close(probe, want["probe_native"][si], atol=1e-4, rtol=0)
            # "coco": exact geometry, so the labels come back where the label file puts them in the original image
            exact = xywh2xyxy(targets[targets[:, 0] == si, 2:6] * torch.tensor((w, h, w, h)))
            boxes_to_original(PROBE.clone(), exact, shape, "coco")
            own = torch.from_numpy(labels[paths[si]][:, 1:5]).float() * torch.tensor((w0, h0, w0, h0))
            torch.testing.assert_close(exact, xywh2xyxy(own).clamp(min=0), atol=2e-3, rtol=0)


def test_weights_convert_both_ways_through_the_official_model(official_results):
    work = official_results["work"]
    back, _ = load_model(work / "back.pt")  # official checkpoint -> plain tensors (no head strides) -> project
    src = official_results["project_model"].state_dict()
    assert back.nc == NC and back.names == ["a", "b", "c"] and back.is_dual
    for k, v in back.state_dict().items():
        assert torch.equal(v, src[k]), k


# ------------------------------------------------------------------------------------------ project-only checks
def test_init_seed_follows_official_rank_rule():
    assert init_seed(5) == 5  # one process: the official trainer's opt.seed + 1 + RANK with RANK -1
    assert [init_seed(5, r) for r in (0, 1)] == [6, 7]


def test_val_loads_bare_state_dict_without_nc(tmp_path):
    model = DetectionModel("gelan-t", nc=NC)
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    loaded, _ = load_model(tmp_path / "sd.pt", cfg="gelan-t")  # the config says nc 80; the weights say 3
    assert loaded.nc == NC
    got = loaded.state_dict()  # once: state_dict() walks every module
    for k, v in model.state_dict().items():
        assert torch.equal(got[k], v)
