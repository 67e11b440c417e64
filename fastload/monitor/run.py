"""Watch a command (or a pid, or the whole machine) and answer "is the GPU waiting on data?".

:func:`monitor` samples once per interval on a fixed schedule (``start + k * interval``, so rows do
not drift), appends each row to a CSV and flushes it (a crashed or killed run keeps its data), then
summarises: mean / p5 GPU utilisation, the fraction of samples under 50 %, CPU and I/O-wait, and a
one-sentence verdict.

The child runs in its own process group: a terminal Ctrl-C reaches only the monitor, which forwards
it once to the child's whole group (the child and its data-loader workers), exactly as the shell
would have done. SIGTERM is forwarded the same way. The exit code is the child's (128 + N when a
signal N killed it, as shells report it).
"""
from __future__ import annotations

import csv
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, TextIO

import numpy as np
import psutil

from fastload.monitor.plot import plot_monitor
from fastload.monitor.sampler import GPU_FIELDS, HOST_FIELDS, GpuReading, HostReading, HostSampler, NvmlSampler

BUSY_PCT = 50.0  # a sample under this GPU utilisation counts as "GPU waiting"


@dataclass
class MonitorResult:
    """What one monitoring run produced; ``summary`` is JSON-able."""

    exit_code: int
    rows: int
    duration_s: float
    gpu_found: bool
    gpu_reason: str
    summary: dict[str, Any] = field(default_factory=dict)
    csv_path: Path | None = None
    plot_path: Path | None = None


def _csv_header(gpu_indices: Sequence[int]) -> list[str]:
    """CSV columns: wall time, elapsed seconds, host fields, then the fields of each GPU."""
    cols = ["time", "elapsed_s", *HOST_FIELDS]
    for i in gpu_indices:
        cols += [f"gpu{i}_{f}" for f in GPU_FIELDS]
    return cols


def _row(now: float, elapsed: float, host: HostReading, gpus: list[GpuReading]) -> list[str]:
    values = [f"{now:.3f}", f"{elapsed:.3f}"] + [_fmt(v) for v in host.values()]
    for g in gpus:
        values += [_fmt(v) for v in g.values()]
    return values


def _fmt(v: float) -> str:
    if isinstance(v, float) and math.isnan(v):
        return ""
    return f"{v:.1f}" if isinstance(v, float) and not float(v).is_integer() else str(int(v))


def monitor(
    command: Sequence[str] | None = None,
    *,
    pid: int | None = None,
    interval: float = 1.0,
    out: str | Path | None = None,
    plot: str | Path | None = None,
    duration: float | None = None,
    gpus: Sequence[int] | None = None,
    echo: TextIO | None = sys.stderr,
) -> MonitorResult:
    """Sample until the command / pid ends (or ``duration`` passes, or Ctrl-C without either).

    Args:
      command: argv of a child to start and watch; its exit code becomes the result's.
      pid: an already running process to watch instead (exit code 0 when it ends).
      interval: seconds between samples.
      out: CSV path (one row per sample, flushed each row).
      plot: PNG path for the time-series plot.
      duration: stop after this many seconds (the child keeps running).
      gpus: NVML indices to record (default: all).
      echo: where a dmon-like line per sample and the summary go (None: silent).
    """
    if interval <= 0:
        raise ValueError(f"interval must be positive, got {interval}")
    if command and pid is not None:
        raise ValueError("give either a command or --pid, not both")
    if command and shutil.which(command[0]) is None:  # say so before any notice about the GPU
        raise FileNotFoundError(f"cannot start {command[0]!r}: not an executable file and not found on PATH")
    nvml = NvmlSampler(gpus)
    if echo is not None and not nvml.available:
        print(f"fastload monitor: no GPU found ({nvml.reason}); recording CPU and memory only", file=echo)

    child: subprocess.Popen | None = None
    if command:
        # Own process group: one forwarded signal reaches the child and its workers, never twice.
        kw: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
        try:
            child = subprocess.Popen(list(command), **kw)
        except OSError as e:
            nvml.close()
            raise FileNotFoundError(f"cannot start {command[0]!r}: {e}") from e
        pid = child.pid
    host = HostSampler(pid)
    say = _Lines(echo, shared_with_child=child is not None) if echo is not None else None

    received: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        received.append(signum)
        if child is not None and child.poll() is None:
            try:
                os.killpg(child.pid, signum)
            except ProcessLookupError:
                pass

    previous = _install(on_signal)
    csv_path = Path(out) if out else None
    fh = None
    writer = None
    rows: list[list[str]] = []
    header = _csv_header(nvml.indices)
    start = time.monotonic()
    try:
        if csv_path is not None:
            csv_path.parent.mkdir(parents=True, exist_ok=True)
            fh = open(csv_path, "w", newline="")
            writer = csv.writer(fh)
            writer.writerow(header)
            fh.flush()
        if say is not None:
            say.line(_echo_header(nvml, host))
        k = 0
        while True:
            k += 1
            stopped = _wait_until(start + k * interval, child, pid, received, duration, start)
            if stopped and rows:
                break
            # Always keep at least one row, also for a child shorter than one interval.
            now = time.time()
            elapsed = time.monotonic() - start
            reading = host.read()
            gpu_readings = nvml.read(host.known_pids | ({pid} if pid else set()))
            row = _row(now, elapsed, reading, gpu_readings)
            rows.append(row)
            if writer is not None:
                writer.writerow(row)
                fh.flush()
            if say is not None:
                say.line(_echo_line(elapsed, reading, gpu_readings))
            if stopped:
                break
        exit_code = 0  # watching a pid or the machine ends normally, also on Ctrl-C
        if child is not None:
            rc = child.wait()
            exit_code = 128 - rc if rc < 0 else rc
    finally:
        _restore(previous)
        if fh is not None:
            fh.close()
        if child is not None and child.poll() is None:
            # Only reached when the monitor itself failed: do not leave the job orphaned silently.
            os.killpg(child.pid, signal.SIGTERM)
            child.wait()
        gpu_indices = list(nvml.indices) if nvml.available else []
        gpu_names = list(nvml.names)
        nvml.close()
    total = time.monotonic() - start
    table = [dict(zip(header, r)) for r in rows]
    summary = summarise(table, gpu_indices, gpu_names, interval, host.cores, nvml.reason)
    result = MonitorResult(
        exit_code=exit_code,
        rows=len(rows),
        duration_s=total,
        gpu_found=bool(gpu_indices),
        gpu_reason=nvml.reason,
        summary=summary,
        csv_path=csv_path,
    )
    if plot:
        result.plot_path = plot_monitor(table, plot, gpu_indices=gpu_indices, cores=host.cores, title=_title(command, pid))
    if say is not None:
        say.line(format_summary(summary))
    return result


class _Lines:
    """Writes the monitor's lines to ``stream``, each on lines of its own even when a child writes there too.

    The child inherits the monitor's terminal. Its progress bar (tqdm, the trainer's) leaves the cursor at
    the end of the bar and redraws it after a bare ``\r``: a row written at that moment would be glued to
    the bar, then overwritten by its next redraw. So while a child shares the stream, every write starts by
    moving to a line of its own: on a terminal by erasing the bar's line (the bar redraws itself on its
    next update, below the row, as with ``tqdm.write``); on a file or pipe, where nothing is redrawn, by
    starting a new line. Every write ends with a newline.
    """

    def __init__(self, stream: TextIO, *, shared_with_child: bool) -> None:
        self.stream = stream
        self.lead = ("\r\x1b[2K" if _is_terminal(stream) else "\n") if shared_with_child else ""

    def line(self, text: str) -> None:
        self.stream.write(f"{self.lead}{text}\n")
        self.stream.flush()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or file-like stream without a terminal behind it
        return False


def _wait_until(
    deadline: float,
    child: subprocess.Popen | None,
    pid: int | None,
    received: list[int],
    duration: float | None,
    start: float,
) -> bool:
    """Sleep until ``deadline``; True as soon as monitoring should stop instead."""
    while True:
        if child is not None:
            if child.poll() is not None:  # a forwarded signal ends the loop through the child's exit
                return True
        elif received or (pid is not None and not _alive(pid)):
            return True  # pid / whole-machine mode: Ctrl-C is the normal way to stop watching
        now = time.monotonic()
        if duration is not None and now - start >= duration:
            return True
        if now >= deadline:
            return False
        time.sleep(min(0.02, deadline - now))


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _install(handler: Any) -> dict[int, Any]:
    previous: dict[int, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread (embedded use): leave signals alone
            pass
    return previous


def _restore(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def _title(command: Sequence[str] | None, pid: int | None) -> str:
    if command:
        text = " ".join(" ".join(command).split())  # one line, also for multi-line `python -c` scripts
        return text if len(text) <= 80 else text[:77] + "..."
    return f"pid {pid}" if pid is not None else "whole machine"


def _echo_header(nvml: NvmlSampler, host: HostSampler) -> str:
    gpu = "".join(f" | gpu{i}  sm%   memGiB  W" for i in nvml.indices)
    return f"#  time_s   cpu%  iow%  tree%  {'pss' if host.pss_available else 'rss'}GiB{gpu}"


def _echo_line(elapsed: float, h: HostReading, gpus: list[GpuReading]) -> str:
    mem = h.proc_rss_mib if math.isnan(h.proc_pss_mib) else h.proc_pss_mib
    line = f"{elapsed:8.1f} {h.cpu_pct:6.1f} {h.iowait_pct:5.1f} {h.proc_cpu_pct:6.0f} {mem / 1024:7.2f}"
    for g in gpus:
        line += f" |      {g.util_pct:4.0f} {g.mem_used_mib / 1024:8.2f} {g.power_w:4.0f}"
    return line


def _col(table: list[dict[str, str]], name: str) -> np.ndarray:
    vals = [float(r[name]) for r in table if r.get(name) not in (None, "")]
    return np.asarray(vals, np.float64)


def summarise(
    table: list[dict[str, str]],
    gpu_indices: Sequence[int],
    gpu_names: Sequence[str],
    interval: float,
    cores: int,
    gpu_reason: str = "",
) -> dict[str, Any]:
    """Per-GPU and host statistics of the rows and the verdict sentence (JSON-able)."""
    devices = []
    for i, name in zip(gpu_indices, gpu_names):
        util = _col(table, f"gpu{i}_util_pct")
        if util.size == 0:
            continue
        mem = _col(table, f"gpu{i}_mem_used_mib")
        power = _col(table, f"gpu{i}_power_w")
        devices.append(
            {
                "index": int(i),
                "name": name,
                "util_mean_pct": float(util.mean()),
                "util_p5_pct": float(np.percentile(util, 5)),
                "util_median_pct": float(np.median(util)),
                "frac_under_50": float((util < BUSY_PCT).mean()),
                "mem_used_max_mib": float(mem.max()) if mem.size else math.nan,
                "power_mean_w": float(power.mean()) if power.size else math.nan,
            }
        )
    cpu = _col(table, "cpu_pct")
    iow = _col(table, "iowait_pct")
    tree_cpu = _col(table, "proc_cpu_pct")
    pss = _col(table, "proc_pss_mib")
    rss = _col(table, "proc_rss_mib")
    used = _col(table, "mem_used_mib")
    host = {
        "cores": int(cores),
        "cpu_mean_pct": float(cpu.mean()) if cpu.size else math.nan,
        "cpu_max_pct": float(cpu.max()) if cpu.size else math.nan,
        "iowait_mean_pct": float(iow.mean()) if iow.size else math.nan,
        "tree_cpu_mean_pct": float(tree_cpu.mean()) if tree_cpu.size else math.nan,
        # PSS where every sample has it (blank cells are samples it could not be read)
        "tree_pss_max_mib": float(pss.max()) if pss.size and pss.size == rss.size else math.nan,
        "tree_rss_max_mib": float(rss.max()) if rss.size else math.nan,
        "mem_used_rise_mib": float(used.max() - used[0]) if used.size else math.nan,
    }
    elapsed = _col(table, "elapsed_s")
    summary: dict[str, Any] = {
        "samples": len(table),
        "interval_s": float(interval),
        # from the start of monitoring to the last sample: a job shorter than one interval still spans its run
        "span_s": float(elapsed[-1]) if elapsed.size else 0.0,
        "gpu_found": bool(gpu_indices),
        "gpu_reason": gpu_reason,
        "gpus": devices,
        "host": host,
    }
    summary["verdict"] = verdict(summary)
    return summary


def verdict(summary: dict[str, Any]) -> str:
    """One sentence: is the GPU waiting on data, and what to look at next."""
    host = summary["host"]
    if not summary["gpu_found"]:
        return f"no GPU found ({summary['gpu_reason']}); recorded CPU and memory only"
    if not summary["gpus"]:
        return "no samples recorded"
    # The busiest GPU speaks for the job (others may be idle on purpose).
    g = max(summary["gpus"], key=lambda d: d["util_mean_pct"])
    idle = g["frac_under_50"]
    head = f"GPU {g['index']}: mean {g['util_mean_pct']:.0f} %, p5 {g['util_p5_pct']:.0f} %, {idle:.0%} of samples under 50 %"
    if g["util_mean_pct"] >= 85 and idle < 0.1:
        return f"{head}: the GPU is busy; data loading is not holding it back"
    cpu = host["cpu_mean_pct"]
    iow = host["iowait_mean_pct"]
    if cpu >= 85:
        return (
            f"{head} while the CPUs are saturated ({cpu:.0f} % of {host['cores']} cores): the GPU is waiting on "
            "CPU-bound data loading; run `fastload bench DATA` to find the slow stage"
        )
    if not math.isnan(iow) and iow >= 10:
        return (
            f"{head} with {iow:.0f} % I/O wait: the GPU is waiting on storage; stage the data to RAM "
            "(`fastload stage DATA --to /dev/shm/NAME`) or convert to an lmdb/ram store"
        )
    return (
        f"{head} but the CPUs are not saturated ({cpu:.0f} %): too few loader workers, small batches or "
        "synchronisation points; try more workers, then `fastload bench DATA`"
    )


def _tree_memory(host: dict[str, Any]) -> str:
    """The watched tree's peak memory: PSS (shared pages split between their processes) where the platform
    reports it, else summed RSS, labelled as such (shared pages counted once per process)."""
    rss = f"{host['tree_rss_max_mib'] / 1024:.2f} GiB"
    if math.isnan(host.get("tree_pss_max_mib", math.nan)):
        return f"watched tree peak RSS {rss} (summed: a page shared by N processes counts N times; PSS not available here)"
    return (f"watched tree peak PSS {host['tree_pss_max_mib'] / 1024:.2f} GiB (summed RSS {rss} counts a page "
            f"shared by N processes N times)")


def format_summary(summary: dict[str, Any]) -> str:
    """Human-readable summary lines ending with the verdict."""
    host = summary["host"]
    lines = [
        f"fastload monitor: {summary['samples']} sample(s) every {summary['interval_s']:g} s over {summary['span_s']:.1f} s",
        f"  host: {host['cores']} cores, cpu mean {host['cpu_mean_pct']:.0f} % (max {host['cpu_max_pct']:.0f} %), "
        f"iowait {host['iowait_mean_pct']:.1f} %, watched tree {host['tree_cpu_mean_pct']:.0f} % of one core",
        f"  memory: {_tree_memory(host)}; the machine's used memory rose {host['mem_used_rise_mib'] / 1024:.2f} GiB",
    ]
    for g in summary["gpus"]:
        lines.append(
            f"  gpu{g['index']} {g['name']}: util mean {g['util_mean_pct']:.0f} %, p5 {g['util_p5_pct']:.0f} %, "
            f"under 50 % for {g['frac_under_50']:.0%} of samples, peak mem {g['mem_used_max_mib'] / 1024:.1f} GiB, "
            f"power {g['power_mean_w']:.0f} W"
        )
    lines.append("  " + summary["verdict"])
    return "\n".join(lines)
