"""fastload.data.index: the planted-fault dataset, the scan cache, and coco128."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest

from fastload.data.index import build_index
from fastload.data.labels import parse_labels
from fastload.data.synthetic import make_synthetic_dataset


@pytest.fixture(autouse=True)
def _private_cache_dir(tmp_path, monkeypatch):
    """Keep fallback caches out of ~/.cache during tests."""
    monkeypatch.setenv("FASTLOAD_CACHE_DIR", str(tmp_path / "user-cache"))


@pytest.fixture
def faulty(tmp_path) -> tuple[Path, dict[str, np.ndarray]]:
    """A synthetic set with one planted fault per kind; returns (yaml, expected labels of the planted-label files)."""
    y = make_synthetic_dataset(tmp_path / "ds", n_train=12, n_val=0, seed=3)
    im, lb = y.parent / "images" / "train", y.parent / "labels" / "train"
    jpg = (im / "train_00000.jpg").read_bytes()
    (im / "train_00000.jpg").write_bytes(jpg[: len(jpg) // 2])  # truncated JPEG
    (im / "train_00002.jpg").write_bytes(b"")  # zero-byte file
    (im / "train_00001.png").rename(im / "train_00001.jpg")  # PNG named .jpg (decodable: kept)
    expected = {}
    for k, row in ((4, "99 0.5 0.5 0.1 0.1"), (5, "0 1.7 0.5 0.1 0.1"), (6, "0 0.5 0.5 0.1"), (7, "cat 0.5 0.5 0.1 0.1")):
        p = lb / f"train_{k:05d}.txt"
        expected[p.name] = parse_labels(p.read_text(), 3).labels
        p.write_text(p.read_text() + row + "\n")
    return y, expected


def test_planted_faults_are_each_named_once_and_counted(faulty):
    y, expected = faulty
    idx = build_index(y, "train", cache=False, progress=False)
    rep = idx.report
    assert rep.images == 12 and rep.corrupt == 2 and len(idx) == 10
    assert rep.rows_dropped == 4 and rep.labels_without_image == 0
    kinds = {(Path(p.path).name, p.kind) for p in rep.problems}
    assert len(rep.problems) == len(kinds) == 7  # each fault once
    assert kinds == {
        ("train_00000.jpg", "corrupt_image"),
        ("train_00002.jpg", "corrupt_image"),
        ("train_00001.jpg", "format_mismatch"),
        ("train_00004.txt", "bad_class"),
        ("train_00005.txt", "out_of_range"),
        ("train_00006.txt", "bad_columns"),
        ("train_00007.txt", "non_numeric"),
    }
    assert "truncated" in next(p.message for p in rep.problems if p.path.endswith("train_00000.jpg"))
    names = [Path(f).name for f in idx.im_files]
    assert "train_00000.jpg" not in names and "train_00002.jpg" not in names and "train_00001.jpg" in names
    for label_file, labels in zip(idx.label_files, idx.labels):
        if Path(label_file).name in expected:  # good rows of a file with a bad row are intact
            np.testing.assert_array_equal(labels, expected[Path(label_file).name])
    assert rep.empty == 1 and rep.found == 9  # train_00009 is the background of the synthetic set
    assert len(rep.format().splitlines()) == 7 and "2 corrupt" in rep.summary()


def test_full_verify_also_decodes(faulty):
    y, _ = faulty
    im = y.parent / "images" / "train" / "train_00003.png"
    data = im.read_bytes()
    # header and IEND intact, compressed pixel data zeroed: only a decode sees it
    im.write_bytes(data[:40] + bytes(len(data) - 52) + data[-12:])
    header = build_index(y, "train", cache=False, progress=False)
    full = build_index(y, "train", cache=False, progress=False, verify="full")
    assert full.report.corrupt == header.report.corrupt + 1


def test_truncated_png_and_tiny_images_are_corrupt(tmp_path):
    import cv2

    y = make_synthetic_dataset(tmp_path / "ds", n_train=3, n_val=0, seed=4)
    im = y.parent / "images" / "train"
    png = (im / "train_00001.png").read_bytes()
    (im / "train_00001.png").write_bytes(png[: len(png) * 2 // 3])
    cv2.imwrite(str(im / "tiny.png"), np.zeros((5, 40, 3), np.uint8))
    idx = build_index(y, "train", cache=False, progress=False)
    bad = {Path(p.path).name: p.message for p in idx.report.problems if p.kind == "corrupt_image"}
    assert set(bad) == {"train_00001.png", "tiny.png"} and "truncated PNG" in bad["train_00001.png"]
    assert len(idx) == 2


def test_shapes_and_labels_match_the_files(synth_yaml):
    from fastload.data.images import read_image_file

    idx = build_index(synth_yaml, "train", cache=False, progress=False)
    assert len(idx) == 24 and idx.shapes.dtype == np.int32 and idx.shapes.shape == (24, 2)
    for f, lf, lab, hw in zip(idx.im_files, idx.label_files, idx.labels, idx.shapes):
        assert tuple(hw) == read_image_file(f).shape[:2]
        assert lab.dtype == np.float32 and lab.shape[1] == 5
        np.testing.assert_array_equal(lab, parse_labels(Path(lf).read_text(), 3).labels)


def test_cache_hit_then_invalidation_on_label_change(tmp_path):
    y = make_synthetic_dataset(tmp_path / "ds", n_train=6, n_val=0, seed=1)
    first = build_index(y, "train", progress=False)
    assert not first.report.cache_hit
    cache = Path(first.report.cache_path)
    assert cache == y.parent / "labels" / "train.fastload.cache" and cache.is_file()
    with np.load(cache, allow_pickle=False) as z:  # no pickle inside
        assert {"files", "stats", "labels", "label_offsets"} <= set(z.files)  # flat arrays, no per-image object
    second = build_index(y, "train", progress=False)
    assert second.report.cache_hit and second.im_files == first.im_files
    for a, b in zip(first.labels, second.labels):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(first.shapes, second.shapes)

    lf = y.parent / "labels" / "train" / "train_00000.txt"
    lf.write_text("2 0.5 0.5 0.25 0.25\n")
    third = build_index(y, "train", progress=False)
    assert not third.report.cache_hit
    np.testing.assert_allclose(third.labels[0], [[2, 0.5, 0.5, 0.25, 0.25]])
    # a problem found on the first scan survives the cache round trip
    lf.write_text("7 0.5 0.5 0.25 0.25\n")
    build_index(y, "train", progress=False)
    again = build_index(y, "train", progress=False)
    assert again.report.cache_hit and [p.kind for p in again.report.problems] == ["bad_class"]


def test_read_only_dataset_caches_in_the_user_dir(tmp_path):
    y = make_synthetic_dataset(tmp_path / "ds", n_train=4, n_val=0, seed=2)
    labels = y.parent / "labels"
    mode = labels.stat().st_mode
    labels.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        first = build_index(y, "train", progress=False)
        assert Path(first.report.cache_path).parent == tmp_path / "user-cache"
        assert not list(labels.glob("*.fastload.cache"))
        assert build_index(y, "train", progress=False).report.cache_hit
    finally:
        labels.chmod(mode)


def test_list_sources_duplicates_and_missing_files(tmp_path):
    y = make_synthetic_dataset(tmp_path / "ds", n_train=4, n_val=0, seed=2)
    ds = y.parent
    (ds / "train.txt").write_text(
        "./images/train/train_00000.jpg\n./images/train/train_00000.jpg\nimages/train/train_00001.png\n./images/train/gone.jpg\n"
    )
    (ds / "l.yaml").write_text("train: train.txt\nval: images/train\nnc: 3\n")
    idx = build_index(ds / "l.yaml", "train", progress=False)
    kinds = sorted(p.kind for p in idx.report.problems)
    assert kinds == ["duplicate_image", "missing_file"]
    assert len(idx) == 2 and idx.report.duplicate == 1 and idx.report.corrupt == 1
    assert idx.report.cache_path and idx.report.cache_path != str(ds / "labels" / "train.fastload.cache")


def test_coco128(coco128_yaml):
    idx = build_index(coco128_yaml, "train", progress=False)
    rep = idx.report
    assert len(idx) == 128 and rep.corrupt == 0 and rep.images == 128
    assert rep.missing == 2 and rep.found == 126 and rep.labels_without_image == 2
    backgrounds = sorted(Path(f).stem for f, lab in zip(idx.im_files, idx.labels) if len(lab) == 0)
    assert backgrounds == ["000000000250", "000000000508"]
    orphans = sorted(Path(p.path).stem for p in rep.problems if p.kind == "label_without_image")
    assert orphans == ["000000000656", "000000000659"]
    for lf, lab in zip(idx.label_files, idx.labels):
        if os.path.exists(lf):
            raw = np.loadtxt(lf, ndmin=2, dtype=np.float32)
            np.testing.assert_array_equal(lab, np.unique(raw, axis=0)[np.argsort(np.unique(raw, axis=0, return_index=True)[1])])
    assert idx.shapes.shape == (128, 2) and (idx.shapes > 0).all()
    again = build_index(coco128_yaml, "train", progress=False)
    assert again.report.cache_hit



def _same_index(a, b) -> None:
    assert a.im_files == b.im_files and a.label_files == b.label_files
    np.testing.assert_array_equal(a.shapes, b.shapes)
    np.testing.assert_array_equal(a.im_bytes, b.im_bytes)
    assert len(a.labels) == len(b.labels)
    for x, y in zip(a.labels, b.labels):
        np.testing.assert_array_equal(x, y)
    assert [str(p) for p in a.report.problems] == [str(p) for p in b.report.problems]
    assert a.report.summary().split(";")[0] == b.report.summary().split(";")[0]


def test_cached_index_equals_a_fresh_scan_and_notices_every_change(tmp_path):
    y = make_synthetic_dataset(tmp_path / "ds", n_train=8, n_val=0, seed=5)
    im, lb = y.parent / "images" / "train", y.parent / "labels" / "train"
    (lb / "train_00003.txt").write_text("9 0.5 0.5 0.1 0.1\n")  # a problem that must survive the cache
    (lb / "stray.txt").write_text("0 0.5 0.5 0.1 0.1\n")  # a label without image: not cached, listed every time

    def check(hit: bool) -> None:
        cached = build_index(y, "train", progress=False)
        assert cached.report.cache_hit is hit
        _same_index(cached, build_index(y, "train", cache=False, progress=False))

    check(False)
    check(True)
    assert {p.kind for p in build_index(y, "train", progress=False).report.problems} == {"bad_class", "label_without_image"}
    os.link(im / "train_00000.jpg", im / "added.jpg")  # an added image (no label file)
    check(False)
    check(True)
    label = lb / "train_00001.txt"
    text = label.read_text()
    st = label.stat()
    label.write_text(text.replace("0.", "0,", 1) if "0." in text else "0 0.5 0.5 0.2 0.2\n")  # same size, in place
    os.utime(label, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # the mtime moves by 1 ns only
    check(False)
    (lb / "train_00002.txt").unlink()  # a removed label file: the image becomes a background
    check(False)
    (im / "train_00006.jpg").unlink()  # a removed image
    check(False)
    img = im / "train_00005.jpg"
    img.write_bytes(img.read_bytes()[:-200])  # a changed (now truncated) image
    again = build_index(y, "train", progress=False)
    assert not again.report.cache_hit and again.report.corrupt == 1
    check(True)


def test_a_cache_hit_lists_folders_not_paths_and_notices_what_the_listing_shows(tmp_path, monkeypatch):
    """The cheap check (folder listings + one stat per file) vouches for a hit without a full listing; a file added
    that is no image refreshes the cache; a new sub-folder, a new label file and a stray label are all seen."""
    import fastload.data.index as index_mod

    y = make_synthetic_dataset(tmp_path / "ds", n_train=6, n_val=0, seed=8)
    im, lb = y.parent / "images" / "train", y.parent / "labels" / "train"
    (lb / "train_00004.txt").unlink()  # a background image
    build_index(y, "train", progress=False)
    real_list = index_mod.list_images

    def hit_without_listing() -> object:
        def refuse(*a, **k):
            raise AssertionError("a valid cache was listed in full")
        monkeypatch.setattr(index_mod, "list_images", refuse)
        idx = build_index(y, "train", progress=False)
        monkeypatch.setattr(index_mod, "list_images", real_list)
        assert idx.report.cache_hit
        return idx

    hit_without_listing()
    (im / "README.md").write_text("not an image\n")  # the folder's listing changes, its images do not
    assert build_index(y, "train", progress=False).report.cache_hit
    hit_without_listing()  # the refreshed cache has the new listing
    (lb / "stray.txt").write_text("0 0.5 0.5 0.1 0.1\n")  # a label without image: a hit that reports it
    assert build_index(y, "train", progress=False).report.labels_without_image == 1
    assert hit_without_listing().report.labels_without_image == 1
    (lb / "train_00004.txt").write_text("1 0.5 0.5 0.2 0.2\n")  # the background image gets a label file
    idx = build_index(y, "train", progress=False)
    assert not idx.report.cache_hit
    np.testing.assert_allclose(idx.labels[4], [[1, 0.5, 0.5, 0.2, 0.2]])
    (im / "more").mkdir()
    os.link(im / "train_00000.jpg", im / "more" / "extra.jpg")  # a new sub-folder with an image
    idx = build_index(y, "train", progress=False)
    assert not idx.report.cache_hit and str(im / "more" / "extra.jpg") in list(idx.im_files)
    _same_index(hit_without_listing(), build_index(y, "train", cache=False, progress=False))


def test_scan_in_processes_equals_the_scan_in_threads(tmp_path, monkeypatch):
    import fastload.data.index as index_mod

    y = make_synthetic_dataset(tmp_path / "ds", n_train=10, n_val=0, seed=6)
    (y.parent / "images" / "train" / "train_00002.jpg").write_bytes(b"")
    monkeypatch.setattr(index_mod, "_SCAN_CHUNK", 2)  # 5 chunks: a pool of forked processes scans them
    forked = build_index(y, "train", cache=False, progress=False, workers=2)
    threads = build_index(y, "train", cache=False, progress=False, workers=1)
    _same_index(forked, threads)
    assert forked.report.corrupt == 1 and len(forked) == 9


# Run by two processes at once (as the ranks of one node would): each counts the scans it made.
_RANK = """
import json, os, sys, time
import fastload.data.index as ix
scans = []
real = ix._scan
def slow_scan(*a, **k):
    scans.append(1)
    time.sleep(1.0)  # long enough for the other process to be waiting when this one writes the cache
    return real(*a, **k)
ix._scan = slow_scan
print("ready", flush=True)
while not os.path.exists(sys.argv[2]):
    time.sleep(0.01)
idx = ix.build_index(sys.argv[1], "train", progress=False)
print(json.dumps({"scans": len(scans), "hit": idx.report.cache_hit, "n": len(idx),
                  "shared": idx.report.checked_by_another_rank}))
"""


def test_ranks_of_one_node_scan_once(tmp_path):
    """Two ranks of one torchrun launch at once: one scans, the other waits and takes its verdict on the cache."""
    import json
    import subprocess
    import sys

    y = make_synthetic_dataset(tmp_path / "ds", n_train=6, n_val=0, seed=7)
    go = tmp_path / "go"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(y), str(go)], env=dict(env, LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2"),
                              stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    go.write_text("")
    results = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(r["scans"] for r in results) == [0, 1] and sorted(r["hit"] for r in results) == [False, True]
    assert sorted(r["shared"] for r in results) == [False, True]  # the waiting rank took the scanning rank's verdict
    assert {r["n"] for r in results} == {6}


def test_ranks_of_one_launch_share_one_check_of_a_valid_cache(tmp_path, monkeypatch):
    """Under torchrun (LOCAL_WORLD_SIZE > 1) a rank takes the verdict of another rank of its launch on its node (the
    same parent process) for the same cache file, made within the window; another launch, an old verdict, or a
    rewritten cache file mean a check of its own, which notices a changed file."""
    import fastload.data.index as index_mod

    y = make_synthetic_dataset(tmp_path / "ds", n_train=4, n_val=0, seed=9)
    build_index(y, "train", progress=False)  # the cache, made outside any launch: no verdict
    checks = []
    real = index_mod._still_valid
    monkeypatch.setattr(index_mod, "_still_valid", lambda *a: checks.append(1) or real(*a))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")

    def rank() -> tuple[bool, bool, int]:
        checks.clear()
        rep = build_index(y, "train", progress=False).report
        return rep.cache_hit, rep.checked_by_another_rank, len(checks)

    assert rank() == (True, False, 1)  # the first rank checks and records its verdict
    assert rank() == (True, True, 0)  # the second takes it
    label = y.parent / "labels" / "train" / "train_00001.txt"
    label.write_text("1 0.5 0.5 0.2 0.2\n")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted launch checks and sees the change
    assert rank()[:2] == (False, False)
    assert rank() == (True, True, 0)  # the verdict after its scan stands for its other ranks
    # a rank that finds the lock taken (another rank checking) reads the cache while it waits, and uses what it read
    import fcntl
    import threading
    import time

    cache = Path(build_index(y, "train", progress=False).report.cache_path)
    lock = Path(str(cache) + ".lock")
    index_mod._verdicts_path(lock).unlink()
    opened = []
    real_open = index_mod._opened_cache
    monkeypatch.setattr(index_mod, "_opened_cache", lambda *a: opened.append(1) or real_open(*a))
    fd = os.open(lock, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # "the other rank"
    got = []
    waiting = threading.Thread(target=lambda: got.append(rank()))
    waiting.start()
    while not opened:  # it found the lock taken and reads the cache
        time.sleep(0.001)
    index_mod._vouch(lock, index_mod.node_launch(), cache)  # its verdict, then it lets the lock go
    os.close(fd)
    waiting.join(10)
    assert got == [(True, True, 0)] and len(opened) == 1  # the cache was read once, while waiting
    monkeypatch.setattr(index_mod, "_SHARED_CHECK_S", 0.0)  # an old verdict is not taken
    assert rank() == (True, False, 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert index_mod.node_launch() is None and rank() == (True, False, 1)
