"""The options fastload adds to the official trainer, in one table.

Each option is a keyword of :func:`fastload.compat.yolov9.create_dataloader`, a ``--fastload-*`` flag
of the launcher (``python -m fastload.compat.yolov9``) and a ``FASTLOAD_*`` environment variable. A
keyword (or launcher flag, which the launcher turns into a keyword) wins; the environment variable
is the fallback for the one-line-import route, where the official script passes no keyword.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping

from fastload.engines.factory import ENGINES

HSV = ("auto", "worker", "consumer")
PARTNERS = ("auto", "dataset", "batch")


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false), got {value!r}")


def _choice(choices: tuple[str, ...]) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value).strip().lower()
        if text not in choices:
            raise ValueError(f"choose one of {', '.join(choices)}, got {value!r}")
        return text
    return parse


def _optional_int(value: Any) -> int | None:
    if value is None or str(value).strip().lower() in ("", "auto", "none"):
        return None
    n = int(value)
    if n < 0:
        raise ValueError(f"must be >= 0, got {n}")
    return n


def _optional_str(value: Any) -> str | None:
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


OPTIONS: tuple[Option, ...] = (
    Option("engine", _choice(tuple(ENGINES)), "cpu", "engine rendering the batches: cpu (worker processes), gpu (PyTorch), dali"),
    Option("store", str, "auto",
           "auto | files | lmdb | disk | ram, or the data.yaml (or output folder) `fastload convert` wrote: its store "
           "for the split whose images the trainer asks for. auto: a raw image folder (ram with --cache ram)"),
    Option("hsv", _choice(HSV), "auto",
           "where HSV is applied: auto (consumer when batches go to a device, else worker), worker (CPU workers), "
           "consumer (on the batch's device)"),
    Option("seed", int, 0, "seed of the order and of every augmentation draw (launcher: the official --seed unless set)"),
    # the keyword is num_workers: `workers` is the official argument (the upper bound)
    Option("num_workers", _optional_int, None,
           "loader worker processes; default: the official rule min(CPUs / CUDA devices, batch size, --workers) "
           "(engine gpu: none, its host side is one thread)",
           short="workers"),
    Option("device", _optional_str, "auto",
           "where batches are delivered: auto (the current CUDA device when CUDA is available, else the CPU without a "
           "copy), or a device such as cuda:0 or cpu (cpu forces the device path: consumer HSV on the CPU)"),
    Option("reduced_decode", _bool, False,
           "decode large JPEGs at a reduced DCT scale (the CPU engine's decode_scale='reduced'; encoded stores)"),
    Option("partners", _choice(PARTNERS), "auto",
           "where mosaic partners of the training loader come from: dataset (YOLOv9), batch (the batch's own images: "
           "one decode per image; for datasets larger than memory), auto (the engine's default)"),
    Option("strict", _bool, False,
           "a damaged record (an LMDB crc mismatch, an undecodable image, a disk/ram checksum mismatch) stops the "
           "run with one StoreError line; default: it is skipped (warned once, counted, its samples drawn again)"),
    Option("batch_log", _optional_str, None,
           "append one JSON line per batch to this file (epoch, batch, size, mosaic samples, images, device)"),
)
_BY_NAME = {o.name: o for o in OPTIONS}


@dataclasses.dataclass(frozen=True)
class CompatOptions:
    """The resolved options of one ``create_dataloader`` call (see :data:`OPTIONS`)."""

    engine: str = "cpu"
    store: str = "auto"
    hsv: str = "auto"
    seed: int = 0
    num_workers: int | None = None
    device: str | None = "auto"
    reduced_decode: bool = False
    partners: str = "auto"
    strict: bool = False
    batch_log: str | None = None

    @classmethod
    def resolve(cls, keywords: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> "CompatOptions":
        """Keyword > ``FASTLOAD_*`` environment variable > default, each value parsed and checked."""
        environ = os.environ if environ is None else environ
        unknown = sorted(set(keywords) - set(_BY_NAME))
        if unknown:
            raise TypeError(f"create_dataloader() got unexpected keyword(s) {', '.join(unknown)}; fastload options are "
                            f"{', '.join(_BY_NAME)}")
        values: dict[str, Any] = {}
        for opt in OPTIONS:
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
                raise ValueError(f"fastload.compat.yolov9: {where}{raw!r}: {e}") from None
        return cls(**values)
