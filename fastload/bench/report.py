"""The text report of a bench run: machine ceilings, one row per measurement, model, bottleneck sentence."""
from __future__ import annotations

import math
from typing import Any

from fastload.bench.run import BenchResult


def _num(x: float | None, fmt: str = "{:.0f}") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, float) and math.isinf(x):
        return "unbounded"
    return fmt.format(x)


def _format_machine(result: BenchResult) -> str:
    m = result.machine
    raw = (
        f"raw read {m.raw_read_mb_s:.0f} MB/s sequential ({'cold' if m.raw_read_cold else 'cache not dropped'})"
        if m.raw_read_mb_s
        else "raw read n/a"
    )
    phys = f", {m.physical_cores} physical" if m.physical_cores else ""
    return (
        f"machine: {m.cores} usable cores ({m.logical_cpus} logical{phys}), RAM {m.ram_total_gb:.1f} GB "
        f"({m.ram_available_gb:.1f} available); memcpy {m.memcpy_mb_s:.0f} MB/s per core; {raw}"
    )


def format_table(result: BenchResult) -> str:
    rows = [("stage", "variant", "samples/s", "MB/s", "note")]
    for m in result.measurements:
        if m.skipped:
            rows.append((m.stage, m.name, "-", "-", "skipped: " + m.skipped))
        else:
            rows.append((m.stage, m.name, f"{m.samples_per_s:.1f}", f"{m.mb_per_s:.1f}", m.note))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = []
    for r in rows:
        lines.append(
            f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}  {r[4]}".rstrip()
        )
    lines.insert(1, "-" * min(120, max(len(line) for line in lines)))
    return "\n".join(lines)


def _format_model(analysis: dict[str, Any]) -> str:
    head = (
        f"ceilings in augmented samples/s ({analysis['reads_per_sample']:.1f} image reads per sample, "
        f"{analysis['parallel_workers']} parallel worker(s)):"
    )
    lines = [head]
    for kind, c in analysis["configs"].items():
        parts = [f"{stage} {_num(v['samples_per_s'])}" for stage, v in c["ceilings"].items()]
        if not parts:
            continue
        tail = f" -> {c['limit']}-limited at {_num(c['limit_samples_per_s'])}"
        if c.get("loader_samples_per_s"):
            eff = c.get("efficiency")
            tail += f"; loader cpu/{kind} measured {c['loader_samples_per_s']:.0f}"
            if eff is not None:
                tail += f" ({eff:.0%} of it)"
        lines.append(f"  {kind:5s}: " + " | ".join(parts) + tail)
    return "\n".join(lines)


def format_report(result: BenchResult) -> str:
    """The whole report printed by ``fastload bench``."""
    cfg = result.config
    head = (
        f"fastload bench: {result.data} [{result.split}], imgsz {cfg['imgsz']}, batch {cfg['batch']}, "
        f"{cfg['workers']} workers, {cfg['seconds']:g} s per measurement"
    )
    parts = [head, _format_machine(result), "", format_table(result), ""]
    model = _format_model(result.analysis)
    if model.count("\n"):
        parts += [model, ""]
    parts.append("bottleneck: " + result.sentence)
    parts.append(f"(measured in {result.elapsed_s:.1f} s, {result.planned_s:.0f} s planned for the timed loops)")
    return "\n".join(parts)
