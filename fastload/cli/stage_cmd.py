"""``fastload stage data.yaml|STORE --to /dev/shm/NAME``: copy onto a RAM disk, verify, write a data.yaml."""
from __future__ import annotations

import argparse
from pathlib import Path

from fastload.cli.errors import UsageError, check_splits


def register(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("stage", help=help_text, description=help_text + ". Checks free space first, copies into a "
                       "temporary sibling, verifies sizes and crc32, then renames. Remove with `fastload unstage`.")
    p.add_argument("source", help="a data.yaml (images + labels of its splits), a store folder, or s3://BUCKET/PREFIX "
                   "(a store uploaded by `fastload convert --out`: downloaded with parallel ranged reads, every "
                   "record verified)")
    p.add_argument("--to", required=True, help="target folder, e.g. /dev/shm/coco")
    p.add_argument("--split", default=None, help="splits to stage, comma separated (default: all)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # imported when the command runs: `fastload --help` stays light
    from fastload.store.objects.urls import is_url
    from fastload.store.stage import stage

    if args.split is not None and is_url(args.source):
        raise UsageError(f"--split applies to a data.yaml; the store at {args.source} is staged whole")
    source = Path(args.source)
    if args.split is not None and source.is_dir():
        raise UsageError(f"--split applies to a data.yaml; the folder {source} is staged whole")
    splits = check_splits("--split", args.split, source)
    stage(args.source, args.to, splits=splits, progress=not args.no_progress)
    return 0
