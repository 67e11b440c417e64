"""Damaged records at load time: each kind of damage planted in a copy of a small store is named once
(``<store path>, record N (<source file>)``), counted in ``stats()`` and skipped by a replacement draw that
gives the same batches for any worker count; ``strict=True`` raises the one-line error instead."""
from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

import lmdb
import msgpack
import numpy as np
import pytest

from fastload.engines.base import DamagedRecordWarning
from fastload.store.base import DamagedRecordError, StoreError
from fastload.data.checksum import record_checksum
from fastload.store.lmdb_store import INDEX_KEY, LmdbStore
from fastload.store.encoded import IMAGES, EncodedStore
from fastload.store.packed import PIXELS, PackedStore

IMGSZ = 64
RECORD = 3  # the record each test damages


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, Path]:
    """A 10-image synthetic dataset and its lmdb, encoded and disk stores at imgsz 64 (copied per test before damage)."""
    from fastload.data.synthetic import make_synthetic_dataset
    from fastload.store.convert import convert

    root = tmp_path_factory.mktemp("damage")
    yaml_path = make_synthetic_dataset(root / "data", n_train=10, n_val=2, nc=3, seed=3, min_size=64, max_size=128)
    res = convert(yaml_path, to="lmdb,encoded,disk", out=root / "stores", imgsz=IMGSZ, splits="train", progress=False,
                  log=lambda *_: None)
    found = {p.name: p for p in (root / "stores").iterdir() if p.is_dir()}
    return {"yaml": yaml_path, "data": root / "data", "stores": res.yaml_path.parent,
            "lmdb": next(p for n, p in found.items() if n.endswith("lmdb")),
            "disk": next(p for n, p in found.items() if "disk" in n),
            "encoded": next(p for n, p in found.items() if n.endswith("encoded"))}


# -- planting damage ----------------------------------------------------------------------------------------------
def _lmdb_put_image(path: Path, record: int, edit: Callable[[bytes], bytes], *, keep_crc: bool) -> None:
    """Rewrite record ``record``'s image bytes with ``edit``; ``keep_crc``: also store their new checksum, so
    only decoding can tell (an image that was already damaged when it was converted)."""
    store = LmdbStore(path)
    key, labels, file = int(store.keys[record]), store.labels[record], store.im_files[record]
    store.close()
    env = lmdb.open(str(path), map_size=1 << 26, subdir=True, lock=False)
    with env.begin(write=True) as txn:
        buf = edit(bytes(txn.get(b"i:%08d" % key)))
        txn.put(b"i:%08d" % key, buf)
        if keep_crc:
            index = msgpack.unpackb(bytes(txn.get(INDEX_KEY)), raw=False)
            sums = np.frombuffer(index["checksums"], np.uint32).copy()
            sums[record] = record_checksum(buf, labels)
            index["checksums"] = sums.tobytes()
            txn.put(INDEX_KEY, msgpack.packb(index))
    env.close()
    assert file


def _flip(buf: bytes) -> bytes:
    b = bytearray(buf)
    for k in range(len(b) // 2, len(b) // 2 + 8):
        b[k] ^= 0xFF
    return bytes(b)


def _flip_record(path: Path, record: int) -> None:
    """Flip 16 bytes inside record ``record`` of a disk, ram or encoded store (its records file, same size)."""
    offsets = np.load(path / "offsets.npy")
    start = int(offsets[record]) + int(offsets[record + 1] - offsets[record]) // 3
    with open(path / (PIXELS if (path / PIXELS).is_file() else IMAGES), "r+b") as f:
        f.seek(start)
        data = f.read(16)
        f.seek(start)
        f.write(bytes(v ^ 0x5A for v in data))


def _jpeg_record(store_path: Path) -> int:
    with LmdbStore(store_path) as store:
        files = store.im_files
    return next(i for i in range(RECORD, len(files)) if files[i].endswith(".jpg"))


def damaged_loader_source(kind: str, stores: dict[str, Path], tmp_path: Path) -> tuple[dict[str, Any], str, int, str]:
    """``(loader keywords, store path, record, damage kind)`` for a damaged copy of a store of ``kind``."""
    if kind in ("lmdb_crc", "lmdb_crc_record0"):  # record 0: the one a Ray actor reads when it opens the store
        record = 0 if kind == "lmdb_crc_record0" else RECORD
        path = shutil.copytree(stores["lmdb"], tmp_path / "train.lmdb")
        _lmdb_put_image(path, record, _flip, keep_crc=False)
        return {"data": LmdbStore(path)}, str(path), record, "checksum"
    if kind == "lmdb_truncated":
        path = shutil.copytree(stores["lmdb"], tmp_path / "train.lmdb")
        record = _jpeg_record(path)
        _lmdb_put_image(path, record, lambda b: b[: len(b) // 2], keep_crc=True)
        return {"data": LmdbStore(path)}, str(path), record, "decode"
    if kind == "disk":
        path = shutil.copytree(stores["disk"], tmp_path / "train-disk")
        _flip_record(path, RECORD)
        return {"data": PackedStore(path)}, str(path), RECORD, "checksum"
    if kind == "encoded":
        path = shutil.copytree(stores["encoded"], tmp_path / "train.encoded")
        _flip_record(path, RECORD)
        return {"data": EncodedStore(path)}, str(path), RECORD, "checksum"
    raise ValueError(kind)


def _files_source(stores: dict[str, Path], tmp_path: Path) -> tuple[dict[str, Any], Path]:
    from fastload.store.files import FileStore
    from fastload.data.config import load_data_config

    data = shutil.copytree(stores["data"], tmp_path / "data")
    store = FileStore.from_config(load_data_config(data / "data.yaml"), "train", cache=False)
    return {"data": store}, data


def _epoch(kw: dict[str, Any], workers: int, *, epochs: int = 1, engine: str = "cpu", ray_actors: int = 2,
           **more: Any) -> tuple[list, dict, list[str]]:
    """Every batch of ``epochs`` epochs (pixels cloned), the loader's stats and the damage warnings raised."""
    from fastload.fastloader import loader

    opts = {"cpu": {"decode_cache_mb": 0}, "ray": {"actors": ray_actors, "decode_cache_mb": 0}}.get(engine)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with loader(kw["data"], imgsz=IMGSZ, batch_size=4, workers=workers, engine=engine, seed=5,
                    engine_options=opts, **more) as ld:
            batches = []
            for _ in range(epochs):
                batches += [(imgs.clone(), targets.clone(), paths) for imgs, targets, paths, _ in ld]
            stats = ld.stats()
            n_batches = len(ld)
    assert len(batches) == epochs * n_batches
    messages = [str(w.message) for w in caught if issubclass(w.category, DamagedRecordWarning)]
    return batches, stats, messages


def _same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (ia, ta, pa), (ib, tb, pb) in zip(a, b):
        assert ia.equal(ib) and ta.equal(tb) and pa == pb


def _check(stats: dict, messages: list[str], path: str, record: int, file: str, kind: str) -> None:
    named = f"{path}, record {record} ({file})"
    assert len(messages) == 1, messages
    assert named in messages[0]
    assert stats["damaged_records"] == 1 and stats["damaged_record_ids"] == [record]
    assert stats["damaged_by_kind"][kind] == 1
    assert stats["replaced_samples"] >= 1


@pytest.mark.parametrize("kind", ["lmdb_crc", "lmdb_truncated", "disk", "encoded"])
def test_damaged_record_skipped_same_for_any_worker_count(kind, stores, tmp_path, shm_root):
    kw, path, record, damage = damaged_loader_source(kind, stores, tmp_path)
    file = kw["data"].im_files[record]
    inline, stats0, msgs0 = _epoch(kw, 0, epochs=2)
    _check(stats0, msgs0, path, record, file, damage)  # two epochs, one warning
    forked, stats2, msgs2 = _epoch(kw, 2, epochs=2)
    _check(stats2, msgs2, path, record, file, damage)
    _same(inline, forked)
    assert stats0["replaced_samples"] == stats2["replaced_samples"]
    assert all(file not in paths for _, _, paths in inline)  # the damaged image is never delivered
    with pytest.raises(StoreError) as err:
        _epoch(kw, 2, strict=True)
    message = str(err.value)
    assert isinstance(err.value, DamagedRecordError) and "\n" not in message
    assert f"{path}, record {record} ({file})" in message and f"fastload verify {path}" in message


def test_ram_record_flipped(stores, tmp_path, shm_root):
    from fastload.store.convert import convert
    from fastload.store.factory import open_store

    res = convert(stores["yaml"], to="ram", out=tmp_path / "stores", imgsz=IMGSZ, splits="train", progress=False,
                  log=lambda *_: None)
    store = open_store(res.yaml_path, "train", kind="ram", imgsz=IMGSZ)
    try:
        _flip_record(Path(store.path), RECORD)
        kw = {"data": store}
        inline, stats0, msgs0 = _epoch(kw, 0)
        forked, stats2, msgs2 = _epoch(kw, 2)
        for stats, msgs in ((stats0, msgs0), (stats2, msgs2)):
            _check(stats, msgs, store.path, RECORD, store.im_files[RECORD], "checksum")
        _same(inline, forked)
        with pytest.raises(DamagedRecordError, match=f"record {RECORD} "):
            _epoch(kw, 0, strict=True)
    finally:
        store.close()


def test_files_image_truncated_after_scan(stores, tmp_path, shm_root):
    kw, data = _files_source(stores, tmp_path)
    store = kw["data"]
    record = next(i for i in range(RECORD, len(store)) if store.im_files[i].endswith(".jpg"))
    file = store.im_files[record]
    Path(file).write_bytes(Path(file).read_bytes()[:300])  # damaged after the scan said it was fine
    inline, stats0, msgs0 = _epoch(kw, 0)
    forked, stats2, msgs2 = _epoch(kw, 2)
    for stats, msgs in ((stats0, msgs0), (stats2, msgs2)):
        _check(stats, msgs, str(store.path), record, file, "decode")
    _same(inline, forked)
    with pytest.raises(DamagedRecordError) as err:
        _epoch(kw, 2, strict=True)
    assert "\n" not in str(err.value) and f"record {record} ({file})" in str(err.value)


@pytest.mark.parametrize("kind", ["lmdb_crc", "disk"])
def test_gpu_engine_on_cpu_replaces_like_cpu(kind, stores, tmp_path):
    pytest.importorskip("torchvision")
    kw, path, record, damage = damaged_loader_source(kind, stores, tmp_path)
    file = kw["data"].im_files[record]
    gpu, stats, msgs = _epoch(kw, 0, engine="gpu", device="cpu", prefetch=1)
    _check(stats, msgs, path, record, file, damage)
    cpu, cpu_stats, _ = _epoch(kw, 0)
    # the same records (boxes and paths); the pixels differ by the engines' own resampling
    assert [p for _, _, p in gpu] == [p for _, _, p in cpu]
    for (_, tg, _), (_, tc, _) in zip(gpu, cpu):
        assert np.allclose(tg.numpy(), tc.numpy(), atol=1e-4)
    assert stats["replaced_samples"] == cpu_stats["replaced_samples"]
    with pytest.raises(DamagedRecordError, match=f"record {record} "):
        _epoch(kw, 0, engine="gpu", device="cpu", strict=True)


def test_replacement_is_a_pure_function_of_seed_epoch_index_attempt():
    from fastload.augment.params import ParamSampler

    shapes = np.array([[48, 64], [64, 40], [64, 64], [30, 64]] * 3)
    a = ParamSampler(shapes, None, 64, seed=7)
    b = ParamSampler(shapes, None, 64, seed=7)
    first, again = a.replacement(2, 5, 1), b.replacement(2, 5, 1)
    assert first.attempt == 1 and first.index == again.index and first.sources == again.sources
    assert np.array_equal(first.image.tiles[0].matrix, again.image.tiles[0].matrix)
    draws = {a.replacement(2, 5, k).index for k in range(1, 30)}
    assert len(draws) > 3  # other attempts draw other images
    bad = {a.sample(2, 5).index}
    record = a.first_usable(2, 5, lambda r: not bad & set(r.sources))
    assert not bad & set(record.sources) and record == b.first_usable(2, 5, lambda r: not bad & set(r.sources))
    rect = np.array([[48, 64], [64, 48]] * 6)  # validation rect batches: a replacement keeps the sample's shape
    val = ParamSampler(shapes, None, 64, augment=False, rect_shapes=rect)
    assert all(val.replacement(0, 1, k).image.out_hw == (64, 48) for k in range(1, 10))
    batch = np.array([4, 7, 9])
    by_batch = ParamSampler(shapes, None, 64, partners="batch")  # the batch's records read only its images
    assert all(set(by_batch.replacement(0, 7, k, batch).sources) <= {4, 7, 9} for k in range(1, 20))


def test_compat_strict_flag_and_environment(stores, monkeypatch):
    from fastload.compat.yolov9.dataloader import create_dataloader
    from fastload.compat.yolov9.launcher import split_args
    from fastload.compat.yolov9.options import CompatOptions

    kw, rest = split_args(["train_dual.py", "--fastload-strict", "1", "--batch", "4"])
    assert kw == {"strict": True} and rest == ["train_dual.py", "--batch", "4"]
    assert CompatOptions.resolve({}, {"FASTLOAD_STRICT": "1"}).strict is True
    assert CompatOptions.resolve({}, {}).strict is False
    monkeypatch.setenv("FASTLOAD_STRICT", "1")
    loader, _ = create_dataloader(str(stores["data"] / "images" / "train"), 64, 4, 32, workers=0, num_workers=0)
    try:
        assert loader.engine.settings.strict is True
    finally:
        loader.close()


@pytest.mark.parametrize("kind", ["lmdb_crc_record0", "disk"])
def test_ray_actors_report_to_the_consumer(kind, stores, tmp_path, local_ray):
    kw, path, record, damage = damaged_loader_source(kind, stores, tmp_path)
    file = kw["data"].im_files[record]
    ray_batches, stats, msgs = _epoch(kw, 0, epochs=2, engine="ray")
    _check(stats, msgs, path, record, file, damage)
    cpu, cpu_stats, _ = _epoch(kw, 0, epochs=2)
    _same(ray_batches, cpu)
    assert stats["replaced_samples"] == cpu_stats["replaced_samples"]
    # one actor: whichever actor meets the record raises (each actor costs a Ray worker process, about 1 s of CPU)
    with pytest.raises(DamagedRecordError) as err:
        _epoch(kw, 0, engine="ray", ray_actors=1, strict=True)
    assert "\n" not in str(err.value) and f"{path}, record {record} ({file})" in str(err.value)


@pytest.mark.parametrize("kind,partners", [("lmdb_crc", "batch"), ("disk", "dataset")])
def test_dali_cpu_reports_to_the_consumer(kind, partners, stores, tmp_path):
    pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed (pip install fastload[dali])")
    kw, path, record, damage = damaged_loader_source(kind, stores, tmp_path)
    file = kw["data"].im_files[record]
    dali, stats, msgs = _epoch(kw, 1, engine="dali", device="cpu", partners=partners)
    _check(stats, msgs, path, record, file, damage)
    cpu, cpu_stats, _ = _epoch(kw, 0, partners=partners)
    assert [p for _, _, p in dali] == [p for _, _, p in cpu]  # the same records; DALI's pixels are its own
    for (_, td, _), (_, tc, _) in zip(dali, cpu):
        assert np.allclose(td.numpy(), tc.numpy(), atol=1e-3)
    assert stats["replaced_samples"] == cpu_stats["replaced_samples"]
    with pytest.raises(DamagedRecordError, match=f"record {record} "):
        _epoch(kw, 1, engine="dali", device="cpu", partners=partners, strict=True)
