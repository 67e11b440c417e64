"""Ram store lifetime: one copy per machine, removed by the last user, after crashes, and rebuilt after a reboot."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fastload.store import StoreError, open_store, shm
from fastload.store.convert import convert

QUIET = dict(progress=False, log=lambda s: None)

HOLDER = """
import sys, time
from fastload.store import open_store
s = open_store(sys.argv[1], 'val', kind='ram', imgsz=96)
print(s.path, flush=True)
sys.stdin.readline()  # hold until told to go
s.read_image(0)
"""


def _start_holder(yaml_path: Path) -> tuple[subprocess.Popen, Path]:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(yaml_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline().strip()
    assert line, "holder process failed to open the ram store"
    return p, Path(line)


def _wait_dead(p: subprocess.Popen) -> None:
    p.wait(timeout=30)


def test_last_user_removes_segment(synth_yaml, monkeypatch, shm_root):
    root = shm_root
    p, seg = _start_holder(synth_yaml)  # builds it on demand (not pinned)
    assert seg.parent == root and shm.is_complete(seg)
    mine = open_store(synth_yaml, "val", kind="ram", imgsz=96)  # a second user: reuses, no rebuild
    assert mine.path == str(seg)
    info = shm.list_segments()[0]
    assert sorted(info.live) == sorted([p.pid, os.getpid()])
    p.stdin.write("\n")
    p.stdin.flush()
    _wait_dead(p)
    assert seg.exists()  # we still hold it
    assert mine.read_image(0).shape[2] == 3
    mine.close()
    assert not seg.exists() and not shm.holders_path(seg).exists()


def test_sigkilled_creator_leaves_stale_segment_that_cleanup_removes(synth_yaml, monkeypatch, shm_root):
    root = shm_root
    p, seg = _start_holder(synth_yaml)
    os.kill(p.pid, signal.SIGKILL)
    _wait_dead(p)
    (info,) = shm.list_segments()
    assert info.stale and info.dead == [p.pid] and not info.live
    removed = shm.cleanup_stale()
    assert [r.path for r in removed] == [seg]
    assert not any(root.iterdir())


def test_next_opener_adopts_segment_of_dead_holder(synth_yaml, monkeypatch, shm_root):
    p, seg = _start_holder(synth_yaml)
    os.kill(p.pid, signal.SIGKILL)
    _wait_dead(p)
    with open_store(synth_yaml, "val", kind="ram", imgsz=96) as s:
        assert s.path == str(seg)
        reg = json.loads(shm.holders_path(seg).read_text())
        assert reg["pids"] == [os.getpid()]  # the dead PID was pruned
    assert not seg.exists()  # and we were the last user


def test_unfinished_build_of_dead_creator_is_rebuilt(synth_yaml, monkeypatch, shm_root):
    root = shm_root
    from fastload.data.config import load_data_config
    from fastload.store.kinds import ram_segment_path

    seg = ram_segment_path(load_data_config(synth_yaml), "val", 96)
    (seg.parent / (seg.name + ".partial")).mkdir()
    (seg.parent / (seg.name + ".partial") / "pixels.bin").write_bytes(b"x" * 100)
    shm.holders_path(seg).write_text(json.dumps({"pids": [2**22 + 7], "pinned": False}))
    assert shm.list_segments()[0].stale
    with open_store(synth_yaml, "val", kind="ram", imgsz=96) as s:
        assert shm.is_complete(seg) and len(s) > 0
    assert not any(root.iterdir())


def test_ram_store_on_demand_has_a_segment_per_loaded_image_rule(synth_yaml, shm_root):
    """A ram store built for Ultralytics' loaded-image rule never serves YOLOv9's (nor the other way round):
    each rule has its own segment, with its own sizes; a decoded store asked for another rule refuses."""
    from fastload.data.images import loaded_shape
    from fastload.store.base import StoreError

    with open_store(synth_yaml, "val", kind="ram", imgsz=96) as v9, \
            open_store(synth_yaml, "val", kind="ram", imgsz=96, load_rule="ultralytics") as ul:
        assert v9.path != ul.path and (v9.load_rule, ul.load_rule) == ("yolov9", "ultralytics")
        assert ul.meta["shrink"] == "linear" and v9.meta["shrink"] == "area"
        for store, rule in ((v9, "yolov9"), (ul, "ultralytics")):
            assert [tuple(store.hw[i]) for i in range(len(store))] == [
                loaded_shape(int(h), int(w), 96, rule) for h, w in store.shapes]
        with pytest.raises(StoreError, match="loaded by the yolov9 rule, and the ultralytics rule was asked for"):
            v9.load(0, rule="ultralytics")
    assert not any(shm_root.iterdir())


def test_pinned_ram_store_survives_and_rebuilds_after_reboot(synth_yaml, tmp_path, monkeypatch, shm_root):
    res = convert(synth_yaml, "disk,ram", out=tmp_path / "o", imgsz=96, splits="val", **QUIET)
    seg = res.stores["val"]["ram"]
    assert shm.is_complete(seg) and shm.list_segments()[0].pinned
    with open_store(res.yaml_path, "val", imgsz=96) as s:
        assert s.kind == "ram"
    assert seg.exists()  # pinned: outlives its users
    shm.remove(seg)  # what a reboot does
    with open_store(res.yaml_path, "val", imgsz=96) as s:  # auto: rebuilt from the disk store
        assert s.kind == "ram" and s.meta["copied_from"].endswith(".disk")
    assert not seg.exists()  # the rebuilt copy is not pinned


def test_missing_ram_store_without_cheap_rebuild_is_a_clear_error(synth_yaml, tmp_path, monkeypatch, shm_root):
    res = convert(synth_yaml, "lmdb,ram", out=tmp_path / "o", imgsz=96, splits="val", **QUIET)
    shm.remove(res.stores["val"]["ram"])
    monkeypatch.setenv("FASTLOAD_RAM_REBUILD_MAX", "0")
    with pytest.raises(StoreError, match="fastload convert .*--to ram"):
        open_store(res.yaml_path, "val", kind="ram", imgsz=96)
    assert not any(shm_root.iterdir())
    with open_store(res.yaml_path, "val", imgsz=96) as s:  # auto falls back to the next store
        assert s.kind == "lmdb"


def test_remove_refuses_live_holders(synth_yaml, monkeypatch, shm_root):
    s = open_store(synth_yaml, "val", kind="ram", imgsz=96)
    with pytest.raises(StoreError, match="in use by PIDs"):
        shm.remove(Path(s.path))
    s.close()


def test_foreign_shm_entries_are_left_alone(shm_root):
    other = shm_root / "fastload-someone-elses-buffer"
    other.write_bytes(b"x" * 10)
    assert shm.list_segments() == [] and shm.cleanup_stale() == []
    from fastload.store.stage import unstage

    with pytest.raises(StoreError, match="not staged by fastload"):
        unstage(other)
    assert other.exists()


def test_listing_survives_segments_built_and_removed_meanwhile(shm_root):
    """Every opener of a decoded cache lists the shm root (stale cleanup) without the segments' locks while other
    processes build (a temporary sibling renamed into place) and remove theirs: the listing must not trip over
    a folder that vanishes under it (engine='ray' failed to start this way when two actors opened one cache)."""
    import threading

    seg = shm_root / "fastload-racing"
    shm.holders_path(seg).write_text(json.dumps({"pids": [os.getpid()]}))
    stop = threading.Event()

    def build_and_remove() -> None:
        while not stop.is_set():
            tmp = seg.with_name(seg.name + ".partial-1")
            (tmp / "sub").mkdir(parents=True)
            for k in range(8):
                (tmp / "sub" / f"f{k}").write_bytes(b"x" * 100)
            os.rename(tmp, seg)
            shutil.rmtree(seg)

    builder = threading.Thread(target=build_and_remove)
    builder.start()
    try:
        for _ in range(3000):
            (info,) = shm.list_segments()
            # a listing may count one build finished and the next begun: at most two builds' bytes
            assert info.path == seg and info.live == [os.getpid()] and 0 <= info.nbytes <= 2 * 800
    finally:
        stop.set()
        builder.join()
