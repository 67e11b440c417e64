"""Segments, keypoints and oriented boxes moved by :mod:`fastload.augment.geometry` and masks built by
:mod:`fastload.augment.masks`, against the real reference code run on the same records.

* YOLOv9: ``LoadImagesAndLabelsAndMasks.__getitem__`` of a temporary copy of ../shared/upstream/yolov9, imported
  here, called on a stand-in dataset (the synthetic labels, grey images of the loaded sizes) with the ``random``
  of its modules replaced by a script that returns fastload's draws (mosaic, centre, partners, the eight
  perspective draws, mixup, flips), so it builds the same sample through its own load_mosaic, random_perspective,
  segment2box, box_candidates, polygons2masks(_overlap) and flips.
* Ultralytics 8.4 (installed): its label preparation (``YOLODataset.update_labels_info``), ``Mosaic`` label
  steps, ``RandomPerspective.apply_instances`` with fastload's matrix and scale, ``MixUp``, ``RandomFlip``,
  ``LetterBox`` and ``Format``.

With augmentation off masks, keypoints and rotated boxes are the references' exactly; with it on each instance
mask has IoU >= 0.99 with the reference's and keypoints / box corners are within 1 px.
"""
from __future__ import annotations

import importlib.util
import shutil
import sys
from types import MethodType, SimpleNamespace

import cv2
import numpy as np
import pytest

from fastload.augment import params as params_module
from fastload.augment.hyp import load_hyp
from fastload.augment.geometry import Geometry, obb_xywhr, transform_geometry
from fastload.augment.masks import batch_masks, polygon_mask
from fastload.augment.params import ParamSampler, SampleParams, translation
from official_helpers import UPSTREAM

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


class _Recorder:
    """A generator stand-in that returns the real generator's values and keeps them."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng, self.values = rng, []

    def uniform(self, *a):
        v = self.rng.uniform(*a)
        self.values.append(v)
        return v

    def random(self, *a):
        v = self.rng.random(*a)
        self.values.append(v)
        return v


@pytest.fixture
def draws(monkeypatch):
    """Records, per composed image of a record, fastload's mosaic centre, tile offsets and perspective draws."""
    log: list = []
    place, persp = params_module._mosaic4_placements, ParamSampler._perspective

    def spy_place(rng, s, hw):
        rec = _Recorder(rng)
        out = place(rec, s, hw)
        log.append({"centre": rec.values, "offsets": [o for crop, o in out if crop is not None]})
        return out

    def spy_persp(self, rng, canvas_hw, out_hw):
        rec = _Recorder(rng)
        out = persp(self, rec, canvas_hw, out_hw)
        if log and "u" not in log[-1]:
            log[-1]["u"] = rec.values[0].tolist()
        else:
            log.append({"u": rec.values[0].tolist()})
        return out

    monkeypatch.setattr(params_module, "_mosaic4_placements", spy_place)
    monkeypatch.setattr(ParamSampler, "_perspective", spy_persp)

    def sample(sampler: ParamSampler, epoch: int, index: int) -> tuple[SampleParams, list]:
        log.clear()
        return sampler.sample(epoch, index), list(log)
    return sample


# ----------------------------------------------------------------------------------------- YOLOv9
class _Script:
    """A ``random`` module stand-in answering from queues (fastload's draws)."""

    def __init__(self, **queues) -> None:
        self.q = {k: list(v) for k, v in queues.items()}

    def random(self):
        return self.q["random"].pop(0)

    def uniform(self, a, b):
        if "u" in self.q:  # random_perspective's draws: the same expression as fastload's
            return a + (b - a) * self.q["u"].pop(0)
        return self.q["uniform"].pop(0)

    def choices(self, seq, k):
        return self.q["choices"].pop(0)

    def randint(self, a, b):
        return self.q["randint"].pop(0)


@pytest.fixture(scope="module")
def yolov9(tmp_path_factory):
    """The official segment loader's modules, imported from a temporary copy (removed from sys.modules after)."""
    if not (UPSTREAM / "utils" / "segment" / "dataloaders.py").is_file():
        pytest.skip(f"official YOLOv9 checkout not found at {UPSTREAM} (set FASTLOAD_YOLOV9_UPSTREAM)")
    root = tmp_path_factory.mktemp("yolov9_geometry") / "yolov9"
    shutil.copytree(UPSTREAM / "utils", root / "utils")
    before = set(sys.modules)
    sys.path.insert(0, str(root))
    try:
        import utils.segment.augmentations as seg_aug
        import utils.segment.dataloaders as seg_dl
        yield SimpleNamespace(dl=seg_dl, aug=seg_aug)
    finally:
        sys.path.remove(str(root))
        for name in set(sys.modules) - before:
            if name == "utils" or name.startswith(("utils.", "models")):
                del sys.modules[name]


def _official_sample(y9, monkeypatch, shapes, labels, hyp, rec: SampleParams, log: list, overlap: bool, augment: bool):
    """``LoadImagesAndLabelsAndMasks.__getitem__`` on a stand-in dataset with fastload's draws."""
    ds = SimpleNamespace(
        indices=np.arange(len(shapes)), n=len(shapes), img_size=IMGSZ, mosaic_border=[-IMGSZ // 2, -IMGSZ // 2],
        hyp=load_hyp(hyp), mosaic=augment, augment=augment, rect=False,
        labels=[lab[0].copy() for lab in labels],
        segments=[[pts[a:b].copy() for a, b in zip(off[:-1], off[1:])] for _, pts, off in labels],
        im_files=[f"{i}.jpg" for i in range(len(shapes))], overlap=overlap, downsample_ratio=RATIO,
        albumentations=lambda im, lb: (im, lb),
        load_image=lambda i: (np.full((*shapes[i], 3), 114, np.uint8), tuple(shapes[i]), tuple(shapes[i])),
    )
    ds.load_mosaic = MethodType(y9.dl.LoadImagesAndLabelsAndMasks.load_mosaic, ds)
    images = [rec.image] + ([rec.mixup] if rec.mixup is not None else [])
    queue = {"random": [0.0 if rec.mosaic else 1.0], "uniform": [], "choices": [], "randint": []}
    if rec.mosaic:
        queue["random"].append(0.0 if rec.mixup is not None else 1.0)
        for k, image in enumerate(images):
            queue["uniform"] += log[k]["centre"]
            queue["choices"].append([t.src for t in image.tiles[1:]])
            if k:
                queue["randint"].append(image.tiles[0].src)
    queue["random"] += [0.0 if rec.flip_ud else 0.999, 0.0 if rec.flip_lr else 0.999]
    monkeypatch.setattr(y9.dl, "random", _Script(**queue))
    monkeypatch.setattr(y9.aug, "random", _Script(u=[v for entry in log for v in entry["u"]]))
    _, targets, _, _, masks = y9.dl.LoadImagesAndLabelsAndMasks.__getitem__(ds, rec.image.tiles[0].src if rec.mosaic
                                                                             else rec.index)
    return targets.numpy(), masks.numpy()


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    union = np.logical_or(a, b).sum()
    return 1.0 if union == 0 else float(np.logical_and(a, b).sum() / union)


@pytest.mark.parametrize("overlap", [True, False])
def test_yolov9_validation_masks_identical(yolov9, monkeypatch, overlap):
    shapes, labels = _world("segment", 1)
    sampler = ParamSampler(shapes, AUG_HYP, IMGSZ, augment=False)
    for i in range(N_IMAGES):
        rec = sampler.sample(0, i)
        geo = transform_geometry([rec], labels.__getitem__, "yolov9", "segment")
        masks, order = batch_masks(geo, 1, RATIO, overlap)
        want_targets, want_masks = _official_sample(yolov9, monkeypatch, shapes, labels, AUG_HYP, rec, [], overlap, False)
        assert np.array_equal(masks, want_masks), f"image {i}: masks differ from the official loader's"
        np.testing.assert_allclose(geo.targets[order], want_targets, atol=1e-6)


@pytest.mark.parametrize("mosaic", [1.0, 0.0])
def test_yolov9_training_same_draws(yolov9, monkeypatch, draws, mosaic):
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
        want_targets, want_masks = _official_sample(yolov9, monkeypatch, shapes, labels, hyp, rec, log, False, True)
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
    from ultralytics.data import augment
    from ultralytics.data.dataset import YOLODataset
    return SimpleNamespace(aug=augment, YOLODataset=YOLODataset)


def _ultra_label(u, task: str, lab, hw) -> dict:
    rows, pts, off = lab
    polys = [pts[a:b] for a, b in zip(off[:-1].tolist(), off[1:].tolist())]
    fake = SimpleNamespace(use_obb=task == "obb", use_segments=task == "segment", format_class=u.aug.Format)
    label = {"img": np.full((*hw, 3), 114, np.uint8), "cls": rows[:, :1].copy(), "bboxes": rows[:, 1:5].copy(),
             "segments": [] if task == "pose" else [p.copy() for p in polys], "normalized": True, "bbox_format": "xywh",
             "keypoints": np.stack(polys).copy() if task == "pose" else None, "resized_shape": tuple(hw),
             "ori_shape": tuple(hw), "im_file": ""}
    return u.YOLODataset.update_labels_info(fake, label)


def _ultra_image(u, task, labels, image, log_entry) -> dict:
    """One composed image through Ultralytics' label steps with fastload's placement and matrix."""
    s = IMGSZ
    fake_ds = SimpleNamespace(cache="ram", use_obb=task == "obb")
    mosaic = "offsets" in log_entry
    if mosaic:
        ox, oy = log_entry["offsets"][0]
        m = image.tiles[0].matrix @ translation(-ox, -oy)
        patches = []
        for tile, (ox, oy) in zip(image.tiles, log_entry["offsets"]):
            lab = _ultra_label(u, task, labels[tile.src], tile.src_hw)
            patches.append(u.aug.Mosaic._update_labels(lab, ox, oy, tile.src_hw))
        out = u.aug.Mosaic(fake_ds, imgsz=s)._cat_labels(patches)
        orig = (2 * s, 2 * s)
    else:
        tile = image.tiles[0]
        m, out, orig = tile.matrix, _ultra_label(u, task, labels[tile.src], tile.src_hw), tile.src_hw
    out["img"] = np.full((*orig, 3), 114, np.uint8)
    rp = u.aug.RandomPerspective(preserve_obb=task == "obb")
    out = rp.apply_instances(out, {"M": m.astype(np.float32), "scale": image.candidate_scale, "orig_shape": orig,
                                   "size": (s, s)})
    out["img"] = np.full((s, s, 3), 114, np.uint8)
    return out


def _ultra_sample(u, task, labels, rec: SampleParams, log, overlap: bool, augment: bool) -> dict:
    s = IMGSZ
    if augment:
        out = _ultra_image(u, task, labels, rec.image, log[0])
        if rec.mixup is not None:
            out["mix_labels"] = [_ultra_image(u, task, labels, rec.mixup, log[1])]
            out = u.aug.MixUp(SimpleNamespace(cache="ram")).apply_instances(out, {})
        for flag, direction in ((rec.flip_ud, "vertical"), (rec.flip_lr, "horizontal")):
            if flag:
                flip = u.aug.RandomFlip(1.0, direction, FLIP_IDX if task == "pose" else None)
                out = flip.apply_instances(out, {"flip": True, "h": s, "w": s, "direction": direction,
                                                 "flip_idx": flip.flip_idx})
    else:
        tile = rec.image.tiles[0]
        out = _ultra_label(u, task, labels[tile.src], tile.src_hw)
        out = u.aug.LetterBox(new_shape=(s, s), scaleup=False)(out)
    fmt = u.aug.Format(bbox_format="xywh", normalize=True, return_mask=task == "segment", return_keypoint=task == "pose",
                       return_obb=task == "obb", mask_ratio=RATIO, mask_overlap=overlap, batch_idx=True)
    return fmt.apply_instances(out, fmt.get_params(out))


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

    general = sys.modules["utils.general"]
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
        inside = _inside_vertex_boxes(poly.astype(np.float64), 64, 48)
        clipped = _clipped_extent_boxes(poly.astype(np.float64), 64, 48)
        for k in range(len(poly)):
            np.testing.assert_array_equal(inside[k], general.segment2box(poly[k], 64, 48).reshape(4))
            np.testing.assert_allclose(clipped[k], ops.segment2box(poly[k], 64, 48), atol=1e-4)
