"""fastload.data.paths.PathList: a sequence of path strings kept as one blob."""
from __future__ import annotations

import copy
import os

import numpy as np
import pytest

import fastload.data.paths as paths_mod
from fastload.data.paths import PathList, joined

PATHS = ["/d/images/a.jpg", "/d/images/sub/b.png", "rel/c.JPG", "/d/images/caf\u00e9.jpg", os.fsdecode(b"/d/\xff.jpg")]


def test_reads_like_the_list_it_was_made_from(monkeypatch):
    monkeypatch.setattr(paths_mod, "_CHUNK", 2)  # iteration decodes in chunks: cross their edges
    p = PathList.from_paths(PATHS)
    assert len(p) == len(PATHS) and list(p) == PATHS and p == PATHS and PATHS == p
    assert [p[i] for i in range(-len(PATHS), len(PATHS))] == PATHS + PATHS
    assert p != PATHS[:-1] and p != PATHS[::-1]
    with pytest.raises(IndexError):
        p[len(PATHS)]
    assert p.encoded() == [os.fsencode(s) for s in PATHS]  # what os.stat takes, the undecodable name included
    assert PathList.from_paths([]) == [] and list(PathList.from_paths([])) == []
    assert copy.deepcopy(p) == p  # (the reduce protocol Ray's serialiser goes through, without loading a pickle)


def test_subsets_and_slices_are_packed_again():
    p = PathList.from_paths(PATHS)
    idx = np.array([4, 0, 0, 2])
    sub = p.subset(idx)
    assert isinstance(sub, PathList) and sub == [PATHS[i] for i in idx]
    assert p[1:4] == PATHS[1:4] and p[::-2] == PATHS[::-2]
    assert PathList(sub.blob) == sub  # the offsets follow from the blob
    with pytest.raises(ValueError, match="NUL"):
        PathList(b"/no/terminator.jpg")


def test_joined_is_the_joined_string_encoded():
    assert joined(PathList.from_paths(PATHS[:4]), "\n") == "\n".join(PATHS[:4]).encode()
    assert joined(PATHS[:4], "\n") == "\n".join(PATHS[:4]).encode()
    assert joined(PathList.from_paths([]), "\n") == b""
