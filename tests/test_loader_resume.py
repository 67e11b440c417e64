"""FastLoader.state_dict() / load_state_dict(): a resumed loader delivers the rest of the interrupted epoch,
bit-identical to an uninterrupted one, renders none of the batches before it, and refuses another run's state.

The ray case starts a local Ray instance (the ``local_ray`` fixture)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import fastload

IMGSZ = 64
BATCH = 4
EPOCHS = 3  # with close_mosaic=1: mosaic closes in epoch 2
HAS_RAY = importlib.util.find_spec("ray") is not None

# without a decoded cache, so that the decodes counted are those of the batches rendered
NO_CACHE = {"decode_cache_mb": 0}
RUNS = [
    pytest.param("cpu", dict(workers=0, engine_options=NO_CACHE), id="cpu-inline"),
    pytest.param("cpu", dict(workers=2, engine_options=NO_CACHE), id="cpu-2workers"),
    pytest.param("gpu", dict(device="cpu"), id="gpu-on-cpu"),
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from fastload.data.synthetic import make_synthetic_dataset

    # 12 images in batches of 4: three per epoch
    return make_synthetic_dataset(tmp_path_factory.mktemp("resume"), n_train=12, n_val=1, nc=3, seed=4, max_size=160)


def make(data, engine, run, **kw):
    args = dict(imgsz=IMGSZ, batch_size=BATCH, store="files", engine=engine, seed=5, close_mosaic=1, epochs=EPOCHS,
                **run)
    args.update(kw)
    return fastload.loader(data, **args)


def clone(batch):
    imgs, targets, paths, shapes = batch
    return imgs.clone(), targets.clone(), paths, shapes


def assert_identical(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2] == y[2] and x[3] == y[3]


@pytest.mark.parametrize("engine,run", RUNS)
def test_resumed_loader_delivers_the_rest_bit_identical_and_renders_nothing_before(data, engine, run):
    check_resume(data, engine, run)


@pytest.mark.skipif(not HAS_RAY, reason='Ray is not installed (pip install "fastload[ray]")')
def test_resumed_ray_loader_delivers_the_rest_bit_identical_and_renders_nothing_before(data, local_ray):
    check_resume(data, "ray", dict(engine_options={**NO_CACHE, "actors": 2}))


def check_resume(data, engine, run):
    # the uninterrupted run, with its state and its decodes so far after every batch
    epochs, states, decodes = [], {}, {}
    with make(data, engine, run) as fl:
        per_epoch = len(fl)
        for e in range(EPOCHS):
            epochs.append([])
            for k, batch in enumerate(fl):
                epochs[-1].append(clone(batch))
                del batch
                states[e, k + 1] = json.loads(json.dumps(fl.state_dict()))  # what a checkpoint holds
                decodes[e, k + 1] = fl.stats()["decodes"]
            decodes[e + 1, 0] = decodes[e, per_epoch]
    assert per_epoch == 3
    assert [s[3] for s in epochs[EPOCHS - 1]] != [s[3] for s in epochs[0]]  # epoch 2 drew no mosaic: shapes given
    assert not states[0, 1]["mosaic_closed"] and states[2, 1]["mosaic_closed"]

    for e, k in [(0, 1), (2, 2)]:  # mid-epoch (the run then crosses close_mosaic), in the closed epoch
        with make(data, engine, run) as fl:
            fl.load_state_dict(states[e, k])
            rest, rest_states = [], []
            for batch in fl:
                rest.append(clone(batch))
                rest_states.append(fl.state_dict())
            assert_identical(rest, epochs[e][k:])
            # a resumed loader's states are the uninterrupted one's: it can be interrupted and resumed again
            assert rest_states == [states[e, j] for j in range(k + 1, per_epoch + 1)]
            # none of the k batches before the position was rendered: only the remaining ones were decoded
            stats = fl.stats()
            assert stats["batches"] == per_epoch - k
            assert stats["decodes"] == decodes[e, per_epoch] - decodes[e, k]
            assert fl.state_dict()["epoch"] == e + 1 and fl.state_dict()["position"] == 0
            for later in range(e + 1, EPOCHS):  # the epochs after it are as usual
                assert_identical([clone(b) for b in fl], epochs[later])


def test_state_at_the_end_of_an_epoch_resumes_with_the_next(data):
    run = dict(workers=0)
    with make(data, "cpu", run) as fl:
        reference = [[clone(b) for b in fl] for _ in range(2)]
        fl.set_epoch(0)
        for _ in fl:
            state = fl.state_dict()  # taken after the last batch, before the iteration ended
    assert state["epoch"] == 0 and state["position"] == state["batches"]
    with make(data, "cpu", run) as fl:
        fl.load_state_dict(state)
        assert list(fl) == []  # the rest of epoch 0: nothing
        assert_identical([clone(b) for b in fl], reference[1])


def test_state_is_plain_json_and_a_set_epoch_trainer_resumes(data):
    run = dict(workers=0)
    with make(data, "cpu", run) as fl:
        fl.set_epoch(1)
        it = iter(fl)
        expected = [clone(b) for b in it][2:]
        fl.set_epoch(1)
        it = iter(fl)
        next(it), next(it)
        state = fl.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert all(v is None or isinstance(v, (str, int, bool)) for v in state.values())
    assert state["epoch"] == 1 and state["position"] == 2
    with make(data, "cpu", run) as fl:
        fl.load_state_dict(state)
        with pytest.raises(ValueError, match="resumes epoch 1 at batch 2"):
            fl.set_epoch(0)
        fl.set_epoch(1)  # what a trainer resuming at the saved epoch does: the position is kept
        assert_identical([clone(b) for b in fl], expected)


def test_another_runs_state_is_refused_saying_what_differs(data, tmp_path):
    from fastload.data.synthetic import make_synthetic_dataset

    run = dict(workers=0)
    with make(data, "cpu", run) as fl:
        it = iter(fl)
        next(it)
        state = fl.state_dict()
    other_data = make_synthetic_dataset(tmp_path / "other", n_train=12, n_val=1, nc=3, seed=9, max_size=160)
    cases = [
        (dict(seed=6), "the seed differs"),
        (dict(rank=0, world_size=2), "the world size differs"),
        (dict(batch_size=2), "the batch size differs"),
        (dict(min_items=1), "the number of images differs|the dataset"),
        (dict(hyp={"mosaic": 0.5}), "the augmentation"),
        (dict(partners="batch"), "partners differs"),
    ]
    for kw, what in cases:
        with make(data, "cpu", run, **kw) as fl, pytest.raises(ValueError, match=what):
            fl.load_state_dict(state)
    with make(other_data, "cpu", run) as fl, pytest.raises(ValueError, match=r"the dataset \(digest"):
        fl.load_state_dict(state)
    with make(data, "cpu", run) as fl:
        with pytest.raises(ValueError, match="not a fastload loader state"):
            fl.load_state_dict({"epoch": 0, "position": 1})
        with pytest.raises(ValueError, match="outside 0..3"):
            fl.load_state_dict({**state, "position": 4})
        fl.load_state_dict({**state, "rank": 1})  # another rank's state is this rank's place too
        fl.set_image_table(list(range(1, fl.n)) + [0])  # another image table: another order of epoch 0
        with pytest.raises(ValueError, match="order of epoch 0 differs"):
            next(iter(fl))
    with make(data, "cpu", run) as fl:
        fl.close_mosaic()
        with pytest.raises(ValueError, match="mosaic on"):
            fl.load_state_dict(state)


def test_one_ranks_state_resumes_every_rank(data):
    """Under DDP a checkpoint is usually written by rank 0 alone: every rank is at the same batch."""
    run = dict(workers=0, world_size=2)
    with make(data, "cpu", run, rank=0) as fl:  # 6 images per rank: 2 batches

        it = iter(fl)
        next(it)
        state = fl.state_dict()
    for rank in (0, 1):
        with make(data, "cpu", run, rank=rank) as fl:
            expected = [clone(b) for b in fl][1:]
        with make(data, "cpu", run, rank=rank) as fl:
            fl.load_state_dict(state)
            assert_identical([clone(b) for b in fl], expected)


def test_a_planned_partners_state_resumes_with_the_plan_it_names(data, shm_root):
    """A loader left to plan its partners records the plan it made ("batch": the 12 images loaded at 256 exceed a
    1 MB decoded cache): the rest of the epoch resumes bit-identical with that plan, and a loader that planned
    otherwise (its cache holds them all) refuses the state, naming the partners= to pass."""
    small = dict(workers=0, engine_options={"decode_cache_mb": 1})
    with make(data, "cpu", small, imgsz=256) as fl:
        assert fl.plan.by == "cache-too-small"
        it = iter(fl)
        next(it)
        state = fl.state_dict()
        rest = [clone(b) for b in it]
    assert state["partners"] == "batch"
    with make(data, "cpu", dict(workers=0), imgsz=256) as fl, pytest.raises(ValueError, match="pass partners='batch'"):
        fl.load_state_dict(state)
    with make(data, "cpu", dict(workers=0), imgsz=256, partners="batch") as fl:
        fl.load_state_dict(state)
        assert_identical([clone(b) for b in fl], rest)


def test_an_image_table_resumes_when_the_trainer_sets_it_again(data):
    run = dict(workers=0)
    table = [i // 2 for i in range(12)]  # --image-weights: each of the first six images twice
    with make(data, "cpu", run) as fl:
        fl.dataset.indices = table
        expected = [clone(b) for b in fl]
        fl.set_epoch(0)
        it = iter(fl)
        next(it)
        state = fl.state_dict()
    with make(data, "cpu", run) as fl:
        fl.load_state_dict(state)
        fl.dataset.indices = table  # what the trainer does before the epoch
        assert_identical([clone(b) for b in fl], expected[1:])


def test_workers_outlive_a_sigterm_to_the_process_group(data):
    """torchrun and SLURM send SIGTERM to a trainer's whole process group, loader workers included: the workers
    keep rendering, so that the trainer can take its next step and save a checkpoint before it exits."""
    import os
    import signal

    with make(data, "cpu", dict(workers=1, engine_options=NO_CACHE)) as loader:
        batches = iter(loader)
        first = clone(next(batches))
        os.kill(loader.stats()["worker_pids"][0], signal.SIGTERM)
        rest = [clone(b) for b in batches]
    with make(data, "cpu", dict(workers=0, engine_options=NO_CACHE)) as loader:
        assert_identical([first, *rest], [clone(b) for b in loader])


def test_a_process_that_ends_with_an_open_loader_exits(data, tmp_path, preloaded_python):
    """Workers that ignore SIGTERM must not hold up the interpreter's exit: multiprocessing SIGTERMs daemonic
    children at exit and then waits for them without a timeout (an official train_dual.py run never closes its
    loaders, and hung there)."""
    script = tmp_path / "open_loader.py"
    script.write_text("import fastload\n"
                      f"loader = fastload.loader({str(data)!r}, imgsz={IMGSZ}, batch_size={BATCH}, store='files', "
                      "workers=2, engine_options={'decode_cache_mb': 0})\n"
                      "batch = next(iter(loader))\n"
                      "print('one batch, then the end of the script', flush=True)\n")
    from preloaded import base_env

    log = tmp_path / "log"
    proc = preloaded_python.spawn([str(script)], tmp_path, base_env(Path(__file__).resolve().parents[1]), log)
    try:
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        proc.kill()
    assert "one batch" in log.read_text()
