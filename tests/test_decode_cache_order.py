"""The decoded-image cache publishes an image only through its entry lock (correct on weakly ordered CPUs).

The protocol (fastload/engines/shm_cache.py; reasoning in docs/design.md): a process writes an image
only while it holds the exclusive OFD lock of the image's flag byte and the flag, read under it, is
0; a process trusts an image's pixels only once it has seen the flag under a lock of that byte; it
then remembers the image. Nobody waits: an image whose lock another process holds is decoded by the
reader for itself. x86 cannot show a reordered store, so these tests check the protocol's logic:
the pieces one by one, then many forked and spawned (unrelated) processes filling and reading one
cache while a writer dies holding claims.
"""
from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import pytest

from fastload.data.images import loaded_shape
from fastload.engines import shm_cache
from fastload.engines.shm_cache import SharedDecodeCache
from fastload.store.base import Store

IMGSZ = 40
RECIPE = "order-test"
GARBAGE = 0xEE  # what a claimer that dies mid-image leaves in its pixels


class PatternStore(Store):
    """``n`` images of varied shapes whose loaded pixels follow from their index (no decoder involved)."""

    kind = "test-pattern"

    def __init__(self, n: int) -> None:
        super().__init__()
        rng = np.random.default_rng(7)
        self.shapes = np.stack([rng.integers(12, 90, n), rng.integers(12, 90, n)], 1).astype(np.int64)
        self.im_files = [f"/pattern/{i:04d}.png" for i in range(n)]
        self.labels = [np.zeros((0, 5), np.float32)] * n

    def read_image(self, i: int) -> bytes:
        raise AssertionError("the cache tests load through expected()")


def expected(store: PatternStore, i: int) -> np.ndarray:
    """Image ``i``'s loaded pixels: unique per image and position, never the garbage byte everywhere."""
    h, w = loaded_shape(*(int(v) for v in store.shapes[i]), IMGSZ)
    return ((np.arange(h * w * 3, dtype=np.int64) * 3 + i * 7919) % 251).astype(np.uint8).reshape(h, w, 3)


def open_cache(store: PatternStore) -> SharedDecodeCache:
    cache = SharedDecodeCache.open(store, IMGSZ, RECIPE, 1 << 30)
    assert cache is not None and cache.slots == len(store)
    return cache


def _claim_in_child(n: int, entries: list[int], flag: bool, claimed, hold) -> None:
    """Another process's writer: claim ``entries``, scribble garbage into their pixels, set their flags when
    ``flag``, report, then hold the claims until the parent's end of the ``hold`` pipe sends or closes (or
    until it is killed: it then waits in a pipe read, not on an Event, whose lock a killed waiter corrupts)."""
    cache = open_cache(PatternStore(n))
    fds = []
    for b in entries:
        fd = cache._lock_entry(b, exclusive=True)
        assert fd is not None
        fds.append(fd)
        cache._view(b)[...] = GARBAGE
        if flag:
            cache._flags[b] = 1
    claimed.set()
    try:
        hold.recv()
    except EOFError:
        pass
    os._exit(0)


def _wait_for(event, proc: mp.Process) -> None:
    """Wait for ``event`` from ``proc``; fail at once if it dies first (no minute-long hang on a broken child)."""
    while not event.wait(0.2):
        assert proc.is_alive(), f"{proc.name} exited with {proc.exitcode} before it was ready"


def _start_claimer(n: int, entries: list[int], *, flag: bool) -> tuple[mp.Process, Connection]:
    """The claiming process and the pipe end whose ``close()`` lets it exit."""
    ctx = mp.get_context("spawn")  # an unrelated process: nothing inherited
    claimed = ctx.Event()
    hold, release = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_claim_in_child, args=(n, entries, flag, claimed, hold))
    proc.start()
    hold.close()
    _wait_for(claimed, proc)
    return proc, release


@pytest.mark.usefixtures("shm_root")
def test_entry_locks_cover_one_byte_and_two_descriptors_of_one_process_exclude_each_other():
    """The packed ``struct flock`` locks exactly the image's byte; locks belong to the open file description,
    so a second cache object of the same process (or another thread) is excluded too."""
    store = PatternStore(8)
    a, b = open_cache(store), open_cache(store)
    try:
        fd = a._lock_entry(5, exclusive=True)
        assert fd is not None
        assert b._lock_entry(5, exclusive=False) is None and b._lock_entry(5, exclusive=True) is None
        for neighbour in (4, 6):
            other = b._lock_entry(neighbour, exclusive=True)
            assert other is not None
            os.close(other)
        img = expected(store, 5)
        assert b.get(5, lambda i: img) is img  # held by `a`: loaded, not cached, no wait
        assert not b._flags[5] and not b._known[5]
        os.close(fd)  # releases it
        got = b.get(5, lambda i: expected(store, i))
        assert np.array_equal(got, img) and b._flags[5] and b._known[5]
        readers = [a._lock_entry(5, exclusive=False), b._lock_entry(5, exclusive=False)]  # shared locks share
        assert None not in readers
        assert a._lock_entry(5, exclusive=True) is None
        for r in readers:
            os.close(r)
    finally:
        a.close()
        b.close()


@pytest.mark.usefixtures("shm_root")
def test_claimed_unpublished_entry_is_never_trusted_and_a_dead_claimer_frees_it():
    """A writer of another process holds an image it has not published (garbage in its pixels): readers
    decode their own copy meanwhile; once the writer dies (its locks go with it), the next reader writes
    the image and publishes it."""
    n = 6
    store = PatternStore(n)
    cache = open_cache(store)
    proc, release = _start_claimer(n, [1, 3], flag=False)
    try:
        loads = []

        def load(i: int) -> np.ndarray:
            loads.append(i)
            return expected(store, i)

        got = cache.get(1, load)
        assert np.array_equal(got, expected(store, 1)) and got.flags.writeable  # its own copy, not the segment
        assert (cache._view(1) == GARBAGE).all() and not cache._flags[1] and not cache._known[1]
        assert np.array_equal(cache.get(2, load), expected(store, 2)) and cache._known[2]  # others unaffected
        proc.kill()  # dies holding its claims: the kernel drops them
        proc.join(30)
        got = cache.get(3, load)
        assert np.array_equal(got, expected(store, 3)) and not got.flags.writeable and cache._flags[3]
        assert loads == [1, 2, 3] and (cache.hits, cache.misses) == (0, 3)
        assert np.array_equal(cache.get(3, lambda i: 1 / 0), expected(store, 3)) and cache.hits == 1
    finally:
        release.close()
        proc.join(30)
        cache.close()


@pytest.mark.usefixtures("shm_root")
def test_flag_seen_without_the_lock_is_not_enough():
    """A flag that is set while another process still holds the image's exclusive lock (a writer between its
    flag store and its unlock, whose pixel stores this CPU might not see yet) is not trusted: the reader
    decodes its own copy, and trusts the entry once it can take the shared lock."""
    n = 4
    store = PatternStore(n)
    cache = open_cache(store)
    proc, release = _start_claimer(n, [2], flag=True)
    try:
        img = expected(store, 2)
        assert cache._flags[2]
        assert cache.get(2, lambda i: img) is img and not cache._known[2] and cache.misses == 1
        release.close()
        proc.join(30)
        got = cache.get(2, lambda i: 1 / 0)  # confirmed under the lock: the (garbage) pixels it published
        assert cache._known[2] and (got == GARBAGE).all() and cache.hits == 1
        cache._flags[2] = 0  # the flag only ever goes 0 -> 1; a process that saw it published keeps trusting it
        assert (cache.get(2, lambda i: 1 / 0) == GARBAGE).all()
    finally:
        release.close()
        proc.join(30)
        cache.close()


@pytest.mark.usefixtures("shm_root")
def test_published_entry_is_never_rewritten_and_failed_loads_leave_it_unpublished():
    store = PatternStore(4)
    a, b = open_cache(store), open_cache(store)
    try:
        with pytest.raises(ZeroDivisionError):
            a.get(0, lambda i: 1 / 0)  # a failing load releases the claim, publishes nothing
        assert not a._flags[0] and not a._known[0]
        first = a.get(0, lambda i: expected(store, i))
        # b has never seen it: it confirms it under the lock instead of writing it again
        assert np.array_equal(b.get(0, lambda i: np.zeros_like(expected(store, i))), first)
        assert b._known[0] and (b.hits, b.misses) == (1, 0)
        with pytest.raises(ValueError, match="differs from the planned"):
            b.get(1, lambda i: np.zeros((3, 3, 3), np.uint8))
        assert not b._flags[1]
    finally:
        a.close()
        b.close()


@pytest.mark.usefixtures("shm_root")
def test_pixels_are_reserved_by_a_thread_and_only_reserved_bytes_are_written(monkeypatch):
    """The segment is made with its first RESERVE_NOW bytes of pixels reserved, the rest by a thread of its maker;
    an image beyond what is reserved is decoded and not kept (no write into pages a full /dev/shm would refuse
    with a SIGBUS); a filesystem that fills meanwhile stops the reservation with a warning, the cache keeps working."""
    import threading

    store = PatternStore(12)
    part = 3 * IMGSZ * IMGSZ * 3  # room for two images at least
    monkeypatch.setattr(shm_cache, "RESERVE_NOW", part)
    gate, real = threading.Event(), os.posix_fallocate

    def slow(fd: int, offset: int, length: int) -> None:
        if threading.current_thread().name == "fastload-reserve":
            assert gate.wait(10)
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", slow)
    a = open_cache(store)
    try:
        st = a.stats()
        assert st["decode_cache_reserved"] == part < st["decode_cache_bytes"]
        last = len(store) - 1
        assert np.array_equal(a.get(last, lambda i: expected(store, i)), expected(store, last))
        assert not a._flags[last] and len(a) == 0  # beyond the reserved bytes: decoded, not kept
        gate.set()
        a._reserving[0].join(10)
        assert a.stats()["decode_cache_reserved"] == st["decode_cache_bytes"]
        a.get(last, lambda i: expected(store, i))
        assert a._flags[last] and len(a) == 1
    finally:
        a.close()

    def full(fd: int, offset: int, length: int) -> None:
        if threading.current_thread().name == "fastload-reserve":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.warns(UserWarning, match=r"cannot reserve the rest of the decoded-image cache .*No space left"):
        b = open_cache(store)
        b._reserving[0].join(10)
    try:
        assert b.stats()["decode_cache_reserved"] == part
        for i in range(len(store)):
            b.get(i, lambda k: expected(store, k))
        assert 0 < len(b) < len(store) and not b._flags[len(store) - 1]  # what fits the reserved part is kept
    finally:
        b.close()


def test_no_cache_without_entry_locks(monkeypatch, shm_root):
    monkeypatch.setattr(shm_cache, "ENTRY_LOCKS", False)
    with pytest.warns(UserWarning, match="open-file-description locks"):
        assert SharedDecodeCache.open(PatternStore(3), IMGSZ, RECIPE, 1 << 30) is None
    assert not any(shm_root.iterdir())


# ------------------------------------------------------------------------------------------------ stress
N_STRESS = 96
ROUNDS = 4
DOOMED = [5, 17, 40, 41, 77]  # claimed and scribbled on by a writer that then dies


def _participant(name: str, out_dir: str, gate, doomed_gone, seed: int, cache: SharedDecodeCache | None = None) -> None:
    """Fill and read every image ``ROUNDS`` times in a random order; every read must be the image's own
    pixels (a hit, a fresh write or a private copy). The last round starts once the doomed writer is dead, so
    that its images are claimed again in it, however the rounds before met its locks. Writes ``<name>.json``."""
    store = PatternStore(N_STRESS)
    own = cache is None
    if own:
        cache = open_cache(store)
    assert gate.wait(60), "the stress test did not start"
    hits, misses = cache.hits, cache.misses  # a forked child starts with its parent's counts
    rng = np.random.default_rng(seed)
    wrong = []
    for round_ in range(ROUNDS):
        if round_ == ROUNDS - 1:
            assert doomed_gone.wait(60), "the doomed writer did not die"
        for i in rng.permutation(N_STRESS):
            if not np.array_equal(cache.get(int(i), lambda k: expected(store, k)), expected(store, int(i))):
                wrong.append(int(i))
    (Path(out_dir) / f"{name}.json").write_text(json.dumps({"hits": cache.hits - hits, "misses": cache.misses - misses,
                                                            "wrong": wrong}))
    if own:
        cache.close()


def _doomed_writer(ready, gate) -> None:
    """Claims the doomed images, leaves garbage in them, and dies (SIGKILL-like) once the others run."""
    cache = open_cache(PatternStore(N_STRESS))
    for b in DOOMED:
        assert cache._lock_entry(b, exclusive=True) is not None
        cache._view(b)[...] = GARBAGE
    ready.set()
    gate.wait(60)
    os._exit(3)


@pytest.mark.timeout(120)
def test_stress_forked_and_unrelated_processes_fill_and_read_one_cache(shm_root, tmp_path):
    store = PatternStore(N_STRESS)
    cache = open_cache(store)
    for i in range(0, N_STRESS, 9):  # some published before the forks: the children inherit what we know
        cache.get(i, lambda k: expected(store, k))
    spawn, fork = mp.get_context("spawn"), mp.get_context("fork")
    gate, doomed_ready, doomed_gone = spawn.Event(), spawn.Event(), spawn.Event()
    procs = [spawn.Process(target=_doomed_writer, args=(doomed_ready, gate))]
    procs += [spawn.Process(target=_participant, args=(f"spawned{k}", str(tmp_path), gate, doomed_gone, k))
              for k in range(3)]
    procs += [fork.Process(target=_participant, args=(f"forked{k}", str(tmp_path), gate, doomed_gone, 10 + k, cache))
              for k in range(2)]
    try:
        for p in procs:
            p.start()
        _wait_for(doomed_ready, procs[0])
        gate.set()
        # On a loaded machine the others can finish rounds before the doomed writer is scheduled to exit; its
        # images are then decoded privately (their lock held), which is right, but nobody publishes them unless a
        # round runs after its death (the final check below read image 5 unpublished in one loaded suite run)
        procs[0].join(60)
        doomed_gone.set()
        for p in procs:
            p.join(90)
        assert [p.exitcode for p in procs] == [3] + [0] * 5
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    results = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert len(results) == 5
    assert all(r["wrong"] == [] for r in results.values()), results
    assert all(r["hits"] + r["misses"] == ROUNDS * N_STRESS and r["hits"] > 0 for r in results.values())
    # every image ends up published with its own pixels, the doomed ones rewritten after their claimer died
    assert [i for i in range(N_STRESS) if not np.array_equal(cache.get(i, lambda k: 1 / 0), expected(store, i))] == []
    assert len(cache) == N_STRESS
    cache.close()
    assert not any(shm_root.glob(shm_cache.PREFIX + "*"))  # the spawned users and we released it
