"""Data-wait accounting for the training loop: how much of each step is spent waiting for the loader.

``StepTimer`` splits every step into *wait* (blocked in ``next(loader)``) and *compute* (the rest), and counts
images. ``GpuUtilSampler`` samples NVML GPU utilisation on a background thread; without ``nvidia-ml-py`` or
a GPU it reports ``None`` (printed as ``n/a``).
"""
from __future__ import annotations

import threading
import time
from typing import Iterable, Iterator

__all__ = ["StepTimer", "GpuUtilSampler", "fmt_util"]


class StepTimer:
    """Wraps a batch iterable; ``wait_frac`` = wait / (wait + compute), ``images_per_s`` over the epoch."""

    def __init__(self, sync=None) -> None:
        self.sync = sync  # e.g. torch.cuda.synchronize, so that GPU work is billed to compute, not wait
        self.reset()

    def reset(self) -> None:
        self.wait = 0.0
        self.total = 0.0
        self.images = 0
        self.steps = 0
        self._t_last: float | None = None

    def wrap(self, batches: Iterable) -> Iterator:
        it = iter(batches)
        self._t_last = time.perf_counter()
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            t1 = time.perf_counter()
            self.wait += t1 - t0
            yield batch
            if self.sync is not None:
                self.sync()
            t2 = time.perf_counter()
            self.total += t2 - t0
            self.steps += 1
            try:
                self.images += int(batch[0].shape[0])
            except (AttributeError, IndexError, TypeError):
                pass

    @property
    def wait_frac(self) -> float:
        return self.wait / self.total if self.total > 0 else 0.0

    @property
    def images_per_s(self) -> float:
        return self.images / self.total if self.total > 0 else 0.0


def fmt_util(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f}%"


class GpuUtilSampler:
    """Mean NVML utilisation of one GPU between :meth:`start` and :meth:`stop` (``None`` when unavailable)."""

    def __init__(self, index: int | None, interval: float = 0.2) -> None:
        self.interval = interval
        self._handle = None
        self._nvml = None
        self._samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if index is None:
            return
        try:
            import pynvml  # from nvidia-ml-py; optional

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(int(index))
            self._nvml = pynvml
        except Exception:  # no library, no driver, no such device: report n/a
            self._handle = None

    @property
    def available(self) -> bool:
        return self._handle is not None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._samples.append(float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))
            except Exception:
                return

    def start(self) -> None:
        self._samples = []
        if not self.available:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="nvml-util", daemon=True)
        self._thread.start()

    def current(self) -> float | None:
        """Mean so far (for the progress bar)."""
        return sum(self._samples) / len(self._samples) if self._samples else None

    def stop(self) -> float | None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=2)
            self._thread = None
        return self.current() if self.available else None
