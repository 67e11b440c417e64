"""One contract, every engine: the same checks run over cpu (in-process and 2 workers), gpu (the
PyTorch engine on CPU tensors), dali (its CPU-only mode, when installed) and ray (2 actors on a local
Ray instance, when installed).

Batch format, the three HSV modes, both layouts, unknown and inapplicable options, stats keys (the
decode counters among them), close-mosaic, set_epoch and determinism, held batches never changing
(the caller owns a batch while any tensor of it lives), with both ``partners``
(``"dataset"``: YOLOv9's draw; ``"batch"``: partners from the batch, one decode per image). A tiny
synthetic set at a small imgsz keeps it fast.
"""
from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

import fastload
from fastload.engines.base import HSV_MODES, EngineOptionError
from fastload.engines.cpu import CPUOptions
from fastload.engines.dali import DALIOptions
from fastload.engines.factory import engine_class
from fastload.engines.gpu import TorchGPUOptions
from fastload.engines.ray_engine import RayOptions

IMGSZ = 64
BATCH = 4
HAS_DALI = importlib.util.find_spec("nvidia") is not None and importlib.util.find_spec("nvidia.dali") is not None
HAS_RAY = importlib.util.find_spec("ray") is not None

# engine name, the settings that run it here
ENGINES = [
    pytest.param("cpu", dict(workers=0), id="cpu-inline"),
    pytest.param("cpu", dict(workers=2), id="cpu-2workers"),
    pytest.param("gpu", dict(device="cpu"), id="gpu-on-cpu"),
    pytest.param("dali", dict(device="cpu", workers=1), id="dali-cpu",
                 marks=pytest.mark.skipif(not HAS_DALI, reason="NVIDIA DALI is not installed (pip install fastload[dali])")),
    # one actor: the contract does not depend on how many render (test_engine_ray.py runs several: their order,
    # mosaic state, a killed one replaced); each actor is a Ray worker process of its own, ~0.6 s to start here
    pytest.param("ray", dict(engine_options={"actors": 1}), id="ray-1actor",
                 marks=pytest.mark.skipif(not HAS_RAY, reason='Ray is not installed (pip install "fastload[ray]")')),
]
# the held-batch check also runs ray's object-store delivery (the others: its shared-memory slots, "auto"), with one
# actor: what is checked is where the batches live, not how many actors render them (each actor costs its own process)
HOLDERS = ENGINES + [
    pytest.param("ray", dict(engine_options={"delivery": "object_store", "actors": 1}), id="ray-object-store",
                 marks=pytest.mark.skipif(not HAS_RAY, reason='Ray is not installed (pip install "fastload[ray]")')),
]
# every engine's options class and one field it has
OPTIONS = {"cpu": (CPUOptions, "keep"), "gpu": (TorchGPUOptions, "max_elements"), "dali": (DALIOptions, "threads"),
           "ray": (RayOptions, "delivery")}
PARTNERS = ["dataset", "batch"]


def refused_settings(name: str) -> list[dict]:
    """The settings engine ``name`` declares it cannot honour (each must be refused, never dropped)."""
    cls = engine_class(name)
    out = []
    if cls.renderers != "workers":
        out.append(dict(workers=2))
    if cls.min_workers > 0:
        out.append(dict(workers=cls.min_workers - 1))
    if cls.min_prefetch > 0:
        out.append(dict(prefetch=cls.min_prefetch - 1))
    out += [dict(hsv_on=mode) for mode in HSV_MODES if mode not in cls.hsv_modes]
    return out

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def ray_for_the_ray_engine(request):
    """The ray engine's cases run on the module's local Ray instance (started by the first of them)."""
    if getattr(request.node, "callspec", None) is not None and request.node.callspec.params.get("engine") == "ray":
        request.getfixturevalue("local_ray")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from fastload.data.synthetic import make_synthetic_dataset

    return make_synthetic_dataset(tmp_path_factory.mktemp("contract"), n_train=8, n_val=1, nc=3, seed=2, max_size=200)


def make(data, engine, run, **kw):
    args = dict(imgsz=IMGSZ, batch_size=BATCH, store="files", engine=engine, seed=3, **run)
    args.update(kw)
    return fastload.loader(data, **args)


def epoch(fl, *, gains=False):
    """One epoch as cloned CPU tensors (clones keep the memory order); with the deferred gains per batch."""
    out = []
    for imgs, targets, paths, shapes in fl:
        item = (imgs.clone(), targets.clone(), paths, shapes)
        out.append(item + ((fl.hsv_gains.clone(),) if gains else ()))
    return out


def assert_identical(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2] == y[2] and x[3] == y[3]


@pytest.mark.parametrize("partners", PARTNERS)
@pytest.mark.parametrize("engine,run", ENGINES)
def test_batch_format_and_stats(data, engine, run, partners):
    with make(data, engine, run, partners=partners) as fl:
        got = epoch(fl)
        stats = fl.stats()
        assert fl.hsv_gains is None  # only hsv_on="defer" hands gains over
    assert len(got) == len(fl) == -(-fl.n // BATCH)
    assert sum(len(b[2]) for b in got) == fl.n
    for imgs, targets, paths, shapes in got:
        b = len(paths)
        assert imgs.dtype == torch.uint8 and imgs.shape == (b, 3, IMGSZ, IMGSZ) and imgs.device.type == "cpu"
        assert imgs.is_contiguous(memory_format=torch.channels_last)  # layout="nhwc", the default
        assert targets.dtype == torch.float32 and targets.ndim == 2 and targets.shape[1] == 6
        assert targets.device == imgs.device
        if len(targets):
            assert set(targets[:, 0].tolist()) <= set(range(b))
            assert (targets[:, 2:] >= 0).all() and (targets[:, 2:] <= 1).all()
        assert len(shapes) == b and all(isinstance(p, str) for p in paths)
        for s in shapes:
            assert s is None or (len(s) == 2 and len(s[0]) == 2 and len(s[1]) == 2)
    assert any(s is None for b in got for s in b[3])  # scratch-high training: mosaics
    assert {"engine", "store", "batches", "images", "worker_pids", "partners", "decodes", "decodes_per_image",
            "batches_copied"} <= set(stats)
    assert stats["batches_copied"] == 0  # the common loop holds one batch while the next is delivered: no copies
    assert stats["engine"] == engine and stats["store"] == "files" and stats["partners"] == partners
    assert stats["batches"] == len(got) and stats["images"] == fl.n
    # JPEG/PNG files: the first epoch decodes; with partners="batch" at most once per output image
    assert stats["decodes_per_image"] == stats["decodes"] / fl.n > 0
    if partners == "batch":
        assert stats["decodes"] <= fl.n
    expected_pids = {"cpu": run.get("workers", 0), "ray": run.get("engine_options", {}).get("actors")}
    assert len(stats["worker_pids"]) == expected_pids.get(engine, 0)
    if engine in ("cpu", "ray"):
        assert {"decode_cache_hits", "decode_cache_misses", "early_batches_used", "early_batches_dropped"} <= set(stats)


@pytest.mark.filterwarnings("ignore:fastload.loader. hsv_on='consumer' without a GPU device")
@pytest.mark.parametrize("engine,run", ENGINES)
def test_hsv_modes_and_layouts(data, engine, run):
    """worker / consumer / defer give the same pixels (defer: after apply_hsv_batch with the handed
    gains), in either memory order; the same seed gives the same batches. An engine that refuses "worker"
    (its declared hsv_modes) runs its default (hsv_on=None) there."""
    own = "worker" if "worker" in engine_class(engine).hsv_modes else None
    with make(data, engine, run, hsv_on=own, layout="nhwc") as fl:
        worker = epoch(fl)
    with make(data, engine, run, hsv_on="consumer", layout="nchw") as fl:
        consumer = epoch(fl)
    with make(data, engine, run, hsv_on="defer", layout="nhwc") as fl:
        deferred = epoch(fl, gains=True)
    for w, c, d in zip(worker, consumer, deferred):
        assert w[0].is_contiguous(memory_format=torch.channels_last) and c[0].is_contiguous()
        assert d[0].is_contiguous(memory_format=torch.channels_last)
        gains = d[4]
        assert gains.dtype == torch.float32 and gains.shape == (len(d[2]), 3) and gains.device.type == "cpu"
        assert (gains != 1).any()
        assert torch.equal(fastload.apply_hsv_batch(d[0], gains), c[0])  # defer + the finishing step = consumer
        assert int((w[0].int() - c[0].int()).abs().max()) <= 1  # OpenCV's HSV (cpu workers) vs the torch twin
        assert torch.equal(w[1], c[1]) and torch.equal(c[1], d[1]) and w[2] == c[2] == d[2] and w[3] == c[3] == d[3]
        assert not torch.equal(d[0], c[0])  # defer really left HSV out
    with make(data, engine, run, hsv_on=own, layout="nchw") as fl:  # a second build, same seed
        again = epoch(fl)
    assert_identical(worker, again)


@pytest.mark.parametrize("partners", PARTNERS)
@pytest.mark.parametrize("engine,run", ENGINES)
def test_set_epoch_and_close_mosaic(data, engine, run, partners):
    with make(data, engine, run, close_mosaic=1, epochs=3, partners=partners) as fl:
        fl.set_epoch(0)
        first = epoch(fl)
        fl.set_epoch(0)
        assert_identical(first, epoch(fl))  # an epoch is a function of (seed, epoch)
        fl.set_epoch(1)
        second = epoch(fl)
        fl.set_epoch(2)  # the last close_mosaic epochs: letterboxes only
        last = epoch(fl)
    assert [b[2] for b in first] != [b[2] for b in second]  # a new shuffle
    assert any(s is None for b in first for s in b[3])
    assert all(s is not None for b in last for s in b[3])
    assert all(b[0].shape[-2:] == (IMGSZ, IMGSZ) for b in last)


@pytest.mark.parametrize("engine,run", HOLDERS)
def test_held_batches_never_change(data, engine, run):
    """A batch is the caller's while any tensor of it lives: hold whole batches and, of others, only a
    one-image slice, through the rest of the epoch and a second one (every slot the engine has is
    rendered into again meanwhile), and they still hold what was delivered, which is what the common loop
    gets. Holding more batches than the engine has spare slots makes the engines that reuse slots copy
    (or, ray, take the object store), and they say so."""
    hold = 6  # one batch per image: 8 per epoch, more than the spare slots of any engine's ring
    with make(data, engine, run, batch_size=1) as fl:
        reference = epoch(fl)
    held, slices = [], []
    with make(data, engine, run, batch_size=1) as fl:
        for k, (imgs, targets, paths, shapes) in enumerate(fl):
            if k < hold:
                held.append(((imgs, targets, paths, shapes), (imgs.clone(), targets.clone())))
            else:
                part = imgs[0]  # the batch itself is dropped: only this view of its pixels lives on
                slices.append((part, part.clone()))
        assert len(held) == hold and slices
        fl.set_epoch(1)
        for _ in fl:
            pass
        copied = fl.stats()["batches_copied"]
    for k, ((imgs, targets, paths, shapes), (imgs_then, targets_then)) in enumerate(held):
        unchanged = torch.equal(imgs, imgs_then)  # (not in the assert: pytest would print both tensors)
        assert unchanged, f"held batch {k}'s pixels changed"
        assert torch.equal(targets, targets_then) and (paths, shapes) == reference[k][2:]
        assert torch.equal(imgs, reference[k][0]) and torch.equal(targets, reference[k][1])
    for k, (part, then) in enumerate(slices):
        unchanged = torch.equal(part, then)
        assert unchanged, f"the held slice of batch {hold + k} changed"
        assert torch.equal(part, reference[hold + k][0][0])
    reuses_slots = engine == "cpu" or (engine == "ray" and run["engine_options"].get("delivery") != "object_store")
    assert (copied > 0) == reuses_slots, copied


@pytest.mark.parametrize("engine,run", ENGINES)
def test_unknown_and_inapplicable_options_are_refused(data, engine, run):
    cls, field = OPTIONS[engine]
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus_option'"):
        make(data, engine, run, bogus_option=1)
    with pytest.raises(EngineOptionError, match=f"engine {engine!r} has no option 'bogus_option'"):
        make(data, engine, run, engine_options={"bogus_option": 1})
    fields = {n: [f.name for f in dataclasses.fields(c)] for n, (c, _) in OPTIONS.items()}
    for other, (other_cls, other_field) in OPTIONS.items():
        if other == engine:
            continue
        with pytest.raises(EngineOptionError, match=f"engine {engine!r} takes {cls.__name__}"):
            make(data, engine, run, engine_options=other_cls())
        if other_field in fields[engine]:  # cpu's fields are all ray's too (HostRenderOptions, keep)
            continue
        owners = [repr(n) for n in OPTIONS if n != engine and other_field in fields[n]]
        with pytest.raises(EngineOptionError, match=f"engine {engine!r} has no option {other_field!r} \\(an option of "
                                                    f"engines? {' and '.join(owners)}\\)"):
            make(data, engine, run, engine_options={other_field: 1})
    for refused in refused_settings(engine):
        (name, value), = refused.items()
        with pytest.raises(EngineOptionError, match=f"engine {engine!r} cannot take {name}={value!r}"):
            make(data, engine, run, **refused)
    if not engine_class(engine).accepts_gpu_store:
        with pytest.raises(ValueError, match=f"engine='{engine}' cannot use store='gpu'"):
            make(data, engine, run, store="gpu")
    with pytest.raises(ValueError, match="layout"):
        make(data, engine, run, layout="chw")
    with pytest.raises(ValueError, match="hsv_on"):
        make(data, engine, run, hsv_on="gpu")
    with pytest.raises(ValueError, match="partners must be None or one of dataset, batch"):
        make(data, engine, run, partners="epoch")
    for no_mosaic in (dict(augment=False), dict(rect=True), dict(hyp={"mosaic": 0.0})):
        with pytest.raises(ValueError, match="partners='batch' applies to mosaic training batches only"):
            make(data, engine, run, partners="batch", **no_mosaic)
    # one build for the last two checks (a ray engine's is an actor process): without mosaic, partners left unset
    # takes the engine's default silently; and a field of the engine's own options is taken
    own_field = {**run.get("engine_options", {}), field: getattr(cls(), field)}
    with make(data, engine, run, augment=False, rect=True, engine_options=own_field) as fl:
        assert fl.stats()["partners"] == fl.engine.default_partners
        assert isinstance(fl.engine.options, cls) and getattr(fl.engine.options, field) == getattr(cls(), field)


def test_options_objects_validate_their_values():
    with pytest.raises(EngineOptionError, match="engine 'cpu': keep"):
        CPUOptions(keep=0)
    with pytest.raises(EngineOptionError, match="engine 'cpu': decode_scale"):
        CPUOptions(decode_scale="half")
    with pytest.raises(EngineOptionError, match="engine 'gpu': decode_on"):
        TorchGPUOptions(decode_on="nvjpeg")
    with pytest.raises(EngineOptionError, match="engine 'dali': threads"):
        DALIOptions(threads=0)
