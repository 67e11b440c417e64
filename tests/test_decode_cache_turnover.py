"""The decoded cache that turns over in epoch order (``decode_cache_keep="latest"``) and its plan.

Once full, an image decoded takes the ring's next slot, that of the image decoded longest ago; a slot a process is
reading (its shared lock held) is never written; a writer that dies mid-slot leaves it empty; forked workers share
the ring. The loader plans it for ``partners="recent"`` on a dataset larger than the cache, and its batches are
those of the cache that keeps its first images, pixel for pixel.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fastload.data.synthetic import make_synthetic_dataset
from fastload.engines.shm_cache import _HEADERS_AT, TurnoverDecodeCache
from fastload.fastloader import loader
from test_decode_cache_order import IMGSZ, RECIPE, PatternStore, expected

SLOTS = 6


def open_ring(store: PatternStore, slots: int = SLOTS) -> TurnoverDecodeCache:
    slot_bytes = IMGSZ * IMGSZ * 3  # at least the largest loaded image
    cache = TurnoverDecodeCache.open(store, IMGSZ, RECIPE, slots * slot_bytes)
    assert cache is not None and cache.slots == slots
    return cache


def read(cache: TurnoverDecodeCache, store: PatternStore, i: int) -> np.ndarray:
    img = cache.get(i, lambda k: expected(store, k))
    assert np.array_equal(img, expected(store, i))
    return img


@pytest.mark.usefixtures("shm_root")
def test_ring_keeps_the_latest_images_and_holds_the_slots_it_lends():
    store = PatternStore(20)
    a, b = open_ring(store), open_ring(store)  # two users of one segment
    try:
        for i in range(14):
            read(a, store, i)
        assert (a.hits, a.misses) == (0, 14) and len(a) == SLOTS
        assert sorted(b._headers - 1) == list(range(14 - SLOTS, 14))  # the latest decoded
        lent = [b.get(i, lambda k: 1 / 0) for i in range(14 - SLOTS, 14)]  # b reads them without decoding
        assert (b.hits, b.misses) == (SLOTS, 0) and not lent[0].flags.writeable
        read(a, store, 0)  # every slot is lent to b: image 0 is decoded but takes none
        assert sorted(b._headers - 1) == list(range(14 - SLOTS, 14))
        assert all(np.array_equal(v, expected(store, i)) for v, i in zip(lent, range(14 - SLOTS, 14)))
        b.release()
        read(a, store, 0)  # it takes the ring's next slot, image 9's (image 8's turn passed while all were lent)
        assert 0 in b._headers - 1 and len(a) == SLOTS
        assert a.stats()["decode_cache_policy"].startswith("the latest decoded images")
        b.MAX_HELD = 1  # beyond it, hits are private copies and hold nothing
        held = b.get(13, lambda k: 1 / 0)
        copy = b.get(12, lambda k: 1 / 0)
        assert held.base is not None and copy.flags.writeable and len(b._held) == 1
        b.release()
    finally:
        a.close()
        b.close()


@pytest.mark.usefixtures("shm_root")
def test_slot_being_read_is_never_overwritten_and_a_dead_writer_leaves_it_empty():
    store = PatternStore(20)
    cache = open_ring(store)
    try:
        for i in range(SLOTS):
            read(cache, store, i)
        # another reader holds slot 0 (image 0): the image that would take it stays uncached, image 0 stays whole
        fd = cache._lock_entry(_HEADERS_AT, exclusive=False)
        try:
            read(cache, store, SLOTS)
            assert cache._headers[0] == 1 and np.array_equal(cache._slot_view(0, 0), expected(store, 0))
            assert cache._table[SLOTS] == 0
        finally:
            os.close(fd)
        # a writer that died in slot 1 after clearing its header: its garbage is never read as an image
        fd = cache._lock_entry(_HEADERS_AT + 4, exclusive=True)
        cache._headers[1] = 0
        cache._slot_view(1, 1)[...] = 0xEE
        os.close(fd)
        hits = cache.hits
        read(cache, store, 1)
        assert cache.hits == hits  # decoded again, not trusted
    finally:
        cache.close()


def _forked_reader(cache: TurnoverDecodeCache, store: PatternStore, order: list[int], out: str) -> None:
    hits, wrong = cache.hits, []
    for i in order:
        if not np.array_equal(cache.get(i, lambda k: expected(store, k)), expected(store, i)):
            wrong.append(i)
        cache.release()  # as the renderer does once a sample is drawn
    Path(out).write_text(json.dumps({"hits": cache.hits - hits, "wrong": wrong}))
    os._exit(0)


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("shm_root")
def test_forked_workers_share_the_ring(tmp_path):
    """Three forked processes read the same epoch orders at once (as a loader's workers read overlapping windows):
    every read is the image's own pixels, and the images one decodes, the others find."""
    store = PatternStore(40)
    cache = open_ring(store, slots=16)
    rng = np.random.default_rng(0)
    order = [int(i) for _ in range(3) for i in rng.permutation(40)]
    procs = [mp.get_context("fork").Process(target=_forked_reader, args=(cache, store, order, str(tmp_path / f"{k}")))
             for k in range(3)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(50)
        assert [p.exitcode for p in procs] == [0, 0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        results = [json.loads(p.read_text()) for p in sorted(tmp_path.iterdir())]
        cache.close()
    assert all(r["wrong"] == [] for r in results)
    assert sum(r["hits"] for r in results) > 0


@pytest.fixture(scope="module")
def tiny_yaml(tmp_path_factory) -> Path:
    """160 small images: their loaded pixels at 64 exceed a 1 MB cache, whose ring of 64-px slots holds the
    images ``partners="recent"`` reach with batch 4."""
    return make_synthetic_dataset(tmp_path_factory.mktemp("tiny"), n_train=160, n_val=1, nc=3, seed=1,
                                  min_size=40, max_size=80, max_objects=3)


def _epochs(fl, epochs: int = 2) -> list[tuple]:
    out = []
    for epoch in range(epochs):
        fl.set_epoch(epoch)
        out += [(imgs.clone(), targets.clone(), paths) for imgs, targets, paths, _ in fl]
    return out


def test_recent_partners_beyond_the_cache_plan_the_turnover_with_the_same_batches(tiny_yaml, shm_root):
    kw = dict(imgsz=64, batch_size=4, workers=2, seed=3, store="files", recipe="ultralytics", partners="recent")
    runs, stats = {}, {}
    for name, options in (("planned", {"decode_cache_mb": 1}),
                          ("first", {"decode_cache_mb": 1, "decode_cache_keep": "first"})):
        with loader(tiny_yaml, **kw, engine_options=options) as fl:
            runs[name], stats[name], text = _epochs(fl), fl.stats(), repr(fl)
        if name == "planned":
            assert "decode cache keeps the latest images (partners=recent, the decoded set, " in text
            assert "exceeds the decode cache, 1.0 MB, whose " in text
    assert {k: (s["decode_cache_keep"], s["decode_cache_keep_by"]) for k, s in stats.items()} == {
        "planned": ("latest", "planned"), "first": ("first", "caller")}
    assert stats["planned"]["decodes"] < stats["first"]["decodes"]  # the partners are the ring's latest images
    assert len(runs["first"]) == len(runs["planned"]) == 80
    for x, y in zip(runs["planned"], runs["first"]):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2] == y[2]


def test_the_cache_turns_over_only_where_it_serves_recent_partners(tiny_yaml, shm_root):
    kw = dict(imgsz=64, batch_size=4, workers=0, store="files")
    small = {"decode_cache_mb": 1}
    cases = {  # (partners, recipe, engine options) -> what the cache keeps, and why in its words
        ("recent", "ultralytics", "small"): ("latest", "partners=recent"),
        ("recent", "ultralytics", "fits"): ("first", "fits the decode cache"),
        ("batch", "yolov9", "small"): ("first", "partners=batch do not draw from the recent images"),
        ("dataset", "yolov9", "small"): ("first", "partners=dataset do not draw from the recent images"),
    }
    for (partners, recipe, cache), (keep, why) in cases.items():
        with loader(tiny_yaml, **kw, partners=partners, recipe=recipe,
                    engine_options=small if cache == "small" else {}) as fl:
            assert (fl.cache_plan.keep, fl.cache_plan.by) == (keep, "planned") and why in fl.cache_plan.why
            assert ("decode cache keeps the latest" in repr(fl)) == (keep == "latest")
            assert fl.engine.cache.KEEP == keep
    # a ring too small for the images partners reach (batch 16: a window of 127 images) keeps the first images
    with loader(tiny_yaml, **{**kw, "batch_size": 16}, partners="recent", recipe="ultralytics",
                engine_options=small) as fl:
        assert fl.cache_plan.keep == "first" and "slots would not hold the" in fl.cache_plan.why
    with loader(tiny_yaml, **kw, partners="recent", recipe="ultralytics",
                engine_options={"decode_cache_mb": 0}) as fl:
        assert fl.cache_plan.keep is None and fl.engine.cache is None
    with pytest.raises(ValueError, match="decode_cache_keep must be None or one of first, latest, got 'lru'"):
        loader(tiny_yaml, **kw, engine_options={"decode_cache_keep": "lru"})
