"""What the store writers share: the worker pool that decodes or re-encodes the source images, the tasks it
runs and the progress bar (``fastload convert`` and the ram-store rebuild of :func:`fastload.store.factory.open_store`)."""
from __future__ import annotations

import multiprocessing
import os
import signal
import time
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
    """``fn`` over ``tasks`` in order, in forked processes when ``workers > 1`` (in chunks).

    Chunk ``j`` is worker ``j % n``'s: each worker computes its chunks in turn from the tasks it has since the fork
    (nothing is sent to it) and sends each result on a pipe of its own, where it waits while the pipe is full:
    each worker runs at most about one chunk ahead of the one being read. The workers share no lock and no
    thread of this process serves them, so an error, Ctrl-C or an abandoned iteration simply kills them. Not
    ``multiprocessing.Pool``: its workers share one result pipe and its lock, read by a thread of the pool. An
    abandoned conversion's ``terminate()`` stops that thread, and a worker that then sends a result larger than
    the pipe (an encoded image over 64 KiB) blocks while holding the lock that ``terminate()`` waits for to send
    its own sentinel: a conversion stopped by a test hung that way (and ``imap``'s task thread before it, and a
    worker still starting when ``terminate()`` sent SIGTERM).
    """
    if workers <= 1 or len(tasks) <= 1:
        yield from map(fn, tasks)
        return
    chunk = max(1, min(32, len(tasks) // (workers * 8)))
    starts = range(0, len(tasks), chunk)
    n = min(workers, len(starts))
    context = multiprocessing.get_context("fork")
    procs: list[Any] = []
    pipes: list[Any] = []
    try:
        for k in range(n):
            reader, writer = context.Pipe(duplex=False)
            proc = context.Process(target=_chunk_worker, args=(fn, tasks, starts[k::n], chunk, writer, pipes),
                                   name=f"fastload-writer-{k}", daemon=True)
            proc.start()
            procs.append(proc)
            pipes.append(reader)
            writer.close()  # the worker's end: this process reads EOF once the worker is gone
        for j in range(len(starts)):
            try:
                ok, value = pipes[j % n].recv()
            except EOFError:
                proc = procs[j % n]
                proc.join()
                raise StoreError(f"a {fn.__name__} worker process ended (exit code {proc.exitcode}) before "
                                 f"sending all its results") from None
            if not ok:
                raise value
            yield from value
    except BaseException:  # an error, Ctrl-C or an abandoned iteration: stop the workers now
        for proc in procs:
            proc.kill()
        raise
    finally:
        for pipe in pipes:
            pipe.close()
        for proc in procs:
            proc.join()


def _chunk_worker(fn: Callable[[Any], Any], tasks: Sequence[Any], starts: Sequence[int], chunk: int, out: Any,
                  others: list[Any]) -> None:
    """A worker of :func:`parallel_map`: ``(True, results)`` of each chunk starting at ``starts`` on ``out``, or
    ``(False, exception)`` for the first that raises."""
    _plain_worker_signals()
    for pipe in others:  # the earlier workers' pipes: one killed parent must leave each worker a closed pipe
        pipe.close()
    for start in starts:
        try:
            sent = (True, [fn(task) for task in tasks[start : start + chunk]])
        except Exception as e:
            sent = (False, e)
        out.send(sent)
        if not sent[0]:
            break
    out.close()


def _plain_worker_signals() -> None:
    # A forked worker inherits its parent's Python signal handlers (e.g. `fastload bench` turns SIGTERM into
    # SystemExit to clean up): a SIGTERM for the whole process group (a supervisor, `timeout`) must end the
    # worker, not run the parent's clean-up in it. Ctrl-C is the parent's to handle: it kills the workers.
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
