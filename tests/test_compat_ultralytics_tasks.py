"""fastload.compat.ultralytics for segment, pose and obb models against the real ``ultralytics`` package (skipped
where it is not installed), on tiny synthetic sets (``fastload synth --task ...``).

The entry points follow the model's task; validation batches (augmentation off) and ``dataset.labels`` equal
Ultralytics' own dataset's on the same images: masks (overlap and per instance, at ``mask_ratio``), semantic
masks, keypoints, xywhr boxes. Then each task's real trainer for 2 epochs both ways (tests/ultralytics_task_run.py,
forked from the pre-loaded interpreter), its weights validated through both loaders with the same metrics.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fastload.compat.ultralytics import UltralyticsOptions, UnsupportedArgument
from fastload.compat.ultralytics.loader import LoaderRequest, build_loader
from augment_helpers import box_rows_only
import preloaded
from preloaded import base_env
from test_compat_ultralytics import ultralytics_env

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ultralytics") is None,
                                reason='ultralytics is not installed (pip install "fastload[ultralytics]")')

REPO = Path(__file__).resolve().parents[1]
TASKS = ("segment", "pose", "obb")
MODELS = {"segment": "yolov8n-seg.yaml", "pose": "yolov8n-pose.yaml", "obb": "yolov8n-obb.yaml"}  # the smallest
N_TRAIN, N_VAL = 8, 10  # the tenth val image has no labels


@pytest.fixture(scope="module")
def task_env(tmp_path_factory):
    """Offline, Ultralytics' settings and fastload's ram stores in a temporary folder, for the module."""
    tmp = tmp_path_factory.mktemp("ultralytics_tasks_env")
    (tmp / "shm").mkdir()
    with pytest.MonkeyPatch.context() as mp:
        for k, v in ultralytics_env(tmp).items():
            mp.setenv(k, v)
        yield tmp


@pytest.fixture(scope="module")
def task_data(tmp_path_factory):
    """``data(task) -> data.yaml`` of a tiny synthetic set of the task, made once per module (the yaml's path
    absolute: Ultralytics reads a relative one from the working directory)."""
    from fastload.data.synthetic import make_synthetic_dataset

    made: dict[str, Path] = {}

    def data(task: str) -> Path:
        if task not in made:
            out = tmp_path_factory.mktemp(f"synth_{task}")
            yaml_path = make_synthetic_dataset(out, n_train=N_TRAIN, n_val=N_VAL, seed=1, min_size=40, max_size=120,
                                               task=task)
            yaml_path.write_text(yaml_path.read_text().replace("path: .", f"path: {out}"))
            made[task] = yaml_path
        return made[task]
    return data


@pytest.fixture
def task_args(task_env, task_data):
    """``make(task, **overrides) -> (args, data dict)`` as the task's Ultralytics trainer holds them."""
    from ultralytics.cfg import get_cfg
    from ultralytics.data.utils import check_det_dataset

    def make(task: str, **overrides):
        data = task_data(task)
        args = get_cfg(overrides={"data": str(data), "task": task, "imgsz": 64, "batch": 4, "workers": 0, **overrides})
        return args, check_det_dataset(str(data))
    return make


def test_classify_and_a_pose_yaml_without_kpt_shape_are_refused(task_args):
    from fastload.compat.ultralytics import FastloadTrainer, FastloadValidator

    for make in (lambda: FastloadTrainer(overrides={"task": "classify", "model": "yolov8n-cls.yaml"}),
                 lambda: FastloadValidator(args={"task": "classify"})):
        with pytest.raises(UnsupportedArgument, match="task='classify'") as e:
            make()
        assert "\n" not in str(e.value)
    args, data = task_args("pose")
    del data["flip_idx"]  # no flips then, with a warning, as Ultralytics (the flip order reaches the store)
    with pytest.warns(UserWarning, match="no flip_idx"):
        build_loader(args, data, LoaderRequest(data["train"], 4, "train", False, 32), UltralyticsOptions()).close()
    del data["kpt_shape"]
    with pytest.raises(UnsupportedArgument, match="no kpt_shape"):
        build_loader(args, data, LoaderRequest(data["val"], 4, "val", True, 32), UltralyticsOptions())


def test_entry_points_become_the_task_trainer_and_validator():
    """``trainer=FastloadTrainer`` / ``validator=FastloadValidator`` are made as the model's task's Ultralytics trainer
    and validator with fastload's loaders (what the class of a new instance is: nothing is built here; the real runs
    below build them); detection stays the detection trainer; a subclass is joined with the task's class, once."""
    from ultralytics.models.yolo.detect import DetectionTrainer
    from ultralytics.models.yolo.obb import OBBTrainer, OBBValidator
    from ultralytics.models.yolo.pose import PoseTrainer, PoseValidator
    from ultralytics.models.yolo.segment import SegmentationTrainer, SegmentationValidator

    from fastload.compat.ultralytics import FastloadTrainer, FastloadValidator

    expected = {"segment": (SegmentationTrainer, SegmentationValidator), "pose": (PoseTrainer, PoseValidator),
                "obb": (OBBTrainer, OBBValidator)}
    for task, (trainer_base, validator_base) in expected.items():
        made = type(FastloadTrainer.__new__(FastloadTrainer, overrides={"task": task, "fastload_workers": 0}))
        assert issubclass(made, FastloadTrainer) and issubclass(made, trainer_base), made.__mro__
        made = type(FastloadValidator.__new__(FastloadValidator, args={"task": task, "fastload_workers": 0}))
        assert issubclass(made, FastloadValidator) and issubclass(made, validator_base), made.__mro__
    assert type(FastloadTrainer.__new__(FastloadTrainer, overrides={})) is FastloadTrainer
    assert type(FastloadValidator.__new__(FastloadValidator)) is FastloadValidator
    assert issubclass(FastloadTrainer, DetectionTrainer)

    class Mine(FastloadTrainer):
        """A user's trainer: its own hooks, any task."""

    made = type(Mine.__new__(Mine, overrides={"task": "pose"}))
    assert issubclass(made, Mine) and issubclass(made, PoseTrainer) and made.__name__ == "Mine"
    assert type(Mine.__new__(Mine, overrides={"task": "pose"})) is made and type(Mine.__new__(Mine)) is Mine


def _both_loaders(task_args, task: str, **overrides):
    """Ultralytics' own rect validation loader and fastload's, over the task's val split."""
    from ultralytics.data import build_dataloader, build_yolo_dataset

    args, data = task_args(task, **overrides)
    own = build_dataloader(build_yolo_dataset(args, data["val"], 4, data, mode="val", rect=True, stride=32), 4, 0,
                           shuffle=False, rank=-1)
    ours = build_loader(args, data, LoaderRequest(data["val"], 4, "val", True, 32), UltralyticsOptions())
    return own, ours


def _largest(diff: torch.Tensor) -> float:
    return float(diff.abs().max()) if diff.numel() else 0.0


CASES = [("segment", {}), ("segment", {"overlap_mask": False, "mask_ratio": 2}), ("pose", {}), ("obb", {}),
         ("segment", {"classes": [0, 2], "single_cls": True})]


@pytest.mark.parametrize("task, overrides", CASES, ids=[f"{t}-{'-'.join(o) or 'default'}" for t, o in CASES])
def test_validation_batches_and_labels_equal_ultralytics(task_args, task, overrides):
    """Augmentation off (rect validation): the same images in the same batches, pixels, classes, boxes, and the
    task's labels: masks, semantic masks, keypoints and xywhr boxes identical; and
    ``dataset.labels`` (segments, keypoints) as Ultralytics' dataset holds them."""
    own, ours = _both_loaders(task_args, task, **overrides)
    try:
        assert len(ours) == len(own) == -(-N_VAL // 4)
        instances, original = 0, {}
        for a, b in zip(own, ours):
            assert a["im_file"] == b["im_file"] and a["ori_shape"] == b["ori_shape"]
            original.update(zip(a["im_file"], a["ori_shape"]))
            assert torch.equal(a["img"], b["img"])
            assert torch.equal(a["cls"], b["cls"]) and torch.equal(a["batch_idx"], b["batch_idx"])
            for (ratio_a, pad_a), (ratio_b, pad_b) in zip(a["ratio_pad"], b["ratio_pad"]):
                assert pad_a == pad_b and ratio_a == pytest.approx(ratio_b, rel=1e-12)
            h, w = a["img"].shape[2:]
            assert a["bboxes"].shape == b["bboxes"].shape
            if task == "obb":  # xywhr from the same corners: identical
                assert torch.equal(a["bboxes"], b["bboxes"])
            else:  # float32 rounding of the same integer pad, as for detection
                assert _largest((a["bboxes"] - b["bboxes"]) * torch.tensor([w, h, w, h])) < 1e-3
            if task == "segment":
                assert a["masks"].shape == b["masks"].shape
                assert a["masks"].dtype == b["masks"].dtype and torch.equal(a["masks"], b["masks"])
                assert torch.equal(a["sem_masks"], b["sem_masks"])
                assert a["masks"].shape[-1] == w // overrides.get("mask_ratio", 4)
            if task == "pose":
                assert b["keypoints"].dtype == torch.float32 and torch.equal(a["keypoints"], b["keypoints"])
            instances += len(a["cls"])
        assert instances > 0 and any(len(lb["cls"]) == 0 for lb in ours.dataset.labels)
        theirs = {lb["im_file"]: lb for lb in own.dataset.labels}  # rect: in aspect order
        assert len(theirs) == len(ours.dataset.labels) == N_VAL
        for lo in ours.dataset.labels:
            lt = theirs[lo["im_file"]]
            assert lo["shape"] == original[lo["im_file"]]  # (Ultralytics' rect dataset pops its own)
            assert lo["keypoints"] is None or task == "pose"
            assert np.array_equal(lo["cls"], lt["cls"]) and np.allclose(lo["bboxes"], lt["bboxes"], atol=1e-6)
            if task == "pose":
                assert np.allclose(lo["keypoints"], lt["keypoints"], atol=1e-6)
            else:
                assert len(lo["segments"]) == len(lt["segments"]) == len(lt["cls"])
                for so, st in zip(lo["segments"], lt["segments"]):
                    assert np.allclose(so, st, atol=1e-6)
    finally:
        ours.close()


@pytest.mark.parametrize("task", TASKS)
def test_training_batches_carry_the_task_labels(task_args, task):
    """Augmented training batches (mosaic, the ultralytics recipe, cache="ram"): the task's fields with Ultralytics'
    shapes and dtypes, one per instance, consistent with the boxes."""
    args, data = task_args(task, cache="ram")
    ld = build_loader(args, data, LoaderRequest(data["train"], 4, "train", False, 32), UltralyticsOptions())
    try:
        assert ld.stats()["store"] == "ram" and ld.dataset.use_segments == (task == "segment")
        assert ld.dataset.use_keypoints == (task == "pose") and ld.dataset.use_obb == (task == "obb")
        batch = next(iter(ld))
    finally:
        ld.close()
    n = len(batch["cls"])
    assert n > 0 and batch["batch_idx"].shape == (n,) and batch["img"].shape == (4, 3, 64, 64)
    if task == "segment":  # overlap masks at mask_ratio 4: image k's instances are 1..n_k
        assert batch["masks"].shape == (4, 16, 16) and batch["sem_masks"].shape == (4, 16, 16)
        for k in range(4):
            assert int(batch["masks"][k].max()) <= int((batch["batch_idx"] == k).sum())
        assert batch["bboxes"].shape == (n, 4)
    elif task == "pose":
        kp = batch["keypoints"]
        assert kp.dtype == torch.float32 and kp.shape == (n, 5, 3)
        shown = kp[..., 2] > 0
        assert bool(((kp[..., :2] >= 0) & (kp[..., :2] <= 1)).all(-1)[shown].all())
    else:
        obb = batch["bboxes"]
        assert obb.dtype == torch.float32 and obb.shape == (n, 5)
        angle = obb[:, 4]
        assert bool((obb[:, 2] >= obb[:, 3]).all()) and bool(((angle >= -np.pi / 4) & (angle < 3 * np.pi / 4)).all())


@pytest.mark.parametrize("task", ["segment", "obb"])
def test_a_box_only_label_file_is_refused_as_ultralytics_refuses_it(task_env, tmp_path, task):
    """A box-only label file (no points) in a segment or obb set: Ultralytics' dataset refuses the set (fewer
    segments than boxes), for training and validation; fastload refuses it too, in one line naming the file."""
    from ultralytics.cfg import get_cfg
    from ultralytics.data import build_yolo_dataset
    from ultralytics.data.utils import check_det_dataset

    from fastload.data.synthetic import make_synthetic_dataset

    yaml_path = make_synthetic_dataset(tmp_path, n_train=4, n_val=0, seed=1, min_size=40, max_size=80, task=task)
    yaml_path.write_text(yaml_path.read_text().replace("path: .", f"path: {tmp_path}"))
    label = box_rows_only(tmp_path / "labels" / "train")
    args = get_cfg(overrides={"data": str(yaml_path), "task": task, "imgsz": 64, "batch": 4, "workers": 0})
    data = check_det_dataset(str(yaml_path))
    for mode, augment in (("train", True), ("val", False)):
        with pytest.raises(ValueError, match="requires equal numbers of boxes and segments"):
            build_yolo_dataset(args, data["train"], 4, data, mode=mode, stride=32)
        with pytest.raises(ValueError) as err:
            build_loader(args, data, LoaderRequest(data["train"], 4, mode, not augment, 32), UltralyticsOptions())
        assert f"{label} has box rows only (Ultralytics refuses such a set)" in str(err.value)
        assert "\n" not in str(err.value)


def test_ddp_ranks_shard_a_pose_split(task_args, monkeypatch):
    """Under DDP each rank loads its shard of a task's split, as for detection: disjoint, covering, each image's
    keypoints with it."""
    args, data = task_args("pose")
    monkeypatch.setenv("WORLD_SIZE", "2")
    seen = {}
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        ld = build_loader(args, data, LoaderRequest(data["train"], 2, "train", False, 32, rank=rank),
                          UltralyticsOptions())
        try:
            assert len(ld.sampler) == N_TRAIN // 2
            batches = list(ld)
        finally:
            ld.close()
        seen[rank] = [f for b in batches for f in b["im_file"]]
        assert all(b["keypoints"].shape == (len(b["cls"]), 5, 3) for b in batches)
    assert not set(seen[0]) & set(seen[1]) and len(set(seen[0]) | set(seen[1])) == N_TRAIN


def _task_run(task: str, tmp_path_factory, preloaded_python, task_data) -> tuple[dict, str]:
    tmp = tmp_path_factory.mktemp(f"run_{task}")
    (tmp / "shm").mkdir()
    env = {**base_env(REPO), **ultralytics_env(tmp)}
    run = preloaded.run(preloaded_python, [str(REPO / "tests" / "ultralytics_task_run.py"), task, MODELS[task],
                                           str(task_data(task)), str(tmp)], tmp, env, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert not list((tmp / "shm").iterdir())  # the ram store went with its last user
    return json.loads((tmp / "summary.json").read_text()), run.stdout


@pytest.fixture(scope="module", params=TASKS)
def task_run(request, tmp_path_factory, preloaded_python, task_data):
    """One task's run (tests/ultralytics_task_run.py): trained 2 epochs with Ultralytics' loader and with fastload's,
    the fastload run's weights validated both ways."""
    summary, stdout = _task_run(request.param, tmp_path_factory, preloaded_python, task_data)
    return request.param, summary, stdout


@pytest.mark.slow
def test_real_task_trainers_two_epochs_both_ways(task_run):
    """Each real trainer trains 2 epochs with either loader, its metrics finite; the fastload run's weights give the
    same validation metrics through fastload's loader (standalone FastloadValidator, which logs its line) as
    through Ultralytics' own."""
    import math

    task, summary, stdout = task_run
    base = {"segment": "SegmentationTrainer", "pose": "PoseTrainer", "obb": "OBBTrainer"}[task]
    own, ours = summary["ultralytics"], summary["fastload"]
    assert base in own["trainer"] and base in ours["trainer"] and "FastloadTrainer" in ours["trainer"]
    assert ours["loader"] == "UltralyticsLoader" and own["loader"] != "UltralyticsLoader"
    assert ours["labels"] == own["labels"] == N_TRAIN
    for run in (own, ours):
        rows = (Path(run["save_dir"]) / "results.csv").read_text().strip().splitlines()
        assert len(rows) == 3  # header and both epochs
        assert set(run["results"]) == set(own["results"]) and all(math.isfinite(v) for v in run["results"].values())
    train_line = f"fastload: {task} {N_TRAIN} images, 1 batches of 8, 0 workers, ram store, cpu engine, HSV in the workers"
    assert train_line in stdout
    # the standalone FastloadValidator names its loader (no cache: the image files; training validated from ram)
    assert f"fastload: {task} {N_VAL} images, 2 batches of 8, 0 workers, files store, cpu engine, HSV off" in stdout
    assert summary["val_fastload"] == pytest.approx(summary["val_ultralytics"], abs=1e-9)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "per-instance"])
def test_semantic_masks_on_the_host_equal_those_made_with_torch(overlap):
    """CPU masks are mapped with numpy, a device's with torch (the path the tests above cannot reach without a GPU):
    the same sem_masks, on torch's CPU tensors, for images with overlapping, equal-area and no instances."""
    from fastload.compat.ultralytics.loader import _semantic_masks_device, semantic_masks

    rng = np.random.default_rng(3)
    counts = [3, 0, 1, 5]  # the second image has no instance
    owner = torch.tensor(np.repeat(np.arange(len(counts)), counts), dtype=torch.float32)
    cls = torch.tensor(rng.integers(0, 4, (sum(counts), 1)), dtype=torch.float32)
    if overlap:
        masks = torch.stack([torch.tensor(rng.integers(0, n + 1, (8, 8)), dtype=torch.uint8) for n in counts])
    else:
        masks = torch.tensor(rng.integers(0, 2, (sum(counts), 8, 8)), dtype=torch.uint8)
        masks[-1] = masks[-2]  # two instances of equal area covering the same pixels: the first wins
    got = semantic_masks(masks, cls, owner, len(counts), overlap)
    want = _semantic_masks_device(masks, cls, owner, len(counts), overlap)
    assert got.dtype == want.dtype == torch.float32 and got.shape == (len(counts), 8, 8)
    assert torch.equal(got, want) and bool(got.any())
    if overlap:  # beyond 255 instances an image's overlap mask is int32 (no 256-entry table lookup then)
        assert torch.equal(semantic_masks(masks.to(torch.int32), cls, owner, len(counts), overlap), want)
