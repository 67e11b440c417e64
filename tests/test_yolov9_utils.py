"""Trainer helpers: optimiser groups, LR schedules, EMA, checkpoints, data-wait meter, letterbox maths."""
from __future__ import annotations

import io
import os
import random
import signal
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn

from yolov9.boxes import scale_boxes_to_original
from yolov9.checkpoint import jsonable, load_model, read_checkpoint, save_checkpoint
from yolov9.detect import letterbox
from yolov9.models import DetectionModel, load_cfg
from yolov9.throughput import GpuUtilSampler, StepTimer, fmt_util
from yolov9.torch_utils import ModelEMA, build_optimizer, lr_lambda, rng_state, set_rng_state
from yolov9.train import _latest_last

# one intra-op thread (conftest's one_torch_thread): with two on the loaded 2-core CI machine, building and saving
# the small model of these tests spent seconds spin-waiting for a core another process held
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tiny() -> DetectionModel:
    cfg = load_cfg("gelan-t.yaml")
    cfg["width_multiple"] = 0.25
    return DetectionModel(cfg, nc=2)


def test_optimizer_groups_no_decay_on_bn_and_bias():
    model = _tiny()
    opt = build_optimizer(model, "SGD", lr=0.01, momentum=0.937, decay=5e-4)
    biases, weights, norms = (set(map(id, g["params"])) for g in opt.param_groups)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 5e-4, 0.0]
    assert opt.param_groups[0]["nesterov"] and opt.param_groups[0]["momentum"] == 0.937
    for mod in model.modules():
        for name, p in mod.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            if name == "bias":
                assert id(p) in biases
            elif isinstance(mod, nn.BatchNorm2d):
                assert id(p) in norms
            else:
                assert id(p) in weights
    n_trainable = sum(1 for p in model.parameters() if p.requires_grad)
    assert len(biases) + len(weights) + len(norms) == n_trainable
    with pytest.raises(ValueError, match="LION"):
        build_optimizer(model, "LION")


@pytest.mark.parametrize("cosine", [False, True])
def test_lr_schedule_endpoints(cosine):
    f = lr_lambda(100, 0.01, cosine)
    assert f(0) == pytest.approx(1.0) and f(100) == pytest.approx(0.01)
    vals = [f(e) for e in range(101)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))


def test_ema_tracks_weights():
    model = _tiny()
    ema = ModelEMA(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    before = next(iter(ema.ema.parameters())).clone()
    for _ in range(3):
        ema.update(model)
    after = next(iter(ema.ema.parameters()))
    assert ema.updates == 3 and not torch.equal(before, after)
    assert all(not p.requires_grad for p in ema.ema.parameters())


def test_checkpoint_roundtrip_weights_only(tmp_path):
    model = _tiny()
    model.names = ["a", "b"]
    opt = build_optimizer(model)
    meta = {"epoch": 3, "cfg": model.yaml, "nc": 2, "names": model.names, "opt": {"project": tmp_path}}
    path = tmp_path / "w.pt"
    save_checkpoint(path, model=model, ema=model, optimizer=opt, meta=meta)
    raw = torch.load(path, weights_only=True)
    assert raw["meta"]["opt"]["project"] == str(tmp_path) and raw["meta"]["format"].startswith("fastload-yolov9")
    loaded, ckpt = load_model(path)
    assert loaded.names == ["a", "b"]
    got = loaded.state_dict()  # once: state_dict() walks every module
    for k, v in model.state_dict().items():
        torch.testing.assert_close(got[k], v)
    # a bare state_dict needs --cfg
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    with pytest.raises(ValueError, match="--cfg"):
        load_model(tmp_path / "sd.pt")
    assert load_model(tmp_path / "sd.pt", cfg=model.yaml)[0].nc == 2
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        read_checkpoint(tmp_path / "missing.pt")
    with pytest.raises(TypeError):
        jsonable({"x": object()})


def test_killed_checkpoint_write_leaves_the_previous_one(tmp_path):
    """A writer killed (SIGKILL) half way through its bytes leaves last.pt as it was and a partial last.pt.tmp that
    does not load and that --resume's search does not pick."""
    model = nn.Linear(64, 64)
    last = tmp_path / "exp" / "weights" / "last.pt"
    last.parent.mkdir(parents=True)
    save_checkpoint(last, model=model, meta={"epoch": 0})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pid = os.fork()
    if pid == 0:  # the writer: new weights, and torch.save cut short by the kill
        try:
            def write_half_then_die(obj, f):
                whole = io.BytesIO()
                real_save(obj, whole)
                f.write(whole.getvalue()[: len(whole.getvalue()) // 2])
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)

            real_save, torch.save = torch.save, write_half_then_die
            with torch.no_grad():
                for v in model.parameters():
                    v.add_(1.0)
            save_checkpoint(last, model=model, meta={"epoch": 1})
        finally:
            os._exit(1)  # never back into pytest in the child
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    partial = last.with_name("last.pt.tmp")
    assert partial.stat().st_size > 0
    with pytest.raises(ValueError, match="not a whole checkpoint file"):
        read_checkpoint(partial)
    kept = read_checkpoint(last)
    assert kept["meta"]["epoch"] == 0 and all(torch.equal(kept["model"][k], v) for k, v in before.items())
    assert _latest_last(tmp_path) == last
    save_checkpoint(last, model=model, meta={"epoch": 2})  # the next save replaces the leftover
    assert read_checkpoint(last)["meta"]["epoch"] == 2 and not partial.exists()


def test_rng_state_round_trip_through_a_weights_only_checkpoint(tmp_path):
    state = rng_state()
    drawn = (random.random(), np.random.rand(), torch.rand(3))
    save_checkpoint(tmp_path / "c.pt", model=nn.Linear(1, 1), rng=[state], meta={})
    set_rng_state(torch.load(tmp_path / "c.pt", weights_only=True)["rng"][0])
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert drawn[:2] == again[:2] and torch.equal(drawn[2], again[2])


def test_step_timer_counts_and_fraction():
    timer = StepTimer()
    batches = [(torch.zeros(4, 3, 8, 8), None), (torch.zeros(2, 3, 8, 8), None)]
    seen = [b for b in timer.wrap(batches)]
    assert len(seen) == 2 and timer.steps == 2 and timer.images == 6
    assert 0.0 <= timer.wait_frac <= 1.0 and timer.images_per_s > 0


def test_gpu_sampler_reports_na_without_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    s = GpuUtilSampler(0)
    s.start()
    assert not s.available and s.stop() is None and fmt_util(s.stop()) == "n/a"
    assert GpuUtilSampler(None).stop() is None


def test_letterbox_and_scale_back_roundtrip():
    img = np.zeros((100, 200, 3), np.uint8)
    out, shape = letterbox(img, 128, stride=32)
    assert out.shape[:2] == (64, 128)
    boxes = torch.tensor([[10.0, 20.0, 50.0, 80.0]])  # original pixels
    (h0, w0), ((gh, gw), (pw, ph)) = shape
    lb = boxes.clone()
    lb[:, [0, 2]] = lb[:, [0, 2]] * gw + pw
    lb[:, [1, 3]] = lb[:, [1, 3]] * gh + ph
    torch.testing.assert_close(scale_boxes_to_original(lb, shape, out.shape[:2]), boxes)
