"""``fastload.loader(task=...)``: segment, pose and obb batches from the CPU engine (in-process and forked workers
alike), their types and shapes, the labels a store view keeps, and the one-line refusals."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import fastload
from fastload.data.synthetic import make_synthetic_dataset
from fastload.engines.base import OBBBatch, PoseBatch, SegmentBatch

RECIPE = {"segment": "yolov9", "pose": "ultralytics", "obb": "ultralytics"}
BATCH = {"segment": SegmentBatch, "pose": PoseBatch, "obb": OBBBatch}


@pytest.fixture(scope="module")
def task_data(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("tasks")
    return {task: make_synthetic_dataset(out / task, n_train=10, n_val=0, seed=3, min_size=48, max_size=120,
                                         task=task) for task in ("detect", *RECIPE)}


def _batches(data: Path, task: str, workers: int, **kw) -> list:
    with fastload.loader(data, "train", imgsz=64, batch_size=4, workers=workers, store="files", task=task,
                         recipe=RECIPE[task], **kw) as fl:
        return list(fl)


def _same(a, b) -> None:
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y)
        else:
            assert x == y


@pytest.mark.parametrize("task", list(RECIPE))
def test_task_batches_are_the_same_rendered_in_process_and_by_forked_workers(task_data, task):
    inline = _batches(task_data[task], task, 0)
    forked = _batches(task_data[task], task, 2)
    assert len(inline) == len(forked) == 3
    for a, b in zip(inline, forked):
        assert type(a) is type(b) is BATCH[task]
        _same(a, b)
    rows = sum(len(b.targets) for b in inline)
    assert rows, "the synthetic set has instances"
    for b in inline:
        n = len(b.targets)
        if task == "segment":  # overlap: one mask per image, values up to the image's instance count
            assert b.masks.shape == (len(b.paths), 16, 16)
            for i in range(len(b.paths)):
                assert int(b.masks[i].max()) <= int((b.targets[:, 0] == i).sum())
        elif task == "pose":
            assert b.keypoints.shape == (n, 5, 3) and b.keypoints.dtype == torch.float32
            visible = b.keypoints[..., 2] > 0
            assert bool(((b.keypoints[..., :2] >= 0) & (b.keypoints[..., :2] <= 1))[visible].all())
        else:
            assert b.obb.shape == (n, 5) and b.obb.dtype == torch.float32
            assert bool((b.obb[:, 2] >= b.obb[:, 3]).all())  # w is the longer side


def test_segment_masks_per_instance_follow_the_targets_and_min_items_keeps_the_points(task_data):
    data = task_data["segment"]
    overlap = _batches(data, "segment", 0, augment=False, shuffle=False, min_items=2)
    single = _batches(data, "segment", 0, augment=False, shuffle=False, min_items=2, overlap_mask=False,
                      mask_ratio=2)
    for o, s in zip(overlap, single):
        assert s.masks.shape == (len(s.targets), 32, 32) and s.masks.dtype == torch.uint8
        assert int(s.masks.max()) == 1
        # the same instances: an overlap mask's k-th instance (by decreasing area) is its image's k-th target row
        assert sorted(map(tuple, o.targets.tolist())) == sorted(map(tuple, s.targets.tolist()))
        assert all(c >= 2 for c in torch.bincount(o.targets[:, 0].long()).tolist())


def test_the_dataset_exposes_the_polygons_of_the_images_it_kept(task_data):
    with fastload.loader(task_data["segment"], "train", imgsz=64, batch_size=4, workers=0, store="files",
                         task="segment", min_items=2) as fl:
        assert "store=files, task=segment, n=" in repr(fl)
        ds = fl.dataset
        assert len(ds.segments) == ds.n and [len(s) for s in ds.segments] == [len(lb) for lb in ds.labels]
        for polygons, rows in zip(ds.segments, ds.labels):
            for poly, row in zip(polygons, rows):  # a row's box spans its polygon
                np.testing.assert_allclose((poly.min(0) + poly.max(0)) / 2, row[1:3], atol=1e-6)


def test_detection_batches_keep_their_four_fields(task_data):
    with fastload.loader(task_data["detect"], "train", imgsz=64, batch_size=4, workers=0, store="files") as fl:
        batch = next(iter(fl))
        assert "task=" not in repr(fl)
    assert type(batch) is fastload.Batch and len(batch) == 4


@pytest.mark.parametrize("kw, says", [
    ({"task": "segment", "engine": "gpu"}, "engine 'gpu' cannot take task='segment': it renders detect batches "
                                           "only; engine 'cpu' renders segment batches"),
    ({"task": "detect", "mask_ratio": 2}, "mask_ratio=2 applies to task='segment' only"),
    ({"task": "pose", "overlap_mask": False}, "overlap_mask=False applies to task='segment' only"),
    ({"task": "pose"}, "task='pose' needs recipe='ultralytics'"),
    ({"task": "keypoints"}, "task must be one of detect, segment, pose, obb"),
])
def test_task_settings_are_refused_in_one_line(task_data, kw, says):
    with pytest.raises(ValueError) as err:
        fastload.loader(task_data["segment"], "train", imgsz=64, batch_size=4, workers=0, store="files", **kw)
    assert says in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("data, task, says", [
    ("detect", "segment", "task='segment' needs polygon labels (class x1 y1 x2 y2 ...);"),
    ("segment", "pose", "task='pose' needs keypoint labels (kpt_shape in the data yaml);"),
    ("pose", "segment", "has keypoints (task='pose')"),
    ("segment", "obb", "task='obb' needs 4-corner polygons (class x1 y1 ... x4 y4); "),
])
def test_labels_without_what_the_task_reads_are_refused(task_data, data, task, says):
    with pytest.raises(ValueError) as err:
        fastload.loader(task_data[data], "train", imgsz=64, batch_size=4, workers=0, store="files", task=task,
                        recipe="ultralytics")
    assert says in str(err.value) and "\n" not in str(err.value)
    if task == "obb":  # names the label file
        assert ".txt has a row of" in str(err.value)


def test_obb_batches_have_one_finite_rotated_box_per_target(task_data):
    batch = _batches(task_data["obb"], "obb", 0, augment=False, shuffle=False)[0]
    assert np.isfinite(batch.obb.numpy()).all() and len(batch.obb) == len(batch.targets)


def test_pose_without_flip_idx_does_not_flip_as_ultralytics(task_data, tmp_path):
    config = yaml.safe_load(task_data["pose"].read_text())
    del config["flip_idx"]
    config["path"] = str(task_data["pose"].parent)
    data = tmp_path / "no_flip_idx.yaml"
    data.write_text(yaml.safe_dump(config))
    with pytest.warns(UserWarning, match="no flip_idx for its keypoints; fliplr and flipud set to 0.0"):
        fl = fastload.loader(data, "train", imgsz=64, batch_size=4, workers=0, store="files", task="pose",
                             recipe="ultralytics", hyp={"fliplr": 0.5, "flipud": 0.5})
    with fl:
        assert fl.dataset.hyp["fliplr"] == fl.dataset.hyp["flipud"] == 0.0


@pytest.mark.parametrize("recipe", ["yolov9", "ultralytics"])
def test_segment_training_pastes_copies_the_same_in_process_and_in_workers(task_data, recipe):
    """hyp copy_paste > 0 reaches the segment loader's records: instances are added (mirrored copies), the same
    whether rendered in process or by forked workers; a detection loader with the same hyp pastes none."""
    hyp = {"mosaic": 1.0, "mixup": 0.0, "degrees": 0.0, "shear": 0.0, "perspective": 0.0}
    kw = dict(imgsz=64, batch_size=4, store="files", task="segment", recipe=recipe, seed=1)

    def run(workers: int, copy_paste: float, task: str = "segment") -> list:
        with fastload.loader(task_data[task], "train", workers=workers,
                             hyp={**hyp, "copy_paste": copy_paste}, **{**kw, "task": task}) as fl:
            records = fl.engine.sampler.sample_batch(0, np.arange(len(fl.dataset.im_files)))
            return [list(fl), records]

    pasted, records = run(0, 1.0)
    forked, _ = run(2, 1.0)
    plain, _ = run(0, 0.0)
    for a, b in zip(pasted, forked):
        _same(a, b)
    assert all(r.image.copy_paste is not None for r in records)
    assert sum(len(b.targets) for b in pasted) > sum(len(b.targets) for b in plain)
    _, detect_records = run(0, 1.0, "detect")
    assert all(r.image.copy_paste is None for r in detect_records)
