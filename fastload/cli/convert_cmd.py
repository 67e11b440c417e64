"""``fastload convert data.yaml --to lmdb|encoded|disk|ram[,..]``: build stores and a data.yaml that points at them."""
from __future__ import annotations

import argparse
import contextlib
import sys

from fastload.cli.errors import UsageError, check_choices, whole


def register(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("convert", help=help_text, description=help_text + ". Writes <out>/data.yaml (original "
                       "keys plus `fastload: {split: {kind: path}}`); interrupted runs never leave a store that opens.")
    p.add_argument("data", help="data.yaml of the dataset")
    p.add_argument("--to", default="lmdb", help="store kinds, comma separated: lmdb, encoded (the same images in one flat file: what object storage streams), disk, ram (default lmdb)")
    p.add_argument("--out", default=None, help="output folder (default <dataset root>/fastload), or s3://BUCKET/PREFIX: "
                   "built locally, then uploaded (readers see it once complete; credentials from AWS_* variables)")
    p.add_argument("--imgsz", type=whole(1), default=640, help="long side of decoded disk/ram images (default 640)")
    p.add_argument("--load-rule", default="yolov9",
                   help="whose loaded-image rule disk/ram images are made with: yolov9 (truncated sizes, INTER_AREA) or "
                        "ultralytics (sizes rounded up, INTER_LINEAR: for fastload's ultralytics recipe; default yolov9)")
    p.add_argument("--split", default=None, help="splits to convert, comma separated (default: all in the yaml)")
    p.add_argument("--workers", type=whole(1), default=None, help="decode/encode processes (default: CPUs, at most 8)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted LMDB conversion")
    p.add_argument("--max-side", type=whole(1), default=None, help="lmdb/encoded: re-encode images whose long side exceeds N")
    p.add_argument("--quality", type=whole(1, 100), default=90, help="JPEG quality for --max-side re-encoding (default 90)")
    p.add_argument("--force", action="store_true",
                   help="replace the stores of another dataset in --out (a folder holds one dataset's stores), and "
                        "remove stores built before the images changed that this run does not rebuild; with an s3:// "
                        "--out, replace the store uploaded there")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # imported when the command runs: `fastload --help` stays light
    from fastload.data.config import load_data_config
    from fastload.data.images import LOAD_RULES
    from fastload.store.convert import convert, output_folder
    from fastload.store.kinds import CONVERT_KINDS, ENCODED_KINDS, finish_hint, unfinished_conversions
    from fastload.store.objects.urls import is_url
    from fastload.store.upload import convert_to_url, work_folder

    kinds = check_choices("--to", args.to, CONVERT_KINDS, "store kind(s)")
    if args.max_side and not any(k in ENCODED_KINDS for k in kinds):
        raise UsageError(f"--max-side {args.max_side} re-encodes the images of {' and '.join(ENCODED_KINDS)} stores; "
                         f"--to {args.to} writes decoded images at --imgsz: drop --max-side")
    rules = check_choices("--load-rule", args.load_rule, LOAD_RULES, "loaded-image rule")
    if len(rules) > 1:
        raise UsageError(f"--load-rule {args.load_rule!r}: a store holds images of one rule; choose one of {', '.join(LOAD_RULES)}")
    load_rule = rules[0]
    cfg = load_data_config(args.data)  # read once: the --split check and the conversion share it
    splits = None if args.split is None else check_choices("--split", args.split, list(cfg.splits),
                                                           f"split(s) of {args.data}:")
    options = dict(imgsz=args.imgsz, load_rule=load_rule, splits=splits, workers=args.workers, resume=args.resume, max_side=args.max_side,
                   quality=args.quality, progress=not args.no_progress, force=args.force)
    uploading = args.out is not None and is_url(args.out)
    try:
        if uploading:
            convert_to_url(cfg, kinds, args.out, **options)
        else:
            convert(cfg, kinds, out=args.out, **options)
    except KeyboardInterrupt:
        # before the "interrupted" line: what was left and the command that finishes it
        with contextlib.suppress(Exception):  # a folder that cannot be listed has nothing to report
            if uploading:  # the finish hints would name the work folder: this run's own command finishes it
                if unfinished_conversions(work_folder(args.out)):
                    print(f"fastload convert: nothing was uploaded to {args.out}; the conversion so far waits in "
                          f"{work_folder(args.out)}: run the same command with --resume to continue it",
                          file=sys.stderr)
            else:
                for partial in unfinished_conversions(output_folder(cfg, args.out)):
                    print(f"fastload convert: {partial} is {finish_hint(partial)}", file=sys.stderr)
        raise
    return 0
