"""fastload.compat.ultralytics against the real ``ultralytics`` package (skipped where it is not installed).

The loaders: Ultralytics' batch dict and loader protocol, its data arguments (fraction, classes,
single_cls, cache), the one-line refusals, and the validation loader beside Ultralytics' own on coco128.
Then the real trainer (tests/ultralytics_run.py, in a subprocess, offline) for 2 epochs with
``close_mosaic=1``, ``cache="ram"`` and rect validation, and its weights validated both ways.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fastload.compat.ultralytics import UltralyticsOptions, UnsupportedArgument
from fastload.compat.ultralytics.loader import LoaderRequest, build_loader, check_arguments
from fastload.store.base import StoreError
import preloaded
from official_helpers import coco_subset
from preloaded import base_env
from store_helpers import assert_refused_as_in_process, refuse_every_render

# Ultralytics is imported inside the fixtures, once the environment keeps it offline and its settings here
pytestmark = pytest.mark.skipif(importlib.util.find_spec("ultralytics") is None,
                                reason='ultralytics is not installed (pip install "fastload[ultralytics]")')

REPO = Path(__file__).resolve().parents[1]
N_IMAGES = 16


def ultralytics_env(tmp: Path) -> dict[str, str]:
    """Offline, settings in ``tmp``, fonts there too (Ultralytics downloads Arial.ttf for its plots otherwise)."""
    import matplotlib

    config = tmp / "ultralytics_config"
    config.mkdir(exist_ok=True)
    shutil.copyfile(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf", config / "Arial.ttf")
    return {"YOLO_OFFLINE": "1", "YOLO_CONFIG_DIR": str(config), "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1",
            "FASTLOAD_SHM_DIR": str(tmp / "shm")}


@pytest.fixture(scope="module")
def coco16(coco128_yaml, tmp_path_factory) -> Path:
    return coco_subset(Path(coco128_yaml).parent, tmp_path_factory.mktemp("ultra") / "data", N_IMAGES)


@pytest.fixture(scope="module")
def ultra_env(tmp_path_factory):
    """The module's environment: offline, Ultralytics' settings and fastload's ram stores in a temporary folder."""
    tmp = tmp_path_factory.mktemp("ultralytics_env")
    (tmp / "shm").mkdir()
    with pytest.MonkeyPatch.context() as mp:
        for k, v in ultralytics_env(tmp).items():
            mp.setenv(k, v)
        yield tmp


@pytest.fixture
def ultra(ultra_env):
    """``make(data, **overrides) -> (args, data dict)`` as Ultralytics' trainer holds them."""
    from ultralytics.cfg import get_cfg
    from ultralytics.data.utils import check_det_dataset

    def make(data: Path, **overrides):
        args = get_cfg(overrides={"data": str(data), "imgsz": 64, "batch": 8, "workers": 0, **overrides})
        return args, check_det_dataset(str(data))
    return make


def test_options_override_then_environment_then_default():
    assert UltralyticsOptions.resolve({}, {}) == UltralyticsOptions()
    assert UltralyticsOptions().recipe == "ultralytics"  # Ultralytics' own recipe unless told otherwise
    env = {"FASTLOAD_WORKERS": "3", "FASTLOAD_RECIPE": "yolov9", "FASTLOAD_SEED": "5"}
    got = UltralyticsOptions.resolve({"fastload_seed": 9, "fastload_engine": "gpu"}, env)
    assert (got.seed, got.num_workers, got.recipe, got.engine) == (9, 3, "yolov9", "gpu")
    assert UltralyticsOptions.resolve({"fastload_recipe": "ultralytics"}, env).recipe == "ultralytics"
    with pytest.raises(ValueError, match="FASTLOAD_RECIPE='ultra'"):
        UltralyticsOptions.resolve({}, {"FASTLOAD_RECIPE": "ultra"})
    with pytest.raises(TypeError, match="fastload_wokers"):
        UltralyticsOptions.resolve({"fastload_wokers": 2}, {})


def test_refusals_are_one_line(coco16, ultra):
    opts = UltralyticsOptions(recipe="yolov9")
    cases = [({"cutmix": 0.5}, opts, "cutmix=0.5"),
             ({"bgr": 0.2}, opts, "bgr=0.2"),
             ({"imgsz": [64, 96]}, opts, "imgsz=\\[64, 96\\]"), ({"cache": "gpu"}, opts, "cache='gpu'")]
    for overrides, o, match in cases:
        args, data = ultra(coco16, **overrides)
        with pytest.raises(UnsupportedArgument, match=match) as e:
            build_loader(args, data, LoaderRequest(data["train"], 8, "train", False, 32), o)
        assert "\n" not in str(e.value)
    args, data = ultra(coco16, copy_paste=0.1)  # detect: nothing to paste (segment sets paste, flip mode only)
    with pytest.raises(UnsupportedArgument, match="copy_paste=0.1: fastload pastes the instances of segment sets"):
        check_arguments(args, data, "train", opts)
    args, data = ultra(coco16, task="segment", copy_paste=0.3, copy_paste_mode="mixup")
    with pytest.raises(UnsupportedArgument, match="copy_paste_mode='mixup'"):
        check_arguments(args, data, "train", opts)
    check_arguments(*ultra(coco16, task="segment", copy_paste=0.3), "train", opts)
    args, data = ultra(coco16, task="classify")  # segment, pose, obb: tests/test_compat_ultralytics_tasks.py
    with pytest.raises(UnsupportedArgument, match="task='classify'"):
        build_loader(args, data, LoaderRequest(data["val"], 8, "val", True, 32), opts)
    # the disk cache needs a converted store: the refusal says how to make one
    args, data = ultra(coco16, cache="disk")
    with pytest.raises(UnsupportedArgument, match="fastload convert .* --to disk --imgsz 64"):
        build_loader(args, data, LoaderRequest(data["train"], 8, "train", False, 32), opts)


def test_trainer_refuses_before_building_anything(coco16, ultra, tmp_path, monkeypatch):
    from fastload.compat.ultralytics import FastloadTrainer

    # Ultralytics' trainer sets PYTHONHASHSEED (init_seeds): undone after the test, or a pre-loaded interpreter started
    # before it (tests/preloaded.py) would refuse the runs of later tests
    monkeypatch.setenv("PYTHONHASHSEED", os.environ.get("PYTHONHASHSEED", "0"))
    with pytest.raises(UnsupportedArgument, match="cutmix"):
        FastloadTrainer(overrides={"model": "yolov9t.yaml", "data": str(coco16), "imgsz": 64, "device": "cpu",
                                   "cutmix": 0.3, "fastload_recipe": "yolov9", "project": str(tmp_path / "runs")})


def test_train_batches_and_loader_protocol(coco16, ultra):
    args, data = ultra(coco16, cache="ram", classes=[0, 2], fraction=0.75)
    ld = build_loader(args, data, LoaderRequest(data["train"], 4, "train", False, 32), UltralyticsOptions(recipe="yolov9"))
    try:
        n = round(N_IMAGES * 0.75)
        assert len(ld.dataset) == n and len(ld.sampler) == n and len(ld) == n // 4
        assert ld.batch_size == 4 and ld.drop_last is False and ld.num_workers == 0
        assert ld.stats()["store"] == "ram"  # cache="ram": the shared ram store
        cls = np.concatenate([lb["cls"] for lb in ld.dataset.labels])
        assert set(np.unique(cls).tolist()) <= {0.0, 2.0} and cls.shape[1] == 1
        assert all(lb["bboxes"].shape == (len(lb["cls"]), 4) for lb in ld.dataset.labels)
        batch = next(iter(ld))
        assert batch["img"].dtype == torch.uint8 and batch["img"].shape == (4, 3, 64, 64)
        assert batch["img"].is_contiguous()  # NCHW on the CPU, as Ultralytics' collate gives
        nb = len(batch["cls"])
        assert batch["cls"].shape == (nb, 1) and batch["bboxes"].shape == (nb, 4) and batch["batch_idx"].shape == (nb,)
        assert batch["bboxes"].dtype == torch.float32 and float(batch["bboxes"].max()) <= 1.0
        assert set(batch["cls"].flatten().tolist()) <= {0.0, 2.0}
        assert len(batch["im_file"]) == len(batch["ori_shape"]) == len(batch["ratio_pad"]) == 4
        assert batch["resized_shape"] == ((64, 64),) * 4
        assert all(r is None for r in batch["ratio_pad"])  # every sample a mosaic (mosaic=1.0)
        ld.dataset.close_mosaic(SimpleNamespace(mosaic=1.0))
        ld.reset()
        for batch in ld:
            assert all(r is not None for r in batch["ratio_pad"])  # letterboxes from now on
    finally:
        ld.close()
    for fraction, images in ((1, N_IMAGES), (3, 3), (0.5, N_IMAGES // 2)):  # an int > 1 is an image count
        args, data = ultra(coco16)
        args.fraction = fraction  # as given, without get_cfg's 1 -> 1.0
        ld = build_loader(args, data, LoaderRequest(data["train"], 4, "train", False, 32),
                          UltralyticsOptions(recipe="yolov9"))
        ld.close()
        assert len(ld.dataset) == images, fraction


def test_an_error_in_a_loader_worker_reaches_the_trainer_as_the_line_it_is_in_process(coco16, ultra, monkeypatch):
    """A fastload error a worker raises is the error of workers=0: its class and one line, the worker's traceback
    kept on it (issue 35)."""
    refuse_every_render(monkeypatch)
    for workers in (0, 2):
        args, data = ultra(coco16, workers=workers)
        ld = build_loader(args, data, LoaderRequest(data["train"], 4, "train", False, 32), UltralyticsOptions())
        try:
            assert ld.num_workers == workers
            with pytest.raises(StoreError) as info:
                next(iter(ld))
        finally:
            ld.close()
        assert_refused_as_in_process(info.value, workers)


def test_batches_are_channels_last_where_the_trainer_makes_the_model_so(coco16, ultra):
    """A CUDA trainer (``channels_last`` not False) makes its model channels-last: its batches are channels-last
    views of the rendered pixels, wherever fastload delivers them (here kept on the CPU, fastload_device=None), and
    hold the pixels of a CPU trainer's contiguous batches."""
    args, data = ultra(coco16)
    imgs = {}
    for name, device, channels_last in (("cpu", None, None), ("cuda", torch.device("cuda"), None),
                                        ("cuda, channels_last=False", torch.device("cuda"), False)):
        args.channels_last = channels_last
        ld = build_loader(args, data, LoaderRequest(data["train"], 4, "train", False, 32, device=device),
                          UltralyticsOptions(device=None))
        try:
            img = next(iter(ld))["img"]
            assert img.shape == (4, 3, 64, 64)
            assert img.is_contiguous(memory_format=torch.channels_last) == (name == "cuda"), name
            assert img.is_contiguous() == (name != "cuda"), name
            imgs[name] = img.clone()
        finally:
            ld.close()
    assert torch.equal(imgs["cpu"], imgs["cuda"]) and torch.equal(imgs["cpu"], imgs["cuda, channels_last=False"])


def test_ddp_shards_and_set_epoch(coco16, ultra, monkeypatch):
    """Under DDP (the trainer passes LOCAL_RANK) each rank loads its shard: disjoint, covering, reshuffled by
    ``sampler.set_epoch`` as the trainer calls it."""
    args, data = ultra(coco16)
    monkeypatch.setenv("WORLD_SIZE", "2")
    seen = {}
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        ld = build_loader(args, data, LoaderRequest(data["train"], 4, "train", False, 32, rank=rank),
                          UltralyticsOptions(recipe="yolov9"))
        try:
            assert len(ld.sampler) == N_IMAGES // 2 and len(ld) == N_IMAGES // 8
            ld.sampler.set_epoch(3)
            seen[rank] = [f for b in ld for f in b["im_file"]]
            ld.sampler.set_epoch(4)
            assert [f for b in ld for f in b["im_file"]] != seen[rank]
        finally:
            ld.close()
    assert not set(seen[0]) & set(seen[1]) and len(set(seen[0]) | set(seen[1])) == N_IMAGES


@pytest.mark.filterwarnings("ignore:fastload.loader. hsv_on='consumer' without a GPU")
@pytest.mark.parametrize("recipe", ["ultralytics", "yolov9"])
def test_hsv_on_the_batch_device_equals_hsv_in_the_workers(coco16, ultra, recipe):
    """The CUDA path forced on the CPU (fastload_device="cpu", fastload_hsv="consumer"): HSV applied to the
    delivered batch equals HSV in the workers within one level, boxes identical."""
    args, data = ultra(coco16)
    batches = {}
    for hsv, device in (("worker", None), ("consumer", "cpu")):
        ld = build_loader(args, data, LoaderRequest(data["train"], 8, "train", False, 32),
                          UltralyticsOptions(recipe=recipe, hsv=hsv, device=device))
        try:
            assert ld.loader.engine.settings.hsv_on == hsv
            batches[hsv] = [(b["img"].clone(), b["bboxes"].clone()) for b in ld]
        finally:
            ld.close()
    for (img_w, box_w), (img_c, box_c) in zip(batches["worker"], batches["consumer"]):
        assert torch.equal(box_w, box_c)
        assert int((img_w.int() - img_c.int()).abs().max()) <= 1


def test_cache_disk_reads_the_converted_disk_store(coco16, ultra, tmp_path):
    """cache="disk" maps to fastload's packed disk store: the one `fastload convert --to disk --load-rule
    ultralytics` recorded; one made with YOLOv9's loaded-image rule is refused in one line, not served."""
    from fastload.store.base import StoreError
    from fastload.store.convert import convert

    args, data = ultra(coco16, cache="disk")
    request = LoaderRequest(data["val"], 8, "val", True, 32)
    yolov9_rule = tmp_path / "yolov9-rule"
    convert(str(coco16), "disk", out=yolov9_rule, imgsz=64, splits="train", workers=1, progress=False, log=lambda _: None)
    with pytest.raises(StoreError, match="loaded by the yolov9 rule.*--load-rule ultralytics"):
        build_loader(args, data, request, UltralyticsOptions(store=str(yolov9_rule / "data.yaml")))
    out = tmp_path / "converted"
    convert(str(coco16), "disk", out=out, imgsz=64, load_rule="ultralytics", splits="train", workers=1,
            progress=False, log=lambda _: None)
    ld = build_loader(args, data, request, UltralyticsOptions(store=str(out / "data.yaml")))
    try:
        assert ld.stats()["store"] == "disk"
        assert sum(len(b["im_file"]) for b in ld) == N_IMAGES
    finally:
        ld.close()


@pytest.mark.parametrize("imgsz", [96, 640])
def test_validation_batches_beside_ultralytics_loader(coco16, ultra, imgsz):
    """Rect validation: the same images in the same batches and shapes, the same labels, and for every image the
    same pixels, ratio and pad, and boxes (moved by the integer pad, as Ultralytics does): the ultralytics
    recipe loads images by Ultralytics' rule (sizes rounded up, INTER_LINEAR), also the ones it resizes (3 of
    the 16 at 640, all of them at 96)."""
    from ultralytics.data import build_dataloader, build_yolo_dataset

    args, data = ultra(coco16, imgsz=imgsz, single_cls=True)
    own = build_dataloader(build_yolo_dataset(args, data["val"], 8, data, mode="val", rect=True, stride=32), 8, 0,
                           shuffle=False, rank=-1)
    ours = build_loader(args, data, LoaderRequest(data["val"], 8, "val", True, 32), UltralyticsOptions())
    resized = 0
    try:
        assert len(ours) == len(own) == N_IMAGES // 8
        for a, b in zip(own, ours):
            assert a["im_file"] == b["im_file"] and a["ori_shape"] == b["ori_shape"]
            assert a["img"].shape == b["img"].shape
            assert [tuple(int(v) for v in hw) for hw in a["resized_shape"]] == list(b["resized_shape"])
            assert torch.equal(a["cls"], b["cls"]) and torch.equal(a["batch_idx"], b["batch_idx"])
            assert float(a["cls"].max()) == 0.0  # single_cls
            h, w = a["img"].shape[2:]
            px = (a["bboxes"] - b["bboxes"]).abs() * torch.tensor([w, h, w, h])
            assert float(px.max()) < 1e-3  # float32 rounding of the same integer pad
            assert torch.equal(a["img"], b["img"])
            for k, (ratio_pad_a, ratio_pad_b) in enumerate(zip(a["ratio_pad"], b["ratio_pad"])):
                (ratio_a, pad_a), (ratio_b, pad_b) = ratio_pad_a, ratio_pad_b
                assert pad_a == pad_b and ratio_a == pytest.approx(ratio_b, rel=1e-12)
                resized += max(a["ori_shape"][k]) != imgsz
        assert resized == (3 if imgsz == 640 else N_IMAGES)
    finally:
        ours.close()


def _batch_statistics(batches) -> dict[str, float]:
    """Per output image: boxes, mean box side (sqrt(w h), normalised), the image's mean saturation and value
    (OpenCV HSV): their means, and their spread over the images (which the HSV gains widen)."""
    import cv2

    boxes, sides, sat, val = [], [], [], []
    for img, cls_idx, bboxes in batches:
        for k, im in enumerate(img):
            mine = bboxes[cls_idx == k]
            boxes.append(len(mine))
            sides += torch.sqrt(mine[:, 2] * mine[:, 3]).tolist()
            hsv = cv2.cvtColor(np.ascontiguousarray(im.permute(1, 2, 0).numpy()), cv2.COLOR_RGB2HSV)
            sat.append(float(hsv[..., 1].mean()))
            val.append(float(hsv[..., 2].mean()))
    return {"boxes": float(np.mean(boxes)), "side": float(np.mean(sides)), "sat": float(np.mean(sat)),
            "val": float(np.mean(val)), "sat_spread": float(np.std(sat)), "val_spread": float(np.std(val)),
            "images": len(boxes)}


def test_ultralytics_hsv_equals_random_hsv(ultra):
    """The "ultralytics" HSV rule with the gains ``1 + r`` equals Ultralytics' RandomHSV drawing ``r``, pixel
    for pixel (its image BGR, ours RGB), hue wrapping both ways (hsv_h 0.5)."""
    from ultralytics.data.augment import RandomHSV

    from fastload.augment.functional.color import apply_hsv

    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (32, 48, 3), dtype=np.uint8)
    rgb[:4] = (255, 255, 255)  # saturation 0: stays grey
    hyp = (0.5, 0.7, 0.4)
    for seed in range(8):
        np.random.seed(seed)
        r = np.random.uniform(-1, 1, 3) * list(hyp)  # what RandomHSV draws first
        np.random.seed(seed)
        labels = RandomHSV(*hyp)({"img": np.ascontiguousarray(rgb[..., ::-1])})
        ours = apply_hsv(rgb.copy(), tuple(1.0 + r), "ultralytics")
        assert np.array_equal(ours, labels["img"][..., ::-1]), seed


@pytest.mark.parametrize("recipe", ["ultralytics", "yolov9"])
def test_training_batches_in_distribution_beside_ultralytics_dataset(coco16, ultra, recipe):
    """fastload's recipes with Ultralytics' default hyperparameters against Ultralytics' own training
    dataset, 256 images each at imgsz 96: boxes per image, box size, and the images' mean saturation and
    value and their spread agree within the tolerances below (measured with seeds 0-3, the trainer's seed for
    both loaders: within 9 %, 7 %, 6 %, 3 %, 13 %, 6 % for yolov9, 6 %, 3 %, 9 %, 2 %, 11 %, 11 % for ultralytics,
    its loaded images and mosaic partners from recent images as Ultralytics': at 256 images the seed moves
    these more than the recipes' differences do, which test_ultralytics_hsv_equals_random_hsv and
    tests/test_augment_params.py check exactly). Mosaic or HSV switched off fails it."""
    import random

    from ultralytics.data import build_yolo_dataset

    args, data = ultra(coco16, imgsz=96)
    random.seed(0)
    np.random.seed(0)
    ds = build_yolo_dataset(args, data["train"], 8, data, mode="train", stride=32)
    theirs = []
    for k in range(256):
        item = ds[k % len(ds)]
        theirs.append((item["img"][None], torch.zeros(len(item["cls"])), item["bboxes"]))
    ours_loader = build_loader(args, data, LoaderRequest(data["train"], 8, "train", False, 32),
                               UltralyticsOptions(recipe=recipe))
    try:
        # without cache="ram" Ultralytics draws mosaic partners from its buffer of recent images: so does its recipe
        assert ours_loader.stats()["partners"] == ("recent" if recipe == "ultralytics" else "dataset")
        ours = [(b["img"], b["batch_idx"], b["bboxes"]) for _ in range(256 // N_IMAGES) for b in ours_loader]
    finally:
        ours_loader.close()
    a, b = _batch_statistics(theirs), _batch_statistics(ours)
    assert a["images"] == b["images"] == 256
    assert b["boxes"] == pytest.approx(a["boxes"], rel=0.15), (a, b)
    assert b["side"] == pytest.approx(a["side"], rel=0.1), (a, b)
    assert b["sat"] == pytest.approx(a["sat"], rel=0.1), (a, b)
    assert b["val"] == pytest.approx(a["val"], rel=0.05), (a, b)
    # HSV off (hsv_s=0) narrows the saturation spread by a third; mosaic off moves every figure above
    assert b["sat_spread"] == pytest.approx(a["sat_spread"], rel=0.2), (a, b)
    assert b["val_spread"] == pytest.approx(a["val_spread"], rel=0.2), (a, b)


@pytest.mark.slow
def test_real_trainer_two_epochs(coco16, tmp_path, preloaded_python):
    """The real trainer, offline on the CPU, with fastload's default recipe (Ultralytics'): results.csv of both
    epochs, mosaic in epoch 1 only, plots from dataset.labels, and the best weights validated through fastload
    and through Ultralytics' own loader with the same metrics. Its first batch fails as out of GPU memory:
    Ultralytics retries at half the batch with new loaders, and both replaced loaders are closed. Its process is forked from the pre-loaded
    interpreter (tests/preloaded.py: torch & co. imported once; Ultralytics itself after the fork, with this
    run's settings folder and offline switch)."""
    env = {**base_env(REPO), **ultralytics_env(tmp_path)}
    (tmp_path / "shm").mkdir()
    run = preloaded.run(preloaded_python, [str(REPO / "tests" / "ultralytics_run.py"), str(coco16), str(tmp_path)],
                        tmp_path, env, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["train_loader"] == summary["val_loader"] == "UltralyticsLoader"
    assert "fastload: 16 images, 2 batches of 8, 0 workers, ram store, cpu engine" in run.stdout  # its log line
    assert "fastload: 16 images, 4 batches of 4, 0 workers, ram store, cpu engine" in run.stdout  # after the retry
    assert "cpu engine, HSV in the workers, batches on cpu" in run.stdout  # where HSV is applied, not the raw option
    assert "cpu engine, HSV off, batches on cpu" in run.stdout  # validation
    # the standalone model.val(validator=FastloadValidator) names its loader too (no cache: the image files)
    assert "fastload: 16 images, 2 batches of 8, 0 workers, files store, cpu engine, HSV off" in run.stdout
    assert summary["batch"] == 4
    # built: train, val (batch 8), then the retry's train, val; the replaced two are closed, not left to the collector
    assert summary["closed_after_epoch_1"] == [True, True, False, False]
    # Ultralytics' own recipe by default; with cache="ram" its partners come from the whole dataset, as Ultralytics'
    assert "cpu, ultralytics recipe (mosaic partners: dataset)" in run.stdout
    assert summary["stores"] == {"train": "ram", "val": "ram"}  # cache="ram": fastload's shared ram store
    save_dir = Path(summary["save_dir"])
    rows = (save_dir / "results.csv").read_text().strip().splitlines()
    assert len(rows) == 3 and rows[0].split(",")[0].strip() == "epoch"
    assert (save_dir / "labels.jpg").is_file()  # Ultralytics' label plot, drawn from dataset.labels
    log = [json.loads(line) for line in (tmp_path / "batches.jsonl").read_text().splitlines()]
    train = [r for r in log if r["split"] == "train"]
    assert {r["epoch"] for r in train} == {0, 1}
    assert all(r["mosaic"] == r["n"] for r in train if r["epoch"] == 0)  # close_mosaic=1: mosaic in epoch 1 only
    assert all(r["mosaic"] == 0 for r in train if r["epoch"] == 1)
    val = [r for r in log if r["split"] == "val"]
    assert val and all(r["hw"][0] % 32 == 0 and r["hw"][1] % 32 == 0 for r in val)
    assert not list((tmp_path / "shm").iterdir())  # the ram store went with its last user
    ours, theirs = summary["fastload"], summary["ultralytics"]
    assert ours["nt"] == theirs["nt"] and sum(ours["nt"]) > 0  # the same labels counted
    # the same validation batches, pixel for pixel (the ultralytics recipe's loaded image): the same metrics
    assert ours["results"] == pytest.approx(theirs["results"], abs=1e-9)


def test_dataset_labels_and_sizes_are_made_when_read_from_the_packed_labels(coco16, ultra):
    """dataset.labels (one dict per image), the classes/single_cls filter and the ori_shape lookup come from the
    packed labels and size arrays: the same values as one array per image, without an object per image up front."""
    from fastload.compat.ultralytics.loader import ImageSizes, UltralyticsLabels
    from fastload.store.factory import open_store

    args, data = ultra(coco16, classes=[0, 2], single_cls=True)
    ld = build_loader(args, data, LoaderRequest(data["train"], 4, "train", False, 32), UltralyticsOptions())
    store = open_store(coco16, split="train", kind="files")
    try:
        labels = ld.dataset.labels
        assert isinstance(labels, UltralyticsLabels) and len(labels) == len(store) == N_IMAGES
        for i, lb in enumerate(labels):
            own = np.asarray(store.labels[i], np.float32).reshape(-1, 5)
            own = own[np.isin(own[:, 0], [0, 2])]
            assert lb["im_file"] == store.im_files[i] and lb["shape"] == tuple(int(v) for v in store.shapes[i])
            assert np.array_equal(lb["bboxes"], own[:, 1:5]) and lb["cls"].shape == (len(own), 1)
            assert not lb["cls"].any()  # single_cls
        assert labels[-1]["im_file"] == labels[N_IMAGES - 1]["im_file"] and len(labels[2:5]) == 3
        with pytest.raises(IndexError):
            labels[N_IMAGES]
        sizes = ImageSizes(store.im_files, np.asarray(store.shapes))
        assert [sizes[f] for f in store.im_files] == [lb["shape"] for lb in labels]
        with pytest.raises(KeyError):
            sizes["not-an-image.jpg"]
    finally:
        store.close()
        ld.close()
