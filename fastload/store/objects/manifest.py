"""The manifest that commits a store to object storage, and publishing / fetching a folder through it.

Layout under ``s3://bucket/prefix``::

    fastload-manifest.json     the commit record, written last: build id, every object's path, size, crc32,
                               and a summary for `fastload info` (counts, classes, sizes per split)
    builds/<build>/<path>      the objects of one upload (a folder's files, by their relative paths)

An upload puts every object of a new build first and the manifest last, so a reader sees the previous
store or the new one, never a mix or a half-written one; a prefix without a manifest is refused. Once the
manifest names the new build, the objects of other builds under ``builds/`` (the replaced store, uploads
that were interrupted) are deleted. One writer per prefix at a time: two uploads racing into the same
prefix are not detected.
"""
from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from fastload._version import __version__
from fastload.data.checksum import file_crc32
from fastload.store.base import StoreError
from fastload.store.objects.client import (
    MissingObjectError, RetryPolicy, missing_bucket, retry_policy, s3_client, with_retries,
)
from fastload.store.objects.transfer import PARALLEL, PART_BYTES, Download, TransferStats, download, upload
from fastload.store.objects.urls import ObjectUrl, parse_url
from fastload.store.space import fmt_bytes

MANIFEST = "fastload-manifest.json"
BUILDS = "builds"
FORMAT = "fastload-objects"
FORMAT_VERSION = 1


class NoManifestError(StoreError):
    """The prefix holds no manifest: no store was uploaded there, or its upload did not finish."""


@dataclass(frozen=True)
class Manifest:
    """A published store: its prefix, build id, objects as (relative path, size, crc32), and the info summary."""

    url: ObjectUrl
    build: str
    objects: tuple[tuple[str, int, int], ...]
    info: dict[str, Any]
    created: str

    @property
    def nbytes(self) -> int:
        return sum(size for _, size, _ in self.objects)

    def object_url(self, relative: str) -> ObjectUrl:
        return self.url.child(f"{BUILDS}/{self.build}/{relative}")

    def as_json(self) -> str:
        return json.dumps({"format": FORMAT, "version": FORMAT_VERSION, "build": self.build, "created": self.created,
                           "fastload": __version__,
                           "objects": [{"path": p, "size": s, "crc32": c} for p, s, c in self.objects],
                           "info": self.info}, indent=1)


def read_manifest(url: str | ObjectUrl, client: Any = None, policy: RetryPolicy | None = None) -> Manifest:
    """The manifest of the store at ``url`` (retried within ``policy``, default :func:`retry_policy`); a
    StoreError naming it when there is none (nothing uploaded there, or an upload that did not finish) or it
    cannot be read."""
    prefix = parse_url(url) if isinstance(url, str) else url
    where = prefix.child(MANIFEST)
    client = client or s3_client()

    def get() -> bytes:
        return client.get_object(Bucket=where.bucket, Key=where.key)["Body"].read()

    try:
        raw = with_retries(get, where, "reading the manifest", policy)
    except MissingObjectError:
        raise NoManifestError(f"{prefix} holds no finished fastload store (no {MANIFEST}: nothing was uploaded there, "
                             f"or an upload was interrupted before it finished); run `fastload convert DATA.yaml "
                             f"--out {prefix}` to upload one") from None
    try:
        doc = json.loads(raw)
        if doc.get("format") != FORMAT or int(doc.get("version", 0)) > FORMAT_VERSION:
            raise ValueError(f"format {doc.get('format')!r} version {doc.get('version')!r}, this fastload reads "
                             f"{FORMAT} version <= {FORMAT_VERSION}")
        objects = tuple((str(o["path"]), int(o["size"]), int(o["crc32"])) for o in doc["objects"])
        return Manifest(prefix, str(doc["build"]), objects, dict(doc.get("info") or {}), str(doc.get("created", "")))
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # not JSON, or not the manifest's shape
        raise StoreError(f"{where}: damaged manifest ({e})") from None


def check_writable(url: str, *, force: bool = False, policy: RetryPolicy | None = None) -> ObjectUrl:
    """The prefix ``url`` names, once its bucket is known to exist and it holds no store (or ``force``); both
    checked within ``policy`` (default :func:`retry_policy`)."""
    prefix = parse_url(url)
    client = s3_client()
    try:
        with_retries(lambda: client.head_bucket(Bucket=prefix.bucket), prefix, "checking the bucket", policy)
    except MissingObjectError:  # HEAD answers have no body: a missing bucket is a bare 404, no NoSuchBucket code
        raise missing_bucket(prefix) from None
    try:
        old = read_manifest(prefix, client, policy)
    except NoManifestError:
        return prefix
    if not force:
        raise StoreError(f"{prefix} already holds a fastload store (uploaded {old.created or 'earlier'}); pass --force "
                         f"to replace it (readers keep the old one until the new one is complete)")
    return prefix


def publish(files: Sequence[tuple[Path, str]], url: str, *, info: dict[str, Any], force: bool = False,
            parallel: int = PARALLEL, log: Callable[[str], None] = print,
            policy: RetryPolicy | None = None) -> Manifest:
    """Upload ``files`` (local path, relative path) as a new build under ``url``, then its manifest, then delete
    the objects of every other build there; every request retried within ``policy`` (default
    :func:`retry_policy`). A prefix that already holds a store is refused unless ``force``."""
    policy = policy or retry_policy()
    prefix = check_writable(url, force=force, policy=policy)
    writer = s3_client(botocore_retries=True)
    build = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(4)
    objects = tuple((rel, *file_crc32(path)) for path, rel in files)
    manifest = Manifest(prefix, build, objects, info, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    try:
        stats = upload(writer, [(path, manifest.object_url(rel)) for path, rel in files], parallel=parallel,
                       policy=policy)
    except StoreError as exc:  # the manifest was not written: say what readers see, not only what failed
        raise StoreError(f"{exc}; nothing was published: readers of {prefix} still see what it held before (the "
                         f"upload's manifest was not written); run the command again") from exc
    where = prefix.child(MANIFEST)
    # the commit: from here on readers see the new build
    with_retries(lambda: writer.put_object(Bucket=where.bucket, Key=where.key, Body=manifest.as_json().encode(),
                                           ContentType="application/json"), where, "writing the manifest", policy)
    removed = with_retries(lambda: _delete_other_builds(writer, prefix, build), prefix.child(BUILDS),
                           "removing the objects of earlier uploads (the new store is complete)", policy)
    log(f"uploaded {stats.objects} objects ({fmt_bytes(stats.nbytes)}) to {prefix}" +
        (f"; removed {removed} objects of the replaced or interrupted uploads" if removed else ""))
    return manifest


def _delete_other_builds(client: Any, prefix: ObjectUrl, build: str) -> int:
    """Delete the objects under ``builds/`` of every build but ``build``; how many (a retry lists them again)."""
    builds = prefix.child(BUILDS)
    keep = f"{builds.key}/{build}/"
    stale: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=prefix.bucket, Prefix=builds.key + "/"):
        stale += [o["Key"] for o in page.get("Contents", []) if not o["Key"].startswith(keep)]
    for i in range(0, len(stale), 1000):  # DeleteObjects takes at most 1000 keys
        client.delete_objects(Bucket=prefix.bucket,
                              Delete={"Objects": [{"Key": k} for k in stale[i:i + 1000]], "Quiet": True})
    return len(stale)


def fetch(manifest: Manifest, dest: Path, *, parallel: int = PARALLEL, part_bytes: int = PART_BYTES,
          policy: RetryPolicy | None = None, progress: Callable[[int], None] | None = None,
          client: Any = None) -> TransferStats:
    """Download every object ``manifest`` lists into the folder ``dest`` (each checked against its size and crc32;
    see :func:`~fastload.store.objects.transfer.download`)."""
    items = []
    for rel, size, crc in manifest.objects:
        target = (dest / rel).resolve()
        if not target.is_relative_to(dest.resolve()):  # a manifest must not write outside the folder
            raise StoreError(f"{manifest.url.child(MANIFEST)}: object path {rel!r} leaves the store folder")
        items.append(Download(manifest.object_url(rel), size, crc, target))
    return download(client or s3_client(), items, parallel=parallel, part_bytes=part_bytes, policy=policy,
                    progress=progress)
