"""``fastload bench``: per-stage throughput on your own data and storage, and the bottleneck in a sentence."""
from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

from fastload.cli.errors import UsageError, image_size, positive_seconds, whole


def register(sub: Any, help_text: str) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "bench",
        help=help_text,
        description=(
            "Measure, side by side, raw reads from each store (cold and warm page cache), decoding per decoder, "
            "augmentation alone and the full loader per engine and store; print the machine's ceilings, a table "
            "and the bottleneck. Each measurement runs for --seconds; the total is printed before and after."
        ),
        epilog="example: fastload bench data.yaml --seconds 5 --json bench.json --plot bench.png",
    )
    p.add_argument("data", help="a data.yaml (as written by `fastload convert` to include its stores) or a store directory")
    p.add_argument("--split", default="train", help="split to measure (default train)")
    p.add_argument("--stages", help="comma list of read,decode,augment,loader (default: all)")
    p.add_argument("--stores", help="comma list of files,lmdb,encoded,disk,ram (default: files + the stores the yaml records)")
    p.add_argument("--engines", help="comma list of cpu,gpu,dali,ray (default: cpu, plus gpu/dali where CUDA is present, "
                                     "plus ray where Ray is installed)")
    p.add_argument("--decoders", help="comma list of fastload,reduced,cv2,pil,torchvision,turbojpeg (default: all)")
    p.add_argument("--convert", action="store_true",
                   help="build missing lmdb/encoded/disk/ram stores in a temporary folder (removed afterwards) instead of skipping them")
    p.add_argument("--batch", type=whole(1), default=64, help="loader batch size (default 64)")
    p.add_argument("--workers", type=whole(0), help="loader workers (default: usable cores, at most 8)")
    p.add_argument("--imgsz", type=image_size, default=640, help="training image size (default 640)")
    p.add_argument("--hyp", help="augmentation hyp yaml (default: YOLOv9 scratch-high)")
    p.add_argument("--seconds", type=positive_seconds, default=5.0, help="time budget of each measurement (default 5)")
    p.add_argument("--json", dest="json_out", help="write every figure to this JSON file")
    p.add_argument("--plot", help="write a PNG bar chart")
    p.add_argument("--quiet", action="store_true", help="no progress lines (the report is still printed)")
    p.set_defaults(func=run)
    return p


def _terminate(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace) -> int:
    # imported when the command runs: `fastload --help` stays light
    from fastload.bench import run_bench
    from fastload.bench.report import format_report
    from fastload.data.config import DataConfigError

    # SIGTERM (`timeout`, a scheduler) becomes SystemExit so that the temporary stores and ram segments
    # built with --convert are removed by run_bench's clean-up instead of being left behind.
    try:
        previous = signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread
        previous = None
    try:
        result = run_bench(
            args.data,
            split=args.split,
            stages=args.stages,
            stores=args.stores,
            engines=args.engines,
            decoders=args.decoders,
            batch=args.batch,
            workers=args.workers,
            seconds=args.seconds,
            imgsz=args.imgsz,
            hyp=args.hyp,
            convert=args.convert,
            log=None if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True)),
        )
    except ValueError as e:
        if isinstance(e, DataConfigError):  # the data.yaml, not an option: exit 1
            raise
        raise UsageError(str(e)) from e  # an option (--stages, --seconds, ...)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print(format_report(result))
    if args.json_out:
        print(f"json -> {result.write_json(args.json_out)}")
    if args.plot:
        # imported when the command runs: `fastload --help` stays light
        from fastload.bench.plot import plot_bench

        print(f"plot -> {plot_bench(result, args.plot)}")
    return 0
