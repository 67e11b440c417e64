"""One reading per interval: GPUs through NVML (optional) and the host / a process tree through psutil.

NVML is imported lazily and every failure (package missing, driver missing, no device, a query a
GPU does not support) degrades to "no GPU" or a NaN field instead of an exception, so that the
monitor still records CPU and memory on a machine without a GPU.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

import psutil

# Per-GPU CSV columns, in order; the CSV names them ``gpu{index}_{field}``.
GPU_FIELDS: tuple[str, ...] = (
    "util_pct",
    "mem_util_pct",
    "mem_used_mib",
    "mem_total_mib",
    "power_w",
    "sm_clock_mhz",
    "mem_clock_mhz",
)

# Host CSV columns, in order.
HOST_FIELDS: tuple[str, ...] = (
    "cpu_pct",
    "iowait_pct",
    "mem_used_mib",
    "proc_cpu_pct",
    "proc_pss_mib",
    "proc_rss_mib",
    "proc_anon_mib",
    "proc_file_mib",
    "nprocs",
)

_MIB = 1024.0 * 1024.0


@dataclass(frozen=True)
class GpuReading:
    """One GPU at one instant. Unsupported queries are NaN.

    ``util_pct`` is NVML's "percent of the last sample period during which a kernel ran", the figure
    ``nvidia-smi dmon`` shows as ``sm``; ``used_by_tree`` says whether the watched process tree had
    a compute context on this GPU (False also when PID namespaces hide it).
    """

    index: int
    util_pct: float
    mem_util_pct: float
    mem_used_mib: float
    mem_total_mib: float
    power_w: float
    sm_clock_mhz: float
    mem_clock_mhz: float
    used_by_tree: bool = False

    def values(self) -> list[float]:
        return [float(getattr(self, f)) for f in GPU_FIELDS]


@dataclass(frozen=True)
class HostReading:
    """The machine and the watched process tree at one instant.

    ``cpu_pct`` is machine-wide (100 = every core busy); ``proc_cpu_pct`` is the tree's own use
    where 100 means one core (so 2 busy workers read 200). ``proc_pss_mib`` sums PSS over the tree: each
    shared page is split between the processes that map it, so the sum is the memory the tree holds
    (data-loader workers share the dataset's pages, the batch ring and the libraries); NaN where the
    platform does not report PSS (Linux does) or a process of the tree cannot be read. ``proc_rss_mib``
    sums RSS, counting a shared page once per process that maps it (as adding up ``top``'s column would):
    with N workers it can exceed the machine's memory use many times over. ``proc_anon_mib`` and ``proc_file_mib``
    split that RSS sum (each summed the same way): anonymous pages (heaps, copies; a page a forked worker still shares
    with its parent counts in both) and file-backed or shared-memory pages (libraries, a memory-mapped store, the
    batch ring, ``/dev/shm`` stores): the second are the page cache's, which the kernel can drop or share, but which
    an RSS-based memory limit (Kubernetes, Slurm) counts for every process that maps them.
    """

    cpu_pct: float
    iowait_pct: float
    mem_used_mib: float
    proc_cpu_pct: float
    proc_pss_mib: float
    proc_rss_mib: float
    proc_anon_mib: float
    proc_file_mib: float
    nprocs: int

    def values(self) -> list[float]:
        return [float(getattr(self, f)) for f in HOST_FIELDS]


class NvmlSampler:
    """Reads every (or the chosen) GPU through NVML; ``available`` is False with a ``reason`` otherwise."""

    def __init__(self, indices: Sequence[int] | None = None) -> None:
        self.available = False
        self.reason = ""
        self.indices: list[int] = []
        self.names: list[str] = []
        self._nvml: Any = None
        self._handles: list[Any] = []
        try:  # GPU sampling is optional: off (with the reason) where pynvml cannot be imported
            import pynvml  # nvidia-ml-py
        except ImportError as e:
            self.reason = f"nvidia-ml-py (pynvml) is not importable: {e}"
            return
        try:
            pynvml.nvmlInit()
        except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded on GPU-less machines
            self.reason = f"NVML could not start (no NVIDIA driver?): {e}"
            return
        self._nvml = pynvml
        try:
            count = int(pynvml.nvmlDeviceGetCount())
            wanted = list(range(count)) if indices is None else [int(i) for i in indices]
            bad = [i for i in wanted if not 0 <= i < count]
            if bad:
                raise ValueError(f"GPU index {bad} out of range: NVML sees {count} GPU(s)")
            for i in wanted:
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                name = pynvml.nvmlDeviceGetName(handle)
                self._handles.append(handle)
                self.indices.append(i)
                self.names.append(name.decode() if isinstance(name, bytes) else str(name))
        except ValueError:
            self.close()
            raise
        except Exception as e:
            self.reason = f"NVML could not list GPUs: {e}"
            self.close()
            return
        if not self._handles:
            self.reason = "NVML found no GPU"
            self.close()
            return
        self.available = True

    def read(self, pids: set[int] | None = None) -> list[GpuReading]:
        """One reading per GPU; ``pids`` (the watched tree) marks the GPUs it has a context on."""
        if not self.available:
            return []
        nv = self._nvml
        out = []
        for index, h in zip(self.indices, self._handles):
            util = _query(lambda: nv.nvmlDeviceGetUtilizationRates(h))
            mem = _query(lambda: nv.nvmlDeviceGetMemoryInfo(h))
            power_mw = _query(lambda: nv.nvmlDeviceGetPowerUsage(h))
            sm = _query(lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
            memclk = _query(lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM))
            used = False
            if pids:
                procs = _query(lambda: nv.nvmlDeviceGetComputeRunningProcesses(h)) or []
                used = any(getattr(p, "pid", None) in pids for p in procs)
            out.append(
                GpuReading(
                    index=index,
                    util_pct=_num(util, "gpu"),
                    mem_util_pct=_num(util, "memory"),
                    mem_used_mib=_num(mem, "used") / _MIB,
                    mem_total_mib=_num(mem, "total") / _MIB,
                    power_w=(float(power_mw) / 1000.0) if power_mw is not None else math.nan,
                    sm_clock_mhz=float(sm) if sm is not None else math.nan,
                    mem_clock_mhz=float(memclk) if memclk is not None else math.nan,
                    used_by_tree=used,
                )
            )
        return out

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # shutting down a half-initialised NVML must not mask the real error
                pass
        self._nvml = None
        self._handles = []
        self.indices = []
        self.names = []
        self.available = False


def _query(fn: Any) -> Any:
    """Run one NVML query; a GPU that does not support it (NVMLError) gives None, not an exception."""
    try:
        return fn()
    except Exception:
        return None


def _num(obj: Any, attr: str) -> float:
    return float(getattr(obj, attr)) if obj is not None else math.nan


class HostSampler:
    """Machine-wide CPU / memory and, when ``pid`` is given, that process and all its descendants.

    psutil's CPU percentages are "since the previous call", so the constructor primes them and every
    :meth:`read` covers exactly the interval since the last one. Process objects are cached by pid for
    the same reason (a fresh ``Process`` reports 0 % on its first call).
    """

    def __init__(self, pid: int | None = None) -> None:
        self.pid = pid
        self.cores = psutil.cpu_count(logical=True) or os.cpu_count() or 1
        self._procs: dict[int, psutil.Process] = {}
        self.pss_available = _reports_pss()
        psutil.cpu_percent(None)
        psutil.cpu_times_percent(None)
        self._root: psutil.Process | None = None
        if pid is not None:
            try:
                self._root = psutil.Process(pid)
            except psutil.NoSuchProcess as e:
                raise ProcessLookupError(f"no process with pid {pid}") from e
            self.tree_pids()

    def tree_pids(self) -> set[int]:
        """The pids of the watched tree now (empty when nothing is watched or the root has exited)."""
        if self._root is None:
            return set()
        try:
            procs = [self._root, *self._root.children(recursive=True)]
        except psutil.Error:
            procs = []
        alive: dict[int, psutil.Process] = {}
        for p in procs:
            cached = self._procs.get(p.pid)
            if cached is None:
                cached = p
                try:
                    cached.cpu_percent(None)  # prime: the first call always answers 0.0
                except psutil.Error:
                    continue
            alive[p.pid] = cached
        self._procs = alive
        return set(alive)

    @property
    def known_pids(self) -> set[int]:
        """The watched tree as of the last reading (no new process listing)."""
        return set(self._procs)

    def read(self) -> HostReading:
        cpu = psutil.cpu_percent(None)
        times = psutil.cpu_times_percent(None)
        vm = psutil.virtual_memory()
        # Read the cached processes first (their CPU delta covers the whole interval), then refresh
        # the tree so that processes born during the interval are primed for the next reading.
        proc_cpu = 0.0
        rss = 0
        shared: float = 0.0
        pss: float = 0.0 if self.pss_available else math.nan
        n = 0
        for p in list(self._procs.values()):
            try:
                with p.oneshot():
                    proc_cpu += p.cpu_percent(None)
                    mem = p.memory_info()
                    rss += mem.rss
                    shared += getattr(mem, "shared", math.nan)  # Linux: resident file-backed + shared-memory pages
                    if not math.isnan(pss):
                        try:
                            pss += p.memory_full_info().pss
                        except psutil.AccessDenied:  # another user's process: a partial sum would mislead
                            pss = math.nan
                n += 1
            except psutil.Error:  # exited between listing and reading
                continue
        self.tree_pids()
        return HostReading(
            cpu_pct=float(cpu),
            iowait_pct=float(getattr(times, "iowait", math.nan)),
            mem_used_mib=float(vm.total - vm.available) / _MIB,
            proc_cpu_pct=float(proc_cpu),
            proc_pss_mib=float(pss) / _MIB,
            proc_rss_mib=float(rss) / _MIB,
            proc_anon_mib=float(rss - shared) / _MIB,
            proc_file_mib=float(shared) / _MIB,
            nprocs=n,
        )


def _reports_pss() -> bool:
    """True where psutil reports a process's PSS (Linux: /proc/PID/smaps_rollup)."""
    try:
        return hasattr(psutil.Process().memory_full_info(), "pss")
    except (psutil.Error, OSError):
        return False
