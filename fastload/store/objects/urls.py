"""Object-storage URLs: telling one from a local path, and splitting ``s3://bucket/prefix`` into its parts."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fastload.store.base import StoreError

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def is_url(value: Any) -> bool:
    """True for a ``scheme://...`` string (any scheme: :func:`parse_url` refuses the ones not read here)."""
    return isinstance(value, str) and _SCHEME.match(value) is not None


@dataclass(frozen=True)
class ObjectUrl:
    """``s3://bucket/key``; ``key`` has no leading or trailing slash (``""``: the bucket's root)."""

    bucket: str
    key: str

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def child(self, relative: str) -> "ObjectUrl":
        """The object ``relative`` (a ``/``-separated path) below this prefix."""
        return ObjectUrl(self.bucket, f"{self.key}/{relative}" if self.key else relative)


def parse_url(text: str) -> ObjectUrl:
    """``s3://bucket/prefix`` as an :class:`ObjectUrl`; another scheme or no bucket is a StoreError naming it."""
    m = _SCHEME.match(text)
    if m is None or m.group(1).lower() != "s3":
        raise StoreError(
            f"{text}: only s3:// URLs are supported (GCS, MinIO, Ceph and other S3-compatible servers are reached "
            f"as s3:// with AWS_ENDPOINT_URL set to their endpoint)")
    bucket, _, key = text[m.end():].partition("/")
    if len(bucket) < 3 or "/" in bucket:
        raise StoreError(f"{text}: no bucket name (bucket names have 3 or more characters): write s3://BUCKET/PREFIX")
    key = key.strip("/")
    if any(part in ("", ".", "..") for part in key.split("/")) and key:
        raise StoreError(f"{text}: the prefix has an empty, '.' or '..' part; write s3://BUCKET/a/b")
    return ObjectUrl(bucket, key)
