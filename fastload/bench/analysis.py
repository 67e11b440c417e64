"""Turn stage measurements into per-configuration ceilings and name the bottleneck in one sentence.

The model, per store (in output samples/s, i.e. augmented training images):

* read    = read rate / reads per sample (warm when the store fits in the page cache, else cold;
            warm reads scale with the worker count, cold ones are taken as one reader),
* decode  = single-core decode+resize rate x parallel workers / decodes per sample (encoded stores
            only; the machine's decoded-image cache removes the decodes of every image it holds; where the
            decoded set exceeds it, the loader plans ``partners="batch"`` (:func:`planned_partners`): each
            batch loads its own images once, so at most one decode per sample; what the loader stage
            measured, when it ran, replaces the modelled share of misses),
* augment = single-core augmentation rate x parallel workers,

where "reads per sample" is what the augmentation stage counted (4 per mosaic, + 4 when mixup fires:
4.6 for YOLOv9 scratch-high) and "parallel workers" is min(workers, usable cores). The smallest
ceiling is the bottleneck; when the measured loader reaches less than :data:`EFFICIENT` of it, the
loader itself (workers, IPC, contention) is named instead.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from fastload.bench.stages import Measurement
from fastload.store.kinds import AUTO_ORDER
from fastload.store.space import fmt_bytes

EFFICIENT = 0.6


@dataclass
class StoreInfo:
    """What the model needs to know about one store."""

    kind: str
    decoded: bool
    n: int
    bytes: int  # size at rest (files or store folder)
    loaded_bytes: int  # all loaded images at imgsz (what a decode cache or ram store holds)
    in_memory: bool  # tmpfs / ram store: reads never touch a disk

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def expected_reads(hyp: dict[str, Any]) -> float:
    """Source images read per output sample: YOLOv9 mixes a second mosaic only inside the mosaic branch."""
    p_mosaic = float(hyp.get("mosaic", 0.0))
    p_mixup = float(hyp.get("mixup", 0.0))
    return p_mosaic * (4.0 + 4.0 * p_mixup) + (1.0 - p_mosaic)


def planned_partners(info: StoreInfo, decode_cache_bytes: int) -> str:
    """Where the default loader (``partners=None``, the cpu engine) draws mosaic partners from on this store, as
    :class:`fastload.fastloader.PartnerPlan` plans them: ``"batch"`` when the decoded set of an encoded store
    exceeds the machine's decoded-image cache, else the engine's ``"dataset"`` (no cache, a decoded store, or
    a set that fits)."""
    return "batch" if not info.decoded and 0 < decode_cache_bytes < info.loaded_bytes else "dataset"


def _find(ms: Sequence[Measurement], stage: str, name: str) -> Measurement | None:
    for m in ms:
        if m.stage == stage and m.name == name and m.ok:
            return m
    return None


def _config_ceilings(
    kind: str,
    ms: Sequence[Measurement],
    info: StoreInfo,
    *,
    parallel: int,
    reads: float,
    ram_available: float,
    decode_cache_bytes: int,
    loader: Measurement | None = None,
) -> dict[str, dict[str, Any]]:
    """``{stage: {"samples_per_s": x, "why": text}}`` for one store (stages that could not be judged omitted)."""
    out: dict[str, dict[str, Any]] = {}
    warm, cold = _find(ms, "read", f"{kind} warm"), _find(ms, "read", f"{kind} cold")
    fits = info.in_memory or info.bytes < 0.5 * ram_available
    chosen, scaled = (warm, True) if (fits and warm) or not cold else (cold, False)
    if chosen is not None:
        cap = chosen.samples_per_s * (parallel if scaled else 1) / reads
        state = "warm page cache" if chosen is warm else "cold disk"
        out["read"] = {
            "samples_per_s": cap,
            "why": f"{chosen.samples_per_s:.0f} reads/s ({chosen.mb_per_s:.0f} MB/s, {state})"
            + (f" x {parallel} workers" if scaled and parallel > 1 else "")
            + f" / {reads:.1f} reads per sample",
        }
    if not info.decoded:
        dec = _find(ms, "decode", "fastload")
        if dec is None:  # the loader's own path was not asked for: the best other decoder stands in
            others = [m for m in ms if m.stage == "decode" and m.ok]
            dec = max(others, key=lambda m: m.samples_per_s) if others else None
        if dec is not None:
            cached = min(1.0, decode_cache_bytes / info.loaded_bytes) if info.loaded_bytes else 0.0
            partners = planned_partners(info, decode_cache_bytes)
            # images a sample loads (each a cache hit or a miss): with "batch" the batch's own, once each
            loads = 1.0 if partners == "batch" else reads
            per_sample = loads * (1.0 - cached)
            if loader is not None and loader.extra.get("decode_miss_fraction") is not None:
                # what the run really did (the loader stage passes no partners: it ran with this plan)
                per_sample = loads * float(loader.extra["decode_miss_fraction"])
            if per_sample > 1e-9:
                out["decode"] = {
                    "samples_per_s": dec.samples_per_s * parallel / per_sample,
                    "why": f"{dec.samples_per_s:.0f} decodes/s per core x {parallel} / {per_sample:.1f} decodes per sample"
                    + (f" ({cached:.0%} of images held by the decode cache)" if cached > 0 else ""),
                    "decodes_per_sample": per_sample,
                    "decodes_per_s_core": dec.samples_per_s,
                    "cached_fraction": cached,
                    "loaded_bytes": info.loaded_bytes,
                    "cache_bytes": decode_cache_bytes,
                    "partners": partners,
                    # YOLOv9's draw (partners="dataset"): every read the cache misses decodes
                    "dataset_partners_decodes_per_sample": reads * (1.0 - cached),
                    # partners="batch": each batch decodes its own images once, those the cache misses
                    "batch_partners_samples_per_s": dec.samples_per_s * parallel / max(1.0 - cached, 1e-9),
                }
            else:
                out["decode"] = {
                    "samples_per_s": math.inf,
                    "why": "every image is decoded once, then served from the shared decode cache",
                    "decodes_per_sample": 0.0,
                    "decodes_per_s_core": dec.samples_per_s,
                }
    aug = _find(ms, "augment", "cpu")
    if aug is not None:
        out["augment"] = {
            "samples_per_s": aug.samples_per_s * parallel,
            "why": f"{aug.samples_per_s:.0f} samples/s per core x {parallel}",
            "per_core": aug.samples_per_s,
        }
    return out


def analyse(
    ms: Sequence[Measurement],
    stores: dict[str, StoreInfo],
    *,
    cores: int,
    workers: int,
    ram_available: float,
    hyp: dict[str, Any],
    decode_cache_bytes: int,
) -> dict[str, Any]:
    """Per-configuration ceilings, the bottleneck of the configuration ``loader()`` would pick, and its sentence."""
    parallel = max(1, min(int(workers) if workers else cores, cores))
    aug = _find(ms, "augment", "cpu")
    reads = float(aug.extra["reads_per_sample"]) if aug and aug.extra.get("reads_per_sample") else expected_reads(hyp)
    configs: dict[str, dict[str, Any]] = {}
    for kind in sorted(stores, key=lambda k: AUTO_ORDER.index(k) if k in AUTO_ORDER else 99):
        loader = _find(ms, "loader", f"cpu/{kind}")
        ceil = _config_ceilings(
            kind, ms, stores[kind], parallel=parallel, reads=reads, ram_available=ram_available,
            decode_cache_bytes=decode_cache_bytes, loader=loader,
        )
        entry: dict[str, Any] = {"ceilings": ceil, "loader_samples_per_s": loader.samples_per_s if loader else None}
        if loader is not None:
            for key in ("cpu_loader_cores", "cpu_other_cores"):
                if key in loader.extra:
                    entry[key] = float(loader.extra[key])
        needed = ["read", "augment"] + ([] if stores[kind].decoded else ["decode"])
        entry["missing"] = [st for st in needed if st not in ceil]
        if ceil:
            limit = min(ceil, key=lambda s: ceil[s]["samples_per_s"])
            entry["limit"] = limit
            entry["limit_samples_per_s"] = ceil[limit]["samples_per_s"]
            if loader is not None and math.isfinite(entry["limit_samples_per_s"]):
                entry["efficiency"] = loader.samples_per_s / entry["limit_samples_per_s"]
        configs[kind] = entry
    primary = next((k for k in AUTO_ORDER if k in configs and configs[k].get("limit")), None)
    result: dict[str, Any] = {
        "reads_per_sample": reads,
        "parallel_workers": parallel,
        "cores": cores,
        "configs": configs,
        "primary": primary,
    }
    bottleneck, sentence = _sentence(primary, configs, parallel, workers, cores)
    if primary is None:
        loaders = [m for m in ms if m.stage == "loader" and m.ok]
        if loaders:
            best = max(loaders, key=lambda m: m.samples_per_s)
            sentence = (
                f"only the loader was measured (best: {best.name} at {best.samples_per_s:.0f} samples/s); "
                "add the read, decode and augment stages to name the bottleneck"
            )
    result["bottleneck"] = bottleneck
    result["sentence"] = sentence
    return result


def _sentence(
    primary: str | None, configs: dict[str, dict[str, Any]], parallel: int, workers: int, cores: int
) -> tuple[str, str]:
    if primary is None:
        return "unknown", "no bottleneck named: too few stages could be measured (see the skipped rows)"
    c = configs[primary]
    limit, cap = c["limit"], c["limit_samples_per_s"]
    info = c["ceilings"][limit]
    if c.get("missing"):
        return limit, (
            f"among the measured stages {limit} is the slowest with the {primary} store ({info['why']}, "
            f"{cap:.0f} samples/s); also measure {', '.join(c['missing'])} (--stages) to name the bottleneck"
        )
    loader = c.get("loader_samples_per_s")
    measured = f" (loader measured {loader:.0f} samples/s)" if loader else ""
    where = f"with the {primary} store"
    eff = c.get("efficiency")
    if eff is not None and eff < EFFICIENT:
        used, others = c.get("cpu_loader_cores"), c.get("cpu_other_cores")
        if others is not None and others >= 0.25 * cores:
            advice = (
                f"other processes kept {others:.1f} of the {cores} cores busy during the run, so the workers "
                "could not have them; measure on a quiet machine, or move work to the GPU (engine=gpu or engine=dali)"
            )
        elif workers < cores:
            advice = f"raise workers (now {workers}) toward the {cores} usable cores"
        elif used is not None and used < 0.8 * parallel:
            advice = (
                f"the loader kept only {used:.1f} of {parallel} cores busy: workers wait on the consumer; "
                "raise prefetch, or check the training loop is not blocking between batches"
            )
        else:
            advice = (
                f"the loader kept {used if used is not None else parallel:.1f} cores busy yet renders slower than "
                "one core alone predicts (memory bandwidth, the consumer's copy); a GPU engine "
                "(engine=gpu or engine=dali) takes the work off the CPU"
            )
        return "workers", (
            f"worker-bound {where}: the loader delivers {loader:.0f} samples/s, only {eff:.0%} of its slowest stage "
            f"({limit} at {cap:.0f} samples/s); {advice}"
        )
    if limit == "read":
        return "read", (
            f"read-bound {where}: {info['why']} cap it at {cap:.0f} samples/s{measured}; stage the dataset to a RAM "
            "disk (`fastload stage DATA --to /dev/shm/NAME`) or convert to an lmdb/ram store (`fastload convert DATA --to ram`)"
        )
    if limit == "decode":
        head = (f"decode-bound {where}: {info['decodes_per_sample']:.1f} decodes per mosaic image at "
                f"{info['decodes_per_s_core']:.0f} decodes/s per core on {parallel} worker(s) cap it at {cap:.0f} samples/s"
                f"{measured}")
        if info.get("cached_fraction", 0.0) >= 1.0:  # only the first epoch decodes: the cache holds the whole set
            return "decode", (
                f"{head}, while the machine's decoded-image cache fills in the first epoch (the decoded dataset, "
                f"{fmt_bytes(info['loaded_bytes'])}, fits its {fmt_bytes(info['cache_bytes'])}); later epochs decode "
                "nothing. For a short run: loader(..., partners=\"batch\") decodes each image once per batch"
            )
        if info["partners"] == "batch":
            return "decode", (
                f"{head}: the loader already draws mosaic partners from the batch (its plan: partners=batch (the "
                f"decoded set, {fmt_bytes(info['loaded_bytes'])}, exceeds the decode cache, "
                f"{fmt_bytes(info['cache_bytes'])})), so each image of a batch decodes once, at most 1 decode per "
                "output image, fewer as the cache serves the images it holds; partners=\"dataset\" gives YOLOv9's "
                f"draw at ~{info['dataset_partners_decodes_per_sample']:.1f} decodes per sample. Give the cache room "
                "(engine_options={\"decode_cache_mb\": ...}: one cache per machine, shared by every rank) or convert "
                "to a ram or disk store (`fastload convert DATA --to ram`)"
            )
        return "decode", (
            f"{head}: the loader has no decoded-image cache on this machine (no shared memory or file locks for it), so mosaic partners are "
            "decoded again and again. Draw them from the batch: loader(..., partners=\"batch\") decodes each image "
            f"of a batch once (at most 1 decode per output image: ceiling ~{info['batch_partners_samples_per_s']:.0f} "
            "samples/s; YOLOv9's own draw is partners=\"dataset\"); or convert to a ram or disk store "
            "(`fastload convert DATA --to ram`)"
        )
    return "augment", (
        f"augment-bound {where}: mosaic/perspective/HSV run at {info['per_core']:.0f} samples/s per core, "
        f"{cap:.0f} samples/s on {parallel} worker(s){measured}; add cores/workers or move augmentation to the GPU "
        "(engine=gpu or engine=dali)"
    )
