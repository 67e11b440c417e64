"""Box maths: agreement with the stock algorithm, containment, and pixel-exact agreement with
the pixels (synthetic shapes drawn through the same records)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fastload.augment.boxes import batch_targets, transform_labels
from fastload.augment.params import ImageParams, ParamSampler, SampleParams
from fastload.augment.pipeline import render_sample
from tests.augment_helpers import load_folder, random_world, shapes_of
from tests.reference.stock_replay import labels_record


def _world(seed=0, n=12, imgsz=640):
    return random_world(n, imgsz, seed, max_boxes=8, nc=80, wh=(0.02, 0.6))


@pytest.mark.parametrize("hyp", [None, {"degrees": 10.0, "shear": 3.0}, {"perspective": 0.0003}, {"mosaic": 0.0}])
def test_boxes_match_stock_within_1px(hyp):
    shapes, labels = _world()
    s = ParamSampler(shapes, {**(hyp or {}), "mixup": 0.5}, 640, seed=0)
    compared = 0
    for e in range(4):
        for i in range(len(shapes)):
            p = s.sample(e, i)
            ours, ref = transform_labels(p, labels), labels_record(p, labels)
            if len(ours) != len(ref):
                # a box right at the 2-px / 10 % thresholds may flip: tolerate one
                assert abs(len(ours) - len(ref)) <= 1
                continue
            assert np.array_equal(ours[:, 0], ref[:, 0])
            h, w = p.out_hw
            err = np.abs(ours[:, 1:] - ref[:, 1:]) * [w, h, w, h]
            # stock's letterbox shifts boxes by the float pad dw but pixels by round(dw - 0.1):
            # up to 0.5 px more, scaled by the perspective (ours follow the pixels)
            tol = 1.0 if p.mosaic or p.image.candidate_scale is None else 1.0 + 0.5 * p.image.candidate_scale
            assert err.max(initial=0) <= tol, err.max()
            compared += len(ours)
    assert compared > 50


def test_validation_boxes_are_only_letterboxed():
    shapes, labels = _world(1)
    s = ParamSampler(shapes, None, 640, augment=False)
    for i in range(len(shapes)):
        p = s.sample(0, i)
        out = transform_labels(p, labels)
        assert len(out) == len(labels[i])  # no candidate filter in validation
        h, w = shapes[i]
        r = min(640 / h, 640 / w, 1.0)
        np.testing.assert_allclose(out[:, 3], labels[i][:, 3] * w * r / 640, atol=2e-3)


def test_boxes_inside_output_and_nonempty():
    shapes, labels = _world(2)
    s = ParamSampler(shapes, {"degrees": 20.0, "mixup": 0.5}, 640, seed=1)
    for i in range(len(shapes)):
        out = transform_labels(s.sample(0, i), labels)
        assert out.dtype == np.float32 and out.shape[1] == 5
        x0, x1 = out[:, 1] - out[:, 3] / 2, out[:, 1] + out[:, 3] / 2
        y0, y1 = out[:, 2] - out[:, 4] / 2, out[:, 2] + out[:, 4] / 2
        assert (x0 >= -1e-5).all() and (x1 <= 1 + 1e-5).all() and (y0 >= -1e-5).all() and (y1 <= 1 + 1e-5).all()
        assert (out[:, 3] * 640 > 2).all() and (out[:, 4] * 640 > 2).all()


def test_empty_labels_callable_and_flips():
    shapes, labels = _world(3)
    empty = [np.zeros((0, 5), np.float32)] * len(shapes)
    s = ParamSampler(shapes, {"fliplr": 1.0, "flipud": 1.0}, 640, seed=0)
    p = s.sample(0, 0)
    assert transform_labels(p, empty).shape == (0, 5)
    a = transform_labels(p, labels)
    b = transform_labels(p, lambda i: labels[i])
    assert np.array_equal(a, b)
    unflipped = transform_labels(replace(p, flip_lr=False, flip_ud=False), labels)
    np.testing.assert_allclose(a[:, 1:3], 1 - unflipped[:, 1:3], atol=1e-6)
    np.testing.assert_allclose(a[:, 3:], unflipped[:, 3:], atol=1e-6)


def test_batch_targets_equal_one_record_at_a_time():
    """The batched box pass (every tile of every sample in one set of array operations) gives
    bit-identical targets to moving each record alone: same rows, order, filtering and flips,
    also when affine and perspective records, mixup partners and label-less images mix."""
    shapes, labels = _world(4)
    labels = [lb if i % 5 else np.zeros((0, 5), np.float32) for i, lb in enumerate(labels)]
    records = []
    for k, hyp in enumerate([None, {"perspective": 0.0003}, {"degrees": 10.0}]):
        s = ParamSampler(shapes, {**(hyp or {}), "mixup": 0.5, "flipud": 0.5}, 640, seed=k)
        records += [s.sample(1, i) for i in range(len(shapes))]
    records = [records[j] for j in np.random.default_rng(0).permutation(len(records))]
    got = batch_targets(records, labels)
    want = [np.concatenate([np.full((len(t), 1), k, np.float32), t], 1) for k, r in enumerate(records)
            for t in [transform_labels(r, labels)]]
    assert got.dtype == np.float32 and got.shape[1] == 6
    assert np.array_equal(got, np.concatenate(want)), "batched targets differ from per-record targets"
    assert len(np.unique(got[:, 0])) > len(records) // 2  # most samples kept boxes: the comparison means something
    assert any(r.mixup is not None for r in records) and any(r.flip_ud for r in records)
    assert batch_targets([], labels).shape == (0, 6)
    mixed = [records[0], replace(records[1], image=replace(records[1].image, out_hw=(320, 320)))]
    with pytest.raises(ValueError, match="different output sizes"):
        batch_targets(mixed, labels)


# ------------------------------------------------------------------ pixel-exact with the pixels
def _coverage_mask(row: np.ndarray, h: int, w: int) -> np.ndarray:
    """255 * the fraction of each pixel covered by the label box (sub-pixel accurate edges)."""
    x0, x1 = (row[1] - row[3] / 2) * w, (row[1] + row[3] / 2) * w
    y0, y1 = (row[2] - row[4] / 2) * h, (row[2] + row[4] / 2) * h
    cx = np.clip(np.minimum(np.arange(w) + 1, x1) - np.maximum(np.arange(w), x0), 0, 1)
    cy = np.clip(np.minimum(np.arange(h) + 1, y1) - np.maximum(np.arange(h), y0), 0, 1)
    m = np.round(np.outer(cy, cx) * 255).astype(np.uint8)
    return np.ascontiguousarray(np.repeat(m[..., None], 3, axis=2))


def _extent(mask: np.ndarray) -> tuple[float, float, float, float] | None:
    ys, xs = np.nonzero(mask)
    if len(xs) == 0:
        return None
    return xs.min(), ys.min(), xs.max() + 1, ys.max() + 1


@pytest.mark.parametrize("hyp", [None, {"degrees": 15.0}, {"mosaic": 0.0}])
def test_boxes_coincide_with_synthetic_shapes(tmp_path, hyp):
    """Each square of fastload's synthetic set, drawn alone through the record's tile matrix,
    covers exactly its transformed box (edges within 1 px)."""
    from fastload.data.synthetic import make_synthetic_dataset

    yaml_path = make_synthetic_dataset(tmp_path / "syn", n_train=16, n_val=1, nc=3, seed=0)
    images, labels = load_folder(Path(yaml_path).parent, 320, 16)
    shapes = shapes_of(images)
    s = ParamSampler(shapes, {**(hyp or {}), "mixup": 0.0, "fliplr": 0.5}, 320, seed=0)
    checked = 0
    for i in range(len(images)):
        p = s.sample(0, i)
        for tile in p.image.tiles:
            h, w = tile.src_hw
            for row in labels[tile.src]:
                if int(row[0]) % 3 != 0:  # squares fill their box; circles/triangles do not
                    continue
                mask = _coverage_mask(row, h, w)
                single = SampleParams(
                    index=i, epoch=0, image=ImageParams((tile,), p.out_hw, 0, None),
                    flip_ud=p.flip_ud, flip_lr=p.flip_lr, mosaic=p.mosaic,
                )
                drawn = render_sample(single, lambda _i: mask, hsv=False)[..., 0]
                box = transform_labels(single, {tile.src: row[None]})
                ext = _extent(drawn >= 128)
                if ext is None or len(box) == 0:
                    continue
                bw, bh = box[0, 3] * p.out_hw[1], box[0, 4] * p.out_hw[0]
                if bw < 4 or bh < 4:
                    continue
                bx0, by0 = box[0, 1] * p.out_hw[1] - bw / 2, box[0, 2] * p.out_hw[0] - bh / 2
                want = np.array([bx0, by0, bx0 + bw, by0 + bh])
                if tile.is_axis_aligned:
                    assert np.abs(np.array(ext) - want).max() <= 1.0, (ext, want)
                elif want.min() > 1 and want[2] < p.out_hw[1] - 1 and want[3] < p.out_hw[0] - 1:
                    # rotated (boxes cut by the output border are the clipped corner bbox, larger
                    # than the visible shape, as in YOLOv9: not compared); thin corner tips fall
                    # under the 50 % threshold, so check an outer bound and closeness
                    outer = np.array(_extent(drawn >= 64))
                    assert (outer[:2] >= want[:2] - 1.0).all() and (outer[2:] <= want[2:] + 1.0).all(), (outer, want)
                    assert np.abs(np.array(ext) - want).max() <= 3.0, (ext, want)
                checked += 1
    assert checked >= 4
