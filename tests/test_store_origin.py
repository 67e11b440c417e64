"""A store folder holds one dataset's stores: converting another dataset into it is refused (or replaces
them all with force), stores built before the images changed are refused too, and a folder whose stores
disagree anyway (made by an older version) is named by open_store, verify and info."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fastload.data.synthetic import make_synthetic_dataset
from fastload.store import open_store
from fastload.store.base import StoreError
from fastload.store.convert import convert
from fastload.store.info import dataset_info, format_info
from fastload.store.origin import MixedStoresError
from fastload.store.verify import verify_target

QUIET = dict(progress=False, log=lambda *_: None, workers=1, imgsz=64, splits="train")


@pytest.fixture(scope="module")
def two_sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("origin")
    a = make_synthetic_dataset(root / "a", n_train=6, n_val=2, seed=1, max_size=96)
    b = make_synthetic_dataset(root / "b", n_train=3, n_val=2, seed=2, max_size=96)
    return a, b


def _counts(yaml_path: Path) -> dict[str, int]:
    counts = {}
    for kind in ("lmdb", "disk"):
        with open_store(yaml_path, "train", kind=kind, imgsz=64) as s:
            counts[kind] = len(s)
    return counts


def test_second_dataset_refused_then_replaced_with_force(two_sets, tmp_path):
    a, b = two_sets
    out = tmp_path / "stores"
    convert(a, "lmdb,disk", out=out, **QUIET)
    with pytest.raises(StoreError, match=r"holds the stores of another dataset .*--force"):
        convert(b, "lmdb", out=out, **QUIET)
    assert _counts(out / "data.yaml") == {"lmdb": 6, "disk": 6}  # nothing was touched
    assert not (out / ".convert.lock").exists()  # the lock file goes with its holder
    convert(b, "lmdb", out=out, force=True, **QUIET)
    assert not (out / "train-64.disk").exists()  # the whole set is replaced, not mixed
    with open_store(out / "data.yaml", "train") as s:
        assert (s.kind, len(s)) == ("lmdb", 3)


def test_store_left_from_before_the_images_changed_is_refused(two_sets, tmp_path):
    a, _ = two_sets
    data = tmp_path / "a"
    shutil.copytree(a.parent, data)
    out = tmp_path / "stores"
    convert(data / "data.yaml", "lmdb,disk", out=out, **QUIET)
    first = sorted((data / "images" / "train").iterdir())[0]
    first.write_bytes(first.read_bytes() + b"\0")  # the dataset changes after the conversion
    with pytest.raises(StoreError, match=r"disk store\(s\) of train .* rebuild them too \(--to lmdb,disk\)"):
        convert(data / "data.yaml", "lmdb", out=out, **QUIET)
    convert(data / "data.yaml", "lmdb", out=out, force=True, **QUIET)
    assert not (out / "train-64.disk").exists()
    open_store(out / "data.yaml", "train").close()


def test_mixed_folder_named_by_open_store_verify_and_info(two_sets, tmp_path):
    a, b = two_sets
    out, other = tmp_path / "stores", tmp_path / "other"
    convert(a, "lmdb,disk", out=out, **QUIET)
    convert(b, "lmdb", out=other, **QUIET)
    shutil.rmtree(out / "train.lmdb")
    shutil.copytree(other / "train.lmdb", out / "train.lmdb")  # what older versions did on `convert b --out`
    for kind in ("auto", "lmdb", "disk"):
        with pytest.raises(MixedStoresError, match=r"train stores come from different datasets .*lmdb holds 3 .*disk holds 6"):
            open_store(out / "data.yaml", "train", kind=kind, imgsz=64)
    open_store(out / "data.yaml", "train", kind="files").close()  # the source images are still fine
    failed = [r for r in verify_target(out) if not r.ok]
    assert len(failed) == 1 and "different datasets" in failed[0].error
    info = dataset_info(out / "data.yaml", ["train"])
    assert "lmdb holds 3" in info["splits"]["train"]["mixed_stores"]
    assert "WARNING: these stores come from different datasets" in format_info(info)


def test_verify_names_an_interrupted_conversion_beside_the_stores(two_sets, tmp_path):
    a, _ = two_sets
    out = tmp_path / "stores"
    convert(a, "lmdb", out=out, **QUIET)
    (out / "train-64.disk.partial").mkdir()
    results = verify_target(out)
    assert [r.ok for r in results] == [True, False]
    assert results[1].path.endswith("train-64.disk.partial") and "interrupted conversion" in results[1].error
