"""How the command lines (``fastload ...`` and ``python -m yolov9.train``) end: exit codes and error lines.

A failure is reported as one line on stderr, ``<prog>: <what is wrong, naming the file or option, and
what to do>``, without a traceback; ``--debug`` or ``FASTLOAD_DEBUG=1`` lets the exception propagate with
its traceback instead (for an error raised in a loader worker or Ray actor, the worker's traceback follows as
a note: :meth:`fastload.engines.base.WorkerFailure.exception`). Exit codes (docs/stores.md, "Errors and exit codes"):

* 0 - the command did its job (also when it skipped and counted bad records);
* 1 - it could not (bad or missing data, a damaged store, no space, a refused conversion);
* 2 - the command line is wrong (unknown option, a value out of range);
* 130 - interrupted (Ctrl-C); 141 - its output pipe was closed (``fastload info | head``).

Usage errors are found before any work, in one of two ways: a value is checked while parsing by the
``type=`` functions here (:func:`whole`, :func:`image_size`, :func:`positive_seconds`, :func:`index_list`);
a value that needs a look at the data (a ``--split`` the yaml lacks) or a light import (the store kinds)
is checked first thing in the command by :func:`check_splits` / :func:`check_choices`, or raised as a
:class:`UsageError`.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, NoReturn, Sequence

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 128 + 13  # SIGPIPE, as a shell reports a writer killed by it

# Exceptions that describe a problem with the input or the machine: their message is the whole report.
# Anything else is a bug: the line names its type and asks for --debug.
USER_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, LookupError, ImportError)


class UsageError(ValueError):
    """An option value that cannot work (found after parsing, e.g. by looking at the machine): exit 2."""


def debug_enabled(flag: bool = False) -> bool:
    """True when ``--debug`` was given or ``FASTLOAD_DEBUG`` is set to anything but ``""``/``0``."""
    return bool(flag) or os.environ.get("FASTLOAD_DEBUG", "").strip() not in ("", "0")


def describe(exc: BaseException) -> str:
    """One line for ``exc``: its message (with the file an OSError names), newlines folded."""
    text = str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        # `[Errno 28] No space left on device` says nothing about where; name the file when the error does
        where = exc.filename if exc.filename is not None else None
        text = exc.strerror + (f": {where}" if where and str(where) not in text else "")
    text = " ".join(text.split())
    if not (isinstance(exc, USER_ERRORS) or type(exc).__module__.startswith("fastload")):
        text = f"unexpected {type(exc).__name__}: {text} (rerun with --debug or FASTLOAD_DEBUG=1 for the traceback, and report it)"
    elif getattr(exc, "worker_exception", None):  # a loader worker's exception that is not fastload's (WorkerError)
        text += " (rerun with --debug or FASTLOAD_DEBUG=1 for the worker's traceback)"
    return text or type(exc).__name__


def run_reported(prog: str, fn: Callable[[], int | None], *, debug: bool = False) -> int:
    """Run ``fn`` and turn its exceptions into one stderr line and an exit code (see the module doc)."""
    try:
        rc = int(fn() or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit handler
        return rc
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`| head`): nothing more to say. Point stdout at /dev/null so that
        # the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except SystemExit:
        raise
    except Exception as exc:
        if debug_enabled(debug):
            raise
        print(f"{prog}: {describe(exc)}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, UsageError) else EXIT_FAILED


# ----------------------------------------------------------------------------- option values
# argparse ``type=`` functions: a value out of range is refused while parsing, so it exits 2 with the
# parser's one line (``fastload demo: argument --batch: must be >= 1, got 0 (see ...)``) before any work.
def whole(low: int, high: int | None = None) -> Callable[[str], int]:
    """An ``int`` option that must be ``>= low`` (and ``<= high`` when given)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"want a whole number, got {text!r}") from None
        if value < low or (high is not None and value > high):
            span = f"in {low}..{high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {value}")
        return value

    return parse


def positive_seconds(text: str) -> float:
    """A duration in seconds, ``> 0``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want a number of seconds, got {text!r}") from None
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def image_size(text: str) -> int:
    """A training image size: a positive multiple of 32 (the YOLO models' largest stride, the loader's default)."""
    value = whole(32)(text)
    if value % 32:
        near = max(32, round(value / 32) * 32)
        raise argparse.ArgumentTypeError(f"must be a multiple of 32 (the models' largest stride), got {value}; "
                                         f"use e.g. {near}")
    return value


def index_list(text: str) -> list[int]:
    """A comma list of indices ``>= 0`` (``--gpus 0,1``)."""
    indices = [whole(0)(item) for item in text.split(",") if item.strip()]
    if not indices:
        raise argparse.ArgumentTypeError(f"want comma-separated indices such as 0,1, got {text!r}")
    return indices


def check_choices(option: str, value: str, allowed: Sequence[str], what: str) -> list[str]:
    """The items of the comma list ``value``, each one of ``allowed``; otherwise a UsageError naming the bad ones."""
    items = [x.strip() for x in value.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise UsageError(f"{option} {value!r}: unknown {what} {', '.join(bad) or '(none given)'}; "
                         f"choose from {', '.join(allowed)}")
    return items


def check_splits(option: str, value: str | None, data: str | os.PathLike) -> list[str] | None:
    """The splits a ``--split`` comma list names, each defined by the data.yaml ``data``; None when not given.

    A split the yaml does not define is the command line's mistake (exit 2); a yaml that cannot be read is the
    data's (its DataConfigError passes through: exit 1).
    """
    if value is None:
        return None
    # imported when the check runs: `fastload --help` stays light
    from fastload.data.config import load_data_config

    return check_choices(option, value, list(load_data_config(data).splits), f"split(s) of {data}:")


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line (the option, the problem, where help is) and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


class SubcommandParser(OneLineParser):
    """A sub-command's parser: an argument it does not know is its own error (``fastload verify: unrecognized
    arguments: --jsn``), not the top-level parser's (which would only say ``fastload:``)."""

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        parsed, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed, extra


def add_debug_flag(parser: argparse.ArgumentParser, *, top: bool = False) -> None:
    """``--debug`` on ``parser``; sub-command parsers leave it unset when absent so that a top-level one counts."""
    parser.add_argument("--debug", action="store_true", default=False if top else argparse.SUPPRESS,
                        help="show the full traceback of an error (same as FASTLOAD_DEBUG=1)")
