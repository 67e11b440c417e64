"""``fastload verify STORE|data.yaml``: full checksum pass; exit 1 naming damaged records."""
from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("verify", help=help_text, description=help_text + ". Exit code 0 when every record "
                       "matches, 1 when a record is damaged or the store is unfinished/unreadable.")
    p.add_argument("target", help="a store folder, a fastload convert output folder, its data.yaml, or s3://BUCKET/PREFIX "
                   "(downloaded to a temporary folder first)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # imported when the command runs: `fastload --help` stays light
    from fastload.store.verify import verify_target

    results = verify_target(args.target, progress=not args.no_progress and not args.json)
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=1))
    else:
        for r in results:
            print(r.format())
    return 0 if all(r.ok for r in results) else 1
