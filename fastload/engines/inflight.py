"""The ordered in-flight window of the engines that render in other processes (``cpu`` with workers, ``ray``).

The window keeps batches in flight up to what its transport has room for, delivers them in batch order,
and, once an epoch's batches are all sent, starts the epoch :meth:`InFlightWindow.expect_next` announced:
its first batches stay in flight across the epoch boundary and are adopted when the next call asks for
exactly that epoch (same indices, same mosaic state), dropped otherwise (``early_used`` /
``early_dropped``).

How a batch travels is the transport's (:class:`Transport`): ``submit`` sends one batch and returns the
engine's handle for it (``None`` when there is no room now: no free slot, the in-flight limit reached),
``receive`` waits for one handle's batch and returns it rendered, ``drop`` abandons handles whose batches
are not wanted (an abandoned epoch, a wrong guess). The CPU engine's transport is its forked worker
pool and shared-memory ring, the Ray engine's its render actors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generator, Generic, Protocol, Sequence, TypeVar

import numpy as np

from fastload.engines.base import Rendered, chunks

TaskT = TypeVar("TaskT")


class Transport(Protocol[TaskT]):
    """How an engine's batches reach its renderers and come back (see the module docstring)."""

    def submit(self, epoch: int, indices: np.ndarray, mosaic_closed: bool, pending: Sequence[TaskT]) -> TaskT | None:
        """Send the batch ``indices`` of ``epoch``, rendered with ``mosaic_closed``; ``pending``: the
        handles in flight (in submission order). None: no room now."""

    def receive(self, task: TaskT, seq: int, pending: Sequence[TaskT]) -> Rendered:
        """The batch of ``task`` (batch ``seq`` of its epoch), the oldest of ``pending``."""

    def drop(self, tasks: Sequence[TaskT]) -> None:
        """Abandon ``tasks`` (every handle still in flight): their batches are not wanted."""


@dataclass
class _Ahead(Generic[TaskT]):
    """The first batches of the expected next epoch, sent before that epoch was asked for."""

    epoch: int
    indices: np.ndarray
    mosaic_closed: bool  # the mosaic state the first of them was sent with
    tasks: list[TaskT]


class InFlightWindow(Generic[TaskT]):
    """The queue of batches in flight, in batch order, and the next epoch's first batches.

    The window holds no transport: each call is given the engine's, so the engine owns its window without
    a reference cycle.
    """

    def __init__(self) -> None:
        self._hint: tuple[int, np.ndarray] | None = None  # expect_next(): the epoch after the current one
        self._ahead: _Ahead[TaskT] | None = None  # that epoch's first batches, sent before it began
        self._queue: list[TaskT] = []  # this epoch's batches in flight, in batch order
        self._early: list[TaskT] = []  # the next epoch's first batches, sent once this epoch's are all out
        self.early_used = 0  # batches sent before their epoch began and delivered in it
        self.early_dropped = 0  # ... and dropped after a wrong guess

    def expect_next(self, epoch: int, indices: np.ndarray) -> None:
        """The iteration after the current one will most likely be ``(epoch, indices)``."""
        self._hint = (int(epoch), np.asarray(indices, np.int64))

    @property
    def in_flight(self) -> int:
        """Batches sent and not yet delivered (this epoch's and the next one's first)."""
        return len(self._queue) + len(self._early) + (len(self._ahead.tasks) if self._ahead is not None else 0)

    def batches(self, transport: Transport[TaskT], epoch: int, indices: np.ndarray, batch_size: int,
                mosaic_closed: Callable[[], bool]) -> Generator[Rendered, None, None]:
        """The batches of ``indices`` for ``epoch`` in order; ``mosaic_closed`` reads the engine's state as
        each batch is sent."""
        batches = chunks(indices, batch_size)
        self._queue = self._adopt(transport, epoch, indices, mosaic_closed())
        self._early = []
        sent = len(self._queue)
        hint, self._hint = self._hint, None
        early_batches = chunks(hint[1], batch_size) if hint is not None else []
        early_mosaic_closed = mosaic_closed()
        finished = False
        try:
            for seq in range(len(batches)):
                while True:  # fill the room the transport has: this epoch's batches first, then the next one's
                    if sent < len(batches):
                        todo, e = batches[sent], epoch
                    elif hint is not None and len(self._early) < len(early_batches):
                        todo, e = early_batches[len(self._early)], hint[0]
                    else:
                        break
                    closed = mosaic_closed()
                    task = transport.submit(e, todo, closed, self._queue + self._early)
                    if task is None:
                        break
                    if sent < len(batches):
                        self._queue.append(task)
                        sent += 1
                    else:
                        if not self._early:
                            early_mosaic_closed = closed
                        self._early.append(task)
                yield self._receive(transport, seq)
            finished = True
        finally:
            if finished and self._early and hint is not None:
                self._ahead = _Ahead(hint[0], hint[1], early_mosaic_closed, self._early)
                self._early = []  # kept for the next epoch, not dropped
            # an abandoned or failed epoch: what is still in flight is not wanted
            if self._queue or self._early:
                transport.drop(self._queue + self._early)
            self._queue, self._early = [], []

    def _receive(self, transport: Transport[TaskT], seq: int) -> Rendered:
        """The batch at the head of the queue, taken off it once received (a helper, so that the generator's
        frame holds no reference to the batch it yielded: the caller's dropping it frees its slot)."""
        rendered = transport.receive(self._queue[0], seq, self._queue + self._early)
        self._queue.pop(0)
        return rendered

    def _adopt(self, transport: Transport[TaskT], epoch: int, indices: np.ndarray, mosaic_closed: bool) -> list[TaskT]:
        """The tasks sent early for this epoch when the guess was right; otherwise drop them."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return []
        if ahead.epoch == epoch and ahead.mosaic_closed == mosaic_closed and np.array_equal(ahead.indices, indices):
            self.early_used += len(ahead.tasks)
            return list(ahead.tasks)
        self.early_dropped += len(ahead.tasks)
        transport.drop(ahead.tasks)
        return []

    def drop_ahead(self, transport: Transport[TaskT]) -> None:
        """Drop the next epoch's early batches (their renderers are gone: the CPU engine restarts its pool)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            self.early_dropped += len(ahead.tasks)
            transport.drop(ahead.tasks)

    def forget(self) -> None:
        """Forget what is in flight without dropping it (the engine is closing its transport)."""
        self._ahead = None
        self._queue, self._early = [], []
