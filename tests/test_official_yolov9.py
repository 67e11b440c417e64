"""The official YOLOv9 scripts (../shared/upstream/yolov9) run with fastload's loader, on the CPU.

A temporary copy of the official repository gets the README's one-line switch in train_dual.py,
train.py, val_dual.py and val.py; a second, unmodified copy runs through the no-edit launcher
(``python -m fastload.compat.yolov9``, and under torchrun). Eight coco128 images at --img 64,
batch 4, the smallest models thinned (one RepNCSP repeat in each RepNCSPELAN4: official_helpers.thin_config).
Every run writes fastload's batch log (one JSON line per batch the trainer received), from which the tests
read what happened inside (mosaic or not, which images).

All runs start once for the module, two at a time (two cores; the torchrun run, which mostly waits, beside
them), forked from one interpreter that has imported torch & co. (tests/preloaded.py; torchrun's ranks too,
through PYTHON_EXEC), validation runs after the training runs whose weights they load. Skipped only where
../shared is absent.
"""
from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from official_helpers import Run, coco_subset, copy_upstream, official_env, python, run_all, thin_config

pytestmark = pytest.mark.slow

SWITCHED = ("train_dual.py", "train.py", "val_dual.py", "val.py")
N_IMAGES = 8
COMMON = ["--img", "64", "--batch", "4", "--device", "cpu", "--noplots", "--hyp", "data/hyps/hyp.scratch-high.yaml",
          "--weights", ""]


@pytest.fixture(scope="module")
def runs(coco128_yaml, tmp_path_factory, preloaded_python):
    tmp = tmp_path_factory.mktemp("official")
    edited = copy_upstream(tmp / "yolov9_edited", switch_import=SWITCHED)
    stock = copy_upstream(tmp / "yolov9_unmodified")
    data = str(coco_subset(Path(coco128_yaml).parent, tmp / "data", N_IMAGES))
    shm = tmp / "shm"  # ram stores of --cache ram go here, not to the machine's /dev/shm
    shm.mkdir()
    project = tmp / "runs"

    def run(name: str, cwd: Path, argv: list[str], waits: bool = False, **env: str) -> Run:
        batch_log = str(tmp / f"{name}.jsonl")
        return Run(name, argv, cwd, official_env(tmp, FASTLOAD_BATCH_LOG=batch_log, FASTLOAD_SHM_DIR=str(shm), **env),
                   waits=waits)

    def train(name: str, *extra: str) -> list[str]:
        return ["--data", data, "--project", str(project), "--name", name, "--exist-ok", *COMMON, *extra]

    for copy in (edited, stock):  # the smallest models, thinned, written into both copies as a user's config
        yolov9_t, gelan_t = (thin_config(copy, f"models/detect/{name}.yaml") for name in ("yolov9-t", "gelan-t"))
    dual = ["--cfg", yolov9_t]
    training = [
        run("dual", edited, [python(), "train_dual.py", *train("dual", *dual, "--epochs", "2", "--close-mosaic", "1",
                                                                "--workers", "2")]),
        run("launcher", stock, [python(), "-m", "fastload.compat.yolov9", "train_dual.py",
                                *train("launcher", *dual, "--epochs", "2", "--close-mosaic", "1", "--workers", "2",
                                       "--cache", "ram", "--image-weights", "--seed", "3"),
                                "--fastload-workers", "1", "--fastload-batch-log", str(tmp / "launcher_flag.jsonl")]),
        # --rect at --img 128: at 64 every coco128 aspect rounds to a 64x64 rect batch
        run("gelan", edited, [python(), "train.py", *train("gelan", "--cfg", gelan_t, "--epochs", "1",
                                                            "--workers", "1", "--noval", "--rect", "--img", "128")]),
        # --monitor-interval 10: the first rank to fail its CUDA assertion has torchrun stop the other; polling every
        # 10 s (not 0.1) lets rank 0 print its options (print_args) and fail on its own first, even while the two
        # trainers started beside it hold both cores
        run("torchrun", stock, [python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                                "--monitor-interval", "10", "-m", "fastload.compat.yolov9", "train_dual.py",
                                *train("ddp", *dual, "--epochs", "1", "--workers", "1"), "--fastload-workers", "0"],
                # the ranks forked too (tests/preloaded.py); mostly the 10 s wait, so started beside the trainers
                waits=True, PYTHON_EXEC=preloaded_python.python),
    ]
    weights = {name: str(project / name / "weights" / "best.pt") for name in ("dual", "gelan")}
    validation = [
        run("val_dual", edited, [python(), "val_dual.py", "--data", data, "--weights", weights["dual"], "--img", "64",
                                 "--batch", "8", "--device", "cpu", "--workers", "1", "--project", str(project),
                                 "--name", "val_dual", "--exist-ok"]),
        run("val", edited, [python(), "val.py", "--data", data, "--weights", weights["gelan"], "--img", "64",
                            "--batch", "8", "--device", "cpu", "--workers", "1", "--project", str(project),
                            "--name", "val", "--exist-ok"]),
    ]
    run_all([training, validation], tmp / "logs", server=preloaded_python)  # torch & co. imported once, not 6 times
    result = {r.name: r for r in training + validation}
    result["tmp"] = tmp  # type: ignore[assignment]
    yield result
    shutil.rmtree(shm, ignore_errors=True)


def batch_log(runs, name: str) -> list[dict]:
    path = Path(runs["tmp"]) / f"{name}.jsonl"
    assert path.is_file(), f"{name}: no batch log, fastload's loader was not used"
    return [json.loads(line) for line in path.read_text().splitlines()]


def train_epochs(lines: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for x in lines:
        if x["split"] == "train":
            out.setdefault(x["epoch"], []).append(x)
    return out


def test_train_dual_with_the_readme_import_closes_mosaic(runs):
    """train_dual.py, import switched: 2 epochs, --close-mosaic 1; its per-epoch validation also comes from
    fastload (the same import serves val_dual.run)."""
    out = runs["dual"].check()
    assert "Closing dataloader mosaic" in out and "Using 2 dataloader workers" in out
    lines = batch_log(runs, "dual")
    epochs = train_epochs(lines)
    assert sorted(epochs) == [0, 1]
    assert all(x["mosaic"] == x["n"] for x in epochs[0])  # scratch-high: every sample a mosaic
    last = epochs[1]
    assert sum(x["mosaic"] for x in last) == 0, "mosaic samples in the close-mosaic epoch"
    assert sorted(i for x in last for i in x["images"]) == sorted({i for x in last for i in x["images"]})
    assert sum(x["n"] for x in last) == N_IMAGES
    val = [x for x in lines if x["split"] == "val"]
    assert not any(x["augment"] for x in val) and len({x["epoch"] for x in val}) >= 2  # every epoch, then best.pt
    assert all(x["hw"][0] % 32 == 0 and x["hw"][1] % 32 == 0 for x in val)


def test_launcher_runs_an_unmodified_train_dual_with_cache_ram_and_image_weights(runs):
    """No file edited: python -m fastload.compat.yolov9 train_dual.py ... with --cache ram, --image-weights
    and --close-mosaic 1; the --fastload-* flags reach the loader and not the script."""
    out = runs["launcher"].check()
    assert "train_dual.py with fastload's create_dataloader" in out
    assert "Using 1 dataloader workers" in out  # --fastload-workers 1
    assert "ram store" in out  # --cache ram -> a shared-memory ram store
    assert not (Path(runs["tmp"]) / "launcher.jsonl").exists()  # the flag won over FASTLOAD_BATCH_LOG
    epochs = train_epochs(batch_log(runs, "launcher_flag"))
    assert sorted(epochs) == [0, 1]
    assert sum(x["mosaic"] for x in epochs[0]) > 0 and sum(x["mosaic"] for x in epochs[1]) == 0
    # --image-weights: each epoch draws its images with replacement (the official trainer sets dataset.indices)
    draws = [Counter(i for x in epochs[e] for i in x["images"]) for e in (0, 1)]
    assert all(sum(c.values()) == N_IMAGES for c in draws)
    assert any(max(c.values()) > 1 for c in draws), draws


def test_train_py_gelan_rect(runs):
    """train.py (one head), import switched, with --rect: letterboxed rectangular batches, never a mosaic."""
    out = runs["gelan"].check()
    epochs = train_epochs(batch_log(runs, "gelan"))
    assert list(epochs) == [0] and sum(x["n"] for x in epochs[0]) == N_IMAGES
    assert all(x["mosaic"] == 0 for x in epochs[0])
    assert any(x["hw"][0] != x["hw"][1] for x in epochs[0])  # rectangular batch shapes
    assert "Closing dataloader mosaic" not in out


@pytest.mark.parametrize("name", ["val_dual", "val"])
def test_standalone_validation_on_saved_weights(runs, name):
    out = runs[name].check()
    assert "all" in out  # the metrics row
    lines = batch_log(runs, name)
    assert lines and all(x["split"] == "val" and not x["augment"] for x in lines)
    assert sum(x["n"] for x in lines) == N_IMAGES


def test_torchrun_starts_the_launcher_in_every_rank(runs):
    """Under torchrun each rank runs the launcher, which passes its rank on to the official script
    (whose DDP path then asserts CUDA devices: this is a CPU machine)."""
    r = runs["torchrun"]
    out = r.output
    for rank in (0, 1):
        assert f"(RANK {rank}, LOCAL_RANK {rank}, WORLD_SIZE 2)" in out, out[-4000:]
    assert "insufficient CUDA devices for DDP command" in out, out[-4000:]
    assert "batch_size=4" in out and "unrecognized arguments" not in out  # official flags in, fastload's out
    assert r.returncode != 0
