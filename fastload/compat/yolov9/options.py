"""The options fastload adds to the official trainer, in one table.

Each option is a keyword of :func:`fastload.compat.yolov9.create_dataloader`, a ``--fastload-*`` flag
of the launcher (``python -m fastload.compat.yolov9``) and a ``FASTLOAD_*`` environment variable. A
keyword (or launcher flag, which the launcher turns into a keyword) wins; the environment variable
is the fallback for the one-line-import route, where the official script passes no keyword.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from fastload.compat.options import (
    Option, parse_bool, parse_choice, parse_optional_int, parse_optional_str, resolve_options,
)
from fastload.engines.factory import ENGINES

HSV = ("auto", "worker", "consumer")
PARTNERS = ("auto", "dataset", "batch")


OPTIONS: tuple[Option, ...] = (
    Option("engine", parse_choice(tuple(ENGINES)), "cpu", "engine rendering the batches: cpu (worker processes), gpu (PyTorch), dali"),
    Option("store", str, "auto",
           "auto | files | lmdb | disk | ram, or the data.yaml (or output folder) `fastload convert` wrote: its store "
           "for the split whose images the trainer asks for. auto: a raw image folder (ram with --cache ram)"),
    Option("hsv", parse_choice(HSV), "auto",
           "where HSV is applied: auto (consumer when batches go to a device, else worker), worker (CPU workers), "
           "consumer (on the batch's device)"),
    Option("seed", int, 0, "seed of the order and of every augmentation draw (launcher: the official --seed unless set)"),
    # the keyword is num_workers: `workers` is the official argument (the upper bound)
    Option("num_workers", parse_optional_int, None,
           "loader worker processes; default: the official rule min(CPUs / CUDA devices, batch size, --workers) "
           "(engine gpu: none, its host side is one thread)",
           short="workers"),
    Option("device", parse_optional_str, "auto",
           "where batches are delivered: auto (the current CUDA device when CUDA is available, else the CPU without a "
           "copy), or a device such as cuda:0 or cpu (cpu forces the device path: consumer HSV on the CPU)"),
    Option("reduced_decode", parse_bool, False,
           "decode large JPEGs at a reduced DCT scale (the CPU engine's decode_scale='reduced'; encoded stores)"),
    Option("partners", parse_choice(PARTNERS), "auto",
           "where mosaic partners of the training loader come from: dataset (YOLOv9), batch (the batch's own images: "
           "one decode per image; for datasets larger than memory), recent (the last images of the epoch order: "
           "Ultralytics' buffer), auto (the loader's plan: the engine's default, batch where the decoded set exceeds "
           "the decoded cache; the Ultralytics layer: Ultralytics' rule)"),
    Option("strict", parse_bool, False,
           "a damaged record (an LMDB crc mismatch, an undecodable image, a disk/ram checksum mismatch) stops the "
           "run with one StoreError line; default: it is skipped (warned once, counted, its samples drawn again)"),
    Option("batch_log", parse_optional_str, None,
           "append one JSON line per batch to this file (epoch, batch, size, mosaic samples, images, device)"),
)

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
        return cls(**resolve_options(OPTIONS, keywords, environ, owner="fastload.compat.yolov9",
                                     unknown="create_dataloader() got unexpected keyword(s)"))

    def loader_keywords(self, *, augment: bool, rect: bool, device: Any) -> dict[str, Any]:
        """The keywords of :func:`fastload.loader` these options decide, for a loader delivering on ``device``
        (None: the CPU without a copy): ``engine``, ``device``, ``hsv_on``, ``engine_options``, ``partners``,
        ``strict``."""
        # auto: on the device with the batch when there is one, else the engine's default (None)
        hsv = self.hsv if self.hsv != "auto" else ("consumer" if device is not None else None)
        return {
            "engine": self.engine,
            "device": device,
            # validation draws no HSV gains: nothing to apply anywhere, the engine's default does
            "hsv_on": hsv if augment else None,
            # a CPU-engine option: another engine refuses it (EngineOptionError) rather than dropping it
            "engine_options": {"decode_scale": "reduced"} if self.reduced_decode else None,
            # validation loaders draw no partners (the loader refuses "batch" where no mosaic is drawn)
            "partners": self.partners if self.partners != "auto" and augment and not rect else None,
            "strict": self.strict,
        }
