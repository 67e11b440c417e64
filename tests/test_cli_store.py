"""The store commands end to end: convert (planted faults), info, verify, stage / unstage."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from fastload.data.index import build_index
from fastload.store import open_store
from store_helpers import check_staged_copy_alone, make_faults_dataset, run_cli


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    return make_faults_dataset(tmp_path_factory.mktemp("faults"))


def test_convert_faults_dataset_reports_each_fault_once(faults, tmp_path, capsys):
    yaml_path, planted = faults
    out = tmp_path / "o"
    assert run_cli(["convert", str(yaml_path), "--to", "lmdb,disk", "--out", str(out), "--no-progress", "--workers", "2"]) == 0
    text = capsys.readouterr().out
    for fault, path in planted.items():
        assert text.count(path) == 1, f"{fault} ({path}) should be named exactly once:\n{text}"
    assert "2 corrupt skipped" in text and "4 bad label rows dropped" in text
    index = build_index(yaml_path, "train", progress=False)
    assert len(index) == 6 + 5  # 6 good + png-as-jpg + the four images with bad labels
    for kind in ("lmdb", "disk"):
        with open_store(out / "data.yaml", "train", kind=kind) as s:
            assert s.im_files == index.im_files
            for i in range(len(s)):
                np.testing.assert_array_equal(s.labels[i], index.labels[i])
                if kind == "lmdb":
                    assert s.read_image(i) == Path(s.im_files[i]).read_bytes()
    class99 = index.im_files.index(planted["class99"].replace("labels", "images").replace(".txt", ".jpg"))
    np.testing.assert_allclose(index.labels[class99], [[0, 0.5, 0.5, 0.2, 0.2]])  # its good row is kept


def test_info_json_and_verify_exit_codes(synth_yaml, tmp_path, capsys):
    out = tmp_path / "o"
    assert run_cli(["convert", str(synth_yaml), "--to", "lmdb", "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    assert run_cli(["info", str(out / "data.yaml"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    index = build_index(synth_yaml, "train", progress=False)
    tr = info["splits"]["train"]
    assert tr["images"] == len(index) and tr["instances"] == sum(len(lb) for lb in index.labels)
    assert tr["backgrounds"] == sum(len(lb) == 0 for lb in index.labels)
    assert tr["stores"]["lmdb"].endswith("train.lmdb")
    assert run_cli(["verify", str(out / "train.lmdb"), "--no-progress"]) == 0
    assert run_cli(["verify", str(tmp_path / "nothing"), "--no-progress"]) == 1


def test_convert_with_ultralytics_load_rule_and_info_says_it(synth_yaml, tmp_path, capsys):
    out = tmp_path / "o"
    assert run_cli(["convert", str(synth_yaml), "--to", "disk", "--imgsz", "64", "--load-rule", "ultralytics",
                    "--split", "val", "--out", str(out), "--no-progress"]) == 0
    store = out / "val-64-ultralytics.disk"  # named per rule: beside, never over, a YOLOv9-rule store
    capsys.readouterr()
    assert run_cli(["info", str(store)]) == 0
    assert "(disk store, imgsz 64, ultralytics loaded images)" in capsys.readouterr().out
    assert run_cli(["convert", str(synth_yaml), "--to", "disk", "--load-rule", "v5", "--out", str(out)]) == 2
    assert "--load-rule 'v5': unknown loaded-image rule v5; choose from yolov9, ultralytics" in capsys.readouterr().err


def test_stage_dataset_then_unstage(synth_yaml, tmp_path, capsys):
    target = tmp_path / "ramdisk" / "synth"
    target.parent.mkdir()
    assert run_cli(["stage", str(synth_yaml), "--to", str(target), "--no-progress"]) == 0
    staged_yaml = target / "data.yaml"
    src, dst = build_index(synth_yaml, "train", progress=False), build_index(staged_yaml, "train", progress=False)
    assert [Path(f).relative_to(target) for f in dst.im_files] == [
        Path(f).relative_to(synth_yaml.parent) for f in src.im_files
    ]
    for a, b in zip(src.labels, dst.labels):
        np.testing.assert_array_equal(a, b)
    assert all(Path(f).read_bytes() == Path(g).read_bytes() for f, g in zip(src.im_files, dst.im_files))
    capsys.readouterr()
    other = tmp_path / "mine"
    other.mkdir()
    assert run_cli(["unstage", str(other)]) == 1
    assert "not staged by fastload" in capsys.readouterr().err and other.exists()
    assert run_cli(["unstage", str(target)]) == 0
    assert not target.exists()


def test_stage_refuses_without_space(synth_yaml, tmp_path, monkeypatch, capsys):
    class Tiny:
        f_bavail, f_frsize = 10, 4096

    import fastload.store.space as space

    monkeypatch.setattr(space.os, "statvfs", lambda p: Tiny())
    assert run_cli(["stage", str(synth_yaml), "--to", str(tmp_path / "x"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "not enough space" in err and "needs" in err and "40.0 KB free" in err
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.staging*"))


def test_stage_running_out_of_space_part_way_names_the_file_and_keeps_nothing(synth_yaml, tmp_path, monkeypatch, capsys):
    import errno

    from fastload.store import stage as stage_mod

    real, calls = stage_mod._copy_file, []

    def fill_up(src, dst):
        calls.append(src)
        if len(calls) == 3:  # the device fills up in the middle of the third file
            dst.write_bytes(src.read_bytes()[:10])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(stage_mod, "_copy_file", fill_up)
    assert run_cli(["stage", str(synth_yaml), "--to", str(tmp_path / "x"), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"stopped at {calls[2]}: No space left on device" in err
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.staging*"))


def test_stage_converted_stores(synth_yaml, tmp_path):
    out = tmp_path / "o"
    assert run_cli(["convert", str(synth_yaml), "--to", "lmdb,disk", "--imgsz", "64", "--out", str(out), "--no-progress"]) == 0
    target = tmp_path / "fast" / "stores"
    target.parent.mkdir()
    assert run_cli(["stage", str(out), "--to", str(target), "--no-progress"]) == 0
    with open_store(target / "data.yaml", "val", imgsz=64) as s:
        assert s.kind == "disk" and Path(s.path).parent == target  # relative store paths follow the copy
    assert run_cli(["verify", str(target), "--no-progress"]) == 0
    assert run_cli(["unstage", str(target)]) == 0


def test_a_staged_store_folder_is_self_contained(tmp_path, capsys):
    import yaml

    from fastload.data.synthetic import make_synthetic_dataset

    data = make_synthetic_dataset(tmp_path / "ds", n_train=4, n_val=2, nc=3, seed=1, max_size=96)
    assert run_cli(["convert", str(data), "--to", "lmdb", "--out", str(tmp_path / "o"), "--workers", "1",
                    "--no-progress"]) == 0
    target = tmp_path / "staged"
    assert run_cli(["stage", str(tmp_path / "o"), "--to", str(target), "--no-progress"]) == 0
    staged_yaml = yaml.safe_load((target / "data.yaml").read_text())
    assert staged_yaml["path"] == str(target)  # not the dataset's root
    assert staged_yaml["train"] == str((tmp_path / "ds" / "images" / "train").resolve())  # what compat matches by
    check_staged_copy_alone(target, tmp_path / "ds", capsys)


def test_unstage_lists_and_removes_stale_shm(synth_yaml, shm_root, capsys):
    import signal
    import subprocess
    import sys

    code = ("import sys; from fastload.store import open_store; "
            "s = open_store(sys.argv[1], 'val', kind='ram', imgsz=64); print(s.path, flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code, str(synth_yaml)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    seg = p.stdout.readline().strip()
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    capsys.readouterr()
    assert run_cli(["info", "--shm"]) == 0
    listing = capsys.readouterr().out
    assert seg in listing and "stale" in listing
    assert run_cli(["unstage", "--stale"]) == 0
    assert f"removed stale segment {seg}" in capsys.readouterr().out
    assert not Path(seg).exists()


def test_default_out_is_beside_the_dataset_and_read_only_folders_refused(tmp_path, capsys):
    from fastload.data.synthetic import make_synthetic_dataset

    yaml_path = make_synthetic_dataset(tmp_path / "ds", n_train=3, n_val=2, min_size=32, max_size=64)
    assert run_cli(["convert", str(yaml_path), "--to", "lmdb", "--no-progress"]) == 0
    assert (tmp_path / "ds" / "fastload" / "data.yaml").is_file()
    (tmp_path / "ds").chmod(0o555)
    try:
        capsys.readouterr()
        assert run_cli(["convert", str(yaml_path), "--to", "lmdb", "--no-progress"]) == 1
        assert "read-only" in capsys.readouterr().err
    finally:
        (tmp_path / "ds").chmod(0o755)
