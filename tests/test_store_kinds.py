"""The registry of store kinds (fastload.store.kinds.STORE_KINDS): what open_store, store="auto", convert and
bench read; open_store's keywords per kind; the loader's path to a store does not import the converter."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fastload.store import open_store
from fastload.store.kinds import AUTO_ORDER, CONVERT_KINDS, ENCODED_KINDS, KINDS, REMOTE_KINDS, RESUMABLE_KINDS, STORE_KINDS, store_kind

REPO = Path(__file__).resolve().parents[1]


def test_every_kind_declares_its_reader_writer_and_place():
    for name, kind in STORE_KINDS.items():
        assert kind.reader_class().kind == name  # the reader is the Store class of that kind
        assert (kind.writer is not None) == (kind.path is not None)  # convert writes what it can place
    assert AUTO_ORDER == ("ram", "disk", "lmdb", "encoded", "files")  # fastest first; gpu only when asked for
    assert CONVERT_KINDS == ("lmdb", "encoded", "disk", "ram") and RESUMABLE_KINDS == ("lmdb",)
    assert REMOTE_KINDS == ("stream",) and ENCODED_KINDS == ("lmdb", "encoded")
    assert [k for k in KINDS if not store_kind(k).on_host] == ["gpu"]
    assert [k for k in KINDS if store_kind(k).decoded] == ["disk", "ram", "gpu"]  # a stream: as its upload
    with pytest.raises(ValueError, match="unknown store kind 'tape'; choose auto or one of files, lmdb"):
        store_kind("tape")


def test_importing_the_store_factory_does_not_import_the_converter():
    code = "import sys, fastload.store.factory; assert 'fastload.store.convert' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_open_store_refuses_keywords_the_kind_does_not_take(synth_yaml):
    with pytest.raises(TypeError, match=r"open_store\(kind='disk'\) takes no 'device' keyword; it takes shard_bytes, window"):
        open_store(synth_yaml, kind="disk", device="cpu")
    with pytest.raises(TypeError, match=r"open_store\(kind='lmdb'\) takes no 'shard_bytes' keyword; it takes none"):
        open_store(synth_yaml, kind="lmdb", shard_bytes=1)  # no byte ranges of records to read in shards
    with pytest.raises(TypeError, match=r"open_store\(kind='auto'\) takes no 'workers' keyword"):
        open_store(synth_yaml, kind="auto", workers=1)
    with pytest.raises(TypeError, match=r"open_store\(kind='files'\) takes no 'share' keyword; it takes cache, workers"):
        open_store(synth_yaml, kind="files", share=0.5)
    with open_store(synth_yaml, kind="files", workers=1, progress=False) as store:  # build_index's keywords
        assert store.kind == "files" and len(store) > 0
