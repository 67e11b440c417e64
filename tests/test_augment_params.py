"""hyp loading, the parameter sampler (determinism, shapes, rect, close_mosaic) and its
distributions compared with the stock algorithm's own draws."""
from __future__ import annotations

import numpy as np
import pytest

from fastload.augment.hyp import HYP_SCRATCH_HIGH, load_hyp
from fastload.augment.params import (
    ParamSampler,
    SampleParams,
    _mosaic4_placements,
    per_index_shapes,
    rect_batch_shapes,
)
from fastload.augment.boxes import transform_labels
from tests.augment_helpers import random_world
from fastload.bench.stock import StockAugmenter

SHAPES = np.array([[480, 640], [640, 427], [640, 640], [20, 30], [300, 640], [640, 200]])


# ----------------------------------------------------------------------------------------- hyp
def test_hyp_defaults_and_merge(tmp_path):
    assert load_hyp(None) == {**HYP_SCRATCH_HIGH}
    merged = load_hyp({"mixup": 0.0, "my_key": 3})
    assert merged["mixup"] == 0.0 and merged["my_key"] == 3 and merged["scale"] == 0.9
    f = tmp_path / "hyp.yaml"
    f.write_text("lr0: 0.02\ndfl: 1.5\nmosaic: 0.5\ndfl: 1.5\nextra: abc\n")  # duplicated key as upstream
    h = load_hyp(f)
    assert h["lr0"] == 0.02 and h["mosaic"] == 0.5 and h["dfl"] == 1.5 and h["extra"] == "abc"
    assert h["fliplr"] == 0.5  # missing key filled


def test_hyp_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_hyp(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="bad.yaml"):
        load_hyp(bad)
    with pytest.raises(ValueError, match="mosaic"):
        load_hyp({"mosaic": "yes"})


# ------------------------------------------------------------------------------------ records
def test_determinism_and_epochs():
    a = ParamSampler(SHAPES, None, 640, seed=3)
    b = ParamSampler(SHAPES, None, 640, seed=3)
    for i in range(len(SHAPES)):
        assert a.sample(5, i) == b.sample(5, i)
        assert a.sample(5, i) != a.sample(6, i)
    assert a.sample(5, 1) != ParamSampler(SHAPES, None, 640, seed=4).sample(5, 1)
    # sampling order does not matter (pure function of seed, epoch, index)
    later = [a.sample(5, i) for i in reversed(range(len(SHAPES)))][::-1]
    assert later == [b.sample(5, i) for i in range(len(SHAPES))]


def test_records_are_frozen():
    p = ParamSampler(SHAPES, None, 640).sample(0, 0)
    with pytest.raises(Exception):
        p.flip_lr = True  # type: ignore[misc]
    with pytest.raises(ValueError):
        p.image.tiles[0].matrix[0, 0] = 2.0


def test_mosaic_record_layout():
    s = ParamSampler(SHAPES, {"mixup": 1.0}, 640, seed=0)
    for i in range(len(SHAPES)):
        p = s.sample(0, i)
        assert p.mosaic and p.shapes is None and p.image.out_hw == (640, 640)
        assert i in [t.src for t in p.image.tiles] or len(p.image.tiles) < 4
        assert p.mixup is not None and 0.2 < p.mixup_ratio < 0.8
        for t in p.image.tiles + p.mixup.tiles:
            h, w = SHAPES[t.src]
            x0, y0, x1, y1 = t.crop
            assert 0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h
            assert t.src_hw == (h, w) and t.is_axis_aligned
            assert 0.1 <= t.matrix[0, 0] <= 1.9


def test_close_mosaic_and_validation():
    s = ParamSampler(SHAPES, None, 640, seed=0)
    s.close_mosaic()
    for i in range(len(SHAPES)):
        p = s.sample(1, i)
        assert not p.mosaic and p.mixup is None and len(p.image.tiles) == 1 and p.shapes is not None
        assert p.image.candidate_scale is not None  # still random perspective
    v = ParamSampler(SHAPES, None, 640, augment=False)
    p = v.sample(0, 0)
    assert p.hsv_gain == (1.0, 1.0, 1.0) and not p.flip_lr and not p.flip_ud and p.image.candidate_scale is None
    assert v.sample(0, 0).image == v.sample(9, 0).image


def test_letterbox_shapes_tuple_huge_and_tiny():
    orig = np.array([[4000, 3000], [20, 30]])
    loaded = np.array([[640, 480], [20, 30]])
    v = ParamSampler(loaded, None, 640, augment=False, orig_shapes=orig)
    p = v.sample(0, 0)
    assert p.shapes == ((4000, 3000), ((640 / 4000, 480 / 3000), (80.0, 0.0)))
    t = p.image.tiles[0]
    assert t.crop == (0, 0, 480, 640) and np.allclose(t.matrix, [[1, 0, 80], [0, 1, 0], [0, 0, 1]])
    tiny = v.sample(0, 1)  # validation never upscales
    assert tiny.shapes == ((20, 30), ((1.0, 1.0), (305.0, 310.0)))
    assert np.allclose(tiny.image.tiles[0].matrix[:2, :2], np.eye(2))
    train = ParamSampler(loaded, {"mosaic": 0.0}, 640, orig_shapes=orig).sample(0, 1)
    assert train.shapes[1][1] == (0.0, 106.5)  # training letterbox upscales: 30 -> 640 wide


def test_rect_batch_shapes():
    rng = np.random.default_rng(0)
    shapes = rng.integers(100, 1000, size=(37, 2))
    order, bs = rect_batch_shapes(shapes, 8, 640, stride=32, pad=0.5)
    assert sorted(order.tolist()) == list(range(37)) and bs.shape == (5, 2)
    ar = shapes[order, 0] / shapes[order, 1]
    assert (np.diff(ar) >= 0).all()
    assert (bs % 32 == 0).all() and (bs <= 640 + 32).all()
    per = per_index_shapes(order, bs, 8)
    for i in range(37):  # every image fits its batch shape once letterboxed to 640
        h, w = shapes[i]
        r = 640 / max(h, w)
        assert per[i][0] >= round(h * r) - 1 and per[i][1] >= round(w * r) - 1
    # all-landscape batch: full width, height from the largest h/w; pad 0.5 adds a stride (as stock)
    order, bs = rect_batch_shapes(np.array([[320, 640], [480, 640]]), 2, 640)
    assert bs.tolist() == [[512, 672]]
    assert rect_batch_shapes(np.array([[320, 640], [480, 640]]), 2, 640, pad=0.0)[1].tolist() == [[480, 640]]
    s = ParamSampler(shapes, None, 640, augment=False, rect_shapes=per)
    for i in range(37):
        p = s.sample(0, i)
        assert p.image.out_hw == tuple(per[i]) and not p.mosaic


# ----------------------------------------------------------------------- distributions vs stock
def _synthetic_world(n=16, imgsz=160, seed=0):
    return random_world(n, imgsz, seed, max_boxes=6, nc=3, wh=(0.05, 0.5))


def test_distributions_match_stock():
    imgsz, n_draw = 160, 400
    shapes, labels = _synthetic_world(imgsz=imgsz)
    images = [np.full((h, w, 3), 100, np.uint8) for h, w in shapes]
    stock = StockAugmenter(images.__getitem__, labels, shapes, imgsz, None, seed=1)
    ours = ParamSampler(shapes, None, imgsz, seed=1)
    st = {"mosaic": [], "mixup": [], "flip": [], "gains": [], "nbox": [], "centres": []}
    us = {k: [] for k in st}
    for k in range(n_draw):
        i = k % len(shapes)
        _, lab, _ = stock(i)
        st["mixup"].append(stock.last["mixup"])
        st["flip"].append(stock.last["flip_lr"])
        st["gains"].append(stock.last["gains"])
        st["nbox"].append(len(lab))
        st["centres"] += stock.last["centres"]
        p: SampleParams = ours.sample(k // len(shapes), i)
        us["mixup"].append(p.mixup is not None)
        us["flip"].append(p.flip_lr)
        us["gains"].append(p.hsv_gain)
        us["nbox"].append(len(transform_labels(p, labels)))
        pl = _mosaic4_placements(np.random.default_rng(k), imgsz, [tuple(shapes[j]) for j in range(4)])
        crop, (ox, oy) = pl[0]
        us["centres"].append((crop[2] + ox, crop[3] + oy))
    for d in (st, us):
        assert abs(np.mean(d["mixup"]) - 0.15) < 0.06
        assert abs(np.mean(d["flip"]) - 0.5) < 0.08
        g = np.array(d["gains"])
        assert (np.abs(g - 1) <= [0.015, 0.7, 0.4]).all()
        assert np.allclose(g.mean(0), 1, atol=[0.003, 0.07, 0.04])
        assert np.allclose(g.std(0), np.array([0.015, 0.7, 0.4]) / np.sqrt(3), rtol=0.15)
        c = np.array(d["centres"])
        assert c.min() >= imgsz // 2 and c.max() < imgsz * 3 // 2
        assert abs(c.mean() - imgsz) < imgsz * 0.05
    # boxes per output image: same mean within sampling noise
    m_st, m_us = np.mean(st["nbox"]), np.mean(us["nbox"])
    se = np.hypot(np.std(st["nbox"]), np.std(us["nbox"])) / np.sqrt(n_draw)
    assert abs(m_st - m_us) < 4 * se + 0.2, (m_st, m_us)


def test_batched_perspective_draws_equal_scalar_uniform_draws():
    """_perspective draws its eight uniforms in one call; they must equal rng.uniform's, one by one."""
    import math

    hyp = {"degrees": 7.0, "shear": 3.0, "perspective": 0.0004, "translate": 0.2, "scale": 0.6}
    s = ParamSampler(np.array([[480, 640]]), hyp, 640, seed=0)
    h = s.hyp
    for seed in range(5):
        m, scale = s._perspective(np.random.default_rng(seed), (1280, 1280), (640, 640))
        rng = np.random.default_rng(seed)
        px, py = rng.uniform(-h["perspective"], h["perspective"]), rng.uniform(-h["perspective"], h["perspective"])
        angle, want_scale = rng.uniform(-h["degrees"], h["degrees"]), rng.uniform(1 - h["scale"], 1 + h["scale"])
        shx, shy = rng.uniform(-h["shear"], h["shear"]), rng.uniform(-h["shear"], h["shear"])
        tx, ty = rng.uniform(0.5 - h["translate"], 0.5 + h["translate"]), rng.uniform(0.5 - h["translate"], 0.5 + h["translate"])
        assert scale == want_scale
        c = np.array([[1, 0, -640], [0, 1, -640], [0, 0, 1.0]])
        p = np.array([[1, 0, 0], [0, 1, 0], [px, py, 1.0]])
        a, b = want_scale * math.cos(math.radians(angle)), want_scale * math.sin(math.radians(angle))
        r = np.array([[a, b, 0], [-b, a, 0], [0, 0, 1.0]])
        sh = np.array([[1, math.tan(math.radians(shx)), 0], [math.tan(math.radians(shy)), 1, 0], [0, 0, 1.0]])
        t = np.array([[1, 0, tx * 640], [0, 1, ty * 640], [0, 0, 1.0]])
        assert np.array_equal(m, t @ sh @ r @ p @ c)
