"""Model configs: every bundled config builds, forward shapes, published sizes, PGI re-parameterisation, fusion."""
from __future__ import annotations

import copy

import pytest
import torch

from yolov9.models import (CFG_DIR, DetectionModel, count_flops, count_params, load_cfg, reparameterize,
                           resolve_cfg)
from yolov9.models.heads import DDetect, DualDDetect

# Published sizes of the converted (auxiliary branch removed, fused) models at 640: params (M), GFLOPs.
PUBLISHED = {"t": (2.0, 7.7), "s": (7.1, 26.4), "m": (20.0, 76.3), "c": (25.3, 102.1), "e": (57.3, 189.0)}
ALL_CFGS = sorted(p.stem for p in CFG_DIR.glob("*.yaml"))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def built():
    """Every bundled config, built once for the module (building E takes a few seconds), with one intra-op
    thread as the tests (one_torch_thread): with two, a loaded suite run took 53 s here instead of 5."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {name: DetectionModel(f"{name}.yaml") for name in ALL_CFGS}
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def converted(built):
    """``converted(size)``: YOLOv9-<size> re-parameterised, once for the module (E takes seconds: it builds GELAN-E).
    Callers that change it (fuse) take a deep copy."""
    cache: dict[str, DetectionModel] = {}

    def get(size: str) -> DetectionModel:
        if size not in cache:
            cache[size] = reparameterize(built[f"yolov9-{size}"])
        return cache[size]

    return get


def test_bundled_configs_present():
    for size in PUBLISHED:
        assert f"yolov9-{size}" in ALL_CFGS and f"gelan-{size}" in ALL_CFGS


def test_bare_name_resolves_to_bundled_config(tmp_path):
    assert resolve_cfg("yolov9-s.yaml") == CFG_DIR / "yolov9-s.yaml"
    assert resolve_cfg("gelan-c") == CFG_DIR / "gelan-c.yaml"
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        resolve_cfg("nope.yaml")


@pytest.mark.parametrize("name", ALL_CFGS)
def test_every_config_builds_with_strides_and_head(built, name):
    m = built[name]
    assert m.stride.tolist() == [8.0, 16.0, 32.0]
    assert isinstance(m.head, DualDDetect if name.startswith("yolov9") else DDetect)
    assert m.is_dual == name.startswith("yolov9")


@pytest.mark.parametrize("name", ["yolov9-t", "yolov9-c", "gelan-s", "gelan-e"])
def test_forward_shapes(built, name):
    m = built[name]
    x = torch.rand(2, 3, 64, 96)
    m.train()
    out = m(x)
    branches = out if m.is_dual else [out]
    for feats in branches:
        assert [tuple(f.shape) for f in feats] == [(2, 80 + 64, 64 // s, 96 // s) for s in (8, 16, 32)]
    m.eval()
    with torch.no_grad():
        y, raw = m(x)
    anchors = sum((64 // s) * (96 // s) for s in (8, 16, 32))
    assert y.shape == (2, 4 + 80, anchors)
    assert torch.all((y[:, 4:] >= 0) & (y[:, 4:] <= 1))
    m.train()


@pytest.mark.parametrize("size", list(PUBLISHED))
def test_converted_sizes_match_published(built, converted, size):
    """Re-parameterised YOLOv9-X (fused, as evaluated) within 3 % of the published params and GFLOPs."""
    conv = copy.deepcopy(converted(size)).eval().fuse()
    params_m = count_params(conv) / 1e6
    pub_p, pub_f = PUBLISHED[size]
    assert params_m == pytest.approx(pub_p, rel=0.03)
    if size in ("t", "s"):  # FLOP counting at 640 is slow for the big ones; T and S cover the head formula
        assert count_flops(conv, 640) == pytest.approx(pub_f, rel=0.03)
    # The converted model is the GELAN network of the same size.
    gelan = copy.deepcopy(built[f"gelan-{size}"]).eval().fuse()
    assert count_params(gelan) == count_params(conv)


def test_reparameterize_keeps_main_branch_outputs(built):
    dual = copy.deepcopy(built["yolov9-t"])
    torch.manual_seed(0)
    with torch.no_grad():  # non-trivial BN statistics so that fusion is actually exercised
        for mod in dual.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                mod.running_mean.uniform_(-0.1, 0.1)
                mod.running_var.uniform_(0.5, 1.5)
    dual.eval()
    single = reparameterize(dual).eval()
    assert not single.is_dual and count_params(single) < count_params(dual)
    x = torch.rand(1, 3, 96, 128)
    with torch.no_grad():
        y_dual, _ = dual(x)
        y_single, _ = single(x)
        y_fused, _ = copy.deepcopy(single).fuse()(x)
    torch.testing.assert_close(y_single, y_dual, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(y_fused, y_dual, rtol=1e-4, atol=1e-2)
    # the converted config is self-contained: it rebuilds and takes the weights back
    rebuilt = DetectionModel(single.yaml)
    rebuilt.load_state_dict(single.state_dict())


def test_silence_backbone_reparameterize(converted):
    """YOLOv9-C/E keep layer 0 (the image) and the routing they need; the aux neck goes."""
    single = converted("c")
    assert len(single.model) == 24  # Silence + 22 GELAN-C layers + DDetect
    e = converted("e")
    assert len(e.model) == 43  # GELAN-E: 42 layers + DDetect


def test_width_and_depth_multiples_shrink_model():
    cfg = load_cfg("gelan-s.yaml")
    cfg["width_multiple"], cfg["depth_multiple"] = 0.25, 0.34
    small = DetectionModel(cfg, nc=3)
    assert count_params(small) < count_params(DetectionModel("gelan-s.yaml", nc=3)) / 5
    y = small.eval()(torch.rand(1, 3, 64, 64))[0]
    assert y.shape == (1, 7, 64 + 16 + 4)


def test_bad_configs_fail_clearly(tmp_path):
    bad = {"nc": 2, "backbone": [[-1, 1, "Conv", [8, 3, 2]]], "head": [[-1, 1, "Bogus", []]]}
    with pytest.raises(ValueError, match="Bogus"):
        DetectionModel(bad)
    fwd = {"nc": 2, "backbone": [[-1, 1, "Conv", [8, 3, 2]], [5, 1, "Conv", [8, 3, 2]]], "head": []}
    with pytest.raises(ValueError, match="layer 1"):
        DetectionModel(fwd)
    p = tmp_path / "x.yaml"
    p.write_text("nc: 2\nbackbone: 3\n")
    with pytest.raises(ValueError, match="x.yaml"):
        DetectionModel(p)


def test_official_style_yaml_loads(built, tmp_path):
    """Official files spell Python names as YAML strings (None, 'nearest'), keep an anchors key, use flow lists."""
    cfg = load_cfg("yolov9-t.yaml")
    rows = []
    for f, n, m, args in cfg["backbone"] + cfg["head"]:
        args_txt = ", ".join("None" if a is None else (f"'{a}'" if isinstance(a, str) else str(a)) for a in args)
        rows.append(f"   [{f}, {n}, {m}, [{args_txt}]],")
    nb = len(cfg["backbone"])
    text = ("nc: 80\ndepth_multiple: 1.0\nwidth_multiple: 1.0\nanchors: 3\nbackbone:\n  [\n"
            + "\n".join(rows[:nb]) + "\n  ]\nhead:\n  [\n" + "\n".join(rows[nb:]) + "\n  ]\n")
    assert "[None, 2, 'nearest']" in text
    path = tmp_path / "official-style.yaml"
    path.write_text(text.replace("'nc'", "nc"))
    official = DetectionModel(path)
    assert count_params(official) == count_params(built["yolov9-t"])  # DetectionModel("yolov9-t.yaml")


def test_cls_width_key_and_loading_weights_of_another_width(built, tmp_path):
    # The official code's class tower is max(ch_P3, min(2 nc, 128)) wide: 128 for T at 80 classes, where the
    # default (the published sizes) is 80. A config key builds it; loading such weights infers it.
    from yolov9.checkpoint import load_model

    cfg = load_cfg("gelan-t.yaml")
    assert cfg["nc"] == 80 and built["gelan-t"].head.cv3[0][0].conv.weight.shape[0] == 80  # DetectionModel(cfg)
    wide = DetectionModel(dict(cfg, cls_width=128), nc=80)
    assert wide.head.cv3[0][0].conv.weight.shape[0] == 128
    torch.save(wide.state_dict(), tmp_path / "wide.pt")
    loaded, _ = load_model(tmp_path / "wide.pt", cfg="gelan-t")
    assert loaded.yaml["cls_width"] == 128
    got = loaded.state_dict()  # once: state_dict() walks every module
    for k, v in wide.state_dict().items():
        assert torch.equal(got[k], v)
