"""The registry of engines: name -> class, and the one place options for an engine are checked.

Every engine module imports only torch and numpy at module level (DALI's and Ray's own packages are
imported when a DALI or Ray engine is built), so this registry names all of them without loading
optional dependencies.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from fastload.engines.base import Engine, EngineOptionError
from fastload.engines.cpu import CPUEngine
from fastload.engines.dali import DALIEngine
from fastload.engines.gpu import GPUEngine
from fastload.engines.ray_engine import RayEngine

ENGINES: dict[str, type[Engine]] = {"cpu": CPUEngine, "gpu": GPUEngine, "dali": DALIEngine, "ray": RayEngine}
# the engines that render epochs which repeat images (Engine.takes_sample_ids: YOLOv9's --image-weights)
SAMPLE_ID_ENGINES: tuple[str, ...] = tuple(name for name, cls in ENGINES.items() if cls.takes_sample_ids)


def engine_class(name: str) -> type[Engine]:
    """The engine called ``name`` (``cpu``, ``gpu``, ``dali`` or ``ray``)."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
    return ENGINES[name]


def resolve_options(name: str, options: Any) -> Any:
    """``options`` for engine ``name`` as its options object: ``None`` (the defaults), an instance of
    its options class, or a dict of that class's fields. Anything else, or a field the engine does
    not have, raises :class:`EngineOptionError` naming the engine and the option."""
    cls = engine_class(name).Options
    if options is None:
        return cls()
    if isinstance(options, cls):
        return options
    if isinstance(options, Mapping):
        known = [f.name for f in dataclasses.fields(cls)]
        for key in options:
            if key not in known:
                owners = [n for n, e in ENGINES.items() if n != name and key in [f.name for f in dataclasses.fields(e.Options)]]
                where = f" (an option of engine{'s' * (len(owners) > 1)} {' and '.join(map(repr, owners))})" if owners else ""
                raise EngineOptionError(
                    f"engine {name!r} has no option {key!r}{where}; its options are: {', '.join(known) or 'none'}")
        return cls(**options)
    raise EngineOptionError(
        f"engine {name!r} takes {cls.__name__} options (or a dict of its fields), got {type(options).__name__}")
