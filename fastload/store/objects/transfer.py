"""Moving whole objects between object storage and local files.

Downloads split each object into ranges read in parallel by a thread pool; a range whose connection drops
or that meets a 5xx is retried with backoff from the byte where it stopped, for as long as the retry budget
allows (:func:`~fastload.store.objects.client.with_retries`). Every object lands in a hidden
temporary file beside its destination and is renamed into place only once its size and crc32 match what was
expected, so a half-downloaded or damaged object is never where a reader looks. Uploads send each file whole
(botocore splits big ones into parts and retries them; a file whose upload fails is sent again within the
budget).
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from fastload.data.checksum import file_crc32
from fastload.store.base import StoreError
from fastload.store.objects.client import RetryPolicy, ShortRead, retry_policy, with_retries
from fastload.store.objects.urls import ObjectUrl

PART_BYTES = 8 << 20  # one ranged GET; big enough to amortise a request, small enough to spread one object
PARALLEL = 16  # ranged GETs (or uploads) in flight
READ_CHUNK = 1 << 20


@dataclass(frozen=True)
class Download:
    """One object, or the bytes ``start .. start + size`` of one, to fetch into ``dest``: the crc32 those bytes
    must have, or ``check`` (given the downloaded file, raising StoreError) where the caller checks them
    itself; ``object_size``, the size the whole object must have (default ``size``)."""

    url: ObjectUrl
    size: int
    crc32: int | None
    dest: Path
    start: int = 0
    object_size: int | None = None
    check: Callable[[Path], None] | None = None


@dataclass
class TransferStats:
    """What a transfer did: objects, bytes, and how many requests were retried (each retry resumed its range)."""

    objects: int = 0
    nbytes: int = 0
    retries: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int = 0, retries: int = 0) -> None:
        with self._lock:
            self.nbytes += nbytes
            self.retries += retries


def download(client: Any, items: Sequence[Download], *, parallel: int = PARALLEL, part_bytes: int = PART_BYTES,
             policy: RetryPolicy | None = None, progress: Callable[[int], None] | None = None,
             stop: threading.Event | None = None) -> TransferStats:
    """Fetch ``items`` with parallel ranged GETs, each retried within ``policy`` (default: :func:`retry_policy`);
    returns the stats. Raises StoreError naming the URL when an object is missing, has another size than
    expected, fails its crc32 or keeps failing; nothing of a failed call is left at any ``dest``, and no
    temporary file is left either. ``stop``, once set, abandons the download (its requests stop retrying and it
    raises); the download sets it itself when one of its requests fails for good."""
    policy = policy or retry_policy()
    stats = TransferStats(objects=len(items))
    stop = stop or threading.Event()
    temps = [partial_path(item.dest) for item in items]
    fds: list[int] = []
    try:
        with cf.ThreadPoolExecutor(max_workers=max(1, parallel), thread_name_prefix="fastload-get") as pool:
            _run_all(pool, stop, [lambda item=item: _check_size(client, item, policy, stop) for item in items])
            jobs = []
            for item, temp in zip(items, temps):
                temp.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                fds.append(fd)
                os.ftruncate(fd, item.size)
                for start in range(0, item.size, part_bytes):
                    end = min(item.size, start + part_bytes) - 1
                    jobs.append(lambda item=item, fd=fd, start=start, end=end: _read_range(
                        client, item.url, fd, item.start, start, end, policy, stats, stop, progress))
            _run_all(pool, stop, jobs)
        for fd in fds:
            os.close(fd)
        fds = []
        for item, temp in zip(items, temps):
            if item.check is not None:
                item.check(temp)
                continue
            size, crc = file_crc32(temp)  # what is on disk, read back: the network and the disk both checked
            if (size, crc) != (item.size, item.crc32):
                raise StoreError(f"{item.url}: the downloaded object has size {size} and crc32 {crc:08x}, the manifest "
                                 f"lists {item.size} and {item.crc32:08x} (changed or damaged after the upload); "
                                 f"nothing was kept")
        for item, temp in zip(items, temps):
            os.replace(temp, item.dest)
    finally:
        for fd in fds:
            os.close(fd)
        for temp in temps:
            temp.unlink(missing_ok=True)
    return stats


def partial_path(dest: Path) -> Path:
    """Where :func:`download` writes ``dest`` (at its full size from the start) until it is complete: a hidden
    sibling named after this process (a cache that accounts for bytes on disk reserves room with it)."""
    return dest.with_name(f".{dest.name}.download-{os.getpid()}")


def _run_all(pool: cf.ThreadPoolExecutor, stop: threading.Event, jobs: Sequence[Callable[[], None]]) -> None:
    """Run ``jobs`` on ``pool``; the first failure stops the others (``stop``) and is raised once they end."""
    futures = [pool.submit(job) for job in jobs]
    try:
        for future in cf.as_completed(futures):
            future.result()
    except BaseException:
        stop.set()
        for future in futures:
            future.cancel()
        cf.wait(futures)
        raise


def _check_size(client: Any, item: Download, policy: RetryPolicy, stop: threading.Event) -> None:
    head = with_retries(lambda: client.head_object(Bucket=item.url.bucket, Key=item.url.key), item.url, "HEAD", policy,
                        cancelled=stop)
    expected = item.size if item.object_size is None else item.object_size
    if int(head["ContentLength"]) != expected:
        raise StoreError(f"{item.url}: the object is {head['ContentLength']} bytes, the manifest lists {expected} "
                         f"(truncated or replaced after the upload); nothing was kept")


def _read_range(client: Any, url: ObjectUrl, fd: int, base: int, start: int, end: int, policy: RetryPolicy,
                stats: TransferStats, stop: threading.Event, progress: Callable[[int], None] | None) -> None:
    """Bytes ``base + start .. base + end`` (inclusive) of ``url`` into ``fd`` at ``start .. end``; a retry asks
    only for the bytes not yet written."""
    pos = start

    def attempt() -> None:
        nonlocal pos
        body = client.get_object(Bucket=url.bucket, Key=url.key, Range=f"bytes={base + pos}-{base + end}")["Body"]
        try:
            for chunk in body.iter_chunks(READ_CHUNK):
                if stop.is_set():
                    raise StoreError(f"{url}: cancelled (another object of the transfer failed)")
                if pos + len(chunk) > end + 1:
                    raise StoreError(f"{url}: the server sent more than the bytes {start}-{end} asked for")
                os.pwrite(fd, chunk, pos)
                pos += len(chunk)
                stats.add(nbytes=len(chunk))
                if progress is not None:
                    progress(len(chunk))
        finally:
            body.close()
        if pos <= end:
            raise ShortRead(f"the response ended at byte {pos} of {start}-{end}")

    with_retries(attempt, url, f"reading bytes {base + start}-{base + end}", policy,
                 on_retry=lambda exc: stats.add(retries=1), cancelled=stop, progress=lambda: pos)


def upload(client: Any, files: Sequence[tuple[Path, ObjectUrl]], *, parallel: int = PARALLEL,
           policy: RetryPolicy | None = None) -> TransferStats:
    """Upload each local file to its URL (``client`` with botocore's retries for short faults: see
    :func:`~fastload.store.objects.client.s3_client`; a file whose upload still fails is sent again within
    ``policy``, default :func:`retry_policy`), then check each object's size with a HEAD."""
    policy = policy or retry_policy()
    stats = TransferStats(objects=len(files))
    stop = threading.Event()  # set by the first upload that fails for good: the others stop retrying

    def send(path: Path, url: ObjectUrl) -> None:
        def put_and_measure() -> int:
            client.upload_file(str(path), url.bucket, url.key)
            return int(client.head_object(Bucket=url.bucket, Key=url.key)["ContentLength"])

        size = with_retries(put_and_measure, url, "upload", policy, cancelled=stop)
        if size != path.stat().st_size:
            raise StoreError(f"{url}: uploaded {path.stat().st_size} bytes from {path}, the server holds {size}")
        stats.add(nbytes=size)

    with cf.ThreadPoolExecutor(max_workers=max(1, parallel), thread_name_prefix="fastload-put") as pool:
        _run_all(pool, stop, [lambda p=p, u=u: send(p, u) for p, u in files])
    return stats
