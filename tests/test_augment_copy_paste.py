"""Copy-paste (the segment task): the sampler's records, and labels and pixels against the real reference code run on
the same records and draws (tests/reference/geometry_replay.py): the official YOLOv9 segment loader, whose
``copy_paste`` draws its ``random.sample`` from fastload's selection keys, and Ultralytics 8.4's ``CopyPaste``
(flip mode, no random draw)."""
from __future__ import annotations

import dataclasses

import cv2
import numpy as np
import pytest

from fastload.augment.geometry import LoadedPolygons, move_record, paste_selection, transform_geometry
from fastload.augment.masks import batch_masks
from fastload.augment.params import CopyPaste, ParamSampler, SampleParams
from fastload.augment.pipeline import render_sample
from tests.reference.geometry_replay import official_segment_pixels, ultralytics_canvas
from tests.test_augment_geometry import (AUG_HYP, IMGSZ, N_IMAGES, RATIO, _compare_ultra, _iou, _official_sample,
                                         _ultra_sample, _world, draws, ultra, yolov9)

__all__ = ["draws", "ultra", "yolov9"]  # the fixtures, shared with tests/test_augment_geometry.py

PASTE_HYP = {**AUG_HYP, "copy_paste": 0.7}


def _instances(labels) -> list[int]:
    return [len(rows) for rows, _, _ in labels]


def _without_paste(rec: SampleParams) -> SampleParams:
    """The record with its copy-paste fields cleared."""
    def plain(image):
        if image is None:
            return None
        tiles = tuple(dataclasses.replace(t, offset=None) for t in image.tiles)
        return dataclasses.replace(image, tiles=tiles, copy_paste=None)

    return dataclasses.replace(rec, image=plain(rec.image), mixup=plain(rec.mixup))


def _images(shapes: np.ndarray, seed: int = 0) -> list[np.ndarray]:
    """Smooth random pixels of the loaded shapes (a mirrored canvas differs from the canvas almost everywhere)."""
    rng = np.random.default_rng(seed)
    return [cv2.GaussianBlur(rng.integers(0, 256, (h, w, 3)).astype(np.uint8), (0, 0), 1.5) for h, w in shapes.tolist()]


# ----------------------------------------------------------------------------------------- records
@pytest.mark.parametrize("recipe", ["yolov9", "ultralytics"])
def test_copy_paste_moves_no_other_draw(recipe):
    shapes, labels = _world("segment", 7)
    hyp = {**PASTE_HYP, "mosaic": 0.6, "mixup": 0.5}
    plain = ParamSampler(shapes, hyp, IMGSZ, seed=2, recipe=recipe)
    pasted = ParamSampler(shapes, hyp, IMGSZ, seed=2, recipe=recipe, copy_paste=0.7, instances=_instances(labels))
    kinds = set()
    for i in range(N_IMAGES * 3):
        a, b = plain.sample(1, i), pasted.sample(1, i)
        assert _without_paste(b) == a, f"record {i}: copy-paste moved another draw"
        assert _without_paste(pasted.replacement(1, i, 2)) == plain.replacement(1, i, 2)
        for image in (b.image, b.mixup):
            if image is None:
                continue
            paste = image.copy_paste
            if recipe == "yolov9" and not (b.mosaic or image is b.mixup):  # YOLOv9 pastes on its mosaics only
                assert paste is None and all(t.offset is None for t in image.tiles)
                continue
            assert paste is not None and paste.fraction == 0.7 and paste.recipe == recipe
            assert all(t.offset is not None for t in image.tiles)
            if recipe == "yolov9":
                assert len(paste.keys) == sum(_instances(labels)[t.src] for t in image.tiles)
            else:
                assert paste.keys is None
            kinds.add(len(image.tiles))
    assert pasted.sample(1, 3) == pasted.sample(1, 3)
    assert kinds == ({1, 4} if recipe == "ultralytics" else {4})
    pasted.close_mosaic()  # both references stop copy-paste with the mosaic
    assert all(pasted.sample(2, i).image.copy_paste is None for i in range(N_IMAGES))


def test_copy_paste_arguments_are_checked():
    shapes, labels = _world("segment", 7)
    with pytest.raises(ValueError, match="instances="):
        ParamSampler(shapes, None, IMGSZ, copy_paste=0.3)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        ParamSampler(shapes, None, IMGSZ, copy_paste=1.5, instances=_instances(labels))
    assert ParamSampler(shapes, None, IMGSZ, augment=False, copy_paste=0.3).copy_paste == 0.0  # training only
    with pytest.raises(ValueError, match="9-tile"):
        ParamSampler(shapes, None, IMGSZ, copy_paste=0.3, instances=_instances(labels), mosaic9=True)
    sampler = ParamSampler(shapes, {**PASTE_HYP, "mosaic": 1.0}, IMGSZ, copy_paste=0.3, instances=_instances(labels))
    rec = sampler.sample(0, 0)
    with pytest.raises(ValueError, match="labels="):
        render_sample(rec, lambda i: np.zeros((*shapes[i], 3), np.uint8))
    with pytest.raises(ValueError, match="segment task"):
        transform_geometry([rec], labels.__getitem__, "ultralytics", "segment")
    fewer = labels[:]
    fewer[rec.image.tiles[0].src] = tuple(a[:1] for a in labels[0][:2]) + (np.array([0, len(labels[0][1][:1])]),)
    with pytest.raises(ValueError, match="instances of the labels"):
        transform_geometry([rec], fewer.__getitem__, "yolov9", "segment")


def test_selection_rules():
    """Candidates overlap no box by 0.3 of its area once mirrored; YOLOv9 takes the smallest keys, Ultralytics the
    least overlap (a box without area takes no part there)."""
    boxes = np.array([[0, 0, 10, 10], [85, 0, 100, 10], [40, 50, 60, 60], [10, 80, 20, 90], [5, 5, 5, 9],
                      [70, 20, 80, 30], [22, 22, 40, 40]], np.float32)
    # mirrored across x = 100: 0 and 1 land on each other, 2 and 6 on themselves or 5 (0.64 of 5's area); 3 lands on
    # nothing, 4 has no area, 5 covers 0.2 of 6's area: the candidates are 3, 4 and 5
    keys = (0.9, 0.8, 0.7, 0.2, 0.3, 0.1, 0.0)
    assert paste_selection(boxes, CopyPaste(1.0, (100, 100), "yolov9", keys)).tolist() == [5, 3, 4]
    assert paste_selection(boxes, CopyPaste(0.5, (100, 100), "yolov9", keys)).tolist() == [5, 3]  # round(1.5)
    assert paste_selection(boxes, CopyPaste(1.0, (100, 100), "ultralytics")).tolist() == [3, 5]
    assert paste_selection(boxes, CopyPaste(0.5, (100, 100), "ultralytics")).tolist() == [3]
    assert paste_selection(boxes[:0], CopyPaste(1.0, (100, 100), "ultralytics")).tolist() == []


def test_selection_equals_the_references_on_many_boxes(yolov9, ultra):
    """The references' own selection code on 60 boxes (many without any overlap: ties in Ultralytics' sort)."""
    from ultralytics.utils.instance import Instances

    from tests.reference.geometry_replay import _Script

    rng = np.random.default_rng(3)
    for trial in range(6):
        n, side = 60, 256
        xy = rng.uniform(0, side - 40, (n, 2))
        boxes = np.concatenate((xy, xy + rng.uniform(2, 40, (n, 2))), 1).astype(np.float32)
        corners = [b[[0, 1, 2, 1, 2, 3, 0, 3]].reshape(4, 2).copy() for b in boxes]
        fraction = (0.3, 0.5, 1.0)[trial % 3]
        keys = tuple(rng.random(n).tolist())
        # YOLOv9: copy_paste appends each pasted instance's mirrored box, its random.sample answered from the keys
        labels = np.concatenate((np.zeros((n, 1), np.float32), boxes), 1)
        stdlib = yolov9.base_aug.random
        yolov9.base_aug.random = _Script(keys=[keys])
        try:
            _, out, _ = yolov9.base_aug.copy_paste(np.zeros((side, side, 3), np.uint8), labels, list(corners), fraction)
        finally:
            yolov9.base_aug.random = stdlib
        got = paste_selection(boxes, CopyPaste(fraction, (side, side), "yolov9", keys))
        want = np.stack((side - boxes[:, 2], boxes[:, 1], side - boxes[:, 0], boxes[:, 3]), 1)[got]
        np.testing.assert_array_equal(out[n:, 1:], want)
        # Ultralytics: CopyPaste.get_params's selection
        inst = Instances(boxes.copy(), np.stack(corners), bbox_format="xyxy", normalized=False)
        label = {"img": np.zeros((side, side, 3), np.uint8), "cls": np.zeros((n, 1), np.float32), "instances": inst}
        selected = ultra.aug.CopyPaste(p=fraction, mode="flip").get_params(label)["selected"]
        got = paste_selection(boxes, CopyPaste(fraction, (side, side), "ultralytics"))
        assert got.tolist() == list(selected), f"trial {trial}"
        assert len(got) >= 3


# ----------------------------------------------------------------------------------------- labels
def _pasted_count(rec: SampleParams, labels, recipe: str) -> int:
    with_paste = len(transform_geometry([rec], labels.__getitem__, recipe, "segment"))
    return with_paste - len(transform_geometry([_without_paste(rec)], labels.__getitem__, recipe, "segment"))


def test_yolov9_labels_same_draws(yolov9, draws):
    """The official load_mosaic -> copy_paste -> random_perspective (main mosaic and mixup partner), its random.sample
    answered from fastload's keys: the same instances, each mask IoU >= 0.99."""
    shapes, labels = _world("segment", 2)
    hyp = {**PASTE_HYP, "mixup": 0.5, "mosaic": 1.0}
    sampler = ParamSampler(shapes, hyp, IMGSZ, seed=3, copy_paste=hyp["copy_paste"], instances=_instances(labels))
    pasted = compared = 0
    for i in range(8):
        rec, log = draws(sampler, 0, i)
        geo = transform_geometry([rec], labels.__getitem__, "yolov9", "segment")
        masks, _ = batch_masks(geo, 1, RATIO, False)
        want_targets, want_masks = _official_sample(yolov9, shapes, labels, hyp, rec, log, False, True)
        assert len(geo) == len(want_targets), f"record {i}: {len(geo)} instances, official {len(want_targets)}"
        np.testing.assert_allclose(geo.targets[:, :2], want_targets[:, :2])
        np.testing.assert_allclose(geo.targets[:, 2:] * IMGSZ, want_targets[:, 2:] * IMGSZ, atol=1.0)
        for k in range(len(masks)):
            assert _iou(masks[k], want_masks[k]) >= 0.99, f"record {i} instance {k}: IoU {_iou(masks[k], want_masks[k])}"
        compared += len(masks)
        pasted += _pasted_count(rec, labels, "yolov9")
    assert pasted >= 4 and compared > 20, (pasted, compared)


def test_ultralytics_labels_same_draws(ultra, draws):
    """Ultralytics' CopyPaste between its Mosaic and RandomPerspective, on mosaics, single images and the mixup
    partner: the same instances, each mask IoU >= 0.99."""
    shapes, labels = _world("segment", 5)
    hyp = {**PASTE_HYP, "mosaic": 0.6, "mixup": 0.4}
    sampler = ParamSampler(shapes, hyp, IMGSZ, seed=1, recipe="ultralytics", copy_paste=hyp["copy_paste"])
    pasted = compared = 0
    for i in range(10):
        rec, log = draws(sampler, 0, i)
        geo = transform_geometry([rec], labels.__getitem__, "ultralytics", "segment")
        compared += _compare_ultra(geo, _ultra_sample(ultra, "segment", labels, rec, log, False, True), "segment", False,
                                   False, f"record {i}")
        pasted += _pasted_count(rec, labels, "ultralytics")
    assert pasted >= 4 and compared > 20, (pasted, compared)


# ----------------------------------------------------------------------------------------- pixels
def _pixel_parity(got: np.ndarray, got_plain: np.ndarray, want: np.ndarray, want_plain: np.ndarray, where: str) -> int:
    """Where the reference's paste changed its image, fastload's changed it too and to the same pixels."""
    changed = (want != want_plain).any(-1)
    ours = (got != got_plain).any(-1)
    if changed.sum() < 20:
        return 0
    assert _iou(ours, changed) >= 0.98, f"{where}: pasted region IoU {_iou(ours, changed)}"
    d = np.abs(got.astype(np.int16) - want.astype(np.int16)).max(-1)
    assert d[changed].mean() <= 1.0 and np.percentile(d[changed], 95) <= 8, \
        f"{where}: pasted pixels mean |diff| {d[changed].mean()}, 95 % {np.percentile(d[changed], 95)}"
    return int(changed.sum())


def test_yolov9_pixels_same_draws(yolov9, draws):
    """The official segment loader's image (its canvas pasted, then warped) on real pixels and the same draws."""
    shapes, labels = _world("segment", 2)
    images = _images(shapes)
    hyp = {**PASTE_HYP, "mixup": 0.0, "mosaic": 1.0, "flipud": 0.0, "fliplr": 0.0, "copy_paste": 1.0, "perspective": 0.0005}
    sampler = ParamSampler(shapes, hyp, IMGSZ, seed=4, copy_paste=1.0, instances=_instances(labels))
    area = 0
    for i in range(6):
        rec, log = draws(sampler, 0, i)
        got = render_sample(rec, images.__getitem__, hsv=False, labels=labels.__getitem__)
        got_plain = render_sample(_without_paste(rec), images.__getitem__, hsv=False)
        want = official_segment_pixels(yolov9, images.__getitem__, labels, hyp, rec, log, imgsz=IMGSZ)
        want_plain = official_segment_pixels(yolov9, images.__getitem__, labels, {**hyp, "copy_paste": 0.0}, rec, log,
                                             imgsz=IMGSZ)
        area += _pixel_parity(got, got_plain, want, want_plain, f"record {i}")
    assert area > 2000, area


def test_ultralytics_pixels_same_draws(ultra, draws):
    """Ultralytics' CopyPaste on the canvas of real pixels, warped as its RandomPerspective warps it."""
    from tests.reference.geometry_replay import _ultralytics_image, ultralytics_label

    shapes, labels = _world("segment", 5)
    images = _images(shapes, 1)
    hyp = {**PASTE_HYP, "mosaic": 0.5, "mixup": 0.0, "flipud": 0.0, "fliplr": 0.0, "copy_paste": 1.0}
    sampler = ParamSampler(shapes, hyp, IMGSZ, seed=5, recipe="ultralytics", copy_paste=1.0)
    area = 0
    for i in range(8):
        rec, log = draws(sampler, 0, i)
        got = render_sample(rec, images.__getitem__, hsv=False, labels=labels.__getitem__)
        got_plain = render_sample(_without_paste(rec), images.__getitem__, hsv=False)
        canvas = ultralytics_canvas(rec.image, images.__getitem__)
        out = _ultralytics_image(ultra, "segment", lambda j, hw: ultralytics_label(ultra, "segment", labels[j], hw),
                                 rec.image, log[0], IMGSZ, canvas)
        ref = rec.image.tiles[0]
        warp = (ref.matrix @ np.array([[1, 0, -ref.offset[0]], [0, 1, -ref.offset[1]], [0, 0, 1]]))[:2]
        want, want_plain = (cv2.warpAffine(c, warp, (IMGSZ, IMGSZ), borderValue=(114, 114, 114))
                            for c in (out["canvas"], canvas))
        area += _pixel_parity(got, got_plain, want, want_plain, f"record {i}")
    assert area > 2000, area


def test_mixup_partner_is_pasted_too():
    """YOLOv9's mixup partner is a mosaic of its own: pasted, and its pixels with it."""
    shapes, labels = _world("segment", 2)
    images = _images(shapes)
    hyp = {**PASTE_HYP, "mixup": 1.0, "mosaic": 1.0}
    sampler = ParamSampler(shapes, hyp, IMGSZ, seed=6, copy_paste=1.0, instances=_instances(labels))
    changed = 0
    for i in range(4):
        rec = sampler.sample(0, i)
        assert rec.mixup is not None and rec.mixup.copy_paste is not None
        only_main = dataclasses.replace(rec, mixup=_without_paste(dataclasses.replace(rec, image=rec.mixup)).image)
        got = render_sample(rec, images.__getitem__, hsv=False, labels=labels.__getitem__)
        changed += int((got != render_sample(only_main, images.__getitem__, hsv=False, labels=labels.__getitem__)).any())
    assert changed >= 2


@pytest.mark.parametrize("recipe", ["yolov9", "ultralytics"])
def test_labels_moved_before_the_pixels_give_the_same_sample(recipe):
    """The renderer's path (each record's labels moved first, the paste outlines taken from them, the batch assembled
    from them) gives the pixels and labels of moving the labels apart, which the parity tests above check."""
    shapes, labels = _world("segment", 3)
    images = _images(shapes, 2)
    hyp = {**PASTE_HYP, "mixup": 0.5, "mosaic": 0.7}
    instances = _instances(labels) if recipe == "yolov9" else None
    sampler = ParamSampler(shapes, hyp, IMGSZ, seed=8, recipe=recipe, copy_paste=0.9, instances=instances)
    records = [sampler.sample(0, i) for i in range(N_IMAGES)]
    assert sum(im is not None and im.copy_paste is not None for r in records for im in (r.image, r.mixup)) >= 4
    loaded = LoadedPolygons()
    moved = [move_record(r, labels.__getitem__, recipe, "segment", loaded) for r in records]
    for r, m in zip(records, moved):
        assert np.array_equal(render_sample(r, images.__getitem__, hsv=False, moved=m),
                              render_sample(r, images.__getitem__, hsv=False, labels=labels.__getitem__))
    got = transform_geometry(records, labels.__getitem__, recipe, "segment", moved_records=moved)
    want = transform_geometry(records, labels.__getitem__, recipe, "segment")
    assert np.array_equal(got.targets, want.targets) and np.array_equal(got.points, want.points)
    assert np.array_equal(got.offsets, want.offsets) and len(got) > 0
    with pytest.raises(ValueError, match="moved records for a batch"):
        transform_geometry(records, labels.__getitem__, recipe, "segment", moved_records=moved[:-1])
