"""``import fastload`` exposes what users need by name, each with a docstring, resolved on first use."""
from __future__ import annotations

import inspect

import pytest

import fastload


def test_every_public_name_resolves_with_a_docstring():
    names = [n for n in fastload.__all__ if n != "__version__"]
    assert set(names) == set(fastload._EXPORTS)
    for name in names:
        obj = getattr(fastload, name)
        assert obj.__name__ == name and obj.__module__ == fastload._EXPORTS[name], name
        assert inspect.getdoc(obj), f"fastload.{name} has no docstring"
    assert issubclass(fastload.EngineOptionError, (TypeError, ValueError))
    assert issubclass(fastload.IncompleteStoreError, fastload.StoreError)
    assert issubclass(fastload.DamagedRecordError, fastload.StoreError)  # strict=True: one except clause for both
    assert isinstance(fastload.__version__, str)
    assert sorted(dir(fastload)) == sorted(fastload.__all__)


def test_unknown_names_raise_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'StoreView'"):
        fastload.StoreView  # noqa: B018 - internal classes stay in their modules
