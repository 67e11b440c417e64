"""The CPU engine's machinery (workers, shared slots, decode cache, failure handling) with stand-in
augmentation: a tiny sampler and renderer defined here, so these tests exercise only the engine."""
from __future__ import annotations

import gc
import os
import queue
import re
import threading
import time
from dataclasses import dataclass

import msgpack
import numpy as np
import psutil
import pytest
import torch

from fastload.augment import task_labels
from fastload.engines import base as engine_base
from fastload.engines import cpu_render
from fastload.cli.errors import describe
from fastload.engines.base import EngineSettings, WorkerFailure, collate_targets
from fastload.engines.cpu import CPUEngine, CPUOptions
from fastload.engines.cpu_workers import WorkerError
from fastload.engines.shm_cache import SharedDecodeCache
from fastload.engines.slot_ledger import SlotLedger
from fastload.store.base import Store, StoreError
from fastload.store.objects.client import MissingObjectError
from fastload.store.view import StoreView

IMGSZ = 32


class ArrayStore(Store):
    """Decoded-or-encoded in-memory store of small random images (encoded = PNG bytes)."""

    kind = "test"

    def __init__(self, n: int, encoded: bool = False) -> None:
        super().__init__()
        rng = np.random.default_rng(0)
        self.decoded = not encoded
        self.imgsz = None if encoded else IMGSZ
        self._imgs = [rng.integers(0, 255, (IMGSZ, IMGSZ, 3), dtype=np.uint8) for _ in range(n)]
        self.im_files = [f"/data/images/{i:03d}.png" for i in range(n)]
        self.labels = [np.array([[i % 3, 0.5, 0.5, 0.2, 0.2]] * (i % 3), np.float32).reshape(-1, 5) for i in range(n)]
        self.shapes = np.full((n, 2), IMGSZ, np.int32)
        self.names = ["a", "b", "c"]
        self.loads = 0

    def read_image(self, i: int):
        return self._imgs[i]

    def load(self, i: int, imgsz: int | None = None, *, reduced: bool = False, shrink: str = "area") -> np.ndarray:
        self.loads += 1
        return self._imgs[i]


@dataclass
class FakeImage:
    out_hw: tuple[int, int]


@dataclass
class FakeParams:
    index: int
    partner: int
    epoch: int
    image: FakeImage
    hsv_gain: tuple[float, float, float]
    shapes: object
    attempt: int = 0

    @property
    def sources(self) -> tuple[int, int]:
        return self.index, self.partner


class FakeSampler:
    """Draws from SeedSequence([seed, epoch, index]) like the real one; one partner image per sample."""

    imgsz = IMGSZ
    max_out_hw = (IMGSZ, IMGSZ)
    partners = "dataset"
    augment = True  # engines pick the loaded-image shrink filter from it
    recipe = "yolov9"  # the colour rule the engines apply HSV with
    load_rule = "yolov9"  # and the loaded-image rule they resize with

    def __init__(self, n: int, seed: int = 0, die_on: int | None = None, fail_on: int | None = None) -> None:
        self.n, self.seed, self.closed = n, seed, False
        self.loaded_shapes = np.full((n, 2), IMGSZ)
        self.die_on, self.fail_on = die_on, fail_on

    def sample(self, epoch: int, index: int) -> FakeParams:
        if index == self.die_on:
            os._exit(3)
        if index == self.fail_on:
            raise ValueError(f"cannot sample {index}")
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch, index])))
        partner = int(rng.integers(self.n))
        shapes = None if not self.closed else ((IMGSZ, IMGSZ), ((1.0, 1.0), (0.0, 0.0)))
        return FakeParams(index, partner, epoch, FakeImage((IMGSZ, IMGSZ)), (1.0, 1.0, float(rng.uniform(0.5, 1.5))), shapes)

    def sample_batch(self, epoch: int, indices) -> list[FakeParams]:
        return [self.sample(epoch, int(i)) for i in indices]

    def first_usable(self, epoch: int, index: int, usable, batch=None, *, record=None) -> FakeParams:
        record = record or self.sample(epoch, index)
        assert usable(record)  # loads its images; nothing here is damaged
        return record

    def close_mosaic(self) -> None:
        self.closed = True


def fake_render(p: FakeParams, get_image, out=None, *, hsv=True, axis_kernel=None, labels=None, moved=None):
    a, b = get_image(p.index), get_image(p.partner)
    img = (a // 2 + b // 2).astype(np.uint8)
    if hsv:
        img = np.clip(img * p.hsv_gain[2], 0, 255).astype(np.uint8)
    if out is None:
        return img
    out[...] = img
    return out


def fake_targets(records, labels):
    return collate_targets([labels[p.index] for p in records])


@pytest.fixture(autouse=True)
def stand_in_augmentation(monkeypatch):
    """The renderer draws with fake_render / fake_targets (patched before any worker forks)."""
    monkeypatch.setattr(cpu_render, "render_sample", fake_render)
    monkeypatch.setattr(task_labels, "batch_targets", fake_targets)


def make_engine(n=20, workers=0, encoded=False, sampler=None, hsv_on="worker", layout="nhwc", **options) -> CPUEngine:
    store = StoreView(ArrayStore(n, encoded))
    settings = EngineSettings(batch_size=4, workers=workers, hsv_on=hsv_on, layout=layout)
    return CPUEngine(store, sampler or FakeSampler(n), settings, CPUOptions(**options))


def collect(eng: CPUEngine, epoch: int, idx: np.ndarray):
    return [(b.imgs.clone(), b.targets.clone(), b.paths, b.shapes) for b in eng.iter_batches(epoch, idx)]


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2] == y[2] and x[3] == y[3]


def test_batches_identical_for_0_1_2_workers():
    idx = np.random.default_rng(1).permutation(20)
    results = []
    for w in (0, 1, 2):
        with make_engine(workers=w) as eng:
            results.append(collect(eng, 3, idx))
    assert_same(results[0], results[1])
    assert_same(results[0], results[2])
    imgs, targets, paths, _ = results[0][0]
    assert imgs.shape == (4, 3, IMGSZ, IMGSZ) and imgs.dtype == torch.uint8
    assert targets.shape[1] == 6 and len(paths) == 4
    assert [len(b[2]) for b in results[0]] == [4] * 5


def test_last_batch_partial_and_targets_batch_index():
    with make_engine(n=10, workers=1) as eng:
        out = collect(eng, 0, np.arange(10))
    assert [len(b[2]) for b in out] == [4, 4, 2]
    t = out[1][1]
    assert set(t[:, 0].tolist()) <= {0.0, 1.0, 2.0, 3.0}
    # index 4..7 have 1, 2, 0, 1 labels (i % 3)
    assert t.shape[0] == 1 + 2 + 0 + 1


def test_layouts_give_equal_pixels():
    idx = np.arange(12)
    with make_engine(layout="nhwc") as a, make_engine(layout="nchw", workers=1) as b:
        ra, rb = collect(a, 0, idx), collect(b, 0, idx)
    assert_same(ra, rb)
    with make_engine(layout="nchw") as b:
        assert next(iter(b.iter_batches(0, idx))).imgs.is_contiguous()
    with make_engine(layout="nhwc") as a:
        assert next(iter(a.iter_batches(0, idx))).imgs.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_common_loop_gets_views_of_the_slots_and_never_a_copy(workers):
    """The previous batch is still in the loop's variables while the next one is delivered: two lent slots
    at most, each batch a view of its slot, no copies, over several epochs; no slot stays lent after."""
    with make_engine(n=40, workers=workers) as eng:
        for epoch in range(3):
            for b in eng.iter_batches(epoch, np.arange(40)):
                assert 1 <= eng.ring.n_lent <= 2  # this batch's slot (and the previous one's, until now)
        assert eng.ring.n_lent == 1  # `b`, the last batch
        del b
        assert eng.ring.n_lent == 0 and eng.ring.n_free == eng.ring.n_slots == (2 * 2 if workers else 1) + 2
        stats = eng.stats()
    assert stats["batches"] == 30 and stats["batches_copied"] == 0


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_held_beyond_keep_are_copies_with_the_same_pixels(workers):
    idx = np.arange(40)
    with make_engine(n=40, workers=workers) as eng:
        ref = collect(eng, 0, idx)
    with make_engine(n=40, workers=workers, keep=2) as eng:
        held = list(eng.iter_batches(0, idx))  # all 10 batches: the first 2 lent, 8 copies
        assert eng.stats()["batches_copied"] == 8 and eng.ring.n_lent == 2
        collect(eng, 1, idx)  # every slot not lent is rendered into again
        collect(eng, 2, idx)
        assert_same([(b.imgs, b.targets, b.paths, b.shapes) for b in held], ref)
        copied = eng.stats()["batches_copied"]
        assert copied == 8 + 20  # while the caller holds `keep` batches, every new one is a copy
        del held
        collect(eng, 3, idx)
        assert eng.stats()["batches_copied"] == copied  # the slots came back: views again


def test_slots_come_back_when_the_last_tensor_dies_in_any_thread_or_in_gc():
    with make_engine(n=16, workers=2) as eng:
        it = eng.iter_batches(0, np.arange(16))
        first, second = next(it), next(it)
        part = first.imgs[1]  # a slice of the first batch keeps the whole slot
        cycle: list = [second]
        cycle.append(cycle)  # only the garbage collector can free the second batch now
        gc.disable()  # (until the collection below: an automatic one would free it earlier)
        try:
            del first, second, cycle
            assert eng.ring.n_lent == 2
            gc.collect()
        finally:
            gc.enable()
        assert eng.ring.n_lent == 1
        # a thread drops the last tensor (the official trainer plots its first batches in a thread)
        handed, go = [part], threading.Event()
        del part
        plotter = threading.Thread(target=lambda: (go.wait(), handed.clear()))
        plotter.start()
        assert eng.ring.n_lent == 1
        go.set()
        plotter.join()
        assert eng.ring.n_lent == 0
        rest = [b.imgs.clone() for b in it]
        assert len(rest) == 2 and eng.stats()["batches_copied"] == 0
        assert eng.ring.n_free == eng.ring.n_slots


def test_the_slot_ledger_takes_lent_slots_back_from_any_thread():
    """Views lent by the consumer thread die in other threads (some in reference cycles, freed by whichever
    thread the garbage collector runs in): no slot is reused while a view of it lives, none is lost."""
    ledger, buffers = SlotLedger(8), np.zeros((8, 64), np.uint8)
    handed: queue.Queue = queue.Queue()
    reused: list[int] = []

    def drop_views() -> None:
        while (item := handed.get()) is not None:
            view, token = item
            if not (view == token).all():  # the consumer wrote into a slot still lent
                reused.append(token)
            if token % 4 == 0:
                cycle: list = [view]
                cycle.append(cycle)
            elif token % 40 == 1:  # a collection in this thread: finalizers of other threads' cycles run here
                gc.collect()
            del view, item

    # Every object older than this test moves to the permanent generation, out of the collections' way: each
    # gc.collect() below then scans only what the test creates (its views and their cycles, still collected as
    # before), not the whole heap of a test process that has imported torch and more (17 collections took 1.6 s
    # alone, several seconds in a suite run's worker).
    gc.freeze()
    try:
        threads = [threading.Thread(target=drop_views) for _ in range(3)]
        for t in threads:
            t.start()
        for token in range(240):
            spins = 0
            while (slot := ledger.take()) is None:
                spins += 1
                time.sleep(0.001)  # (lets the threads run)
                if spins % 20 == 0:  # views in reference cycles come back only through a collection
                    gc.collect()
            buffers[slot] = token
            handed.put((ledger.lend(slot, buffers[slot][:]), token))  # a fresh view object per delivery
        for t in threads:
            handed.put(None)
        for t in threads:
            t.join()
        gc.collect()
    finally:
        gc.unfreeze()
    assert not reused and ledger.n_lent == 0 and sorted(ledger._free) == list(range(8))
    with pytest.raises(RuntimeError, match="slot 2 released twice"):
        ledger.give_back(2)


def test_abandoned_epoch_then_next_epoch_is_clean():
    idx = np.arange(20)
    with make_engine(workers=2) as eng:
        ref = collect(eng, 1, idx)
        it = eng.iter_batches(0, idx)
        next(it)  # abandon with batches in flight
        again = collect(eng, 1, idx)
        assert_same(ref, again)
        assert eng.ring.n_free == eng.ring.n_slots and eng.ring.n_lent == 0  # the abandoned batch was dropped


def test_close_mosaic_reaches_persistent_workers():
    with make_engine(workers=2) as eng:
        before = collect(eng, 0, np.arange(8))
        assert all(s is None for b in before for s in b[3])
        eng.close_mosaic()
        after = collect(eng, 1, np.arange(8))
        assert all(s is not None for b in after for s in b[3])


def test_worker_death_raises_clear_error_not_hang():
    eng = make_engine(workers=2, sampler=FakeSampler(20, die_on=13))
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=r"worker 1 .*exit.*code 3.*batch 3"):
            collect(eng, 0, np.arange(20))
        assert time.monotonic() - t0 < 20
    finally:
        eng.close()


def test_a_workers_foreign_exception_is_one_line_with_its_traceback_kept_and_loader_recovers():
    eng = make_engine(workers=2, sampler=FakeSampler(20, fail_on=5))
    try:
        with pytest.raises(WorkerError) as info:
            collect(eng, 0, np.arange(20))
        err = info.value
        assert re.fullmatch(r"fastload worker 1 \(pid \d+\) failed on batch 1: ValueError: cannot sample 5", str(err)), err
        assert err.worker_exception == "builtins.ValueError"
        assert "in sample" in err.worker_traceback and err.worker_traceback.rstrip().endswith("ValueError: cannot sample 5")
        assert describe(err) == f"{err} (rerun with --debug or FASTLOAD_DEBUG=1 for the worker's traceback)"
        out = collect(eng, 0, np.arange(4))  # a batch without the bad index still works
        assert len(out) == 1
    finally:
        eng.close()


@pytest.mark.parametrize("module,qualname,message,rebuilt", [
    ("fastload.store.base", "StoreError", "s3://b/k: no such object", StoreError),
    ("fastload.store.objects.client", "MissingObjectError", "s3://b/k: no such object", MissingObjectError),
    # fastload's, but its constructor takes the path and the reason: not said again from the message alone
    ("fastload.data.images", "CorruptImageError", "a.jpg: truncated", None),
    ("builtins", "OSError", "[Errno 5] Input/output error:\n '/data/x'", None),  # not fastload's
    ("fastload.store.base", "check_schema", "not a class", None),
    ("fastload.store.base", "GoneError", "a class this version lacks", None),
    ("fastload.nowhere", "StoreError", "a module this version lacks", None),
])
def test_a_worker_failure_comes_back_as_its_fastload_class_or_a_one_line_worker_error(module, qualname, message, rebuilt):
    failure = WorkerFailure.from_fields([module, qualname, message, f"Traceback ...\n{qualname}: {message}\n"])
    err = failure.exception("fastload worker 0 (pid 7)", "batch 3")
    assert err.worker_traceback == failure.traceback
    assert err.__notes__ == [f"raised by fastload worker 0 (pid 7) on batch 3; its traceback there:\n"
                             f"Traceback ...\n{qualname}: {message}"]
    if rebuilt is not None:
        assert type(err) is rebuilt and str(err) == message
        return
    name = qualname if module == "builtins" else f"{module}.{qualname}"
    assert type(err) is WorkerError and err.worker_exception == f"{module}.{qualname}"
    assert str(err) == f"fastload worker 0 (pid 7) failed on batch 3: {name}: {' '.join(message.split())}"


def test_a_worker_failure_naming_an_undecodable_file_name_can_be_sent():
    missing = FileNotFoundError(2, "No such file or directory", "/data/images/caf\udce9.jpg")  # Latin-1 bytes
    failure = WorkerFailure.of(missing, "Traceback ...\nFileNotFoundError: ... '/data/images/caf\udce9.jpg'\n")
    assert msgpack.unpackb(msgpack.packb(failure.fields())) == failure.fields()
    assert failure.message == "[Errno 2] No such file or directory: '/data/images/caf\\udce9.jpg'"


def test_inline_render_failures_do_not_leak_slots():
    """With workers=0 a failing sample raises in the caller; repeated failures must not use up the ring."""
    eng = make_engine(workers=0, sampler=FakeSampler(20, fail_on=5))
    try:
        for _ in range(2 * eng.ring.n_slots + 1):
            with pytest.raises(ValueError, match="cannot sample 5"):
                collect(eng, 0, np.arange(4, 8))
        assert len(collect(eng, 1, np.r_[0:4, 8:12])) == 2
    finally:
        eng.close()


def test_close_stops_workers():
    eng = make_engine(workers=2)
    collect(eng, 0, np.arange(8))
    pids = eng.stats()["worker_pids"]
    assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    eng.close()
    time.sleep(0.1)
    for p in pids:
        assert not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize("workers", [0, 2])
def test_closed_engine_refuses_to_iterate(workers):
    eng = make_engine(workers=workers)
    eng.close()
    eng.close()  # idempotent
    with pytest.raises(RuntimeError, match="engine was closed"):
        collect(eng, 0, np.arange(4))


@pytest.mark.usefixtures("shm_root")
def test_shared_decode_cache_decodes_each_image_once_across_workers_and_epochs():
    n = 16
    with make_engine(n=n, workers=2, encoded=True) as eng:
        first = collect(eng, 0, np.arange(n))
        collect(eng, 1, np.arange(n))
        second = collect(eng, 0, np.arange(n))
        stats = eng.stats()
        hits, misses = stats["decode_cache_hits"], stats["decode_cache_misses"]
        assert len(eng.cache) == n  # every image cached once, in the shared mapping
        assert misses <= n + 2 * 2  # at most a few duplicate decodes when two workers race
        assert hits > misses
    assert_same(first, second)


@pytest.mark.usefixtures("shm_root")
def test_decode_cache_bound_and_off():
    store = StoreView(ArrayStore(10, encoded=True))
    c = SharedDecodeCache.open(store, IMGSZ, "test", IMGSZ * IMGSZ * 3 * 3 + 5)  # room for 3 images
    try:
        assert c.slots == 3 and c.stats()["decode_cache_images"] == 10
        img = np.ones((IMGSZ, IMGSZ, 3), np.uint8)
        got = c.get(2, lambda i: img)
        assert not got.flags.writeable and c.get(2, lambda i: 1 / 0).sum() == img.sum()  # the second read: a hit
        assert c.get(7, lambda i: img) is img  # beyond the bound: loaded, not cached
        assert len(c) == 1 and (c.hits, c.misses) == (1, 2)
    finally:
        c.close()
    assert not c.segment.exists()  # its only holder left
    with make_engine(n=8, encoded=True, decode_cache_mb=0) as eng:
        assert eng.cache is None


def test_consumer_hsv_returns_gains(monkeypatch):
    calls = []

    def apply_hsv_batch(imgs, gains, rule):
        calls.append(gains.clone())
        assert rule == "yolov9"  # the sampler's recipe decides the colour rule
        return imgs

    monkeypatch.setattr(engine_base, "apply_hsv_batch", apply_hsv_batch)
    with make_engine(workers=1, hsv_on="consumer") as eng, make_engine(workers=0, hsv_on="consumer") as eng0:
        a, b = collect(eng, 0, np.arange(8)), collect(eng0, 0, np.arange(8))
    assert_same(a, b)
    assert len(calls) == 4 and calls[0].shape == (4, 3)
    assert torch.equal(calls[0], calls[2])
    assert not torch.all(calls[0][:, 2] == 1)


def test_collate_targets_empty():
    t = collate_targets([np.zeros((0, 5), np.float32)] * 3)
    assert t.shape == (0, 6)
