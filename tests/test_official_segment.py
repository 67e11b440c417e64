"""fastload's segment batches against the official YOLOv9 segment loader (``utils/segment/dataloaders.py`` of a
temporary copy of ../shared/upstream/yolov9, imported into this process), on a small synthetic segment set:

* validation (no augmentation; square and rect batches, overlap masks and one per instance): the batches of
  ``fastload.compat.yolov9.segment.create_dataloader`` are the official ``create_dataloader``'s, pixels, targets,
  shapes and masks (dtype included);
* training: each sample of a fastload training batch against the official ``__getitem__`` replaying the same record
  and draws (tests/reference/geometry_replay.py): the same instances, boxes within 1 px, each mask IoU >= 0.99.
"""
from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest
import torch

from fastload.compat.yolov9.segment import create_dataloader
from fastload.data.synthetic import make_synthetic_dataset
from augment_helpers import box_rows_only
from official_helpers import UPSTREAM
from tests.reference.geometry_replay import official_segment_modules, official_segment_sample, recording_draws

IMGSZ = 96
BATCH = 4
RATIO = 4


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> str:
    data = make_synthetic_dataset(tmp_path_factory.mktemp("seg"), n_train=8, n_val=0, seed=5, min_size=48,
                                  max_size=160, task="segment")
    return str(Path(data).parent / "images" / "train")


@pytest.fixture(scope="module")
def yolov9(tmp_path_factory):
    if not (UPSTREAM / "utils" / "segment" / "dataloaders.py").is_file():
        pytest.skip(f"official YOLOv9 checkout not found at {UPSTREAM} (set FASTLOAD_YOLOV9_UPSTREAM)")
    with official_segment_modules(UPSTREAM, tmp_path_factory.mktemp("yolov9_segment")) as modules:
        yield modules


def test_signature_and_defaults_are_the_officials(yolov9):
    official = inspect.signature(yolov9.dl.create_dataloader).parameters
    ours = inspect.signature(create_dataloader).parameters
    assert list(ours)[: len(official)] == list(official) and list(ours)[len(official):] == ["fastload_options"]
    assert all(ours[name].default == p.default for name, p in official.items() if p.default is not p.empty)


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    union = np.logical_or(a, b).sum()
    return 1.0 if union == 0 else float(np.logical_and(a, b).sum() / union)


def _both_loaders(yolov9, images, kw: dict) -> tuple[list, list]:
    """The batches of fastload's ``create_dataloader`` and of the official one, as segment/val.py calls them."""
    official = list(yolov9.dl.create_dataloader(images, IMGSZ, BATCH, 32, False, **kw)[0])
    ours, _ = create_dataloader(images, IMGSZ, BATCH, 32, False, **kw, num_workers=0, device=None)
    try:
        return list(ours), official
    finally:
        ours.close()


@pytest.mark.parametrize("rect", [True, False], ids=["rect", "square"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "per-instance"])
def test_validation_batches_identical_to_official(yolov9, images, rect, overlap):
    # as segment/val.py calls it
    kw = dict(pad=0.5 if rect else 0.0, rect=rect, workers=0, prefix="", mask_downsample_ratio=RATIO,
              overlap_mask=overlap)
    got, official = _both_loaders(yolov9, images, kw)
    assert len(got) == len(official) == 2
    _assert_same_batches(got, official)


def _assert_same_batches(got: list, official: list) -> None:
    """fastload's segment batches are the official ones: paths, pixels, shapes, masks (dtype included), targets."""
    assert len(got) == len(official)
    for k, (mine, want) in enumerate(zip(got, official)):
        imgs, targets, paths, shapes, masks = want
        assert mine.paths == tuple(paths), k
        assert np.array_equal(mine.imgs.numpy(), imgs.numpy()), f"batch {k}: pixels differ"
        assert mine.shapes == tuple(shapes), k
        assert mine.masks.dtype == masks.dtype and mine.masks.shape == masks.shape, (k, mine.masks.dtype, masks.dtype)
        assert np.array_equal(mine.masks.numpy(), masks.numpy()), f"batch {k}: masks differ"
        np.testing.assert_allclose(mine.targets.numpy(), targets.numpy(), atol=1e-6, err_msg=f"batch {k}")


def test_training_batch_matches_the_official_sample_of_the_same_draws(yolov9, images):
    hyp = {"hsv_h": 0.0, "hsv_s": 0.0, "hsv_v": 0.0, "degrees": 10.0, "shear": 2.0, "translate": 0.1, "scale": 0.5,
           "flipud": 0.3, "fliplr": 0.5, "mosaic": 1.0, "mixup": 0.5, "copy_paste": 0.0}
    loader, dataset = create_dataloader(images, IMGSZ, BATCH, 32, False, hyp=hyp, augment=True, workers=0,
                                        mask_downsample_ratio=RATIO, overlap_mask=False, num_workers=0, device=None,
                                        seed=2)
    try:
        sampler, labels = loader.engine.sampler, loader.engine.store.labels
        batch = next(iter(loader))  # shuffle=False: epoch 0's first batch is images 0..3
        shapes = np.asarray(sampler.loaded_shapes)
        per_image = [labels.image(i) for i in range(len(labels))]
        compared = 0
        with recording_draws() as draws:
            for b in range(BATCH):
                rec, log = draws(sampler, 0, b)
                want_targets, want_masks = official_segment_sample(yolov9, shapes, per_image, hyp, rec, log,
                                                                   imgsz=IMGSZ, mask_ratio=RATIO, overlap=False,
                                                                   augment=True)
                rows = np.flatnonzero(batch.targets[:, 0].numpy() == b)
                assert len(rows) == len(want_targets), f"sample {b}: {len(rows)} instances, official {len(want_targets)}"
                mine = batch.targets.numpy()[rows]
                np.testing.assert_allclose(mine[:, 1], want_targets[:, 1])
                np.testing.assert_allclose(mine[:, 2:] * IMGSZ, want_targets[:, 2:] * IMGSZ, atol=1.0)
                for k, row in enumerate(rows.tolist()):
                    iou = _iou(batch.masks[row].numpy(), want_masks[k])
                    assert iou >= 0.99, f"sample {b} instance {k}: mask IoU {iou}"
                compared += len(rows)
        assert compared >= 8
    finally:
        loader.close()


@pytest.fixture(scope="module")
def box_row_images(tmp_path_factory) -> tuple[str, Path]:
    """``(images, label file)``: a small segment set where one image's label file has box rows only (its polygons'
    boxes, ``class xc yc w h``), as a set mixing detection and segment labels has."""
    data = make_synthetic_dataset(tmp_path_factory.mktemp("seg_box_rows"), n_train=BATCH, n_val=0, seed=5,
                                  min_size=48, max_size=96, task="segment")
    label = box_rows_only(Path(data).parent / "labels" / "train")
    return str(Path(data).parent / "images" / "train"), label


def test_box_rows_keep_their_boxes_with_empty_masks_where_the_official_loader_does(yolov9, box_row_images):
    """Validation with one mask per instance (segment/val.py's default): the official loader keeps a box-only
    image's boxes with all-zero masks (float32: the batch's masks are promoted); fastload's batches are the same."""
    images, label = box_row_images
    kw = dict(pad=0.0, rect=False, workers=0, prefix="", mask_downsample_ratio=RATIO, overlap_mask=False)
    got, official = _both_loaders(yolov9, images, kw)
    _assert_same_batches(got, official)
    (batch,) = got
    k = [Path(p).stem for p in batch.paths].index(label.stem)
    rows = (batch.targets[:, 0] == k).numpy()
    assert rows.sum() == len(label.read_text().splitlines())
    assert batch.masks.dtype == torch.float32 and not batch.masks[rows].any() and batch.masks[~rows].any()


def test_box_rows_where_the_official_loader_fails_are_refused_naming_the_file(yolov9, box_row_images):
    """Overlap masks and training: the official loader fails on a box-only image's rows (its labels and masks no
    longer match); fastload refuses the set in one line naming the label file."""
    images, label = box_row_images
    stems = [Path(f).stem for f in sorted(Path(images).iterdir())]
    hyp = {"hsv_h": 0.0, "hsv_s": 0.0, "hsv_v": 0.0, "degrees": 0.0, "shear": 0.0, "translate": 0.1, "scale": 0.5,
           "perspective": 0.0, "flipud": 0.0, "fliplr": 0.5, "mosaic": 1.0, "mixup": 0.0, "copy_paste": 0.0}
    for augment, overlap, failure in ((False, True, RuntimeError), (True, False, IndexError)):
        official = yolov9.dl.LoadImagesAndLabelsAndMasks(images, IMGSZ, BATCH, augment=augment, hyp=hyp, stride=32,
                                                         overlap=overlap, downsample_ratio=RATIO)
        with pytest.raises(failure):
            official[stems.index(label.stem)]
        with pytest.raises(ValueError) as err:
            create_dataloader(images, IMGSZ, BATCH, 32, False, hyp=hyp, augment=augment, workers=0,
                              mask_downsample_ratio=RATIO, overlap_mask=overlap, num_workers=0, device=None)
        assert f"{label} has box rows only" in str(err.value) and "\n" not in str(err.value)
