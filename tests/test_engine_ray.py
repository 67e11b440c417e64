"""engine="ray" on one local Ray instance (2 CPUs, shared with the other modules that start Ray: its start-up
is the slow part): the same batches as engine="cpu" whatever the number of actors, a killed actor replaced without a
batch lost or repeated, bounded memory under a slow consumer, Ctrl-C and close() leaving nothing behind,
clear errors (a store an actor cannot open, Ray missing), DDP ranks sharing the instance, the bench row.

The engine-contract checks (batch format, HSV modes, layouts, options) run in test_engine_contract.py.
"""
from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

import fastload
from fastload.engines.base import WorkerError
from fastload.engines.ray_engine import RayOptions
from fastload.engines.ray_slots import PREFIX as SLOTS_PREFIX
from fastload.store.base import StoreError
from fastload.store.kinds import shm_root

pytest.importorskip("ray", reason='Ray is not installed (pip install "fastload[ray]")')

IMGSZ = 64
BATCH = 4
REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_torch_thread", "local_ray")


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """A small synthetic set converted to lmdb and disk: actors open them by path."""
    from fastload.data.synthetic import make_synthetic_dataset
    from fastload.store.convert import convert

    root = tmp_path_factory.mktemp("ray")
    yaml_path = make_synthetic_dataset(root / "src", n_train=24, n_val=8, nc=3, seed=5, max_size=160)
    res = convert(yaml_path, to="lmdb,disk", out=root / "stores", imgsz=IMGSZ, workers=1, progress=False,
                  log=lambda *_: None)
    return res.yaml_path


def load(data, engine, *, epochs=(0, 1), close=None, **kw):
    """Batches of ``epochs`` as cloned tensors, and the loader's final stats."""
    args = dict(imgsz=IMGSZ, batch_size=BATCH, store="disk", engine=engine, seed=11)
    if close is not None:
        args.update(close_mosaic=close, epochs=len(epochs))
    args.update(kw)
    out = []
    with fastload.loader(data, **args) as fl:
        for e in epochs:
            fl.set_epoch(e)
            out.append([(imgs.clone(), targets.clone(), paths, shapes) for imgs, targets, paths, shapes in fl])
        stats = fl.stats()
    return out, stats


def assert_same(a, b):
    assert [len(e) for e in a] == [len(e) for e in b]
    for ea, eb in zip(a, b):
        for x, y in zip(ea, eb):
            assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2] == y[2] and x[3] == y[3]


@pytest.fixture(scope="module")
def cpu_reference(stores):
    """engine="cpu" (in-process) over two epochs, the second with mosaic closed."""
    return load(stores, "cpu", workers=0, close=1)[0]


def test_actor_module_does_not_load_torch():
    """Actors import only what rendering needs (torch would add seconds and memory to every actor)."""
    code = "import sys, fastload.engines.ray_actor; print('torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


def test_batches_equal_the_cpu_engine_over_two_epochs_with_close_mosaic(stores, cpu_reference):
    got, stats = load(stores, "ray", close=1, engine_options=RayOptions(actors=2))
    assert_same(cpu_reference, got)
    assert any(s is None for b in got[0] for s in b[3])  # epoch 0 has mosaics
    assert all(s is not None for b in got[1] for s in b[3])  # epoch 1 is after close-mosaic
    assert stats["actors"] == 2 and len(stats["worker_pids"]) == 2 and stats["actor_restarts"] == 0
    assert stats["nodes"] and socket.gethostname() in stats["nodes"][0]
    assert stats["in_flight_peak"] <= stats["in_flight_limit"] == 2 * 2  # actors x prefetch
    # the actors share this node: the batches come through the shared-memory slots (delivery="auto"), except
    # around close-mosaic: epoch 1's first two batches, sent early with mosaic on, are dropped, and while they
    # finish rendering their slots are busy; batches sent meanwhile (at most the in-flight limit) take the store
    assert stats["slot_batches"] + stats["object_store_batches"] == sum(map(len, got))
    assert stats["object_store_batches"] <= stats["in_flight_limit"] < stats["slot_batches"]


def test_slots_that_do_not_fit_shared_memory_fall_back_to_the_object_store(stores, cpu_reference, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    # one actor (2 in flight + keep=2: 4 slots): what is checked is the fallback, not how many actors render
    # (each actor is a Ray worker process of its own, about 1 s of CPU to start)
    with pytest.warns(UserWarning, match=r"engine 'ray': cannot reserve .* for 4 batch slots in .*No space left on "
                                         r"device; batches from the actors on this node go through Ray's object store"):
        got, stats = load(stores, "ray", close=1, engine_options=RayOptions(actors=1))
    assert_same(cpu_reference, got)
    assert stats["object_store_batches"] == sum(map(len, got)) and stats["slot_batches"] == 0


def test_same_batches_whatever_the_number_of_actors_and_store(stores, cpu_reference):
    one, stats = load(stores, "ray", close=1, prefetch=3, engine_options={"actors": 1, "delivery": "object_store"})
    assert stats["actors"] == 1 and stats["in_flight_limit"] == 3
    assert stats["object_store_batches"] == sum(map(len, one)) and stats["slot_batches"] == 0
    assert_same(cpu_reference, one)
    # encoded: decoded by the actors; keep=1, the fewest spare slots: the common loop (one batch held while the
    # next is asked for) gets every batch of both epochs in a slot, none copied (without close_mosaic: see RayOptions)
    lmdb, lmdb_stats = load(stores, "ray", store="lmdb", engine_options={"actors": 2, "keep": 1})
    assert lmdb_stats["slot_batches"] == sum(map(len, lmdb)) and lmdb_stats["batches_copied"] == 0, lmdb_stats
    assert_same(load(stores, "cpu", store="lmdb", workers=0)[0], lmdb)
    # validation batches: rect shapes differ from batch to batch (one actor: the default count, cpus // 1, is
    # what test_two_gloo_ranks_share_one_ray_instance and test_bench_measures_the_ray_engine run)
    val = dict(split="val", augment=False, rect=True, pad=0.5, shuffle=False, epochs=(0,))
    assert_same(load(stores, "cpu", workers=0, **val)[0], load(stores, "ray", engine_options={"actors": 1}, **val)[0])


def test_ultralytics_recipe_gives_the_cpu_engine_s_batches(stores):
    """recipe="ultralytics" (the sampler Ray ships carries it, and with it Ultralytics' loaded-image rule, which the
    actors decode the lmdb store's images by): the actors render the CPU engine's batches."""
    kw = dict(epochs=(0,), recipe="ultralytics", store="lmdb")  # the disk store holds YOLOv9's loaded images
    cpu = load(stores, "cpu", workers=0, **kw)[0]
    assert_same(cpu, load(stores, "ray", engine_options={"actors": 1}, **kw)[0])
    assert not torch.equal(cpu[0][0][0], load(stores, "cpu", workers=0, epochs=(0,), store="lmdb")[0][0][0][0])


def test_an_image_table_gives_the_cpu_engine_s_batches(stores):
    """YOLOv9's --image-weights: positions show the table's images, repeats with their own draws."""
    table = np.random.default_rng(0).integers(0, 24, 24)
    got = {}
    # one actor: the table is applied where the order is drawn, in this process, before any actor gets a batch
    for engine, kw in (("cpu", {"workers": 0}), ("ray", {"engine_options": {"actors": 1}})):
        with fastload.loader(stores, imgsz=IMGSZ, batch_size=BATCH, store="disk", engine=engine, seed=11, **kw) as fl:
            fl.set_image_table(table)
            got[engine] = [[(i.clone(), t.clone(), p, s) for i, t, p, s in fl]]
    assert_same(got["cpu"], got["ray"])
    assert len({p for b in got["ray"][0] for p in b[2]}) == len(set(table.tolist())) < 24  # images repeat


@pytest.fixture(scope="module")
def uncached_lmdb_epoch(stores):
    """``run(partners)``: epoch 0 of the lmdb store on two actors without decoded caches, as :func:`load` returns
    it; each partner draw runs once for the module (the partners test and the decoded-cache test's baseline)."""
    runs = {}

    def run(partners):
        if partners not in runs:
            runs[partners] = load(stores, "ray", store="lmdb", epochs=(0,), partners=partners,
                                  engine_options={"actors": 2, "decode_cache_mb": 0})
        return runs[partners]
    return run


@pytest.mark.parametrize("partners", ["dataset", "batch"])
def test_partners_give_the_cpu_engine_s_batches_and_decode_counts(stores, uncached_lmdb_epoch, partners):
    """Both partner draws on an encoded store, without decoded caches: the same batches as engine="cpu",
    and the decodes the actors report add up to the CPU engine's (one epoch: no early batches dropped)."""
    cpu, cpu_stats = load(stores, "cpu", workers=0, engine_options={"decode_cache_mb": 0}, store="lmdb", epochs=(0,),
                          partners=partners)
    ray, ray_stats = uncached_lmdb_epoch(partners)
    assert_same(cpu, ray)
    assert ray_stats["partners"] == cpu_stats["partners"] == partners
    assert ray_stats["decodes"] == cpu_stats["decodes"] and ray_stats["decode_cache_hits"] == 0
    assert ray_stats["decodes_per_image"] == ray_stats["decodes"] / 24
    if partners == "batch":
        assert ray_stats["decodes"] == 24  # each image once, in its own batch
    else:
        assert ray_stats["decodes"] > 2 * 24  # mosaic partners and mixup read other images too


def test_the_actors_of_a_node_share_its_decoded_cache(stores, uncached_lmdb_epoch):
    """Encoded store, the default cache: the two actors fill one segment of this machine, so two epochs
    decode far less than one epoch without it; close() removes the segment."""
    from fastload.engines.shm_cache import PREFIX
    from fastload.store.shm import list_segments

    without = uncached_lmdb_epoch("dataset")[1]  # the default partners, as below
    with fastload.loader(stores, imgsz=IMGSZ, batch_size=BATCH, store="lmdb", engine="ray", seed=11,
                         engine_options={"actors": 2}) as fl:
        for epoch in (0, 1):
            fl.set_epoch(epoch)
            for _ in fl:
                pass
        stats = fl.stats()
        held = [s for s in list_segments(prefix=PREFIX) if set(s.live) & set(stats["worker_pids"])]
        assert len(held) == 1 and set(stats["worker_pids"]) <= set(held[0].live)
    assert 24 <= stats["decodes"] < without["decodes"] / 2  # every image decoded at least once, then read
    assert stats["decode_cache_hits"] > 0
    assert not held[0].path.exists()  # the actors closed it before they were killed


def test_a_killed_actor_is_replaced_and_its_batches_rendered_again(stores, cpu_reference):
    got = []
    # prefetch=1: one batch per actor in flight, so 3 of the epoch's 6 batches are still to be sent when an actor
    # is killed after the second. The engine notices a death only when it fetches a task of the dead actor; a
    # dead actor's tasks end at once, so it looks idle and is sent one of those batches. With 4 in flight
    # (prefetch=2) a single batch was left, and when it went to the live actor nothing was replaced (1 of 3 runs).
    with fastload.loader(stores, imgsz=IMGSZ, batch_size=BATCH, store="disk", engine="ray", seed=11, close_mosaic=1,
                         epochs=2, prefetch=1, engine_options=RayOptions(actors=2)) as fl:
        for epoch in (0, 1):
            fl.set_epoch(epoch)
            batches = []
            for k, (imgs, targets, paths, shapes) in enumerate(fl):
                batches.append((imgs.clone(), targets.clone(), paths, shapes))
                if k == 1:  # both actors have rendered; batches 2-5 are still to be rendered
                    if epoch == 0:  # the process dies (as by the OOM killer)
                        os.kill(fl.stats()["worker_pids"][0], signal.SIGKILL)
                    else:  # Ray kills it
                        import ray

                        ray.kill(fl.engine._actors[1], no_restart=True)
            got.append(batches)
        stats = fl.stats()
    assert_same(cpu_reference, got)  # none lost, none twice, same pixels
    assert stats["actor_restarts"] == 2 and stats["batches"] == sum(len(e) for e in cpu_reference)


def test_an_actor_that_dies_too_often_raises(stores):
    with fastload.loader(stores, imgsz=IMGSZ, batch_size=BATCH, store="disk", engine="ray",
                         engine_options=RayOptions(actors=1, max_restarts=0)) as fl:
        it = iter(fl)
        next(it)
        os.kill(fl.stats()["worker_pids"][0], signal.SIGKILL)
        with pytest.raises(WorkerError, match=r"render actor 0 .* died and was already replaced max_restarts=0 times"):
            list(it)


def _needed_object_store_bytes(ray) -> float:
    """Object-store bytes that something still references (Ray's ``memory --stats-only`` figure)."""
    from ray._private.internal_api import memory_summary  # Ray's own `ray memory` report; no public API has it

    # the address named: without it Ray looks for the machine's one instance and fails where another runs
    summary = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    m = re.search(r"([\d.]+)% needed", summary)
    assert m, "Ray's memory summary changed its format"
    return float(m.group(1)) / 100 * ray.cluster_resources()["object_store_memory"]


def _wait_until_rendered(fl, ray) -> None:
    """Returns once the actors have finished every batch the loader has sent them (none is fetched here)."""
    window = fl.engine._window  # the engine's batches in flight; no public API lists their Ray references
    refs = [t.ref for t in window._queue + window._early + (window._ahead.tasks if window._ahead else [])]
    assert refs, "nothing in flight to wait for"
    _, unfinished = ray.wait(refs, num_returns=len(refs), timeout=60, fetch_local=False)
    assert not unfinished, f"{len(unfinished)} of {len(refs)} batches still rendering after 60 s"


@pytest.mark.parametrize("delivery", ["object_store", "auto"])
def test_a_slow_consumer_keeps_memory_flat(stores, local_ray, delivery):
    """Many batches through a consumer slower than the actors: the engine never has more than its limit
    in flight, Ray's object store holds no more results than those (none with the shared-memory slots of
    delivery="auto": the actors share this node), and this process's memory stays flat."""
    batch = 12  # 147 kB: Ray returns results under 100 kB inline instead of through its object store
    batch_bytes = batch * IMGSZ * IMGSZ * 3
    in_store = 1 if delivery == "object_store" else 0  # batches whose pixels travel through the object store
    me = psutil.Process()
    with fastload.loader(stores, imgsz=IMGSZ, batch_size=batch, store="disk", engine="ray", prefetch=2,
                         engine_options={"actors": 2, "delivery": delivery}) as fl:
        it = iter(fl)
        next(it)
        _wait_until_rendered(fl, local_ray)  # the actors finish all they were sent while the consumer stalls
        stalled = fl.stats()["in_flight"]
        assert stalled == 3  # this epoch's second batch and the next epoch's two (2 batches per epoch)
        # control: the measure sees results waiting in the store, and there are no more than those
        needed_stalled = _needed_object_store_bytes(local_ray)
        assert in_store * stalled * batch_bytes * 0.95 <= needed_stalled <= (in_store * stalled + 0.5) * batch_bytes
        list(it)
        needed, private = [], []
        for epoch in range(1, 21):  # 40 batches, 20 x the data set
            fl.set_epoch(epoch)
            for imgs, *_ in fl:
                time.sleep(0.02)  # the consumer is the slow side
                needed.append(_needed_object_store_bytes(local_ray))
            private.append(me.memory_full_info().uss)  # shared pages (store, slots) are not counted here
        stats = fl.stats()
    assert stats["in_flight_peak"] <= stats["in_flight_limit"] == 4
    assert max(needed) <= (4 * in_store + 0.5) * batch_bytes, needed  # the limit (with room for the percent rounding)
    assert max(private[5:]) - private[4] < 32 << 20, private  # no growth after warm-up
    delivered = stats["slot_batches"] + stats["object_store_batches"]
    assert delivered == 42 and stats["slot_batches"] == (0 if in_store else delivered)
    assert stats["batches_copied"] == 0  # the loop holds one batch while the next comes: a slot is always free


def test_ctrl_c_in_the_consumer_and_close_leave_nothing_running(stores, cpu_reference):
    with fastload.loader(stores, imgsz=IMGSZ, batch_size=BATCH, store="disk", engine="ray", seed=11, close_mosaic=1,
                         epochs=2, engine_options={"actors": 2}) as fl:
        pids = fl.stats()["worker_pids"]
        with pytest.raises(KeyboardInterrupt):
            for k, _ in enumerate(fl):
                if k == 1:
                    raise KeyboardInterrupt
        assert fl.stats()["in_flight"] == 0  # what was in flight is dropped
        fl.set_epoch(0)  # the loader goes on with the same batches
        assert_same(cpu_reference[:1], [[(i.clone(), t.clone(), p, s) for i, t, p, s in fl]])
        assert fl.stats()["in_flight"] <= fl.stats()["in_flight_limit"]  # the next epoch's first batches
    assert fl.stats()["in_flight"] == 0
    # the batch slots went with the loader (this process's: the suite's other worker may have its own open)
    assert not list(shm_root().glob(f"{SLOTS_PREFIX}{os.getpid()}-*"))
    deadline = time.monotonic() + 20
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, f"actor processes {pids} still run after close()"
        time.sleep(0.2)


def test_a_store_an_actor_cannot_open_is_one_clear_error(stores, tmp_path):
    # one actor each: every actor opens the store itself and reports the same error (a process saved per start)
    missing = tmp_path / "not-staged-here"
    with pytest.raises(StoreError, match=rf"render actor on node {re.escape(socket.gethostname())}.*cannot open the "
                                         rf"disk store at {re.escape(str(missing))}: no store at"):
        fastload.loader(stores, imgsz=IMGSZ, batch_size=BATCH, store="disk", engine="ray",
                        engine_options={"store_path": str(missing), "actors": 1})
    from fastload.data.config import load_data_config

    lmdb_dir = load_data_config(stores).stores["train"]["lmdb"]
    with pytest.raises(StoreError, match="holds 24 encoded samples, the loader's disk store 24 decoded ones"):
        fastload.loader(stores, imgsz=IMGSZ, batch_size=BATCH, store="disk", engine="ray",
                        engine_options={"store_path": str(lmdb_dir), "actors": 1})
    with pytest.raises(fastload.EngineOptionError, match="store_path does not apply to store='files'"):
        fastload.loader(stores, imgsz=IMGSZ, batch_size=BATCH, store="files", engine="ray",
                        engine_options={"store_path": str(lmdb_dir)})
    with pytest.raises(fastload.EngineOptionError, match="3 actors x 1 CPUs need more than the 2 CPUs"):
        fastload.loader(stores, imgsz=IMGSZ, batch_size=BATCH, store="disk", engine="ray", engine_options={"actors": 3})


def test_ray_missing_is_one_line_naming_the_extra(stores, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as on an install without the extra
    assert fastload.RayOptions(actors=2).actors == 2  # the options need no Ray
    with pytest.raises(ImportError) as info:
        fastload.loader(stores, imgsz=IMGSZ, batch_size=BATCH, store="disk", engine="ray")
    msg = str(info.value)
    assert "\n" not in msg and 'pip install "fastload[ray]"' in msg


@pytest.mark.timeout(180)
def test_two_gloo_ranks_share_one_ray_instance(stores, tmp_path, local_ray, preloaded_python):
    from gloo_rank import epoch_checksums
    from preloaded import base_env

    address = local_ray.get_runtime_context().gcs_address
    # the ranks (tests/gloo_rank.py) are forked from the worker's pre-loaded interpreter, which has imported torch
    # once for all its runs, not from two fresh ones that import it each (seconds of CPU); never from this process,
    # whose Ray threads can hang a fork (grpc/grpc#31885)
    script = str(Path(__file__).with_name("gloo_rank.py"))
    ranks = [preloaded_python.spawn([script, str(k), str(stores), str(tmp_path), address, str(IMGSZ), str(BATCH)],
                                    tmp_path, base_env(REPO), tmp_path / f"rank{k}.log") for k in range(2)]
    try:
        codes = [rank.wait(timeout=150) for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
    assert codes == [0, 0], "\n".join((tmp_path / f"rank{k}.log").read_text()[-3000:] for k in range(2))
    r = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(2)]
    for k in range(2):
        assert r[k]["actors"] == 1  # the instance's 2 CPUs split between the ranks
        with fastload.loader(stores, imgsz=IMGSZ, batch_size=BATCH, store="disk", engine="cpu", workers=0, seed=4,
                             rank=k, world_size=2) as fl:
            assert r[k]["ray"] == epoch_checksums(fl)  # each rank's own stream, as engine="cpu" gives it
    assert set(r[0]["ray"]["paths"]).isdisjoint(r[1]["ray"]["paths"])  # 24 images, 2 ranks: no padding
    assert len(r[0]["ray"]["paths"]) + len(r[1]["ray"]["paths"]) == 24


def test_bench_measures_the_ray_engine(stores):
    from fastload.bench.run import _default_engines
    from fastload.bench.stages import measure_loader

    assert "ray" in _default_engines()  # Ray is installed here
    m = measure_loader(stores, "ray", "disk", 0.5, imgsz=IMGSZ, batch=BATCH, workers=2)
    assert m.ok, m.skipped
    assert m.extra["workers"] == 2 and "2 actors" in m.note
