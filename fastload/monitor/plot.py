"""Time-series PNG of a monitoring run: utilisation, memory and (with a GPU) power over time."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np


def _series(table: list[dict[str, str]], name: str) -> np.ndarray:
    """A column as floats; blanks (unsupported NVML fields) become NaN so that lines break there."""
    return np.asarray([float(r[name]) if r.get(name) not in (None, "") else np.nan for r in table], np.float64)


def plot_monitor(
    table: list[dict[str, str]],
    out: str | Path,
    *,
    gpu_indices: Sequence[int] = (),
    cores: int | None = None,
    title: str = "",
) -> Path:
    """Write the PNG of the CSV rows ``table`` (dicts keyed by the CSV header) and return its path."""
    # matplotlib is slow to import and only a --plot run needs it; the headless backend goes first
    import matplotlib

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t = _series(table, "elapsed_s")
    panels = 3 if gpu_indices else 2
    fig, axes = plt.subplots(panels, 1, figsize=(10, 2.6 * panels + 0.6), sharex=True, squeeze=False)
    ax_util, ax_mem = axes[0, 0], axes[1, 0]

    for i in gpu_indices:
        ax_util.plot(t, _series(table, f"gpu{i}_util_pct"), label=f"GPU {i} util", lw=1.6)
    ax_util.plot(t, _series(table, "cpu_pct"), label=f"CPU (all {cores or '?'} cores)", lw=1.2, color="tab:gray")
    ax_util.plot(
        t, _series(table, "proc_cpu_pct") / max(cores or 1, 1), label="watched tree CPU (share of all cores)", lw=1.0, color="tab:green"
    )
    ax_util.plot(t, _series(table, "iowait_pct"), label="I/O wait", lw=1.0, color="tab:brown", ls=":")
    if gpu_indices:
        ax_util.axhline(50, color="tab:red", lw=0.8, ls="--", label="50 %")
    ax_util.set_ylim(0, 105)
    ax_util.set_ylabel("%")
    ax_util.legend(loc="upper right", fontsize=8, ncol=2)

    for i in gpu_indices:
        ax_mem.plot(t, _series(table, f"gpu{i}_mem_used_mib") / 1024, label=f"GPU {i} memory", lw=1.4)
    pss = _series(table, "proc_pss_mib")
    if np.isfinite(pss).any():
        ax_mem.plot(t, pss / 1024, label="process tree PSS", lw=1.2, color="tab:gray")
    else:  # PSS not reported here: summed RSS, which counts shared pages once per process
        ax_mem.plot(t, _series(table, "proc_rss_mib") / 1024, label="process tree RSS (summed)", lw=1.2, color="tab:gray")
    ax_mem.set_ylim(bottom=0)
    ax_mem.set_ylabel("GiB")
    ax_mem.legend(loc="upper right", fontsize=8)

    if gpu_indices:
        ax_pow = axes[2, 0]
        for i in gpu_indices:
            ax_pow.plot(t, _series(table, f"gpu{i}_power_w"), label=f"GPU {i} power", lw=1.4)
        ax_pow.set_ylabel("W")
        ax_clk = ax_pow.twinx()
        for i in gpu_indices:
            ax_clk.plot(t, _series(table, f"gpu{i}_sm_clock_mhz"), lw=0.8, ls=":", label=f"GPU {i} SM clock")
        ax_clk.set_ylabel("MHz")
        ax_pow.legend(loc="upper left", fontsize=8)
        ax_clk.legend(loc="upper right", fontsize=8)

    axes[-1, 0].set_xlabel("seconds")
    heading = title or "fastload monitor"
    if not gpu_indices:
        heading += " (no GPU found: CPU and memory only)"
    fig.suptitle(heading, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
