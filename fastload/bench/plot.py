"""PNG bar chart of a bench run: one horizontal bar per measurement, grouped and coloured by stage."""
from __future__ import annotations

import textwrap
from pathlib import Path

from fastload.bench.run import BenchResult

COLOURS = {"read": "tab:blue", "decode": "tab:orange", "augment": "tab:green", "loader": "tab:red"}


def plot_bench(result: BenchResult, out: str | Path) -> Path:
    """Write the chart (samples/s, log scale; MB/s printed on each bar) and return its path."""
    # matplotlib is slow to import and only a --plot run needs it; the headless backend goes first
    import matplotlib

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = list(reversed(result.measurements))  # matplotlib draws bottom-up; keep the table's order
    labels = [f"{m.stage}: {m.name}" for m in rows]
    values = [m.samples_per_s if m.ok else 0.0 for m in rows]
    colours = [COLOURS.get(m.stage, "tab:gray") if m.ok else "lightgray" for m in rows]
    fig_h = 1.6 + 0.32 * max(len(rows), 1)
    fig, ax = plt.subplots(figsize=(10, fig_h))
    positive = [v for v in values if v > 0]
    floor = min(positive) / 2 if positive else 1.0
    ax.barh(range(len(rows)), [v if v > 0 else floor for v in values], color=colours)
    for y, m in enumerate(rows):
        text = f" {m.samples_per_s:.0f}/s, {m.mb_per_s:.0f} MB/s" if m.ok else f" skipped: {m.skipped}"
        ax.text(values[y] if values[y] > 0 else floor, y, text[:70], va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    if positive and max(positive) / min(positive) > 20:
        ax.set_xscale("log")
    ax.set_xlabel("samples/s (read/decode/augment: one core; loader: all workers)")
    m = result.machine
    title = (
        f"fastload bench - {Path(result.data).name} [{result.split}] - {m.cores} cores, "
        f"memcpy {m.memcpy_mb_s / 1000:.1f} GB/s"
        + (f", raw read {m.raw_read_mb_s:.0f} MB/s" if m.raw_read_mb_s else "")
    )
    ax.set_title(title + "\n" + "\n".join(textwrap.wrap(result.sentence, 120)), fontsize=8, loc="left")
    xmax = max(positive) if positive else 1.0
    ax.set_xlim(right=xmax * (8 if ax.get_xscale() == "log" else 1.6))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
