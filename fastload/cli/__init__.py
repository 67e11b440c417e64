"""The ``fastload`` command line: one module per sub-command, each exposing ``register(subparsers)``.

A sub-command module adds its parser with ``set_defaults(func=run)``; ``run(args) -> int`` returns
the process exit code. Modules are imported lazily by name so that ``fastload --help`` stays fast
and a broken optional dependency only breaks its own command. How a command fails (one line on stderr,
exit codes, ``--debug``) is :mod:`fastload.cli.errors`.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from fastload._version import __version__
from fastload.cli.errors import EXIT_USAGE, OneLineParser, SubcommandParser, add_debug_flag, run_reported

# (sub-command module, one-line help) in the order `fastload --help` lists them.
COMMANDS: tuple[tuple[str, str], ...] = (
    ("demo", "generate a synthetic dataset, convert it, load augmented batches, print throughput"),
    ("synth", "write a synthetic YOLO dataset (shapes with exact boxes)"),
    ("convert", "convert a data.yaml into lmdb / disk / ram stores"),
    ("stage", "copy a dataset or store onto a RAM disk (/dev/shm) and write a new data.yaml"),
    ("unstage", "remove a staged copy"),
    ("verify", "check every record of a store against its checksum"),
    ("info", "counts, class histogram and image sizes of a dataset or store"),
    ("bench", "measure read / decode / augment / loader throughput and name the bottleneck"),
    ("monitor", "sample GPU and CPU utilisation while a command runs"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="fastload",
        description="Fast object-detection data loading for YOLO datasets.",
    )
    parser.add_argument("--version", action="version", version=f"fastload {__version__}")
    add_debug_flag(parser, top=True)
    sub = parser.add_subparsers(dest="subcommand", metavar="COMMAND", parser_class=SubcommandParser)
    for name, help_text in COMMANDS:
        module = importlib.import_module(f"fastload.cli.{name}_cmd")
        module.register(sub, help_text)
        add_debug_flag(sub.choices[name])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    return run_reported(f"fastload {args.subcommand}", lambda: args.func(args), debug=args.debug)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
