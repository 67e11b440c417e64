"""Store backends on a small synthetic set: files/lmdb/encoded/disk agree, pickling, concurrent readers, options."""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from fastload.data.images import decode_image, loaded_shape, resize_long_side
from fastload.data.index import build_index
from fastload.store import IncompleteStoreError, StoreError, open_store
from fastload.store import writing
from fastload.store import space
from fastload.store.convert import convert, output_lock
from fastload.store.packed import PackedStore

QUIET = dict(progress=False, log=lambda s: None)


@pytest.fixture(scope="module")
def stores(synth_yaml, tmp_path_factory):
    out = tmp_path_factory.mktemp("synth_stores")
    result = convert(synth_yaml, "lmdb,encoded,disk", out=out, imgsz=128, workers=2, **QUIET)
    return result


def test_files_lmdb_disk_agree(stores, synth_yaml):
    index = build_index(synth_yaml, "train", progress=False)
    files = open_store(synth_yaml, "train", kind="files")
    lmdb = open_store(stores.yaml_path, "train", kind="lmdb", imgsz=128)
    disk = open_store(stores.yaml_path, "train", kind="disk", imgsz=128)
    encoded = open_store(stores.yaml_path, "train", kind="encoded")
    assert len(files) == len(lmdb) == len(disk) == len(encoded) == len(index) > 0
    for i in range(len(files)):
        assert files.read_image(i) == lmdb.read_image(i) == encoded.read_image(i)
        expect = resize_long_side(decode_image(files.read_image(i)), 128)
        np.testing.assert_array_equal(disk.read_image(i), expect)
        np.testing.assert_array_equal(lmdb.load(i, 128), expect)
        for s in (files, lmdb, disk, encoded):
            np.testing.assert_array_equal(s.labels[i], index.labels[i])
            np.testing.assert_array_equal(s.shapes[i], index.shapes[i])
    assert any(len(lb) == 0 for lb in disk.labels)  # backgrounds survive the round trip
    for s in (files, lmdb, disk, encoded):
        s.close()


def test_negative_and_out_of_range_index(stores):
    with open_store(stores.yaml_path, "val", kind="lmdb") as s:
        assert s.read_image(-1) == s.read_image(len(s) - 1)
        with pytest.raises(IndexError, match="out of range"):
            s.read_image(len(s))


@pytest.mark.parametrize("kind", ["lmdb", "encoded", "disk"])
def test_store_sent_to_a_spawned_process_reopens_its_handles(stores, kind):
    """Spawned workers (DALI's, a spawn-context DataLoader) receive the store serialised: its open handles are
    dropped on the way and reopened lazily in the child, which reads the same samples."""
    with open_store(stores.yaml_path, "train", kind=kind, imgsz=128) as s:
        expected = _read_all((s, [0, 1, 2]))
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            assert pool.apply(_read_all, ((s, [0, 1, 2]),)) == expected


def _digest(sample) -> int:
    return zlib.crc32(np.ascontiguousarray(sample).tobytes() if isinstance(sample, np.ndarray) else sample)


def _read_all(args):
    store, order = args
    return [(i, _digest(store.read_image(i))) for i in order]


def test_two_processes_read_lmdb_and_ram_concurrently(stores, monkeypatch, shm_root):
    lmdb = open_store(stores.yaml_path, "train", kind="lmdb")
    ram = open_store(stores.yaml_path, "train", kind="ram", imgsz=128)  # built on demand from the disk store
    assert ram.kind == "ram" and ram.meta.get("copied_from")
    expect = {(k, i): _digest(s.read_image(i)) for k, s in (("l", lmdb), ("r", ram)) for i in range(len(lmdb))}
    n = len(lmdb)
    orders = [np.random.default_rng(seed).permutation(n).tolist() * 3 for seed in (0, 1)]
    with multiprocessing.get_context("fork").Pool(2) as pool:  # both stores opened in the parent, read in children
        jobs = [pool.apply_async(_read_all, ((s, o),)) for s in (lmdb, ram) for o in orders]
        got = [j.get(timeout=60) for j in jobs]
    for k, res in zip("llrr", got):
        assert all(expect[(k, i)] == d for i, d in res)
    lmdb.close()
    seg = Path(ram.path)
    ram.close()
    assert not seg.exists()  # built on demand, so the last user removed it


def test_incomplete_packed_store_refused(stores, tmp_path):
    src = Path(stores.stores["val"]["disk"])
    broken = tmp_path / "broken.disk"
    broken.mkdir()
    for f in src.iterdir():
        if f.name != "meta.json":
            (broken / f.name).write_bytes(f.read_bytes())
    with pytest.raises(IncompleteStoreError, match="unfinished"):
        PackedStore(broken)


def test_an_encoded_store_without_its_marker_or_with_bytes_missing_is_refused(stores, tmp_path):
    import shutil

    from fastload.store.encoded import EncodedStore

    src = Path(stores.stores["val"]["encoded"])
    unfinished = shutil.copytree(src, tmp_path / "unfinished.encoded")
    (unfinished / "meta.json").unlink()
    with pytest.raises(IncompleteStoreError, match="unfinished.encoded is an unfinished store"):
        open_store(unfinished)
    cut = shutil.copytree(src, tmp_path / "cut.encoded")
    data = (cut / "images.bin").read_bytes()
    (cut / "images.bin").write_bytes(data[:-10])
    with pytest.raises(StoreError, match=f"images.bin holds {len(data) - 10} bytes, the index expects {len(data)}"):
        EncodedStore(cut)


def test_packed_store_records_its_shrink_filter_and_old_schema_is_refused(stores, tmp_path):
    """Decoded stores say how their pixels were made; one written before loaded sizes followed YOLOv9's
    truncation (schema 1) is refused with a rebuild message instead of being read with wrong sizes."""
    import json
    import shutil

    src = Path(stores.stores["val"]["disk"])
    with PackedStore(src) as s:
        assert s.meta["shrink"] == "area" and s.meta["schema"] == 2
    old = tmp_path / "old.disk"
    shutil.copytree(src, old)
    meta = json.loads((old / "meta.json").read_text())
    meta["schema"] = 1
    (old / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match="older fastload.*convert the dataset again"):
        PackedStore(old)


def test_max_side_reencode(synth_yaml, tmp_path):
    out = tmp_path / "small"
    res = convert(synth_yaml, "lmdb,encoded", out=out, splits="val", max_side=64, quality=80, **QUIET)
    index = build_index(synth_yaml, "val", progress=False)
    with open_store(res.yaml_path, "val", kind="lmdb") as s, open_store(res.yaml_path, "val", kind="encoded") as e:
        assert e.meta["options"] == {"max_side": 64, "quality": 80}
        assert [e.read_image(i) for i in range(len(e))] == [s.read_image(i) for i in range(len(s))]
        assert s.meta["options"] == {"max_side": 64, "quality": 80}
        np.testing.assert_array_equal(s.shapes, index.shapes)  # shapes stay the originals
        for i in range(len(s)):
            img = decode_image(s.read_image(i))
            assert max(img.shape[:2]) <= max(64, 0) or max(index.shapes[i]) <= 64
            h0, w0 = index.shapes[i]
            assert s.load(i, 48).shape[:2] == loaded_shape(h0, w0, 48)  # planned shape, exactly
    with pytest.raises(StoreError, match="max_side=64 re-encodes the images of lmdb and encoded stores, and disk "
                                         "stores hold decoded images at imgsz=640; drop max_side"):
        convert(synth_yaml, "disk", out=tmp_path / "decoded", splits="val", max_side=64, **QUIET)
    assert not (tmp_path / "decoded").exists()  # refused before any work


def test_convert_again_merges_yaml_key(synth_yaml, tmp_path):
    out = tmp_path / "merge"
    convert(synth_yaml, "lmdb", out=out, splits="val", **QUIET)
    res = convert(synth_yaml, "disk", out=out, splits="val", imgsz=96, **QUIET)
    from fastload.data.config import load_data_config

    cfg = load_data_config(res.yaml_path)
    assert set(cfg.stores["val"]) == {"lmdb", "disk"}
    assert cfg.splits["val"] == load_data_config(synth_yaml).splits["val"]  # originals still usable by YOLOv9


def test_second_converter_refused(synth_yaml, tmp_path):
    out = tmp_path / "locked"
    with output_lock(out):
        with pytest.raises(StoreError, match="another `fastload convert`"):
            convert(synth_yaml, "lmdb", out=out, **QUIET)


def test_disk_space_checked_first(synth_yaml, tmp_path, monkeypatch):
    monkeypatch.setattr(space, "free_bytes", lambda p: 1000)
    with pytest.raises(StoreError, match=r"needs about .* free"):
        convert(synth_yaml, "disk", out=tmp_path / "full", **QUIET)
    assert not list((tmp_path / "full").glob("*.disk*"))


def test_ram_memory_checked_first(synth_yaml, monkeypatch, tmp_path, shm_root):
    import psutil

    class Tiny:
        available = 1 << 20

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Tiny())
    with pytest.raises(StoreError, match="not enough memory"):
        convert(synth_yaml, "ram", out=tmp_path / "ram", **QUIET)
    assert not any(shm_root.iterdir())  # nothing half-built left in shared memory


def test_unknown_kind_and_split(synth_yaml, tmp_path):
    with pytest.raises(StoreError, match="unknown store kind"):
        convert(synth_yaml, "zip", out=tmp_path, **QUIET)
    with pytest.raises(StoreError, match="split"):
        convert(synth_yaml, "lmdb", out=tmp_path, splits="test", **QUIET)
    with pytest.raises(StoreError, match="no disk store recorded"):
        open_store(synth_yaml, "train", kind="disk")


def _sigterm_is_default(_task: int) -> bool:
    import signal

    return signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_conversion_workers_die_on_sigterm_whatever_the_parent_installed():
    """`fastload bench --convert` turns SIGTERM into SystemExit in its own process; the conversion pool's forked
    workers must not inherit that, or Pool.terminate() at the end of a conversion can hang on the queue's lock."""
    import signal

    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        assert all(writing.parallel_map(_sigterm_is_default, list(range(8)), workers=2))
    finally:
        signal.signal(signal.SIGTERM, previous)


SLOW_WORKER = """
import os, signal, sys, time
import fastload.store.writing as writing

signal.signal(signal.SIGTERM, lambda *_: None)  # as `fastload bench --convert` does
plain = writing._plain_worker_signals

def slow_second_worker():
    try:
        os.close(os.open(sys.argv[1], os.O_CREAT | os.O_EXCL))  # the first worker to start goes on at once
    except FileExistsError:
        time.sleep(0.5)  # still starting when the first worker has done its share (4 of abs(): a few ms)
    plain()

writing._plain_worker_signals = slow_second_worker
print(sum(writing.parallel_map(abs, list(range(8)), workers=2)), flush=True)
"""


def test_a_conversion_pool_whose_worker_is_still_starting_at_the_end_does_not_hang(tmp_path):
    """Under load a worker can still be starting (before its initializer) when the other has finished every
    task it has; the map must still end with every result (multiprocessing.Pool's terminate() waited for such a
    worker forever: a CI run hung there once)."""
    res = subprocess.run([sys.executable, "-c", SLOW_WORKER, str(tmp_path / "first")], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "28", res.stderr


ABANDONED_LARGE_RESULTS = """
import multiprocessing, sys, time
import fastload.store.writing as writing

def large(i):
    time.sleep(0.002 * (i % 5))  # the workers finish at staggered moments, as decoding does
    return bytes(300_000)  # more than a pipe holds (an encoded image over 64 KiB)

for stop_after in list(range(3)) * 20:
    for k, _ in enumerate(writing.parallel_map(large, list(range(12)), workers=2)):
        if k == stop_after:
            break  # abandoned, as a conversion whose writer fails
    assert not multiprocessing.active_children(), multiprocessing.active_children()
print(sum(len(r) for r in writing.parallel_map(large, list(range(12)), workers=2)), flush=True)
"""


def test_conversions_abandoned_while_workers_send_results_larger_than_a_pipe_end_and_leave_no_worker():
    """A conversion stopped by an error while its workers send results larger than a pipe holds: the workers are
    stopped, none is left, and the next conversion runs. (multiprocessing.Pool's terminate() deadlocked there: a
    worker blocked writing into the shared result pipe, which no thread read any more, held the lock terminate()
    waited for; a suite run hung in test_store_unfinished.py, and this script hung in 6 of 6 runs.)"""
    res = subprocess.run([sys.executable, "-c", ABANDONED_LARGE_RESULTS], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                                           os.environ.get("PYTHONPATH", "")])})
    assert res.returncode == 0 and res.stdout.strip() == str(12 * 300_000), res.stderr


def _killed_on_task_3(task: int) -> int:
    if task == 3:
        os.kill(os.getpid(), 9)  # as the kernel's OOM killer would
    return task


def test_a_conversion_worker_killed_midway_is_one_clear_error():
    with pytest.raises(StoreError, match=r"_killed_on_task_3 worker process ended \(exit code -9\)"):
        list(writing.parallel_map(_killed_on_task_3, list(range(8)), workers=2))
    assert not multiprocessing.active_children()


def test_a_cold_lmdb_record_is_read_ahead_not_page_by_page(stores, tmp_path, monkeypatch):
    """A record not in the page cache (a dataset larger than memory) comes in a few reads, not one 4 KiB page fault
    at a time (LMDB opened without read-ahead: ~10x slower cold, benchmarks/store_read.py --cold)."""
    import resource

    from fastload.bench.pagecache import drop
    from fastload.store.lmdb_store import LmdbStore

    import shutil

    # a copy of its own: no environment another test opened on the store is reused
    path = Path(shutil.copytree(stores.stores["train"]["lmdb"], tmp_path / "train.lmdb"))

    def cold_faults() -> tuple[int, int]:
        if not drop([str(path / "data.mdb")]).ok:
            pytest.skip(f"{path} cannot leave the page cache here (tmpfs?)")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        pages = 0
        with LmdbStore(path) as store:
            for i in range(len(store)):  # records until a few hundred pages are read: enough to tell
                pages += -(-len(store.read_image(i)) // 4096)
                if pages >= 400:
                    break
        return resource.getrusage(resource.RUSAGE_SELF).ru_majflt - before, pages

    faults, pages = cold_faults()
    assert pages > 200 and faults < pages / 4, (faults, pages)
    monkeypatch.setattr("fastload.store.lmdb_store.READAHEAD", False)  # the check can tell the two apart
    faults, pages = cold_faults()
    assert faults > pages / 2, (faults, pages)


def _mapped_rss(data_file: Path) -> int:
    """Bytes of ``data_file`` resident in this process's mappings of it: the pages of its mappings (from
    /proc/self/maps) that /proc/self/pagemap says are present, which is what smaps' ``Rss:`` counts."""
    # Not /proc/self/smaps: the kernel walks every mapping's page tables to write it, 10 ms in a pytest worker
    # that has imported torch, and this runs after every record read.
    name = str(data_file.resolve())
    page = os.sysconf("SC_PAGE_SIZE")
    present = 0
    with open("/proc/self/maps") as maps, open("/proc/self/pagemap", "rb") as pagemap:
        for line in maps:
            if line.rstrip("\n").endswith(name):
                start, end = (int(v, 16) for v in line.split(maxsplit=1)[0].split("-"))
                pagemap.seek(start // page * 8)
                entries = np.frombuffer(pagemap.read((end - start) // page * 8), np.uint64)
                present += int(np.count_nonzero(entries >> np.uint64(63)))
    return present * page


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="no /proc/self/pagemap to read a mapping's RSS from")
def test_lmdb_readers_release_the_pages_they_read_from_their_rss(tmp_path, monkeypatch):
    """Reading every record of an LMDB store (a worker over epochs, `fastload verify`) keeps the store's pages in
    the reader's RSS to about the release bound, not the whole store; the bytes read after a release are the same."""
    from fastload.store import lmdb_store
    from fastload.store.verify import verify_store

    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, int(rng.integers(80_000, 160_000)), np.uint8).tobytes() for _ in range(120)]
    writer = lmdb_store.LmdbWriter(tmp_path / "train.lmdb", job={"test": "release"}, map_size=64 << 20)
    no_boxes = np.zeros((0, 5), np.float32)
    writer.add_many([(i, im, no_boxes, (64, 64), f"{i}.jpg", None) for i, im in enumerate(images)])
    path, _ = writer.commit(len(images), {"kind": "lmdb", "names": []})
    data_file = path / "data.mdb"
    store_bytes = sum(len(im) for im in images)  # about 14 MiB

    def read_all_peak_rss() -> int:
        peak = 0
        with lmdb_store.LmdbStore(path) as store:
            for i, expected in enumerate(images):
                assert store.read_image(i) == expected  # also after the releases before it
                peak = max(peak, _mapped_rss(data_file))
        return peak

    bound = 1 << 20
    # What stays mapped past the bound: the record that crossed it, and the page cache's folios (up to 2 MiB each
    # with large folios) that a fault maps whole, at either end of the span read since the last release.
    limit = bound + (5 << 20)
    monkeypatch.setattr(lmdb_store, "RELEASE_EVERY", bound)
    assert read_all_peak_rss() < limit

    # verify reads through the same path (record_ok), a second pass: its RSS stays as small while it checks every
    # record
    verify_peak = 0
    record_ok = lmdb_store.LmdbStore.record_ok

    def record_ok_and_rss(store: lmdb_store.LmdbStore, i: int) -> bool:
        nonlocal verify_peak
        ok = record_ok(store, i)
        verify_peak = max(verify_peak, _mapped_rss(data_file))
        return ok

    monkeypatch.setattr(lmdb_store.LmdbStore, "record_ok", record_ok_and_rss)
    result = verify_store(path)
    assert result.ok and result.n == len(images) and verify_peak < limit

    monkeypatch.setattr(lmdb_store, "RELEASE_EVERY", 1 << 40)  # never released: the check can tell the two apart
    assert read_all_peak_rss() > 0.9 * store_bytes


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="no /proc/self/maps to find the writer's map in")
def test_the_lmdb_writer_releases_its_map_pages_and_keeps_every_record(tmp_path, monkeypatch):
    """A conversion's writer looks at B-tree pages through its read-only map, and the kernel maps the images written
    next to them too: the writer drops its map's pages every RELEASE_EVERY bytes written or read (at 1M small images
    its RSS reached 4.3 GB without), over the whole map, and every record reads back as written."""
    from fastload.store import lmdb_store

    rng = np.random.default_rng(1)
    images = [rng.integers(0, 256, int(rng.integers(20_000, 60_000)), np.uint8).tobytes() for _ in range(48)]
    no_boxes = np.zeros((0, 5), np.float32)
    released: list[tuple[int, int]] = []
    real_madvise = lmdb_store._MADVISE

    def madvise(address: int, length: int, advice: int) -> int:
        released.append((address, length))
        return real_madvise(address, length, advice)

    monkeypatch.setattr(lmdb_store, "_MADVISE", madvise)
    monkeypatch.setattr(lmdb_store, "RELEASE_EVERY", 256 << 10)
    writer = lmdb_store.LmdbWriter(tmp_path / "train.lmdb", job={"test": "writer release"}, map_size=64 << 20)
    for k in range(0, len(images), 8):
        writer.add_many([(i, images[i], no_boxes, (64, 64), f"{i}.jpg", None) for i in range(k, k + 8)])
    written = len(released)
    assert written >= 4 and all(length >= 64 << 20 for _, length in released)  # the whole map each time
    monkeypatch.setattr(lmdb_store, "_RECORD_READ_COST", 64 << 10)  # the commit's read-back counts too
    path, _ = writer.commit(len(images), {"kind": "lmdb", "names": []})
    assert len(released) > written
    with lmdb_store.LmdbStore(path) as store:
        assert [store.read_image(i) for i in range(len(images))] == images
