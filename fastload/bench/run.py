"""``run_bench``: plan the measurements, run them within the time asked, analyse, and keep the result.

Stores: by default the ``files`` store plus every store ``fastload convert`` recorded for the split in
the data.yaml (or, for a store directory, that store plus the original files when they still exist).
A kind asked for with ``stores=`` that does not exist is skipped with the reason, unless
``convert=True``: then lmdb/disk stores are built into a temporary folder (removed at the end) and a
ram store is built on demand in shared memory (released at the end). Conversions are set-up time:
printed, never part of a figure.

Budget: every measurement runs for ``seconds``; the plan (count x seconds) is printed before the first
one and the elapsed total after the last one. Set-up (scans, conversions, worker start-up, cache
drops) comes on top and is printed too.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from fastload.augment.hyp import load_hyp
from fastload.bench import pagecache
from fastload.bench.analysis import StoreInfo, analyse
from fastload.bench.ceilings import Ceilings, measure_ceilings, usable_cores
from fastload.bench.decoders import DECODERS
from fastload.bench.stages import (
    STAGES,
    Measurement,
    encoded_samples,
    measure_augment,
    measure_decode,
    measure_loader,
    measure_read,
    store_files,
)
from fastload.data.config import load_data_config
from fastload.engines.factory import ENGINES
from fastload.engines.ray_engine import disconnect as ray_disconnect
from fastload.engines.shm_cache import ENTRY_LOCKS, decoded_set_bytes, planned_cache_bytes
from fastload.store.base import StoreError
from fastload.store.convert import convert as do_convert
from fastload.store.factory import open_store
from fastload.store.files import FileStore
from fastload.store.kinds import AUTO_ORDER, CONVERT_KINDS, detect_kind

STORE_KINDS = tuple(reversed(AUTO_ORDER))  # the host stores store="auto" chooses from, slowest first
ENGINE_KINDS = tuple(ENGINES)

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class BenchResult:
    """Everything one bench run measured; :meth:`as_dict` is the ``--json`` document."""

    data: str
    split: str
    config: dict[str, Any]
    machine: Ceilings
    measurements: list[Measurement]
    stores: dict[str, StoreInfo]
    analysis: dict[str, Any]
    planned_s: float
    elapsed_s: float

    @property
    def sentence(self) -> str:
        return str(self.analysis.get("sentence", ""))

    def as_dict(self) -> dict[str, Any]:
        return {
            "data": self.data,
            "split": self.split,
            "config": self.config,
            "machine": self.machine.as_dict(),
            "stores": {k: v.as_dict() for k, v in self.stores.items()},
            "measurements": [m.as_dict() for m in self.measurements],
            "stages": {s: [m.name for m in self.measurements if m.stage == s] for s in STAGES},
            "analysis": _jsonable(self.analysis),
            "bottleneck": self.sentence,
            "planned_s": self.planned_s,
            "elapsed_s": self.elapsed_s,
        }

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.as_dict(), indent=2))
        return path


def _jsonable(obj: Any) -> Any:
    """Replace non-finite floats (an unlimited ceiling) by None so that the JSON stays standard."""
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not np.isfinite(obj):
        return None
    return obj


@dataclass
class _Source:
    """One store kind: how to open it for reading and what to hand the loader; or why it is skipped."""

    kind: str
    data: Any = None  # loader / open_store ``data``
    skipped: str | None = None
    store: Any = None  # the opened store while the bench runs


def _default_engines() -> list[str]:
    """Every engine whose optional package is installed, those that render on a device only when CUDA is
    present (``ray``: on the cluster ``ray.init()`` finds, else a local instance on this machine)."""
    cuda = torch.cuda.is_available()
    return [name for name, cls in ENGINES.items()
            if (cls.renders_on == "host" or cuda) and (cls.requires is None or _installed(cls.requires))]


def _installed(module: str) -> bool:
    """Whether ``module`` (dotted) can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False


def _parse_list(value: str | Sequence[str] | None, allowed: Sequence[str], what: str) -> list[str] | None:
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else [x for v in value for x in str(v).split(",")]
    items = [x.strip() for x in items if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad:
        raise ValueError(f"unknown {what} {bad}; choose from {', '.join(allowed)}")
    return list(dict.fromkeys(items))


def _resolve_sources(
    data: Any, split: str, kinds: list[str] | None, imgsz: int, convert: bool, tmp: Path | None, log: Log
) -> tuple[list[_Source], Any]:
    """Decide where each store kind comes from; returns the sources and the DataConfig (or None)."""
    if isinstance(data, (str, os.PathLike)) and Path(data).is_dir() and detect_kind(Path(data)):
        # a store directory: that store, plus the original files when they are still on disk
        found = detect_kind(Path(data))
        wanted = kinds or ["files", found]
        out = []
        for k in wanted:
            if k == found:
                out.append(_Source(k, data=str(data)))
            elif k == "files":
                out.append(_Source(k, data=None))  # filled from the opened store's im_files
            else:
                out.append(_Source(k, skipped=f"{data} is a {found} store; pass a data.yaml to compare other stores"))
        return out, None

    cfg = load_data_config(data)
    if split not in cfg.splits:
        raise ValueError(f"split {split!r} is not defined in {cfg.origin} (it defines {', '.join(cfg.splits)})")
    recorded = dict((cfg.stores or {}).get(split, {}))
    wanted = kinds or ["files", *[k for k in STORE_KINDS if k in recorded and k in CONVERT_KINDS]]
    missing = [k for k in wanted if k in CONVERT_KINDS and k not in recorded]
    data_for: dict[str, Any] = {k: data for k in wanted}
    if missing and convert:
        disk_kinds = [k for k in missing if k != "ram"]
        if "ram" in missing and "disk" not in recorded and "disk" not in disk_kinds:
            disk_kinds.append("disk")  # the ram store is then a copy of it (no second decode)
        if disk_kinds:
            assert tmp is not None
            t0 = time.perf_counter()
            log(f"converting {'/'.join(disk_kinds)} for split {split!r} into {tmp} (set-up, not timed) ...")
            res = do_convert(data, to=disk_kinds, out=tmp, imgsz=imgsz, splits=[split], progress=False, log=lambda m: None)
            log(f"  converted in {time.perf_counter() - t0:.1f} s")
            for k in missing:
                data_for[k] = str(res.yaml_path)
        else:
            for k in missing:
                data_for[k] = data
    out = []
    for k in wanted:
        if k == "files" or k in recorded or convert:
            out.append(_Source(k, data=data_for[k]))
        else:
            origin = cfg.yaml_path or "the data config"
            out.append(_Source(k, skipped=(
                f"no {k} store recorded for {split!r} in {origin}; run `fastload convert {origin} --to {k}` "
                "and bench the data.yaml it writes, or pass --convert"
            )))
    return out, cfg


def _open(src: _Source, split: str, imgsz: int, sources: list[_Source]) -> Any:
    if src.kind == "files" and src.data is None:
        base = next((s.store for s in sources if s.store is not None), None)
        if base is None:
            raise FileNotFoundError("no store to take the file list from")
        if not base.im_files or not Path(base.im_files[0]).is_file():
            raise FileNotFoundError(f"the original images of {base.path} are not on this machine")
        return FileStore(base.im_files, base.labels, base.shapes, base.names, path=str(Path(base.im_files[0]).parent))
    return open_store(src.data, split=split, kind=src.kind, imgsz=imgsz)


def _store_info(store: Any, imgsz: int) -> StoreInfo:
    files = store_files(store)
    size = 0
    for f in files:
        try:
            size += os.path.getsize(f)
        except OSError:
            pass
    return StoreInfo(
        kind=store.kind, decoded=bool(store.decoded), n=len(store), bytes=size,
        loaded_bytes=decoded_set_bytes(store, imgsz, "yolov9"),  # what the loader's partners plan compares
        in_memory=store.kind == "ram" or pagecache.in_memory(files),
    )


def _decode_cache_bytes() -> int:
    """The decoded-image cache bound the loader plans its mosaic partners by (0: no cache on this platform)."""
    return planned_cache_bytes(None) if ENTRY_LOCKS else 0


def _fmt_row(m: Measurement) -> str:
    if m.skipped:
        return f"skipped: {m.skipped}"
    return f"{m.samples_per_s:9.1f} samples/s {m.mb_per_s:8.1f} MB/s  ({m.samples} in {m.seconds:.1f} s)"


def run_bench(
    data: Any,
    *,
    split: str = "train",
    stages: str | Sequence[str] | None = None,
    stores: str | Sequence[str] | None = None,
    engines: str | Sequence[str] | None = None,
    decoders: str | Sequence[str] | None = None,
    batch: int = 64,
    workers: int | None = None,
    seconds: float = 5.0,
    imgsz: int = 640,
    hyp: Any = None,
    convert: bool = False,
    log: Log | None = _stderr,
) -> BenchResult:
    """Measure each stage on ``data`` (a data.yaml or a store directory) and name the bottleneck.

    Args:
      stages: subset of ``read, decode, augment, loader`` (default: all).
      stores: store kinds (default: files plus what ``fastload convert`` recorded).
      engines: loader engines (default: cpu, plus gpu/dali where CUDA is present, plus ray where Ray is installed).
      decoders: decoders for the decode stage (default: all; unavailable ones are skipped rows).
      batch, workers: loader batch size and worker processes (default workers: usable cores, at most 8).
      seconds: wall-time budget of each measurement.
      convert: build missing lmdb/encoded/disk/ram stores in a temporary folder instead of skipping them.
      log: progress lines (None: silent).
    """
    say: Log = log or (lambda m: None)
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    stage_list = _parse_list(stages, STAGES, "stage(s)") or list(STAGES)
    kinds = _parse_list(stores, STORE_KINDS, "store kind(s)")
    engine_list = _parse_list(engines, ENGINE_KINDS, "engine(s)") or _default_engines()
    decoder_list = _parse_list(decoders, DECODERS, "decoder(s)") or list(DECODERS)
    cores = usable_cores()
    n_workers = int(workers) if workers is not None else min(8, cores)
    hyp_d = load_hyp(hyp)
    t_all = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="fastload-bench-")) if convert else None
    measurements: list[Measurement] = []
    infos: dict[str, StoreInfo] = {}
    sources: list[_Source] = []
    try:
        sources, _cfg = _resolve_sources(data, split, kinds, imgsz, convert, tmp, say)
        # a files store derived from a store directory needs that store open first
        for src in sorted(sources, key=lambda s: s.kind == "files" and s.data is None):
            if src.skipped:
                continue
            t0 = time.perf_counter()
            try:
                src.store = _open(src, split, imgsz, sources)
            except Exception as e:
                known = isinstance(e, (StoreError, OSError, ValueError))  # the message says it all
                src.skipped = f"cannot open: {'' if known else type(e).__name__ + ': '}{e}"
                continue
            infos[src.kind] = _store_info(src.store, imgsz)
            say(f"store {src.kind}: {len(src.store)} samples, {infos[src.kind].bytes / 1e6:.1f} MB "
                f"(opened in {time.perf_counter() - t0:.1f} s)")
        live = [s for s in sources if s.store is not None]
        if not live:  # nothing to measure: one error, not a report of skipped rows
            reason = next((s.skipped for s in sources if s.skipped), "no store")
            raise StoreError(f"cannot bench {data} [{split}]: {reason.removeprefix('cannot open: ')}")
        for src in sources:
            if src.skipped:
                say(f"store {src.kind}: {src.skipped}")
        n_timed = (
            ("read" in stage_list) * 2 * len(live)
            + ("decode" in stage_list) * len(decoder_list)
            + ("augment" in stage_list)
            + ("loader" in stage_list) * len(engine_list) * len(live)
        )
        planned = n_timed * seconds + min(seconds, 0.5) * 1.5
        say(f"fastload bench: {n_timed} measurements x {seconds:g} s + ceilings ~ {planned:.0f} s "
            f"(plus set-up: cache drops, pre-decoding, worker start-up); {cores} usable cores, {n_workers} workers")

        say("ceilings: memcpy, raw sequential read ...")
        raw_paths: list[str] = []
        for s in live:
            if not infos[s.kind].in_memory:  # a RAM copy says nothing about the disk
                raw_paths += store_files(s.store)[:2000]
        machine = measure_ceilings(raw_paths, seconds=min(seconds, 0.5))
        say(f"  memcpy {machine.memcpy_mb_s:.0f} MB/s per core; raw read "
            + (f"{machine.raw_read_mb_s:.0f} MB/s ({machine.raw_read_note})" if machine.raw_read_mb_s else "n/a"))

        def add(rows: list[Measurement]) -> None:
            for m in rows:
                measurements.append(m)
                say(f"  {m.stage:7s} {m.name:16s} {_fmt_row(m)}")

        for src in sources:
            if src.skipped and "read" in stage_list:
                add([Measurement("read", f"{src.kind} warm", skipped=src.skipped)])
        if "read" in stage_list:
            say("stage read: random-order reads, cold (page cache dropped) then warm")
            for s in live:
                add(measure_read(s.store, seconds))
        if "decode" in stage_list:
            enc = next((s.store for s in live if not s.store.decoded), None)
            say("stage decode: one core, encoded bytes already in memory")
            samples = encoded_samples(enc, seconds) if enc is not None else []
            rows = measure_decode(samples, seconds, imgsz, decoder_list)
            if enc is None:
                for m in rows:
                    m.skipped = "no encoded store (files/lmdb) to take bytes from"
            add(rows)
        if "augment" in stage_list:
            say("stage augment: sampled records drawn from pre-decoded images, one core")
            src_store = next((s.store for s in sorted(live, key=lambda s: AUTO_ORDER.index(s.kind))), None)
            if src_store is None:
                add([Measurement("augment", "cpu", skipped="no store could be opened")])
            else:
                add([measure_augment(src_store, seconds, imgsz, hyp_d)])
        if "loader" in stage_list:
            say(f"stage loader: fastload.loader(batch={batch}, workers={n_workers}) per engine and store")
            for engine in engine_list:
                for s in sources:
                    if s.store is None:
                        add([Measurement("loader", f"{engine}/{s.kind}", skipped=s.skipped or "store unavailable")])
                        continue
                    # A files store made from a store directory's list is handed over as an object.
                    loader_data = s.data if s.data is not None else s.store
                    add([measure_loader(loader_data, engine, s.kind, seconds, split=split, imgsz=imgsz,
                                        batch=batch, workers=n_workers, hyp=hyp_d)])
    finally:
        ray_disconnect()  # a local Ray instance a ray engine of the bench started stops with it (no-op otherwise)
        for s in sources:
            if s.store is not None:
                try:
                    s.store.close()
                except Exception:
                    pass
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    analysis = analyse(
        measurements, infos, cores=cores, workers=n_workers, ram_available=machine.ram_available_gb * 1e9,
        hyp=hyp_d, decode_cache_bytes=_decode_cache_bytes(),
    )
    elapsed = time.perf_counter() - t_all
    say(f"fastload bench: done in {elapsed:.1f} s (planned {planned:.0f} s of measurement)")
    config = {
        "stages": stage_list, "stores": [s.kind for s in sources], "engines": engine_list, "decoders": decoder_list,
        "batch": batch, "workers": n_workers, "seconds": seconds, "imgsz": imgsz, "convert": convert,
    }
    return BenchResult(
        data=str(data), split=split, config=config, machine=machine, measurements=measurements, stores=infos,
        analysis=analysis, planned_s=planned, elapsed_s=elapsed,
    )
