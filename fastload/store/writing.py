"""What the store writers share: the worker pool that decodes or re-encodes the source images, the tasks it
runs and the progress bar (``fastload convert`` and the ram-store rebuild of :func:`fastload.store.factory.open_store`)."""
from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, overload

import cv2
import numpy as np
from tqdm import tqdm

from fastload.data.images import LoadRule, ShrinkFilter, decode_image, probe_shape, resize_long_side, rule_shrink
from fastload.store.base import StoreError

# Decoded (disk/ram) stores of YOLOv9's loaded-image rule hold images shrunk once, with YOLOv9 validation's
# INTER_AREA: validation batches from them are the official ones bit for bit. YOLOv9 training shrinks with
# INTER_LINEAR, so training batches read from such a store differ slightly from the stock loader's (encoded
# stores are shrunk per mode, exactly as the official loader does). Ultralytics' rule resizes with INTER_LINEAR
# in both modes, so its decoded stores serve both exactly. Recorded as meta["shrink"] (and meta["load_rule"]).
DECODED_SHRINK: ShrinkFilter = "area"


def decoded_shrink(rule: LoadRule) -> ShrinkFilter:
    """The filter a decoded store of loaded-image rule ``rule`` shrinks its images with, once."""
    return rule_shrink(DECODED_SHRINK, rule)


def default_workers() -> int:
    return max(1, min(8, (os.cpu_count() or 1)))


class FileTasks(Sequence[tuple]):
    """The tasks ``(i, files[i], *options)`` of the source indices ``indices``, made when a chunk of them is taken:
    a conversion of N images holds no list of N tuples (about 100 bytes each, 0.1 GB at 1M images)."""

    def __init__(self, files: Sequence[str], options: tuple, indices: np.ndarray | None = None) -> None:
        self.files, self.options = files, options
        self.indices = np.arange(len(files)) if indices is None else np.asarray(indices, np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    @overload
    def __getitem__(self, k: int) -> tuple: ...

    @overload
    def __getitem__(self, k: slice) -> list[tuple]: ...

    def __getitem__(self, k: int | slice) -> tuple | list[tuple]:
        if isinstance(k, slice):
            return [(i, self.files[i], *self.options) for i in self.indices[k].tolist()]
        i = int(self.indices[k])
        return (i, self.files[i], *self.options)


def encoded_task(task: tuple[int, str, int | None, int]) -> tuple[int, bytes | None, str | None, int]:
    """Read one file (re-encoding it smaller when its long side exceeds ``max_side``)."""
    i, path, max_side, quality = task
    try:
        buf = Path(path).read_bytes()
    except OSError as e:
        return i, None, f"cannot read: {e}", 0
    if max_side:
        try:
            buf = _reencode(buf, max_side, quality, path)
        except Exception as e:  # a corrupt image is reported, never fatal
            return i, None, str(e), len(buf)
    return i, buf, None, len(buf)


def _reencode(buf: bytes, max_side: int, quality: int, path: str | None = None) -> bytes:
    """Shrink an encoded image to ``max_side`` on its long side as JPEG ``quality``; small ones stay as they are."""
    h, w = probe_shape(buf, path)
    if max(h, w) <= max_side:
        return buf
    img = resize_long_side(decode_image(buf, path), max_side)
    ok, enc = cv2.imencode(".jpg", cv2.cvtColor(img, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, int(quality)])
    if not ok:
        raise StoreError(f"{path}: JPEG re-encode failed")
    return enc.tobytes()


def decoded_task(task: tuple[int, str, int, LoadRule]) -> tuple[int, np.ndarray | None, str | None, int]:
    """Decode one file and resize it to its loaded shape (as ``rule``'s load_image)."""
    i, path, imgsz, rule = task
    try:
        buf = Path(path).read_bytes()
        img = np.ascontiguousarray(resize_long_side(decode_image(buf, path), imgsz, shrink=DECODED_SHRINK, rule=rule))
    except Exception as e:
        return i, None, str(e), 0
    return i, img, None, len(buf)


def parallel_map(fn: Callable[[Any], Any], tasks: Sequence[Any], workers: int) -> Iterator[Any]:
    """``fn`` over ``tasks`` in order, in a process pool when ``workers > 1`` (chunked).

    At most ``2 * workers`` chunks are sent ahead of the one being read. Not ``Pool.imap``: its task thread
    fills the workers' task pipe with every chunk, and an abandoned iteration's ``terminate()`` then waits
    for that thread, blocked writing into a full pipe that no terminated worker reads (seen in CI: a
    conversion stopped by a test hung until the 600 s test timeout).
    """
    if workers <= 1 or len(tasks) <= 1:
        yield from map(fn, tasks)
        return
    chunk = max(1, min(32, len(tasks) // (workers * 8)))
    pool = multiprocessing.get_context("fork").Pool(workers, initializer=_plain_worker_signals)
    sent: deque = deque()
    try:
        for start in range(0, len(tasks), chunk):
            sent.append(pool.apply_async(_map_chunk, (fn, tasks[start : start + chunk])))
            if len(sent) > 2 * workers:
                yield from sent.popleft().get()
        while sent:
            yield from sent.popleft().get()
    except BaseException:  # an error, Ctrl-C or an abandoned iteration: stop the workers now
        pool.terminate()
        raise
    # Finished: the workers exit on their own. Not terminate(): it holds the task queue's lock while it joins
    # workers it has sent SIGTERM, and a worker still starting (before its initializer) survives that
    # signal and then waits for the lock forever (seen in a loaded CI run).
    pool.close()
    pool.join()


def _map_chunk(fn: Callable[[Any], Any], chunk: Sequence[Any]) -> list[Any]:
    return [fn(task) for task in chunk]


def _plain_worker_signals() -> None:
    # A forked worker inherits its parent's Python signal handlers (e.g. `fastload bench` turns SIGTERM into
    # SystemExit to clean up). Pool.terminate() must simply kill the worker: a handler that runs instead can
    # leave it blocked on the task queue's lock and the terminate() hangs. Ctrl-C is the parent's to handle.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Progress:
    """A tqdm bar in images/s with MB/s of source data in its postfix."""

    def __init__(self, total: int, desc: str, enabled: bool, initial: int = 0) -> None:
        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="img", disable=not enabled, dynamic_ncols=True)
        self.t0 = time.perf_counter()
        self.bytes = 0
        self.last = 0.0

    def update(self, n: int, nbytes: int) -> None:
        self.bytes += nbytes
        self.bar.update(n)
        now = time.perf_counter()
        if now - self.last > 0.5:
            self.last = now
            self._show_rate(now)

    def _show_rate(self, now: float) -> None:
        self.bar.set_postfix_str(f"{self.bytes / max(now - self.t0, 1e-9) / 1e6:.1f} MB/s", refresh=False)

    def close(self) -> None:
        self._show_rate(time.perf_counter())  # the final rate, not the one sampled after the first image
        self.bar.close()
