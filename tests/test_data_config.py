"""fastload.data.config: data.yaml variants as YOLOv5/v9 users write them."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import yaml

from fastload.data import config as config_mod
from fastload.data.config import DataConfig, DataConfigError, load_data_config
from fastload.data.index import build_index, list_images


def _tree(root: Path) -> Path:
    """root/ds with images/{a,b}/x.jpg files (empty files are enough for config tests)."""
    ds = root / "ds"
    for split, names in (("a", ["1.jpg", "2.png"]), ("b", ["3.jpg"])):
        (ds / "images" / split).mkdir(parents=True)
        for n in names:
            (ds / "images" / split / n).write_bytes(b"x")
    return ds


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_folder_splits_resolve_against_the_yaml_folder(tmp_path):
    ds = _tree(tmp_path)
    y = _write(ds / "data.yaml", {"train": "images/a", "val": "images/b", "names": ["x", "y"]})
    cfg = load_data_config(str(y))
    assert cfg.yaml_path == y and cfg.root == ds
    assert cfg.splits == {"train": [ds / "images" / "a"], "val": [ds / "images" / "b"]}
    assert cfg.names == ["x", "y"] and cfg.nc == 2


def test_relative_path_key_resolves_against_the_yaml_folder(tmp_path):
    ds = _tree(tmp_path)
    (tmp_path / "cfgs").mkdir()
    y = _write(tmp_path / "cfgs" / "d.yaml", {"path": "../ds", "train": "images/a", "val": "images/b", "nc": 1})
    cfg = load_data_config(y)
    assert cfg.root == ds and cfg.splits["train"] == [ds / "images" / "a"]
    assert cfg.names == ["class0"]


def test_txt_list_and_list_of_sources(tmp_path):
    ds = _tree(tmp_path)
    (ds / "lists").mkdir()
    # YOLOv5 style `./` entries and plain relative entries both resolve against the list's folder
    (ds / "lists" / "train.txt").write_text("../images/a/1.jpg\n./../images/a/2.png\n\n# comment\n")
    y = _write(ds / "data.yaml", {"train": ["lists/train.txt", "images/b"], "val": "images/b", "names": {0: "a", 1: "b"}})
    cfg = load_data_config(y)
    files = list_images(cfg.sources("train"))
    assert files == sorted([str(ds / "images" / "a" / "1.jpg"), str(ds / "images" / "a" / "2.png"), str(ds / "images" / "b" / "3.jpg")])
    assert cfg.names == ["a", "b"]


def test_names_dict_with_gap_or_nc_mismatch_is_an_error(tmp_path):
    ds = _tree(tmp_path)
    y = _write(ds / "bad.yaml", {"train": "images/a", "val": "images/b", "names": {0: "a", 2: "c"}})
    with pytest.raises(DataConfigError, match="bad.yaml.*names"):
        load_data_config(y)
    y = _write(ds / "bad2.yaml", {"train": "images/a", "val": "images/b", "nc": 3, "names": ["a", "b"]})
    with pytest.raises(DataConfigError, match=r"bad2.yaml.*'nc' is 3 but 'names' lists 2"):
        load_data_config(y)
    y = _write(ds / "bad3.yaml", {"train": "images/a", "val": "images/b"})
    with pytest.raises(DataConfigError, match="bad3.yaml.*names"):
        load_data_config(y)


def test_missing_split_names_the_yaml_and_the_key(tmp_path):
    ds = _tree(tmp_path)
    y = _write(ds / "d.yaml", {"train": "images/a", "val": "images/b", "nc": 1})
    cfg = load_data_config(y)
    with pytest.raises(DataConfigError, match=r"d.yaml.*'test'"):
        build_index(cfg, "test")
    y = _write(ds / "none.yaml", {"test": "images/a", "nc": 1})
    with pytest.raises(DataConfigError, match=r"none.yaml.*'train'"):
        load_data_config(y)


def test_nonexistent_source_and_bad_files(tmp_path):
    ds = _tree(tmp_path)
    y = _write(ds / "d.yaml", {"train": "images/nope", "val": "images/b", "nc": 1})
    with pytest.raises(DataConfigError, match=r"d.yaml.*'train'.*images/nope"):
        build_index(load_data_config(y), "train", cache=False, progress=False)
    (ds / "images" / "empty").mkdir()
    y = _write(ds / "e.yaml", {"train": "images/empty", "val": "images/b", "nc": 1})
    with pytest.raises(DataConfigError, match=r"e.yaml.*'train' has no images"):
        build_index(y, "train", cache=False, progress=False)
    with pytest.raises(DataConfigError, match="not found"):
        load_data_config(ds / "missing.yaml")
    (ds / "broken.yaml").write_text("train: [unclosed\n")
    with pytest.raises(DataConfigError, match="broken.yaml"):
        load_data_config(ds / "broken.yaml")
    (ds / "scalar.yaml").write_text("just a string\n")
    with pytest.raises(DataConfigError, match="scalar.yaml"):
        load_data_config(ds / "scalar.yaml")


def test_download_key_is_never_executed(tmp_path, monkeypatch, caplog):
    ds = _tree(tmp_path)
    marker = tmp_path / "PWNED"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(config_mod, "_download_notice_given", False)
    script = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
    y = _write(ds / "d.yaml", {"train": "images/a", "val": "images/b", "nc": 1, "download": script})
    y2 = _write(ds / "d2.yaml", {"train": "images/a", "val": "images/b", "nc": 1, "download": f"bash -c 'touch {marker}'"})
    with caplog.at_level(logging.WARNING, logger="fastload.data"):
        load_data_config(y)
        load_data_config(y2)
        build_index(y, "train", cache=False, progress=False)
    assert not marker.exists()
    notices = [r for r in caplog.records if "download" in r.getMessage()]
    assert len(notices) == 1  # one notice per process, not per load


def test_dict_input_and_fastload_stores(tmp_path, monkeypatch):
    ds = _tree(tmp_path)
    monkeypatch.chdir(ds)
    cfg = load_data_config({"train": "images/a", "val": "images/b", "names": ["only"]})
    assert cfg.yaml_path is None and cfg.root == Path(os.getcwd())
    assert cfg.splits["train"] == [ds / "images" / "a"]
    y = _write(
        ds / "conv.yaml",
        {"path": str(ds), "train": "images/a", "val": "images/b", "nc": 1,
         "fastload": {"train": {"lmdb": "stores/train.lmdb", "disk": str(tmp_path / "abs")}}},
    )
    cfg = load_data_config(y)
    assert cfg.stores == {"train": {"lmdb": ds / "stores" / "train.lmdb", "disk": tmp_path / "abs"}}
    assert load_data_config(cfg) is cfg and isinstance(cfg, DataConfig)
    y = _write(ds / "badstore.yaml", {"train": "images/a", "val": "images/b", "nc": 1, "fastload": ["x"]})
    with pytest.raises(DataConfigError, match="badstore.yaml.*fastload"):
        load_data_config(y)


def test_coco128_yaml(coco128_yaml):
    cfg = load_data_config(coco128_yaml)
    assert cfg.nc == 80 and len(cfg.names) == 80 and cfg.names[0] == "person"
    assert cfg.splits["train"] == [coco128_yaml.parent / "images" / "train2017"]
