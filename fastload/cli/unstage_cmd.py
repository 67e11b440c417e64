"""``fastload unstage PATH``: remove a staged copy or a ram store; ``--stale`` removes shm leftovers."""
from __future__ import annotations

import argparse
import sys

from fastload.cli.errors import UsageError


def register(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("unstage", help=help_text, description=help_text + ". Refuses folders fastload did not "
                       "stage. --list shows /dev/shm leftovers, --stale removes those no live process holds.")
    p.add_argument("path", nargs="*", help="staged folder(s) or /dev/shm/fastload-* ram store(s)")
    p.add_argument("--force", action="store_true", help="remove a ram store even while processes hold it")
    p.add_argument("--stale", action="store_true",
                   help="remove ram stores and decoded-image caches whose holders are all dead")
    p.add_argument("--list", action="store_true", help="list fastload segments and staged copies in /dev/shm")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # imported when the command runs: `fastload --help` stays light
    from fastload.store import shm
    from fastload.store.base import StoreError
    from fastload.store.kinds import shm_root
    from fastload.store.info import format_shm, shm_info
    from fastload.store.stage import list_staged, unstage

    if not (args.path or args.stale or args.list):
        raise UsageError("give a PATH, --stale or --list")
    if args.force and not args.path:
        raise UsageError("--force applies to the PATHs given (--stale removes only segments nobody alive holds)")
    if args.list:
        print(format_shm(shm_info()))
        for p in list_staged(shm_root()):
            print(f"staged copy: {p}")
    if args.stale:
        removed = shm.cleanup_stale()
        for s in removed:
            print(f"removed stale segment {s.path} (dead holders {s.dead})")
        if not removed:
            print("no stale segments")
    rc = 0
    for path in args.path:
        try:
            unstage(path, force=args.force)
        except (StoreError, OSError) as e:
            print(f"fastload unstage: {e}", file=sys.stderr)
            rc = 1
    return rc
