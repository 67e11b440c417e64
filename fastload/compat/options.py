"""What every compat layer's options share: one :class:`Option` per setting (a keyword, a ``--fastload-*``
flag and a ``FASTLOAD_*`` environment variable), the value parsers, and :func:`resolve_options`
(keyword > environment variable > default). Each layer keeps its own table of options.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping, Sequence


def parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false), got {value!r}")


def parse_choice(choices: tuple[str, ...]) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value).strip().lower()
        if text not in choices:
            raise ValueError(f"choose one of {', '.join(choices)}, got {value!r}")
        return text
    return parse


def parse_optional_int(value: Any) -> int | None:
    if value is None or str(value).strip().lower() in ("", "auto", "none"):
        return None
    n = int(value)
    if n < 0:
        raise ValueError(f"must be >= 0, got {n}")
    return n


def parse_optional_str(value: Any) -> str | None:
    return None if value is None or str(value).strip() == "" else str(value)


@dataclasses.dataclass(frozen=True)
class Option:
    """One fastload option: its keyword, launcher flag, environment variable, parser and default."""

    name: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    short: str = ""  # the name in the flag and the environment variable, when it differs from the keyword

    @property
    def env(self) -> str:
        return "FASTLOAD_" + (self.short or self.name).upper()

    @property
    def flag(self) -> str:
        return "--fastload-" + (self.short or self.name).replace("_", "-")


def resolve_options(table: Sequence[Option], keywords: Mapping[str, Any], environ: Mapping[str, str] | None, *,
                    owner: str, unknown: str) -> dict[str, Any]:
    """``{name: value}`` for every option of ``table``: keyword > ``FASTLOAD_*`` variable > default, parsed.

    ``owner`` starts a bad value's one-line ``ValueError``; ``unknown`` starts the ``TypeError`` for a
    keyword the table does not have (e.g. ``"create_dataloader() got unexpected keyword(s)"``).
    """
    environ = os.environ if environ is None else environ
    names = [o.name for o in table]
    strays = sorted(set(keywords) - set(names))
    if strays:
        raise TypeError(f"{unknown} {', '.join(strays)}; fastload options are {', '.join(names)}")
    values: dict[str, Any] = {}
    for opt in table:
        if opt.name in keywords:
            raw, where = keywords[opt.name], f"{opt.name}="
        elif opt.env in environ:
            raw, where = environ[opt.env], f"{opt.env}="
        else:
            values[opt.name] = opt.default
            continue
        try:
            values[opt.name] = opt.parse(raw)
        except ValueError as e:
            raise ValueError(f"{owner}: {where}{raw!r}: {e}") from None
    return values
