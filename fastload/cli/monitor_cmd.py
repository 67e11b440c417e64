"""``fastload monitor``: watch a command (or a pid) and say whether the GPU is waiting on data."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from fastload.cli.errors import UsageError, index_list, positive_seconds, whole


def register(sub: Any, help_text: str) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "monitor",
        help=help_text,
        description=(
            "Sample GPU utilisation, memory, power and clocks (NVML) plus CPU use and the process tree's memory (PSS) "
            "once per interval while COMMAND runs (or while --pid lives, or until Ctrl-C). Writes a CSV "
            "(flushed each row) and a PNG plot, prints a summary, and exits with COMMAND's exit code."
        ),
        epilog="example: fastload monitor --interval 1 --out run.csv --plot run.png -- python train.py --data coco.yaml",
    )
    p.add_argument("--interval", type=positive_seconds, default=1.0, help="seconds between samples (default 1)")
    p.add_argument("--out", help="CSV file, one row per sample")
    p.add_argument("--plot", help="PNG time-series plot written at the end")
    p.add_argument("--pid", type=whole(1), help="watch this running process (and its children) instead of a command")
    p.add_argument("--duration", type=positive_seconds, help="stop monitoring after this many seconds")
    p.add_argument("--gpus", type=index_list, help="comma-separated NVML GPU indices to record (default: all)")
    p.add_argument("--json", dest="json_out", help="also write the summary as JSON")
    p.add_argument("--quiet", action="store_true", help="no line per sample (summary only)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    # imported when the command runs: `fastload --help` stays light
    from fastload.monitor import format_summary, monitor

    command = list(args.command or [])
    if command and command[0] == "--":
        command = command[1:]
    if command and args.pid is not None:
        raise UsageError("give either -- COMMAND or --pid, not both")
    try:
        result = monitor(
            command or None,
            pid=args.pid,
            interval=args.interval,
            out=args.out,
            plot=args.plot,
            duration=args.duration,
            gpus=args.gpus,
            echo=None if args.quiet else sys.stderr,
        )
    except (ValueError, FileNotFoundError, ProcessLookupError) as e:  # the options name what cannot be watched
        raise UsageError(str(e)) from e
    if args.quiet:
        print(format_summary(result.summary), file=sys.stderr)
    if args.out:
        print(f"fastload monitor: {result.rows} rows -> {args.out}", file=sys.stderr)
    if result.plot_path:
        print(f"fastload monitor: plot -> {result.plot_path}", file=sys.stderr)
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"exit_code": result.exit_code, **result.summary}, fh, indent=2, default=str)
    return result.exit_code
