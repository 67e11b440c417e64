"""``fastload info``: counts (polygons, keypoint instances and OBB-shaped rows too), per-class histogram,
image-size distribution and bytes.

Works on a ``data.yaml`` (scans each split; label files without images are counted and ignored) or
on a store directory (reads the store's own index). Everything is returned as a JSON-able dict and
rendered as text by :func:`format_info`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from fastload.data.config import load_data_config
from fastload.data.index import build_index
from fastload.data.labels import FlatLabels
from fastload.store import shm
from fastload.store.factory import open_path
from fastload.store.base import StoreError
from fastload.store.kinds import detect_kind, finish_hint, shm_root, unfinished_conversions
from fastload.store.objects.manifest import read_manifest
from fastload.store.objects.urls import is_url
from fastload.store.origin import mixed_sources
from fastload.store.space import fmt_bytes, tree_bytes

# Long-side buckets of the image-size histogram.
SIZE_BUCKETS = (320, 640, 1024, 2048)


def _geometry_stats(flat: FlatLabels, kpt_shape: Sequence[int] | None) -> dict[str, Any]:
    """What a split's label points hold: ``polygons`` (segment rows) and ``obb_shaped`` (those with 4 corners), or
    ``keypoint_instances`` with ``kpt_shape``; nothing for labels without points."""
    counts = flat.point_counts
    if flat.points is None or counts is None:
        return {}
    if flat.points.shape[1] == 3:
        return {"keypoint_instances": int((counts > 0).sum()),
                "kpt_shape": [int(v) for v in kpt_shape] if kpt_shape is not None else None}
    return {"polygons": int((counts > 0).sum()), "obb_shaped": int((counts == 4).sum())}


def _store_kpt_shape(store: Any) -> list[int] | None:
    return (store.meta.get("geometry") or {}).get("kpt_shape")


def _split_stats(labels: Sequence[np.ndarray], shapes: np.ndarray, names: Sequence[str],
                 kpt_shape: Sequence[int] | None = None) -> dict[str, Any]:
    """Counts, class histogram, size distribution and label geometry of one split."""
    shapes = np.asarray(shapes, np.int64).reshape(-1, 2)
    flat = FlatLabels.from_arrays(labels)  # an index's labels already are: no per-image work
    counts = flat.counts
    classes = flat.rows[:, 0].astype(np.int64)
    hist = np.bincount(classes, minlength=len(names)) if len(classes) else np.zeros(len(names), np.int64)
    per_class = {
        (names[c] if c < len(names) else f"class{c}"): int(hist[c]) for c in range(len(hist)) if hist[c] or c < len(names)
    }
    long_side = shapes.max(axis=1) if len(shapes) else np.zeros(0, np.int64)
    edges = [0, *SIZE_BUCKETS]
    buckets = {f"<={hi}": int(((long_side > lo) & (long_side <= hi)).sum()) for lo, hi in zip(edges[:-1], edges[1:])}
    buckets[f">{SIZE_BUCKETS[-1]}"] = int((long_side > SIZE_BUCKETS[-1]).sum())

    def dist(v: np.ndarray) -> dict[str, int]:
        if not len(v):
            return {}
        return {"min": int(v.min()), "median": int(np.median(v)), "max": int(v.max())}

    return {
        "images": int(len(counts)),
        "backgrounds": int((counts == 0).sum()),
        "instances": int(counts.sum()),
        **_geometry_stats(flat, kpt_shape),
        "per_class": per_class,
        "height": dist(shapes[:, 0]) if len(shapes) else {},
        "width": dist(shapes[:, 1]) if len(shapes) else {},
        "long_side": buckets,
    }


def dataset_info(target: str | Path, splits: Sequence[str] | None = None) -> dict[str, Any]:
    """Info about a data.yaml (every split, or ``splits``), a store directory, or a store in object storage
    (:func:`url_info`)."""
    if is_url(target):
        return url_info(str(target), splits)
    target = Path(target)
    if target.is_dir() and detect_kind(target) is not None:
        return store_info(target)
    if target.is_dir() and (target / "data.yaml").is_file():
        target = target / "data.yaml"
    elif target.is_dir() and unfinished_conversions(target):  # a convert interrupted before it wrote the yaml
        raise StoreError(f"{target} holds no data.yaml and no finished store: " + "; ".join(
            f"{p} is {finish_hint(p)}" for p in unfinished_conversions(target)))
    cfg = load_data_config(target)
    out: dict[str, Any] = {"source": str(target), "type": "dataset", "names": cfg.names, "splits": {}}
    unfinished = unfinished_conversions(target.parent)
    if unfinished:
        out["unfinished"] = {str(p): finish_hint(p) for p in unfinished}
    for split in splits or list(cfg.splits):
        recorded = cfg.stores.get(split, {})
        gone = [src for src in cfg.splits.get(split, []) if not Path(src).exists()]
        # the yaml of stores staged or copied without their images: a split is described from its store's index,
        # and one that has no store here (not converted) is named as absent unless it was asked for
        described = _split_from_store(recorded, cfg.names) if gone and recorded else None
        if described is not None:
            out["splits"][split] = described
            continue
        if gone and cfg.stores and not recorded and not splits:
            out.setdefault("absent", {})[split] = f"no store of it here, and its images are not at {gone[0]}"
            continue
        index = build_index(cfg, split, progress=False)
        rep = index.report
        stats = _split_stats(index.labels, index.shapes, cfg.names, cfg.kpt_shape)
        stats.update(
            without_label_file=int(rep.missing),
            empty_label_file=int(rep.empty),
            corrupt=int(rep.corrupt),
            labels_without_image=int(rep.labels_without_image),
            problems=rep.by_kind(),
            bytes=int(index.im_bytes.sum()),  # sizes the scan's validation just read
            stores={k: str(p) for k, p in cfg.stores.get(split, {}).items()},
        )
        why = mixed_sources(cfg.stores.get(split, {}))
        if why:
            stats["mixed_stores"] = why
        out["splits"][split] = stats
    return out


def _split_from_store(recorded: dict[str, Path], names: Sequence[str]) -> dict[str, Any] | None:
    """A split's info from the index of the first of its ``recorded`` stores that opens (its source images are
    not there to scan), or None when none opens."""
    for kind, path in recorded.items():
        try:
            store = open_path(path)
        except StoreError:
            continue
        with store:
            stats = _split_stats(store.labels, store.shapes, names, _store_kpt_shape(store))
        stats.update(bytes=tree_bytes(path), stores={k: str(p) for k, p in recorded.items()}, described_by=str(path))
        why = mixed_sources(recorded)
        if why:
            stats["mixed_stores"] = why
        return stats
    return None


def url_info(url: str, splits: Sequence[str] | None = None) -> dict[str, Any]:
    """Info about the store uploaded at ``url``: the summary its manifest carries (written by the upload from the
    stores' own indexes), plus when it was uploaded and how many objects and bytes it holds; nothing else is
    downloaded."""
    manifest = read_manifest(url)
    info = dict(manifest.info, source=str(manifest.url),
                uploaded={"created": manifest.created, "objects": len(manifest.objects), "bytes": manifest.nbytes})
    unknown = [s for s in splits or () if s not in info.get("splits", {})]
    if unknown:
        raise StoreError(f"{url} holds no split {', '.join(unknown)} (it holds {', '.join(info.get('splits', {}))})")
    if splits:
        info["splits"] = {s: info["splits"][s] for s in splits}
    return info


def store_info(path: str | Path) -> dict[str, Any]:
    """Info about one store directory, read from the store's index (no source files needed)."""
    path = Path(path)
    with open_path(path) as store:
        stats = _split_stats(store.labels, store.shapes, store.names, _store_kpt_shape(store))
        stats["bytes"] = tree_bytes(path)
        return {
            "source": str(path),
            "type": "store",
            "kind": store.kind,
            "imgsz": store.imgsz,
            "load_rule": store.load_rule,
            "names": store.names,
            "meta": {k: v for k, v in store.meta.items() if k != "names"},
            "splits": {"store": stats},
        }


def shm_info() -> list[dict[str, Any]]:
    """Every fastload segment under the shm root (see :mod:`fastload.store.shm`)."""
    return [s.as_dict() for s in shm.list_segments()]


def format_shm(segments: list[dict[str, Any]]) -> str:
    """One line per segment of :func:`shm_info`: path, size and state (stale ones marked)."""
    if not segments:
        return f"no fastload segments in {shm_root()}"
    lines = [f"{'segment':<52} {'size':>10}  state"]
    for s in segments:
        state = "complete" if s["complete"] else "UNFINISHED"
        state += ", pinned" if s["pinned"] else ""
        state += f", live holders {s['live']}" if s["live"] else ""
        state += f", dead holders {s['dead']}" if s["dead"] else ""
        state += "  <- stale (fastload unstage --stale removes it)" if s["stale"] else ""
        lines.append(f"{s['path']:<52} {fmt_bytes(s['nbytes']):>10}  {state}")
    return "\n".join(lines)


def format_info(info: dict[str, Any], top: int = 20) -> str:
    """Human-readable rendering of :func:`dataset_info`'s dict."""
    head = f"{info['source']}"
    if info["type"] == "store":
        head += (f"  ({info['kind']} store" + (f", imgsz {info['imgsz']}" if info.get("imgsz") else "")
                 + (f", {info['load_rule']} loaded images" if info.get("load_rule") else "") + ")")
    lines = [head, f"classes: {len(info['names'])}"]
    if info.get("uploaded"):
        up = info["uploaded"]
        lines.append(f"uploaded {up['created']}: {up['objects']} objects, {fmt_bytes(up['bytes'])}")
    for split, s in info["splits"].items():
        lines.append(f"[{split}] {s['images']} images, {s['backgrounds']} backgrounds, {s['instances']} instances, {fmt_bytes(s['bytes'])}")
        if "polygons" in s:
            lines.append(f"  polygons (segments) {s['polygons']}, of them OBB-shaped (4 corners) {s['obb_shaped']}")
        if "keypoint_instances" in s:
            lines.append(f"  keypoint instances {s['keypoint_instances']}, kpt_shape {s['kpt_shape']}")
        if s.get("described_by"):
            lines.append(f"  from the index of {s['described_by']} (the source images are not there to scan)")
        extra = [f"{k.replace('_', ' ')} {s[k]}" for k in ("without_label_file", "empty_label_file", "corrupt", "labels_without_image") if k in s]
        if extra:
            lines.append("  " + ", ".join(extra))
        if s.get("problems"):
            lines.append("  problems: " + ", ".join(f"{k} {v}" for k, v in sorted(s["problems"].items())))
        if s["height"]:
            lines.append(
                "  size (h x w): min {}x{}, median {}x{}, max {}x{}".format(
                    s["height"]["min"], s["width"]["min"], s["height"]["median"], s["width"]["median"],
                    s["height"]["max"], s["width"]["max"],
                )
            )
            lines.append("  long side: " + ", ".join(f"{k}: {v}" for k, v in s["long_side"].items()))
        ranked = sorted(((v, k) for k, v in s["per_class"].items() if v), reverse=True)
        if ranked:
            shown = ", ".join(f"{k} {v}" for v, k in ranked[:top])
            more = f" (+{len(ranked) - top} more classes)" if len(ranked) > top else ""
            lines.append(f"  instances per class: {shown}{more}")
        for kind, p in (s.get("stores") or {}).items():
            lines.append(f"  store {kind}: {p}")
        if s.get("mixed_stores"):
            lines.append(f"  WARNING: these stores come from different datasets ({s['mixed_stores']}); loaders refuse "
                         f"them until the dataset is converted again with --force")
    for split, why in info.get("absent", {}).items():
        lines.append(f"[{split}] {why}")
    for path, hint in info.get("unfinished", {}).items():
        lines.append(f"UNFINISHED {path}: {hint}")
    return "\n".join(lines)
