"""Segments, keypoints and oriented boxes moved by :mod:`fastload.augment.geometry` and masks built by
:mod:`fastload.augment.masks`, against the real reference code run on the same records and draws
(tests/reference/geometry_replay.py): the official YOLOv9 segment loader's ``__getitem__`` from a temporary copy
of ../shared/upstream/yolov9, and Ultralytics 8.4's label preparation and transforms (installed).

With augmentation off masks, keypoints and rotated boxes are the references' exactly; with it on each instance
mask has IoU >= 0.99 with the reference's and keypoints / box corners are within 1 px.
"""
from __future__ import annotations

import importlib.util

import cv2
import numpy as np
import pytest

from fastload.augment.geometry import Geometry, LoadedPolygons, obb_xywhr, resample_polygons, transform_geometry
from fastload.augment.masks import batch_masks, pixel_outlines, polygon_mask
from fastload.augment.params import ParamSampler, SampleParams
from official_helpers import UPSTREAM
from tests.reference.geometry_replay import (official_segment_modules, official_segment_sample, recording_draws,
                                             ultralytics_label, ultralytics_modules, ultralytics_sample)

IMGSZ = 128
RATIO = 4
N_IMAGES = 6
K_KPT = 5
FLIP_IDX = [0, 2, 1, 4, 3]
AUG_HYP = {"hsv_h": 0.0, "hsv_s": 0.0, "hsv_v": 0.0, "degrees": 10.0, "shear": 2.0, "translate": 0.1, "scale": 0.5,
           "flipud": 0.3, "fliplr": 0.5, "copy_paste": 0.0}


# ----------------------------------------------------------------------------------------- synthetic labels
def _world(task: str, seed: int = 0, long_side: int = IMGSZ):
    """Loaded shapes (``long_side`` long) and per image ``(rows, points, offsets)``: star polygons, rotated rectangles
    or keypoints; each row's box is its points' extent (as both references derive a segment row's box)."""
    rng = np.random.default_rng(seed)
    shapes, labels = [], []
    for _ in range(N_IMAGES):
        short = int(rng.integers(long_side // 2, long_side + 1))
        shapes.append((long_side, short) if rng.random() < 0.5 else (short, long_side))
        rows, pts = [], []
        for _ in range(int(rng.integers(2, 5))):
            c, size = rng.uniform(0.25, 0.75, 2), rng.uniform(0.1, 0.45)
            if task == "segment":
                k = int(rng.integers(6, 16))
                ang = np.sort(rng.uniform(0, 2 * np.pi, k))
                p = c + size * rng.uniform(0.4, 1.0, (k, 1)) * np.stack([np.cos(ang), np.sin(ang)], 1)
            elif task == "obb":
                a, (w, h) = rng.uniform(0, np.pi), rng.uniform(0.1, 0.4, 2) * size * 2
                rot = np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]])
                p = c + np.array([[-w, -h], [w, -h], [w, h], [-w, h]]) / 2 @ rot.T
            else:
                p = c + rng.uniform(-size, size, (K_KPT, 2)) / 2
            p = np.clip(p, 0.0, 1.0).astype(np.float32)
            lo, hi = p[:, :2].min(0), p[:, :2].max(0)
            if task == "pose":  # a box around the keypoints; some hidden
                lo, hi = np.clip(lo - 0.05, 0, 1), np.clip(hi + 0.05, 0, 1)
                p = np.concatenate([p, rng.choice([0.0, 1.0, 2.0], (K_KPT, 1), p=[0.2, 0.2, 0.6])], 1).astype(np.float32)
            rows.append([int(rng.integers(0, 3)), *(lo + hi) / 2, *(hi - lo)])
            pts.append(p)
        offsets = np.concatenate([[0], np.cumsum([len(p) for p in pts])]).astype(np.int64)
        labels.append((np.array(rows, np.float32), np.concatenate(pts).astype(np.float32), offsets))
    return np.array(shapes, np.int64), labels


@pytest.fixture
def draws():
    with recording_draws() as sample:
        yield sample


@pytest.fixture(scope="module")
def yolov9(tmp_path_factory):
    """The official segment loader's modules, imported from a temporary copy (removed from sys.modules after)."""
    if not (UPSTREAM / "utils" / "segment" / "dataloaders.py").is_file():
        pytest.skip(f"official YOLOv9 checkout not found at {UPSTREAM} (set FASTLOAD_YOLOV9_UPSTREAM)")
    with official_segment_modules(UPSTREAM, tmp_path_factory.mktemp("yolov9_geometry")) as modules:
        yield modules


def _official_sample(y9, shapes, labels, hyp, rec: SampleParams, log: list, overlap: bool, augment: bool):
    return official_segment_sample(y9, shapes, labels, hyp, rec, log, imgsz=IMGSZ, mask_ratio=RATIO, overlap=overlap,
                                   augment=augment)


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    union = np.logical_or(a, b).sum()
    return 1.0 if union == 0 else float(np.logical_and(a, b).sum() / union)


@pytest.mark.parametrize("overlap", [True, False])
def test_yolov9_validation_masks_identical(yolov9, overlap):
    shapes, labels = _world("segment", 1)
    sampler = ParamSampler(shapes, AUG_HYP, IMGSZ, augment=False)
    for i in range(N_IMAGES):
        rec = sampler.sample(0, i)
        geo = transform_geometry([rec], labels.__getitem__, "yolov9", "segment")
        masks, order = batch_masks(geo, 1, RATIO, overlap)
        want_targets, want_masks = _official_sample(yolov9, shapes, labels, AUG_HYP, rec, [], overlap, False)
        assert np.array_equal(masks, want_masks), f"image {i}: masks differ from the official loader's"
        np.testing.assert_allclose(geo.targets[order], want_targets, atol=1e-6)


def test_rows_without_points_get_empty_masks_in_yolov9_validation_and_are_refused_elsewhere():
    """An image whose rows have no points (a box-only label file): YOLOv9's validation keeps the boxes, each with an
    empty mask (tests/test_official_segment.py compares it with the official loader); training and Ultralytics'
    recipe refuse them, where both references fail on them."""
    shapes, labels = _world("segment", 1)
    rows = labels[0][0]
    labels[0] = (rows, np.zeros((0, 2), np.float32), np.zeros(len(rows) + 1, np.int64))
    rec = ParamSampler(shapes, AUG_HYP, IMGSZ, augment=False).sample(0, 0)
    geo = transform_geometry([rec], labels.__getitem__, "yolov9", "segment")
    masks, _ = batch_masks(geo, 1, RATIO, False)
    assert len(geo) == len(rows) and masks.shape == (len(rows), IMGSZ // RATIO, IMGSZ // RATIO) and not masks.any()
    for recipe, augment in (("yolov9", True), ("ultralytics", False)):
        rec = ParamSampler(shapes, {**AUG_HYP, "mosaic": 0.0}, IMGSZ, augment=augment, recipe=recipe).sample(0, 0)
        with pytest.raises(ValueError, match="labels of image 0: a row without points"):
            transform_geometry([rec], labels.__getitem__, recipe, "segment")


@pytest.mark.parametrize("mosaic", [1.0, 0.0])
def test_yolov9_training_same_draws(yolov9, draws, mosaic):
    """Mosaic with mixup, and the letterbox + random perspective of a sample without mosaic (close_mosaic; images
    smaller than the output, so that the letterbox scales them)."""
    shapes, labels = _world("segment", 2, IMGSZ if mosaic else 100)
    hyp = {**AUG_HYP, "mixup": 0.5, "mosaic": mosaic}
    sampler = ParamSampler(shapes, hyp, IMGSZ, seed=3)
    compared = mixups = 0
    for i in range(8):
        rec, log = draws(sampler, 0, i)
        geo = transform_geometry([rec], labels.__getitem__, "yolov9", "segment")
        masks, order = batch_masks(geo, 1, RATIO, False)
        want_targets, want_masks = _official_sample(yolov9, shapes, labels, hyp, rec, log, False, True)
        assert len(geo) == len(want_targets), f"record {i}: {len(geo)} instances, official {len(want_targets)}"
        np.testing.assert_allclose(geo.targets[:, :2], want_targets[:, :2])
        np.testing.assert_allclose(geo.targets[:, 2:] * IMGSZ, want_targets[:, 2:] * IMGSZ, atol=1.0)
        for k in range(len(masks)):
            assert _iou(masks[k], want_masks[k]) >= 0.99, f"record {i} instance {k}: IoU {_iou(masks[k], want_masks[k])}"
        compared += len(masks)
        mixups += rec.mixup is not None
    assert compared > 10 and (mixups > 0) == (mosaic > 0)


# ----------------------------------------------------------------------------------------- Ultralytics
@pytest.fixture(scope="module")
def ultra():
    if importlib.util.find_spec("ultralytics") is None:
        pytest.skip('ultralytics is not installed (pip install "fastload[ultralytics]")')
    return ultralytics_modules()


def _ultra_sample(u, task, labels, rec: SampleParams, log, overlap: bool, augment: bool) -> dict:
    return ultralytics_sample(u, task, lambda i, hw: ultralytics_label(u, task, labels[i], hw), rec, log, imgsz=IMGSZ,
                              mask_ratio=RATIO, overlap=overlap, augment=augment, flip_idx=FLIP_IDX)


def _corners(xywhr: np.ndarray) -> np.ndarray:
    return np.array([cv2.boxPoints(((x, y), (w, h), np.degrees(r))) for x, y, w, h, r in xywhr.tolist()]).reshape(-1, 4, 2)


def _compare_ultra(geo: Geometry, want: dict, task: str, overlap: bool, exact: bool, where: str) -> int:
    s = IMGSZ
    n = len(want["cls"])
    assert len(geo) == n, f"{where}: {len(geo)} instances, Ultralytics {n}"
    if task == "segment":
        masks, order = batch_masks(geo, 1, RATIO, overlap)
        got_masks, want_masks = masks, want["masks"].numpy()
        if exact:
            assert np.array_equal(got_masks, want_masks), f"{where}: masks differ"
        else:
            for k in range(len(got_masks)):
                assert _iou(got_masks[k], want_masks[k]) >= 0.99, f"{where} instance {k}: IoU {_iou(got_masks[k], want_masks[k])}"
        geo_targets = geo.targets[order]
    else:
        geo_targets = geo.targets
    np.testing.assert_array_equal(geo_targets[:, 1], want["cls"].numpy().reshape(-1))
    if task == "pose":
        kp = geo.flipped_points(FLIP_IDX).reshape(n, K_KPT, 3)
        want_kp = want["keypoints"].numpy()
        atol = 1e-6 if exact else 1.0 / s
        np.testing.assert_allclose(kp[..., :2] / s, want_kp[..., :2], atol=atol, err_msg=where)
        near_edge = ((want_kp[..., :2] * s < 1) | (want_kp[..., :2] * s > s - 1)).any(-1)
        assert ((kp[..., 2] == want_kp[..., 2]) | near_edge).all(), f"{where}: visibility differs"
    if task == "obb":
        got, ref = obb_xywhr(geo), want["bboxes"].numpy()
        if exact:
            np.testing.assert_allclose(got, ref, atol=1e-6, err_msg=where)
        else:
            a, b = _corners(got * [s, s, s, s, 1]), _corners(ref * [s, s, s, s, 1])
            dist = np.linalg.norm(a[:, :, None] - b[:, None], axis=-1).min(-1)  # each corner to its nearest
            assert dist.max(initial=0) <= 1.0, f"{where}: corners {dist.max()} px apart"
    else:
        # exact: boxes are the detection boxes, clipped 1e-3 px inside the border as YOLOv9's xyxy2xywhn does
        np.testing.assert_allclose(geo_targets[:, 2:] * s, want["bboxes"].numpy() * s, atol=2e-3 if exact else 1.0,
                                   err_msg=where)
    return n


@pytest.mark.parametrize("task,overlap", [("segment", True), ("segment", False), ("pose", False), ("obb", False)])
def test_ultralytics_validation_identical(ultra, task, overlap):
    shapes, labels = _world(task, 4)
    sampler = ParamSampler(shapes, AUG_HYP, IMGSZ, augment=False, recipe="ultralytics")
    for i in range(N_IMAGES):
        rec = sampler.sample(0, i)
        geo = transform_geometry([rec], labels.__getitem__, "ultralytics", task)
        _compare_ultra(geo, _ultra_sample(ultra, task, labels, rec, [], overlap, False), task, overlap, True, f"image {i}")


@pytest.mark.parametrize("task", ["segment", "pose", "obb"])
def test_ultralytics_training_same_draws(ultra, draws, task):
    shapes, labels = _world(task, 5)
    sampler = ParamSampler(shapes, {**AUG_HYP, "mosaic": 0.7, "mixup": 0.4}, IMGSZ, seed=1, recipe="ultralytics")
    compared = 0
    for i in range(10):
        rec, log = draws(sampler, 0, i)
        geo = transform_geometry([rec], labels.__getitem__, "ultralytics", task)
        compared += _compare_ultra(geo, _ultra_sample(ultra, task, labels, rec, log, False, True), task, False, False,
                                   f"record {i}")
    assert compared > 10


# ----------------------------------------------------------------------------------------- pieces
def test_block_masks_equal_full_size_masks():
    """polygon_mask fills only the block-aligned box: the references' full-size fill + resize, bit for bit."""
    rng = np.random.default_rng(0)
    for r in (1, 2, 3, 4, 8):
        for hw in ((64, 96), (65, 96)):
            hw = (hw[0] * r // 4 * 4 or r, hw[1] * r // 4 * 4)
            for _ in range(20):
                poly = rng.uniform(-20, max(hw) + 20, (int(rng.integers(3, 30)), 2))
                full = np.zeros(hw, np.uint8)
                cv2.fillPoly(full, [poly.astype(np.int32)], 1)
                assert np.array_equal(polygon_mask(poly, hw, r), cv2.resize(full, (hw[1] // r, hw[0] // r)))


def test_pixel_outlines_fill_as_the_polygons():
    """The outlines without repeated pixels fill as the polygons' own truncated points (edges of length 0 add nothing),
    polygons densely resampled (mostly repeats), an empty one and one of a single repeated point among them."""
    rng = np.random.default_rng(3)
    polys = []
    for _ in range(40):
        k = int(rng.integers(3, 12))
        vertices = rng.uniform(-30, 150, (k, 2)).astype(np.float32)
        polys.append(resample_polygons(vertices, np.array([0, k]), int(rng.integers(50, 1000)), True)[0])
    polys[5] = np.zeros((0, 2))
    polys[9] = np.full((30, 2), 64.7)
    offsets = np.concatenate(([0], np.cumsum([len(p) for p in polys])))
    outlines = pixel_outlines(np.concatenate(polys), offsets)
    assert len(outlines) == len(polys) and sum(map(len, outlines)) < 0.9 * offsets[-1]  # repeats dropped
    assert len(outlines[5]) == 0 and len(outlines[9]) == 1
    for poly, outline in zip(polys, outlines):
        want, got = np.zeros((128, 160), np.uint8), np.zeros((128, 160), np.uint8)
        if len(poly):
            cv2.fillPoly(want, [poly.astype(np.int32)], 1)
            cv2.fillPoly(got, [outline], 1)
        assert np.array_equal(got, want) and outline.dtype == np.int32


def test_batch_order_flips_and_refusals():
    shapes, labels = _world("pose", 6)
    sampler = ParamSampler(shapes, {**AUG_HYP, "fliplr": 1.0, "flipud": 0.0}, IMGSZ, seed=0, recipe="ultralytics")
    records = sampler.sample_batch(0, range(N_IMAGES))
    geo = transform_geometry(records, labels.__getitem__, "ultralytics", "pose")
    assert np.all(np.diff(geo.targets[:, 0]) >= 0)  # by sample, as batch_targets
    kp = geo.flipped_points(FLIP_IDX).reshape(len(geo), K_KPT, 3)
    plain = geo.points.reshape(len(geo), K_KPT, 3)
    np.testing.assert_allclose(kp[:, 1, 0], IMGSZ - plain[:, 2, 0])  # left and right swap through flip_idx
    with pytest.raises(ValueError, match="no pose task"):
        transform_geometry(records, labels.__getitem__, "yolov9", "pose")


@pytest.mark.parametrize("task", ["segment", "pose", "obb"])
def test_a_batch_moves_as_its_records_alone_and_the_memo_changes_nothing(task):
    """A batch's images are moved together (one pass for all their tiles and instances): each sample's instances are
    the ones it gets alone; the memo of resampled polygons (kept between batches, evicting beyond its bound) gives
    the same batches. Some segment images have a polygon of over 1000 points: their mosaics' polygons have more
    points (Ultralytics resamples to the longest), so the batch's images move in groups of one point count."""
    shapes, labels = _world(task, 3)
    if task == "segment":
        labels = [_with_long_polygon(*one, 1001 + i) if i % 4 == 0 else one for i, one in enumerate(labels)]
    sampler = ParamSampler(shapes, {**AUG_HYP, "mosaic": 0.7, "mixup": 0.4}, IMGSZ, seed=2, recipe="ultralytics")
    records = sampler.sample_batch(0, range(N_IMAGES))
    alone = [transform_geometry([rec], labels.__getitem__, "ultralytics", task) for rec in records]
    memo = LoadedPolygons(max_bytes=3_000)  # about one image's polygons: later ones evict earlier ones
    for _ in range(2):
        geo = transform_geometry(records, labels.__getitem__, "ultralytics", task, memo)
        for k, one in enumerate(alone):
            mine = geo.targets[:, 0] == k
            np.testing.assert_array_equal(geo.targets[mine, 1:], one.targets[:, 1:])
            polygons = geo.polygons()
            np.testing.assert_array_equal(np.concatenate([polygons[i] for i in np.flatnonzero(mine)] or [one.points]),
                                          one.points)
    assert len(memo._entries) < N_IMAGES
    if task == "segment":
        assert len(set(np.diff(geo.offsets).tolist())) > 1  # more than one point count in the batch


def _with_long_polygon(rows: np.ndarray, points: np.ndarray, offsets: np.ndarray, k: int
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An image's labels with one more row: a circle of ``k`` points."""
    ang = np.linspace(0, 2 * np.pi, k, endpoint=False)
    circle = (0.5 + 0.2 * np.stack([np.cos(ang), np.sin(ang)], 1)).astype(np.float32)
    row = np.array([[1, 0.5, 0.5, 0.4, 0.4]], np.float32)
    return np.concatenate((rows, row)), np.concatenate((points, circle)), np.append(offsets, offsets[-1] + k)


def test_loaded_polygons_are_resampled_once():
    rng = np.random.default_rng(1)
    points = rng.uniform(0, 1, (9, 2)).astype(np.float32)
    offsets = np.array([0, 4, 9])
    memo = LoadedPolygons()
    first = memo.resampled(7, points, offsets, 50)
    again = memo.resampled(7, points, offsets, 50)
    assert first[0] is again[0] and not first[0].flags.writeable
    poly = resample_polygons(points, offsets, 50, True)
    np.testing.assert_array_equal(first[0], poly.reshape(-1, 2))
    np.testing.assert_array_equal(first[1], np.concatenate((poly.min(1), poly.max(1)), 1))


def test_loaded_polygons_check_each_image_once_within_their_bound():
    """Labels are checked the first time an image is seen (a bad row named then, and again while it is refused), and
    the images only checked (YOLOv9's, nothing resampled) count against the bound too."""
    from fastload.augment.geometry import _IMAGE_BYTES

    rows = np.zeros((2, 5), np.float32)
    points = np.random.default_rng(2).uniform(0, 1, (7, 2)).astype(np.float32)
    memo = LoadedPolygons(max_bytes=10 * _IMAGE_BYTES)
    for src in range(50):
        assert memo.longest(src, rows, points, np.array([0, 3, 7])) == 4
    assert len(memo._entries) == 10 and memo._bytes <= memo.max_bytes
    for _ in range(2):
        with pytest.raises(ValueError, match="labels of image 99: a row without points"):
            memo.longest(99, rows, points, np.array([0, 7, 7]))


def _random_polygons(rng: np.random.Generator, k: int, n: int, size: float) -> np.ndarray:
    """[k, n, 2] float32 star polygons around ``size``-square, many crossing its border."""
    centre = rng.uniform(-0.15 * size, 1.15 * size, (k, 1, 2))
    radius = rng.uniform(0.01, 0.6, (k, 1, 1)) * size
    ang = np.sort(rng.uniform(0, 2 * np.pi, (k, n)), 1)
    poly = centre + radius * rng.uniform(0.3, 1, (k, n, 1)) * np.stack([np.cos(ang), np.sin(ang)], -1)
    return poly.astype(np.float32)


def test_polygon_pieces_equal_the_references_functions(yolov9, ultra):
    """Resampling (both rules, bit for bit) and the boxes derived from warped polygons (both rules)."""
    from ultralytics.utils import ops
    from fastload.augment.geometry import _clipped_extent_boxes, _inside_vertex_boxes, resample_polygons

    general = yolov9.general
    rng = np.random.default_rng(0)
    segs = [rng.uniform(-10, 700, (int(m), 2)).astype(np.float32) for m in rng.integers(1, 1100, 30)]
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in segs])])
    flat = np.concatenate(segs)
    for got, want in ((resample_polygons(flat, offsets, 1000, False), general.resample_segments([p.copy() for p in segs])),
                      (resample_polygons(flat, offsets, 1000, True), ops.resample_segments([p.copy() for p in segs], 1000)),
                      (resample_polygons(flat, offsets, 100, True), ops.resample_segments([p.copy() for p in segs], 100))):
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
    for n in (4, 100, 1000):
        poly = _random_polygons(rng, 40, n, 64.0)
        poly[::4, :, 0] = np.clip(poly[::4, :, 0], 0, 64)  # points on the border
        inside = _inside_vertex_boxes(*poly.astype(np.float64).transpose(2, 0, 1), 64, 48)  # x, y planes
        clipped = _clipped_extent_boxes(*poly.astype(np.float64).transpose(2, 0, 1), 64, 48)
        for k in range(len(poly)):
            np.testing.assert_array_equal(inside[k], general.segment2box(poly[k], 64, 48).reshape(4))
            np.testing.assert_allclose(clipped[k], ops.segment2box(poly[k], 64, 48), atol=1e-4)
