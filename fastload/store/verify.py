"""``fastload verify``: a full checksum pass over a store's records.

Every record's stored bytes (LMDB: the encoded image; disk/ram: the decoded pixels) and its labels
are checked against the crc32 written at conversion. Damaged records are named (index and source
file); an unfinished or unreadable store is reported as a failure rather than raised.
"""
from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

from fastload.data.config import load_data_config
from fastload.store.base import StoreError
from fastload.store.factory import open_path
from fastload.store.kinds import PARTIAL, detect_kind, finish_hint, unfinished_conversions
from fastload.store.objects.manifest import fetch, read_manifest
from fastload.store.objects.urls import is_url
from fastload.store.origin import mixed_sources
from fastload.store.space import check_space


@dataclasses.dataclass
class VerifyResult:
    """Outcome of verifying one store."""

    path: str
    kind: str | None
    n: int = 0
    bad: list[tuple[int, str, str]] = dataclasses.field(default_factory=list)  # (index, file, reason)
    error: str | None = None  # the store could not be opened at all

    @property
    def ok(self) -> bool:
        return self.error is None and not self.bad

    def format(self) -> str:
        if self.error:
            return f"FAILED {self.path}: {self.error}"
        if not self.bad:
            return f"OK {self.path}: {self.kind}, {self.n} records, all checksums match"
        lines = [f"FAILED {self.path}: {len(self.bad)} of {self.n} records damaged"]
        lines += [f"  record {i} ({f}): {why}" for i, f, why in self.bad]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ok"] = self.ok
        return d


def verify_store(path: str | Path, *, progress: bool = False) -> VerifyResult:
    """Check every record of the store at ``path``; never raises for a damaged or unfinished store."""
    path = Path(path)
    result = VerifyResult(str(path), detect_kind(path) if path.exists() else None)
    if path.name.endswith(PARTIAL) and path.is_dir():
        result.error = finish_hint(path)
        return result
    try:
        store = open_path(path)
    except (StoreError, OSError, ValueError) as e:
        result.error = str(e)
        return result
    with store:
        result.kind = store.kind
        result.n = len(store)
        for i in tqdm(range(len(store)), desc=f"verify {path.name}", unit="rec", disable=not progress):
            try:
                ok = store.record_ok(i)  # type: ignore[attr-defined]
                reason = "checksum mismatch (image bytes or labels changed)"
            except Exception as e:  # a record so damaged it cannot even be read
                ok, reason = False, f"unreadable: {e}"
            if not ok:
                result.bad.append((i, store.im_files[i], reason))
    return result


def verify_target(target: str | Path, *, progress: bool = False) -> list[VerifyResult]:
    """Verify a store directory, or every store a ``data.yaml`` records (each path once).

    For a yaml, also one failed result per split whose stores were built from different images, and one per
    interrupted conversion (``*.partial``) left beside it. An ``s3://`` URL is downloaded to a temporary folder
    first (:func:`verify_url`).
    """
    if is_url(target):
        return verify_url(str(target), progress=progress)
    target = Path(target)
    if target.is_file() and target.suffix in (".yaml", ".yml"):
        cfg = load_data_config(target)
        paths: list[Path] = []
        for kinds in cfg.stores.values():
            for p in kinds.values():
                if p not in paths:
                    paths.append(p)
        if not paths:
            return [VerifyResult(str(target), None, error="the yaml records no stores (run `fastload convert` first)")]
        results = [verify_store(p, progress=progress) for p in paths]
        for split, kinds in cfg.stores.items():
            why = mixed_sources(kinds)
            if why:
                results.append(VerifyResult(str(target), None, error=(
                    f"the {split} stores come from different datasets ({why}); convert the dataset again with --force")))
        return results + _unfinished(target.parent)
    if target.is_dir() and detect_kind(target) is None:
        if (target / "data.yaml").is_file():
            return verify_target(target / "data.yaml", progress=progress)
        if unfinished_conversions(target):  # a convert interrupted before it wrote the yaml
            return _unfinished(target)
    return [verify_store(target, progress=progress)]


def verify_url(url: str, *, progress: bool = False) -> list[VerifyResult]:
    """Verify the store uploaded at ``url``: download it into a temporary folder (each object checked against the
    manifest's size and crc32), verify every record there, and remove the folder. The results name the URL;
    a missing manifest or object, or a damaged one, is one failed result."""
    try:
        manifest = read_manifest(url)
        with tempfile.TemporaryDirectory(prefix="fastload-verify-") as tmp:
            folder = Path(tmp).resolve()
            check_space(folder, manifest.nbytes, f"the download of {url}")
            fetch(manifest, folder)
            results = verify_target(folder / "data.yaml" if (folder / "data.yaml").is_file() else folder,
                                    progress=progress)
    except StoreError as e:
        return [VerifyResult(url, None, error=str(e))]
    for r in results:
        r.path = r.path.replace(str(folder), str(manifest.url))
    return results


def _unfinished(folder: Path) -> list[VerifyResult]:
    """One failed result per interrupted conversion in ``folder``, saying how to finish it."""
    return [VerifyResult(str(p), detect_kind(p), error=finish_hint(p)) for p in unfinished_conversions(folder)]
