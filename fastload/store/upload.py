"""``fastload convert DATA.yaml --out s3://bucket/prefix``: build the stores locally, then publish them to object
storage behind a manifest (:mod:`fastload.store.objects.manifest`), so readers see the whole upload or nothing.

The stores are built by :func:`fastload.store.convert.convert` into a work folder under the temporary directory
named after the URL (the same URL, the same folder: ``--resume`` continues an interrupted LMDB conversion
there; a second conversion to the URL on the machine refuses while one runs); the folder is removed once the
manifest is written. ``ram`` stores live in one machine's shared
memory and are not uploaded: upload ``disk`` (or ``lmdb``) and stage it on each node.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from fastload.data.config import load_data_config
from fastload.store.base import StoreError
from fastload.store.convert import convert
from fastload.store.info import store_info
from fastload.store.objects.manifest import Manifest, check_writable, publish
from fastload.store.objects.urls import parse_url
from fastload.store.shm import OneHolder
from fastload.store.stage import store_files


def work_folder(url: str) -> Path:
    """The local folder the stores for ``url`` are built in before the upload (one per URL)."""
    digest = hashlib.sha1(str(parse_url(url)).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"fastload-upload-{digest}"


def convert_to_url(data: Any, to: str | Sequence[str], url: str, *, resume: bool = False, force: bool = False,
                   log: Callable[[str], None] = print, **convert_options: Any) -> Manifest:
    """Convert ``data`` into the store kinds ``to`` and upload them (with their data.yaml) to ``url``.

    ``convert_options`` are :func:`~fastload.store.convert.convert`'s (imgsz, splits, workers, max_side,
    quality, progress). A URL that already holds a store is refused unless ``force`` (readers keep the old one
    until the new manifest is written). Returns the new manifest.
    """
    kinds = [k.strip() for k in (to.split(",") if isinstance(to, str) else to) if k.strip()]
    if "ram" in kinds:
        raise StoreError(f"--to ram builds shared memory on this machine and is not uploaded to {url}; upload "
                         f"disk (or lmdb) and stage it on each node with `fastload stage {url} --to /dev/shm/NAME`")
    prefix = check_writable(url, force=force)  # before the conversion: a refusal costs nothing
    work = work_folder(str(prefix))
    with _one_upload_per_url(work, str(prefix)):
        if not resume:  # stores an earlier, failed run left there must not be uploaded with this one
            shutil.rmtree(work, ignore_errors=True)
        # an interrupted conversion keeps the work folder (--resume continues there); once built, it goes either way
        result = convert(data, kinds, out=work, resume=resume, force=force, log=log, **convert_options)
        try:
            files = [(path, rel.as_posix()) for path, rel in store_files(work)]
            return publish(files, str(prefix), info=_summary(result.yaml_path), force=force, log=log)
        finally:
            shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def _one_upload_per_url(work: Path, url: str) -> Iterator[None]:
    """Hold the lock beside ``work`` from the conversion to the end of the upload: a second conversion to the same
    URL on this machine would empty the work folder under the first (or upload it half-built); it refuses at once."""
    try:
        holder = OneHolder(work.with_name(work.name + ".lock"))
    except BlockingIOError as e:
        raise StoreError(f"another `fastload convert --out {url}` (pid {e.args[0] or '?'}) runs on this machine; wait "
                         f"for it to finish") from None
    with holder:
        yield


def _summary(yaml_path: Path) -> dict[str, Any]:
    """What `fastload info URL` shows without downloading a store: per split, the counts, classes and image
    sizes of its first store (every store of a split holds the same images) and the URL of each store."""
    cfg = load_data_config(yaml_path)
    splits: dict[str, Any] = {}
    for split, kinds in cfg.stores.items():
        first = next(iter(kinds.values()))
        stats = store_info(first)["splits"]["store"]
        # where each store lies inside the upload (staging puts it at the same place under --to)
        stats["stores"] = {k: Path(os.path.relpath(p, yaml_path.parent)).as_posix() for k, p in kinds.items()}
        splits[split] = stats
    return {"type": "dataset", "names": list(cfg.names), "splits": splits}
