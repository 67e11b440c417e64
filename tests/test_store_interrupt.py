"""Interrupted conversions never leave an openable store; --resume finishes them; damage is named by verify."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastload.data.synthetic import make_synthetic_dataset
from fastload.store import IncompleteStoreError, StoreError, open_store
from fastload.store.convert import convert
from fastload.store.factory import open_path
from fastload.store.verify import verify_store, verify_target
from store_helpers import run_cli

# The conversion, slowed down to 20 ms per record (and committing LMDB every 8 records) so that it
# can be killed half-way: the writers are wrapped here, in the test, not in the library.
CONVERT = """
import sys, time
from fastload.store import convert as c, lmdb_store
from fastload.store.lmdb_store import LmdbWriter
from fastload.store.packed import PackedWriter

def slowed(cls, name, per_call):
    original = getattr(cls, name)
    def wrapper(self, *args, **kwargs):
        time.sleep(0.02 * per_call(args))
        return original(self, *args, **kwargs)
    setattr(cls, name, wrapper)

lmdb_store.COMMIT_EVERY = 8
slowed(LmdbWriter, "add_many", lambda args: len(args[0]))
slowed(PackedWriter, "add", lambda args: 1)
c.convert(sys.argv[1], sys.argv[2], out=sys.argv[3], workers=1, imgsz=64, progress=False)
"""


@pytest.fixture(scope="module")
def many_yaml(tmp_path_factory):
    """A few hundred tiny images, so that a slowed conversion can be killed half-way."""
    return make_synthetic_dataset(tmp_path_factory.mktemp("many"), n_train=240, n_val=1, nc=2, seed=3,
                                  min_size=24, max_size=48, max_objects=2)


def _kill_midway(yaml_path: Path, kind: str, out: Path, partial: Path) -> None:
    p = subprocess.Popen([sys.executable, "-c", CONVERT, str(yaml_path), kind, str(out)])
    try:
        deadline = time.monotonic() + 60
        while not partial.exists() and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.05)
        time.sleep(1.5)  # ~ 60 of 240 records at 20 ms each
        assert p.poll() is None, "conversion finished before it could be killed; raise the delay"
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.wait(timeout=30)


def test_killed_lmdb_conversion_refused_then_resumed(many_yaml, tmp_path, capsys):
    out = tmp_path / "o"
    final, partial = out / "train.lmdb", out / "train.lmdb.partial"
    _kill_midway(many_yaml, "lmdb", out, partial)
    assert partial.exists() and not final.exists() and not (out / "data.yaml").exists()
    with pytest.raises(IncompleteStoreError, match="--resume"):
        open_path(final)
    with pytest.raises(IncompleteStoreError):
        open_path(partial)
    assert not verify_store(final).ok and not verify_store(partial).ok
    assert run_cli(["verify", str(partial), "--no-progress"]) == 1

    logs: list[str] = []
    res = convert(many_yaml, "lmdb", out=out, resume=True, workers=1, progress=False, log=logs.append)
    resumed = [line for line in logs if line.startswith("resuming")]
    assert resumed, logs
    done = int(resumed[0].split(": ")[1].split(" of ")[0])
    assert 0 < done < 240
    assert not partial.exists()
    assert verify_store(final).ok
    with open_store(res.yaml_path, "train", kind="lmdb") as s:
        assert len(s) == 240
        for i in range(len(s)):
            assert s.read_image(i) == Path(s.im_files[i]).read_bytes()


def test_killed_disk_conversion_leaves_nothing_that_opens(many_yaml, tmp_path):
    out = tmp_path / "d"
    final = out / "train-64.disk"
    _kill_midway(many_yaml, "disk", out, out / "train-64.disk.partial")
    assert not final.exists()
    with pytest.raises(StoreError):
        open_path(out / "train-64.disk.partial")
    # a fresh run replaces the leftover and completes
    convert(many_yaml, "disk", out=out, imgsz=64, workers=1, progress=False, log=lambda s: None)
    assert verify_store(final).ok and not (out / "train-64.disk.partial").exists()


def test_resume_refuses_other_options(many_yaml, tmp_path):
    out = tmp_path / "r"
    _kill_midway(many_yaml, "lmdb", out, out / "train.lmdb.partial")
    with pytest.raises(StoreError, match="other sources or options"):
        convert(many_yaml, "lmdb", out=out, resume=True, max_side=16, progress=False, log=lambda s: None)


def test_flipped_byte_in_lmdb_named_by_verify(synth_yaml, tmp_path, capsys):
    res = convert(synth_yaml, "lmdb", out=tmp_path / "f", splits="val", progress=False, log=lambda s: None)
    path = res.stores["val"]["lmdb"]
    with open_store(path) as s:
        victim = 3
        record = s.read_image(victim)
        victim_file = s.im_files[victim]
    data = bytearray((path / "data.mdb").read_bytes())
    probe = record[len(record) // 2 : len(record) // 2 + 64]
    pos = data.find(probe)
    assert pos > 0 and data.find(probe, pos + 1) == -1
    data[pos + 10] ^= 0xFF
    (path / "data.mdb").write_bytes(bytes(data))
    result = verify_store(path)
    assert not result.ok and [b[0] for b in result.bad] == [victim]
    capsys.readouterr()
    assert run_cli(["verify", str(res.yaml_path), "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert f"record {victim} ({victim_file})" in out and "1 of" in out


def test_damaged_disk_pixels_named_by_verify(synth_yaml, tmp_path):
    res = convert(synth_yaml, "disk", out=tmp_path / "p", splits="val", imgsz=64, progress=False, log=lambda s: None)
    path = res.stores["val"]["disk"]
    import numpy as np

    offsets = np.load(path / "offsets.npy")
    with open(path / "pixels.bin", "r+b") as f:
        f.seek(int(offsets[5]) + 7)
        b = f.read(1)
        f.seek(int(offsets[5]) + 7)
        f.write(bytes([b[0] ^ 0x55]))
    (result,) = verify_target(path)
    assert [b[0] for b in result.bad] == [5]
