"""Pixel kernels: fast tile path vs the stock canvas + warpAffine, HSV, mixup, flips, odd inputs."""
from __future__ import annotations

import math

import cv2
import numpy as np
import pytest

from fastload.augment.functional.color import apply_hsv, apply_hsv_reference
from fastload.augment.functional.flip import flip_inplace
from fastload.augment.functional import tiles
from fastload.augment.functional.tiles import render_image
from fastload.augment.params import ImageParams, ParamSampler, Rect, TileParams
from fastload.augment.pipeline import mixup_blend, render_sample
from tests.augment_helpers import load_folder, shapes_of, smooth_images
from fastload.bench.stock import augment_hsv, mixup_pixels
from tests.reference.stock_replay import render_image_record, render_record


KERNELS = ("warp", "resize")


def _parity(images, hyp, n, seed=0, axis_kernel=None):
    s = ParamSampler(shapes_of(images), hyp, 640, seed=seed)
    stats = []
    for i in range(n):
        p = s.sample(0, i % len(images))
        fast = render_sample(p, images.__getitem__, hsv=False, axis_kernel=axis_kernel)
        ref = render_record(p, images.__getitem__, hsv=False)
        d = np.abs(fast.astype(np.int16) - ref.astype(np.int16))
        stats.append((d.mean(), np.percentile(d, 99)))
    return np.array(stats)


@pytest.fixture(scope="module")
def coco_images(coco128_yaml):
    return load_folder(coco128_yaml.parent, 640, 24)


@pytest.mark.parametrize("kernel", KERNELS)
def test_parity_mosaic_coco128(coco_images, kernel):
    """Axis-aligned mosaics (scratch-high) on real photos: mean |diff| <= 1 level per image."""
    images, _ = coco_images
    st = _parity(images, {"mixup": 0.5}, 24, axis_kernel=kernel)
    assert st[:, 0].max() <= 1.0 and st[:, 0].mean() <= 0.5, st[:, 0]
    assert st[:, 1].max() <= 8, st[:, 1]  # 99 % of pixels within 8 levels (seams hold the rest)


@pytest.mark.parametrize("kernel", KERNELS)
def test_parity_mosaic_smooth_images(kernel):
    images = smooth_images(12, 640)
    st = _parity(images, {"mixup": 0.5}, 12, seed=3, axis_kernel=kernel)
    assert st[:, 0].max() <= 1.0, st[:, 0]


def test_scaled_warp_reads_only_what_it_needs():
    """The warp kernel copies only the source rows / columns the owned rectangle reads before
    warping; the result equals warping the whole crop with BORDER_REPLICATE (within 1 level on a
    few pixels: warpAffine rounds the matrix's translation to 1/1024 px, and the two translations
    differ). Random pixels make a tap range cut one row or column short fail loudly."""
    rng = np.random.default_rng(11)
    src = rng.integers(0, 256, (300, 420, 3)).astype(np.uint8)
    checked = 0
    for _ in range(300):
        a, b = (float(v) for v in rng.uniform(0.15, 2.5, 2))
        x0, y0 = int(rng.integers(0, 200)), int(rng.integers(0, 150))
        x1, y1 = int(rng.integers(x0 + 1, 421)), int(rng.integers(y0 + 1, 301))
        tx, ty = (float(v) for v in rng.uniform(-300, 300, 2))
        m = np.array([[a, 0, tx], [0, b, ty], [0, 0, 1]])
        tile = TileParams(0, (x0, y0, x1, y1), m, (300, 420))
        plan = tiles.tile_plan(tile, (300, 420), (320, 320), "warp")
        if plan.method is tiles.DrawMethod.SKIP:
            continue
        assert plan.method is tiles.DrawMethod.SCALED_WARP
        r = plan.rect
        got = np.zeros((320, 320, 3), np.uint8)
        assert tiles.draw_tile(got, src, tile, axis_kernel="warp") == r
        local = np.array([[a, 0, a * x0 + tx - r.x0], [0, b, b * y0 + ty - r.y0]])
        want = np.zeros_like(got)
        cv2.warpAffine(np.ascontiguousarray(src[y0:y1, x0:x1]), local, (r.x1 - r.x0, r.y1 - r.y0),
                       dst=want[r.y0:r.y1, r.x0:r.x1], flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
        d = np.abs(got.astype(int) - want)
        assert d.max() <= 1 and (d > 0).mean() < 0.01, (a, b, tx, ty, tile.crop)
        checked += 1
    assert checked > 100


def test_warp_kernel_keeps_exact_resizes_on_cv2_resize():
    """Under the warp kernel a letterbox tile (integer-size resize at an integer offset) still takes
    the resize plan; a mosaic tile takes the scaled warp."""
    images = smooth_images(4, 640, seed=2)
    s = ParamSampler(shapes_of(images), None, 640, augment=False)
    tile = s.sample(0, 0).image.tiles[0]
    assert tiles.tile_plan(tile, tile.src_hw, (640, 640), "warp").method is tiles.DrawMethod.RESIZE
    mosaic = ParamSampler(shapes_of(images), None, 640, seed=0).sample(0, 0)
    assert mosaic.mosaic
    plans = [tiles.tile_plan(t, t.src_hw, (640, 640), "warp") for t in mosaic.image.tiles]
    assert all(p.method in (tiles.DrawMethod.SCALED_WARP, tiles.DrawMethod.SKIP) for p in plans)
    assert any(p.method is tiles.DrawMethod.SCALED_WARP for p in plans)


def test_axis_kernel_is_checked():
    with pytest.raises(ValueError, match="axis_kernel"):
        tiles.check_axis_kernel("bicubic")
    assert tiles.check_axis_kernel(None) == tiles.default_axis_kernel() in KERNELS


@pytest.mark.parametrize("hyp", [{"degrees": 10.0, "shear": 4.0}, {"degrees": 5.0, "perspective": 0.0005}])
def test_parity_general_warp(hyp):
    """Rotation / shear / perspective go through warpAffine / warpPerspective of each crop."""
    images = smooth_images(8, 640, seed=1)
    st = _parity(images, hyp, 8)
    assert st[:, 0].max() <= 0.3, st[:, 0]


@pytest.mark.parametrize("kernel", KERNELS)
def test_letterbox_bit_exact(kernel):
    images = smooth_images(6, 640, seed=2) + [np.full((20, 30, 3), 7, np.uint8)]
    shapes = shapes_of(images)
    rect = np.array([[640, 672]] * 3 + [[480, 352]] * 4)
    for kw in ({}, {"rect_shapes": rect}):
        s = ParamSampler(shapes, None, 640, augment=False, **kw)
        for i in range(len(images)):
            p = s.sample(0, i)
            got = render_sample(p, images.__getitem__, axis_kernel=kernel)
            assert np.array_equal(got, render_record(p, images.__getitem__))


def test_training_letterbox_close_mosaic():
    images = smooth_images(6, 640, seed=4)
    s = ParamSampler(shapes_of(images), None, 640, seed=0)
    s.close_mosaic()
    for i in range(6):
        p = s.sample(2, i)
        d = np.abs(render_sample(p, images.__getitem__, hsv=False).astype(int) - render_record(p, images.__getitem__, hsv=False))
        assert d.mean() <= 1.0


def test_render_into_batch_view_and_flip():
    images = smooth_images(4, 320, seed=5)
    s = ParamSampler(shapes_of(images), {"fliplr": 1.0, "flipud": 1.0}, 320, seed=0)
    batch = np.zeros((4, 320, 320, 3), np.uint8)
    for i in range(4):
        p = s.sample(0, i)
        assert p.flip_lr and p.flip_ud
        ret = render_sample(p, images.__getitem__, out=batch[i], hsv=False)
        assert ret is batch[i] or np.shares_memory(ret, batch)
        unflipped = render_sample(p.__class__(**{**p.__dict__, "flip_lr": False, "flip_ud": False}), images.__getitem__, hsv=False)
        assert np.array_equal(batch[i], unflipped[::-1, ::-1])


def test_flip_helpers():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (5, 7, 3)).astype(np.uint8)
    for ud in (False, True):
        for lr in (False, True):
            want = img[:: -1 if ud else 1, :: -1 if lr else 1]
            assert np.array_equal(flip_inplace(img.copy(), ud, lr), want)


# ---------------------------------------------------------------------------------------- HSV
def _hsv_images():
    rng = np.random.default_rng(0)
    imgs = smooth_images(2, 256, seed=6)
    imgs.append(rng.integers(0, 256, (64, 256, 3)).astype(np.uint8))  # saturated, noisy colours
    return imgs


@pytest.mark.parametrize("transform", [True, False])
@pytest.mark.parametrize("rule", ["yolov9", "ultralytics"])
def test_hsv_fast_matches_stock_luts(transform, rule, monkeypatch):
    """apply_hsv == the stock LUT path, bit for bit, with either middle step (cv2.transform with the hue wrapped
    on the pixels that need it, OpenCV 5; the 3-channel LUT, OpenCV 4), for hue moved up, down and not at all."""
    from fastload.augment.functional import color

    monkeypatch.setattr(color, "TRANSFORM_MIDDLE", transform)
    rng = np.random.default_rng(1)
    middles = set()
    for img in _hsv_images():
        for _ in range(25):
            g = rng.uniform(-1, 1, 3) * [0.015, 0.7, 0.4] + 1
            for gh in (g[0], 1.0, 1 + 1.5 / 180, 1 - 1.5 / 180):  # a hue held, and shifted by +1 / -2 levels (ultralytics)
                gains = (gh, g[1], g[2])
                middle = color._hsv_middle(gains, rule)
                middles.add((type(middle).__name__, getattr(middle, "lift_below", 0) > 0, getattr(middle, "may_reach_180", False)))
                assert np.array_equal(apply_hsv(img.copy(), gains, rule), apply_hsv_reference(img.copy(), gains, rule)), gains
    if transform:  # every kind of exact transform was met: no wrap, raised below 0, lowered from 180
        want = {("_HueTransform", False, False), ("_HueTransform", False, True)}
        assert want | ({("_HueTransform", True, False)} if rule == "ultralytics" else set()) <= middles, middles
    else:
        assert middles == {("ndarray", False, False)}


def test_hsv_reference_is_stock_on_bgr_and_identity():
    img = _hsv_images()[2]
    g = [1.01, 1.4, 0.7]
    bgr = np.ascontiguousarray(img[..., ::-1])
    augment_hsv(bgr, g, bgr=True)
    assert np.array_equal(apply_hsv_reference(img.copy(), g), bgr[..., ::-1])
    assert np.array_equal(apply_hsv(img.copy(), (1.0, 1.0, 1.0)), img)
    # large hue gains (outside scratch-high) take the LUT path and stay exact
    g = [1.6, 1.0, 1.0]
    assert np.array_equal(apply_hsv(img.copy(), g), apply_hsv_reference(img.copy(), g))


def test_hsv_ultralytics_rule_shifts_hue_additively():
    """The "ultralytics" rule: hue moved by 180 (gh - 1) levels, wrapping both ways (YOLOv9's multiplies, so
    hue 0 never moves); the fast path, the box path and the render pipeline equal the reference tables."""
    from fastload.augment.functional.color import apply_hsv_in_box, hsv_luts

    lut_h, lut_s, _ = hsv_luts((1.1, 1.5, 1.0), "ultralytics")
    assert (int(lut_h[0]), int(lut_h[170]), int(lut_s[0]), int(lut_s[100])) == (18, 8, 0, 150)
    assert int(hsv_luts((0.9, 1.0, 1.0), "ultralytics")[0][5]) == 167
    assert int(hsv_luts((1.1, 1.0, 1.0), "yolov9")[0][0]) == 0
    with pytest.raises(ValueError, match="HSV rule"):
        hsv_luts((1.0, 1.0, 1.0), "other")  # type: ignore[arg-type]
    rng = np.random.default_rng(4)
    for img in _hsv_images():
        for _ in range(10):
            g = rng.uniform(-1, 1, 3) * [0.5, 0.7, 0.4] + 1
            want = apply_hsv_reference(img.copy(), g, "ultralytics")
            assert not np.array_equal(want, apply_hsv_reference(img.copy(), g))
            assert np.array_equal(apply_hsv(img.copy(), g, "ultralytics"), want)
            box = Rect(0, 16, img.shape[1], 48)
            padded = img.copy()
            padded[:16], padded[48:] = 114, 114
            assert np.array_equal(apply_hsv_in_box(padded.copy(), g, box, "ultralytics"),
                                  apply_hsv_reference(padded.copy(), g, "ultralytics"))
    shapes = np.array([im.shape[:2] for im in _hsv_images()])
    sampler = ParamSampler(shapes, {"mosaic": 0.0, "mixup": 0.0, "hsv_h": 0.5}, 64, seed=2, recipe="ultralytics")
    rec = sampler.sample(0, 2)
    drawn = render_sample(rec, _hsv_images().__getitem__)
    plain = render_sample(rec, _hsv_images().__getitem__, hsv=False)
    assert np.array_equal(drawn, apply_hsv_reference(plain, rec.hsv_gain, "ultralytics"))


def test_hsv_in_box_fills_coloured_border_rows():
    """Border rows above and below the box (any colour, not only grey) get the colour's own HSV result."""
    from fastload.augment.functional.color import apply_hsv_in_box

    rng = np.random.default_rng(3)
    img = np.empty((96, 64, 3), np.uint8)
    img[...] = (200, 40, 90)  # a saturated border colour: its HSV result is not grey
    img[32:64] = rng.integers(0, 256, (32, 64, 3), dtype=np.uint8)
    for g in ((1.01, 0.5, 1.3), (0.99, 1.6, 0.7)):
        got = apply_hsv_in_box(img.copy(), g, Rect(10, 32, 50, 64))
        assert np.array_equal(got, apply_hsv(img.copy(), g))
        assert not np.array_equal(got[0, 0], img[0, 0])  # the border did change


def test_opencv_hue_wrap_is_not_exact():
    """Why apply_hsv wraps the hue itself: OpenCV's HSV->RGB of H = 180 + k is k's within one level, not exactly."""
    s, v = np.meshgrid(np.arange(256), np.arange(256))
    for k in (0, 1):
        a = np.stack([np.full_like(s, 180 + k), s, v], -1).astype(np.uint8)
        b = np.stack([np.full_like(s, k), s, v], -1).astype(np.uint8)
        d = np.abs(cv2.cvtColor(a, cv2.COLOR_HSV2RGB).astype(int) - cv2.cvtColor(b, cv2.COLOR_HSV2RGB))
        assert d.max() <= 1 and 0 < (d > 0).mean() < 0.01


# -------------------------------------------------------------------------------------- mixup
def test_mixup_blend_matches_stock_truncation():
    rng = np.random.default_rng(2)
    a = rng.integers(0, 256, (128, 128, 3)).astype(np.uint8)
    b = rng.integers(0, 256, (128, 128, 3)).astype(np.uint8)
    for r in rng.beta(32, 32, 10):
        want = mixup_pixels(a, b, r)
        got = mixup_blend(a.copy(), b, r)
        d = np.abs(got.astype(int) - want)
        assert d.max() <= 1 and (d > 0).mean() < 0.01


# --------------------------------------------------------------------------------- odd inputs
def test_tiny_and_single_images():
    tiny = [np.full((20, 30, 3), 50 + 40 * i, np.uint8) for i in range(3)]
    s = ParamSampler(shapes_of(tiny), {"mixup": 1.0}, 640, seed=0)
    for i in range(3):
        p = s.sample(0, i)
        img = render_sample(p, tiny.__getitem__)
        assert img.shape == (640, 640, 3)
    one = [np.full((640, 480, 3), 9, np.uint8)]  # one image: partners are itself
    p = ParamSampler(shapes_of(one), None, 640).sample(0, 0)
    assert {t.src for t in p.image.tiles} == {0}
    assert render_sample(p, one.__getitem__).shape == (640, 640, 3)


def test_wrong_image_shape_is_reported():
    images = smooth_images(2, 320)
    p = ParamSampler(shapes_of(images), None, 320).sample(0, 0)
    with pytest.raises(ValueError, match="loaded shape"):
        render_sample(p, lambda i: np.zeros((10, 10, 3), np.uint8))
    with pytest.raises(ValueError, match="out must be"):
        render_sample(p, images.__getitem__, out=np.zeros((10, 10, 3), np.uint8))


def test_tile_outside_output_is_skipped():
    img = np.full((50, 50, 3), 200, np.uint8)
    m = np.array([[1.3, 0, 900.0], [0, 1.3, 10], [0, 0, 1]])
    ip = ImageParams((TileParams(0, (0, 0, 50, 50), m, (50, 50)),), (100, 100))
    from fastload.augment.functional.tiles import render_image

    assert (render_image(ip, [img].__getitem__) == 114).all()


def test_parity_mosaic9():
    images = smooth_images(10, 640, seed=7)
    s = ParamSampler(shapes_of(images), {"mixup": 0.3}, 640, seed=0, mosaic9=True)
    for i in range(6):
        p = s.sample(0, i)
        assert 1 <= len(p.image.tiles) <= 9 and p.out_hw == (640, 640)
        d = np.abs(render_sample(p, images.__getitem__, hsv=False).astype(int) - render_record(p, images.__getitem__, hsv=False))
        assert d.mean() <= 1.0


def test_stock_dataset_smoke(coco128_yaml):
    """The benchmark's "stock loader": fresh tensors, YOLOv9 batch tuple."""
    import torch

    from fastload.bench.stock import StockDataset

    root = coco128_yaml.parent
    files = sorted((root / "images").rglob("*.jpg"))[:6]
    _, labels = load_folder(root, 640, 6)
    ds = StockDataset(files, labels, 320, None, seed=0)
    dl = torch.utils.data.DataLoader(ds, batch_size=3, collate_fn=StockDataset.collate_fn)
    imgs, targets, paths, shapes = next(iter(dl))
    assert imgs.shape == (3, 3, 320, 320) and imgs.dtype == torch.uint8
    assert targets.shape[1] == 6 and set(targets[:, 0].tolist()) <= {0.0, 1.0, 2.0}
    assert len(paths) == 3 and len(shapes) == 3
    val = StockDataset(files, labels, 320, None, augment=False)
    img, lab, _, shp = val[0]
    assert img.shape[1:] == (320, 320) and shp[0] == tuple(val.aug.shapes[0])



def test_sliver_tile_whose_resize_ends_before_its_offset():
    """A tile of which only output row 0 is visible (scale 1.15, the crop's last row lands at y = 0.58): the
    clamped copy once found no resized row left at its offset (a record of the synthetic set at imgsz 128,
    scale 0.5, epoch 32). It must render like the reference."""
    src = cv2.GaussianBlur(np.random.default_rng(6).integers(0, 256, (128, 75, 3)).astype(np.uint8), (0, 0), 2.5)
    m = np.array([[1.1496986453976223, 0, -5.80469884], [0, 1.1496986453976223, -146.58254868], [0, 0, 1]])
    image = ImageParams(tiles=(TileParams(src=0, crop=(0, 55, 75, 128), matrix=m, src_hw=(128, 75)),), out_hw=(128, 128))
    fast = render_image(image, [src].__getitem__)
    ref = render_image_record(image, [src].__getitem__, mosaic=True)
    assert np.abs(fast.astype(np.int16) - ref.astype(np.int16)).mean() <= 1.0


# ------------------------------------------------------------------------------ speed-ups stay exact
def test_bbox_bounds_every_drawn_pixel_and_hsv_in_box_equals_whole_image():
    """render_image_bbox's box holds every drawn pixel, and HSV on its rows only (what
    render_sample does) gives the same bytes as HSV on the whole image."""
    from fastload.augment.functional.color import apply_hsv_in_box
    from fastload.augment.functional.tiles import render_image_bbox

    images = smooth_images(10, 320, seed=7)
    s = ParamSampler(shapes_of(images), {"mixup": 0.5, "scale": 0.9}, 320, seed=5)
    borders = 0
    for i in range(20):
        p = s.sample(0, i % 10)
        img, box = render_image_bbox(p.image, images.__getitem__)
        outside = np.ones(img.shape[:2], bool)
        if box is not None:
            outside[box.y0 : box.y1, box.x0 : box.x1] = False
        assert (img[outside] == p.image.fill).all()
        borders += int(outside.any())
        for g in ((1.01, 0.5, 1.3), (0.99, 1.6, 0.7)):
            assert np.array_equal(apply_hsv_in_box(img.copy(), g, box), apply_hsv(img.copy(), g))
        # the whole sample: mixup boxes are united, flips come last
        want = render_sample(p, images.__getitem__, hsv=False)
        unflip = want[:: -1 if p.flip_ud else 1, :: -1 if p.flip_lr else 1].copy()
        apply_hsv(unflip, p.hsv_gain)
        got = render_sample(p, images.__getitem__, out=np.empty_like(want))
        assert np.array_equal(got, unflip[:: -1 if p.flip_ud else 1, :: -1 if p.flip_lr else 1])
    assert borders > 0  # the border path was exercised


def test_padded_tiles_do_not_depend_on_scratch_contents():
    """Tiles whose resize origin lies before the image use a reused pad buffer of which only the
    rows / columns next to the image are written: the kept pixels must not depend on what that
    buffer held before."""
    from fastload.augment.functional import scratch as scratch_mod

    images = smooth_images(6, 320, seed=8)
    s = ParamSampler(shapes_of(images), {"scale": 0.95}, 320, seed=2)
    for i in range(12):
        p = s.sample(1, i % 6)
        a = render_image(p.image, images.__getitem__)
        for name in ("tile_pad", "tile_full"):
            buf = getattr(scratch_mod._local, "pool", {}).get(name)
            if buf is not None:
                buf[:] = 255 if i % 2 else 0
        assert np.array_equal(render_image(p.image, images.__getitem__), a)


def test_axis_plan_takes_the_nearest_well_aligned_origin():
    """Every source origin further back costs a resized and discarded row / column: the plan takes
    the nearest origin whose phase error is below _PHASE_OK (checked against all candidates), and
    its resize lands output pixel d0 on its exact sampling point within that error."""
    from fastload.augment.functional import tiles

    rng = np.random.default_rng(11)
    checked = 0
    for _ in range(3000):
        a, t = float(rng.uniform(0.1, 1.9)), float(rng.uniform(-300, 600))
        sp = tiles.axis_plan(a, t, 0, 400, 480, 640)
        if sp is None:
            continue
        base = math.floor((sp.d0 - t - 0.5 + 0.5 * a) / a + 1e-9)
        k = np.arange(64)
        x = (base - k) * a + t + 0.5 - 0.5 * a
        good = np.nonzero(np.abs(x - np.round(x)) < tiles._PHASE_OK)[0]
        if len(good):
            assert sp.s0 == base - good[0] and sp.err < tiles._PHASE_OK
            drawn = sp.s0 + (sp.j0 + 0.5) / a - 0.5  # where the resize samples output pixel d0
            assert abs(drawn - (sp.d0 - t) / a) * a <= sp.err + 1e-9
            checked += 1
    assert checked > 2500


@pytest.mark.parametrize("a", [0.33374, 0.39978, 1.00263, 1.49865])
def test_near_rational_scales_stay_on_resize_path(a):
    """Scales near a ratio of small integers drift slowly through the resize phases: when the
    first 64 source origins are all off by more than PHASE_MAX, the wide search often finds one
    (the tile is resized, not warped); output pixel d0 then lands within PHASE_MAX of its exact
    sampling point, and the pixels match a warp of the crop."""
    from fastload.augment.functional.tiles import PHASE_MAX, _resize_plan, axis_plan

    wide = []
    for t in 17.0 + np.linspace(0.0, 1.0, 41):
        sp = axis_plan(a, t, 3, 300, 480, 640)
        if sp.err > PHASE_MAX:
            continue  # still warped
        exact = (sp.d0 - t) / a  # source position output pixel d0 must sample
        drawn = sp.s0 + (sp.j0 + 0.5) / a - 0.5
        assert abs(exact - drawn) * a <= PHASE_MAX + 1e-9
        if exact - sp.s0 > 64:  # the origin lies beyond the first 64 candidates
            wide.append(t)
    assert wide  # the wide search was exercised
    img = smooth_images(1, 480, seed=5)[0]
    t = wide[0]
    m = np.array([[a, 0, t], [0, a, t], [0, 0, 1]])
    tile = TileParams(0, (3, 3, 300, 300), m, img.shape[:2])
    assert _resize_plan(tile, img.shape[:2], (640, 640)).method is tiles.DrawMethod.RESIZE
    got = render_image(ImageParams((tile,), (640, 640)), [img].__getitem__)
    ref = cv2.warpAffine(img[3:300, 3:300], (m @ _shift(3))[:2], (640, 640), flags=cv2.INTER_LINEAR, borderValue=(114, 114, 114))
    n = int(297 * a) - 4  # inner pixels: away from the crop's edges
    inner = (slice(int(t + 3 * a) + 2, int(t + 3 * a) + n),) * 2
    assert np.abs(got[inner].astype(int) - ref[inner]).max() <= 2


def _shift(d: float) -> np.ndarray:
    return np.array([[1.0, 0, d], [0, 1, d], [0, 0, 1]])
