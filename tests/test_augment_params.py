"""hyp loading, the parameter sampler (determinism, shapes, rect, close_mosaic) and its
distributions compared with the stock algorithm's own draws."""
from __future__ import annotations

import math

import numpy as np
import pytest

from fastload.augment.hyp import HYP_SCRATCH_HIGH, load_hyp
from fastload.augment.params import (
    ParamSampler,
    SampleParams,
    _mosaic4_placements,
    per_index_shapes,
    recent_window,
    rect_batch_shapes,
    translation,
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


# ----------------------------------------------------------------------- partners="batch"
def _epoch_use_counts(sampler: ParamSampler, n: int, batch_size: int, epoch: int = 0) -> np.ndarray:
    """How often each image is drawn (as any tile, main or mixup) over one shuffled epoch."""
    from fastload.order import epoch_indices

    counts = np.zeros(n, np.int64)
    order = epoch_indices(n, epoch, seed=sampler.seed, shuffle=True, rank=-1, world_size=1, drop_last=False)
    for start in range(0, n, batch_size):
        for rec in sampler.sample_batch(epoch, order[start : start + batch_size]):
            np.add.at(counts, list(rec.sources), 1)
    return counts


def _mean_var_se(c: np.ndarray) -> tuple[float, float, float, float]:
    """Sample mean and variance of the use counts with their standard errors (from the sample's own
    second and fourth central moments)."""
    n = len(c)
    x = c - c.mean()
    var = float((x**2).sum() / (n - 1))
    m4 = float((x**4).mean())
    se_var = math.sqrt(max(m4 - var**2 * (n - 3) / (n - 1), 0.0) / n)
    return float(c.mean()), var, math.sqrt(var / n), se_var


def test_batch_partners_use_each_image_as_often_as_dataset_partners():
    """Over an epoch, the mean and the spread of the number of times each image is used match
    YOLOv9's dataset-wide draw within 4 standard errors of the two estimates (the errors come from
    the counts themselves); a draw biased toward some images of each batch lies far outside."""
    n, b = 512, 16
    shapes = np.random.default_rng(0).integers(200, 640, (n, 2))
    hyp = {"mixup": 0.15}  # scratch-high otherwise
    stats = {}
    for partners in ("dataset", "batch"):
        stats[partners] = _mean_var_se(_epoch_use_counts(ParamSampler(shapes, hyp, 640, seed=5, partners=partners), n, b))
    (m_d, v_d, sm_d, sv_d), (m_b, v_b, sm_b, sv_b) = stats["dataset"], stats["batch"]
    assert 4.0 < m_d < 5.2 and v_d > 2.0  # ~4.6 uses per image (4 tiles + mixup's), Poisson-like spread
    assert abs(m_b - m_d) < 4 * math.hypot(sm_d, sm_b), (m_d, m_b)
    assert abs(v_b - v_d) < 4 * math.hypot(sv_d, sv_b), (v_d, v_b)

    # negative control: partners always the first images of the batch -> the spread explodes
    biased = ParamSampler(shapes, hyp, 640, seed=5, partners="batch")
    biased._draw = lambda rng, n_, pool, k: pool[:k].tolist() if pool is not None else [0] * k  # type: ignore[method-assign]
    _, v_x, _, sv_x = _mean_var_se(_epoch_use_counts(biased, n, b))
    assert abs(v_x - v_d) > 4 * math.hypot(sv_d, sv_x)


def test_batch_partners_come_from_the_batch_and_depend_on_it():
    shapes = np.random.default_rng(1).integers(100, 640, (64, 2))
    s = ParamSampler(shapes, {"mixup": 1.0}, 320, seed=2, partners="batch")
    batch = np.arange(8, 24)
    recs = s.sample_batch(3, batch)
    assert all(set(r.sources) <= set(batch.tolist()) and r.mixup is not None for r in recs)
    assert recs == s.sample_batch(3, batch)  # a pure function of (seed, epoch, index, batch)
    assert [s.sample(3, int(i), batch=batch) for i in batch] == recs
    other = s.sample_batch(3, np.concatenate([batch[:8], np.arange(40, 48)]))
    assert [r.sources for r in other[:8]] != [r.sources for r in recs[:8]]  # another batch, other partners
    assert [r.hsv_gain for r in other[:8]] == [r.hsv_gain for r in recs[:8]]  # the rest of the draw is the sample's
    with pytest.raises(ValueError, match="partners='batch' draws from the sample's batch"):
        s.sample(3, 8)
    with pytest.raises(ValueError, match="partners must be one of dataset, batch"):
        ParamSampler(shapes, None, 320, partners="epoch")  # type: ignore[arg-type]
    # dataset mode ignores the batch: YOLOv9's records, unchanged
    d = ParamSampler(shapes, None, 320, seed=2)
    assert d.sample_batch(3, batch) == [d.sample(3, int(i)) for i in batch]
    # letterbox records (validation) have no partners: identical under both settings
    v = [ParamSampler(shapes, None, 320, augment=False, partners=p) for p in ("dataset", "batch")]
    assert v[0].sample_batch(0, batch) == v[1].sample_batch(0, batch)


# ----------------------------------------------------------------------- partners="recent"
def test_recent_partners_come_from_the_window_of_the_epoch_order():
    """Ultralytics' buffer as a function of the order: a mosaic's partners are images of the last `window`
    positions up to the sample's own (its own included; at an epoch's start the previous epoch's last ones),
    the mixup image is uniform over the dataset; the records are a pure function of the seed and the order."""
    from fastload.order import EpochOrder

    n, b = 64, 4
    shapes = np.random.default_rng(1).integers(100, 640, (n, 2))
    order = EpochOrder(n, b, seed=7)
    window = recent_window(n, b)
    assert window == 31 and recent_window(5000, 256) == 999 and recent_window(3, 64) == 2
    hyp = {"mosaic": 1.0, "mixup": 1.0}
    s = ParamSampler(shapes, hyp, 320, seed=2, partners="recent", epoch_order=order, window=window, recipe="ultralytics")
    o0, o1 = order(0), order(1)
    assert s.recent(0, int(o0[0])).tolist() == [o0[0]]  # the first sample of the run: its own image only
    assert s.recent(1, int(o1[0])).tolist() == [*o0[-30:], o1[0]]  # crosses into epoch 0's tail
    assert s.recent(1, int(o1[40])).tolist() == o1[10:41].tolist()
    mixup_outside = 0
    for p, i in enumerate(o1.tolist()):
        rec = s.sample(1, i)
        pool = set(s.recent(1, i).tolist())
        assert {t.src for t in rec.image.tiles} <= pool and rec.image.tiles[0].src == i
        mixup_outside += rec.mixup.tiles[0].src not in pool  # type: ignore[union-attr]
    assert mixup_outside > 10  # the mixup image comes from the whole dataset
    fresh = ParamSampler(shapes, hyp, 320, seed=2, partners="recent", epoch_order=EpochOrder(n, b, seed=7),
                         window=window, recipe="ultralytics")
    assert fresh.sample_batch(1, o1[8:12]) == s.sample_batch(1, o1[8:12]) == [s.sample(1, int(i)) for i in o1[8:12]]
    other = ParamSampler(shapes, hyp, 320, seed=2, partners="recent", epoch_order=EpochOrder(n, b, seed=8),
                         window=window, recipe="ultralytics")
    i = int(o1[50])
    assert other.sample(1, i).sources != s.sample(1, i).sources  # another order, other partners
    assert other.sample(1, i).hsv_gain == s.sample(1, i).hsv_gain  # the rest of the draw is the sample's
    with pytest.raises(ValueError, match="partners='recent' draws from the last `window` images"):
        ParamSampler(shapes, hyp, 320, partners="recent")
    with pytest.raises(IndexError, match="not in the epoch order of epoch 0"):
        ParamSampler(shapes, hyp, 320, partners="recent", epoch_order=EpochOrder(n, b, rank=0, world_size=2),
                     window=window).sample(0, int(EpochOrder(n, b, rank=1, world_size=2)(0)[0]))


# ----------------------------------------------------------------------------------------- ultralytics recipe
def test_ultralytics_recipe_draws():
    """Ultralytics' recipe: the sample's own image is always the top-left mosaic tile (YOLOv9 shuffles it
    among its partners), mosaics are imgsz square, every record carries the additive-hue rule."""
    ours = ParamSampler(SHAPES, {"mosaic": 1.0, "mixup": 0.0}, 64, seed=3, recipe="ultralytics")
    yolo = ParamSampler(SHAPES, {"mosaic": 1.0, "mixup": 0.0}, 64, seed=3)
    recs = [ours.sample(0, i % len(SHAPES)) for i in range(40)]
    assert all(r.mosaic and r.image.out_hw == (64, 64) and r.hsv_rule == "ultralytics" for r in recs)
    for r in recs:
        top_left = r.image.tiles[0]
        assert top_left.src == r.index
        # its visible part ends at the mosaic centre: the crop's bottom-right corner is the loaded image's
        assert (top_left.crop.x1, top_left.crop.y1) == (top_left.src_hw[1], top_left.src_hw[0])
    assert any(yolo.sample(0, i).image.tiles[0].src != i for i in range(len(SHAPES)))
    assert all(yolo.sample(0, i).hsv_rule == "yolov9" for i in range(len(SHAPES)))


def test_ultralytics_recipe_mixup_and_centred_samples():
    """Without mosaic, Ultralytics warps the loaded image about its centre straight into the output (no
    letterbox) and still mixes up (YOLOv9 mixes only mosaics); rect batches and validation draw neither."""
    hyp = {"mosaic": 0.0, "mixup": 1.0, "degrees": 0.0, "scale": 0.0, "translate": 0.0, "shear": 0.0}
    ours = ParamSampler(SHAPES, hyp, 64, seed=1, recipe="ultralytics")
    for i in range(len(SHAPES)):
        r = ours.sample(0, i)
        assert not r.mosaic and r.mixup is not None and r.shapes[1][1] == (0.0, 0.0) and 0 < r.mixup_ratio < 1
        h, w = ours.loaded_shapes[i]
        # no scale, rotation or translation: the loaded image's centre lands on the output's
        np.testing.assert_allclose(r.image.tiles[0].matrix, translation(32 - w / 2, 32 - h / 2), atol=1e-12)
        assert r.image.candidate_scale == 1.0
    assert all(ParamSampler(SHAPES, hyp, 64, seed=1).sample(0, i).mixup is None for i in range(len(SHAPES)))
    rect = ParamSampler(SHAPES, hyp, 64, seed=1, recipe="ultralytics", rect_shapes=np.full((len(SHAPES), 2), 64))
    assert rect.mixup_prob == 0.0 and all(rect.sample(0, i).mixup is None for i in range(len(SHAPES)))
    with pytest.raises(ValueError, match="recipe must be one of yolov9, ultralytics"):
        ParamSampler(SHAPES, None, 64, recipe="ultra")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no 9-tile mosaic"):
        ParamSampler(SHAPES, None, 64, recipe="ultralytics", mosaic9=True)


def test_ultralytics_recipe_validation_boxes_follow_the_integer_pad():
    """Validation letterbox: the same pixels either way; YOLOv9 moves boxes by the float pad, Ultralytics by
    the pixels' integer pad (and records that pad)."""
    shapes = np.array([[64, 43]])  # 21 px of pad: 10.5 on each side, the pixels' left pad is 10
    ours = ParamSampler(shapes, None, 64, augment=False, recipe="ultralytics").sample(0, 0)
    yolo = ParamSampler(shapes, None, 64, augment=False).sample(0, 0)
    np.testing.assert_array_equal(ours.image.tiles[0].matrix, yolo.image.tiles[0].matrix)
    assert ours.image.tiles[0].box_matrix[0, 2] == 10.0 and yolo.image.tiles[0].box_matrix[0, 2] == 10.5
    assert ours.shapes[1][1] == (10.0, 0.0) and yolo.shapes[1][1] == (10.5, 0.0)
