"""Persistent forked worker processes that render whole batches into shared slots.

Protocol (msgpack over one pipe pair per worker, no pickle):
  task   ``{"s": seq, "e": epoch, "slot": k, "idx": int64 bytes, "mc": mosaic_closed}``, or ``{"stop": 1}``
  result ``{"s": seq, "slot": k, "hw": [h, w], "t": float32 [N, 6] bytes, "x": the task's extra array (masks,
           keypoints, oriented boxes: ``[dtype name, shape, bytes]``) or None (detection), "sh": float64 [B, 6] bytes,
           "g": float32 [B, 3] bytes | None, "c": [cache hits, cache misses, decodes] (the worker's totals),
           "ix": int64 [B] bytes (the image each sample shows), "rp": samples drawn again,
           "d": [DamagedRecordError fields of the damaged records it met first]}``,
         or ``{"s": seq, "damaged": fields}`` (``strict``: the first damaged record), or ``{"s": seq, "err": fields}``
         (any other exception, as :meth:`WorkerFailure.fields`: its class, message and traceback text)

Batch ``seq`` always goes to worker ``seq % n``, and each worker answers in task order, so the
consumer reads results in batch order from one pipe at a time. A worker that dies is noticed by
polling with a timeout (never a hang): the consumer raises :class:`WorkerError` naming the worker,
its exit code or signal, and the batch it was rendering. A worker's exception is raised again by the consumer
as the one line it would have been in-process (:meth:`WorkerFailure.exception`), the worker's traceback kept on it.
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.util
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import cv2
import msgpack
import numpy as np
import torch

from fastload.augment.params import shapes_to_array
from fastload.engines.base import WorkerError, WorkerFailure
from fastload.engines.cpu_render import BatchRenderer
from fastload.engines.shm_batch import SlotRing
from fastload.store.base import DamagedRecordError


def _worker_main(
    tasks: Connection,
    results: Connection,
    renderer: BatchRenderer,
    ring: SlotRing,
    foreign: list[Connection],
) -> None:
    # The consumer handles Ctrl-C and SIGTERM and shuts us down (or we exit when its pipe closes). Both go to the
    # whole process group (a terminal's Ctrl-C, torchrun's and SLURM's SIGTERM): a worker that died of them would
    # stop a trainer that saves a checkpoint at its next step before exiting. A handler inherited from the
    # parent (e.g. `fastload bench`'s clean-up) must not run here either.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for c in foreign:  # pipe ends inherited from the parent: holding them would hide the parent's death
        c.close()
    # one thread each: the parallelism is the worker count; oversubscription only thrashes
    cv2.setNumThreads(0)
    torch.set_num_threads(1)
    layout = renderer.layout
    while True:
        try:
            raw = tasks.recv_bytes()
        except (EOFError, OSError):  # consumer gone
            break
        task = msgpack.unpackb(raw)
        if task.get("stop"):
            break
        seq, slot = task["s"], task["slot"]
        try:
            renderer.sync(bool(task.get("mc")))
            idx = np.frombuffer(task["idx"], np.int64)
            out = renderer.render(task["e"], idx, lambda b, h, w: ring.array(slot, b, h, w, layout))
            hits, misses = (renderer.cache.hits, renderer.cache.misses) if renderer.cache is not None else (0, 0)
            msg = {
                "s": seq,
                "slot": slot,
                "hw": list(out.hw),
                "t": np.ascontiguousarray(out.targets, np.float32).tobytes(),
                "x": None if out.extra is None else array_fields(out.extra),
                "sh": np.stack([shapes_to_array(s) for s in out.shapes]).tobytes(),
                "g": None if out.gains is None else out.gains.tobytes(),
                "c": [hits, misses, renderer.decodes],
                "ix": out.images.tobytes(),
                "rp": out.replaced,
                "d": out.damaged,
            }
        except DamagedRecordError as e:  # strict: one line for the consumer to raise, not a traceback
            msg = {"s": seq, "slot": slot, "damaged": e.fields()}
        except Exception as e:
            msg = {"s": seq, "slot": slot, "err": WorkerFailure.of(e, traceback.format_exc()).fields()}
        try:
            results.send_bytes(msgpack.packb(msg))
        except (BrokenPipeError, OSError):
            break
    tasks.close()
    results.close()


def array_fields(a: np.ndarray) -> list[Any]:
    """An array as plain values for a message: ``[dtype name, shape, bytes]`` (:func:`array_from_fields`)."""
    a = np.ascontiguousarray(a)
    return [a.dtype.str, list(a.shape), a.tobytes()]


def array_from_fields(fields: list[Any]) -> np.ndarray:
    """The array :func:`array_fields` sent (writable: it owns its memory)."""
    dtype, shape, data = fields
    return np.frombuffer(bytearray(data), np.dtype(dtype)).reshape(shape)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is unresponsive"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (SIGKILL: often the out-of-memory killer; lower workers or batch_size)" if -code == 9 else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {code}"


class WorkerPool:
    """``n`` persistent forked workers sharing one :class:`SlotRing` and one renderer state."""

    def __init__(self, n: int, renderer: BatchRenderer, ring: SlotRing, *, timeout: float = 0.0) -> None:
        if n < 1:
            raise ValueError("a worker pool needs at least one worker")
        if "fork" not in mp.get_all_start_methods():
            raise RuntimeError("fastload CPU workers need the 'fork' start method (Linux/macOS); use workers=0")
        self.n = n
        self.timeout = float(timeout)
        self.inflight = [0] * n  # tasks sent, results not yet read, per worker
        ctx = mp.get_context("fork")
        self.procs: list[Any] = []
        self.tasks: list[Connection] = []
        self.results: list[Connection] = []
        for wid in range(n):
            task_r, task_w = ctx.Pipe(duplex=False)
            res_r, res_w = ctx.Pipe(duplex=False)
            foreign = self.tasks + self.results + [task_w, res_r]
            p = ctx.Process(
                target=_worker_main,
                args=(task_r, res_w, renderer, ring, foreign),
                name=f"fastload-worker-{wid}",
                daemon=True,
            )
            p.start()
            task_r.close()  # the child's ends: closing ours lets recv() see EOF when a child dies
            res_w.close()
            self.procs.append(p)
            self.tasks.append(task_w)
            self.results.append(res_r)
        # At interpreter exit multiprocessing SIGTERMs its daemonic children and then waits for them without a
        # timeout; ours ignore SIGTERM, so a process that ends with an open loader would wait forever. Its
        # finalizers of priority >= 0 run first: this one stops the workers (also when the pool is collected).
        self._stopper = multiprocessing.util.Finalize(self, _stop_workers, args=(self.procs, self.tasks, self.results),
                                                      exitpriority=10)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def submit(self, seq: int, epoch: int, slot: int, indices: np.ndarray, mosaic_closed: bool) -> None:
        wid = seq % self.n
        msg = {"s": seq, "e": int(epoch), "slot": slot, "idx": np.asarray(indices, np.int64).tobytes(), "mc": mosaic_closed}
        try:
            self.tasks[wid].send_bytes(msgpack.packb(msg))
        except (BrokenPipeError, OSError) as e:
            raise self._death(wid, seq) from e
        self.inflight[wid] += 1

    def receive(self, seq: int) -> dict[str, Any]:
        """The result of batch ``seq``; raises :class:`WorkerError` when its worker died or hung, and the worker's
        exception when it raised one (:meth:`WorkerFailure.exception`)."""
        wid = seq % self.n
        conn, proc = self.results[wid], self.procs[wid]
        start = time.monotonic()
        while True:
            try:
                if conn.poll(1.0):
                    msg = msgpack.unpackb(conn.recv_bytes())
                    break
            except (EOFError, OSError) as e:
                raise self._death(wid, seq) from e
            if not proc.is_alive():
                raise self._death(wid, seq)
            if self.timeout and time.monotonic() - start > self.timeout:
                raise WorkerError(f"fastload worker {wid} (pid {proc.pid}) gave no batch for {self.timeout:.0f} s (batch {seq})")
        self.inflight[wid] -= 1
        if msg["s"] != seq:
            raise WorkerError(f"fastload worker {wid} answered batch {msg['s']} while batch {seq} was expected")
        if "damaged" in msg:
            raise DamagedRecordError.from_fields(msg["damaged"])
        if "err" in msg:
            raise WorkerFailure.from_fields(msg["err"]).exception(f"fastload worker {wid} (pid {proc.pid})", f"batch {seq}")
        return msg

    def drain(self) -> None:
        """Read and drop every outstanding result (after an abandoned or failed epoch)."""
        for wid in range(self.n):
            while self.inflight[wid]:
                conn = self.results[wid]
                try:
                    if not conn.poll(30.0):
                        raise WorkerError(f"fastload worker {wid} did not finish its batch within 30 s")
                    conn.recv_bytes()
                except (EOFError, OSError):
                    self.inflight[wid] = 0
                    break
                self.inflight[wid] -= 1

    def _death(self, wid: int, seq: int) -> WorkerError:
        p = self.procs[wid]
        p.join(timeout=0.5)
        return WorkerError(
            f"fastload worker {wid} (pid {p.pid}) {_describe_exit(p.exitcode)} while rendering batch {seq}; "
            f"the loader cannot continue this epoch"
        )

    def close(self, timeout: float = 5.0) -> None:
        """Ask every worker to stop, then kill those that do not (they ignore SIGTERM). Idempotent."""
        self._stopper.cancel()
        _stop_workers(self.procs, self.tasks, self.results, timeout)
        self.procs, self.tasks, self.results = [], [], []
        self.inflight = [0] * self.n


def _stop_workers(procs: list[Any], tasks: list[Connection], results: list[Connection], timeout: float = 5.0) -> None:
    """Ask the workers to stop, kill those still running after ``timeout`` seconds, close the pipes."""
    for conn in tasks:
        try:
            conn.send_bytes(msgpack.packb({"stop": 1}))
        except (BrokenPipeError, OSError):
            pass
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(timeout=1.0)
    for conn in tasks + results:
        conn.close()


def default_start_method_ok() -> bool:
    """True where forked workers can be used (fork exists; Windows has none)."""
    return sys.platform != "win32" and "fork" in mp.get_all_start_methods() and hasattr(os, "fork")
