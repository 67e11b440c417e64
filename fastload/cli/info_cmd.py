"""``fastload info data.yaml|STORE``: counts, class histogram, image sizes, bytes; ``--shm`` lists /dev/shm."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from fastload.cli.errors import UsageError, check_choices, check_splits


def register(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("info", help=help_text, description=help_text + ".")
    p.add_argument("target", nargs="?", help="a data.yaml, a store folder, or s3://BUCKET/PREFIX (reads only its manifest)")
    p.add_argument("--split", default=None, help="splits to report, comma separated (default: all)")
    p.add_argument("--shm", action="store_true", help="list fastload ram stores and decoded-image caches in /dev/shm (holders, stale)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # imported when the command runs: `fastload --help` stays light
    from fastload.store.info import dataset_info, format_info, format_shm, shm_info
    from fastload.store.kinds import detect_kind
    from fastload.store.objects.urls import is_url

    if not args.target and not args.shm:
        raise UsageError("give a data.yaml or store folder, or --shm")
    out: dict = {}
    if args.target and is_url(args.target):
        out = dataset_info(args.target)
        if args.split is not None:
            keep = check_choices("--split", args.split, list(out["splits"]), f"split(s) of {args.target}:")
            out["splits"] = {s: out["splits"][s] for s in keep}
    elif args.target:
        target = Path(args.target)
        if args.split is not None and target.is_dir() and detect_kind(target) is not None:
            raise UsageError(f"--split applies to a data.yaml or a converted folder; {target} is one store")
        splits = check_splits("--split", args.split, target / "data.yaml" if target.is_dir() else target)
        out = dataset_info(args.target, splits)
    if args.shm:
        out["shm"] = shm_info()
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    if args.target:
        print(format_info(out))
    if args.shm:
        print(format_shm(out["shm"]))
    return 0
