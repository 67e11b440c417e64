"""Run an unmodified official YOLOv9 script with fastload's ``create_dataloader``.

``python -m fastload.compat.yolov9 SCRIPT.py [official flags] [--fastload-* flags]`` (and the same
after ``torchrun ... -m``): the ``--fastload-*`` flags are taken out, the script's own folder goes
first on ``sys.path`` (as when Python runs it), the checkout's ``utils.dataloaders`` is imported and
its ``create_dataloader`` replaced, then the script runs as ``__main__`` with the remaining flags.
Every ``from utils.dataloaders import create_dataloader`` that follows (the script's, and
``val_dual.py``'s when the trainer imports it) gets fastload's. Nothing on disk changes.
"""
from __future__ import annotations

import functools
import importlib
import logging
import os
import runpy
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from fastload.compat.yolov9 import dataloader
from fastload.compat.yolov9.options import OPTIONS

PROG = "python -m fastload.compat.yolov9"
# official flags fastload refuses, with the reason printed in the one line that says so
UNSUPPORTED = {"--quad": "the quad collate (4 images tiled into one) is not implemented"}


class LaunchError(Exception):
    """A launcher usage error: printed as one line, exit status 2."""


def usage() -> str:
    lines = [f"usage: {PROG} SCRIPT.py [official flags] [fastload flags]", "",
             "Runs an official YOLOv9 script (train_dual.py, train.py, val_dual.py, val.py ...) unchanged, with",
             "fastload's create_dataloader in place of utils.dataloaders.create_dataloader. Every flag that is",
             "not a fastload flag goes to the script. fastload flags (environment variable in brackets):", ""]
    for opt in OPTIONS:
        lines.append(f"  {opt.flag} VALUE   [{opt.env}] {opt.help} (default: {opt.default})")
    return "\n".join(lines)


def split_args(argv: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """``(fastload keywords, the script and its flags)``: ``--fastload-x v`` / ``--fastload-x=v`` taken out."""
    flags = {opt.flag: opt for opt in OPTIONS}
    keywords: dict[str, Any] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name.startswith("--fastload-"):
            opt = flags.get(name)
            if opt is None:
                raise LaunchError(f"unknown fastload flag {name}; known: {', '.join(flags)}")
            if not eq:
                if i + 1 >= len(argv):
                    raise LaunchError(f"{name} needs a value")
                i += 1
                value = argv[i]
            try:
                keywords[opt.name] = opt.parse(value)
            except ValueError as e:
                raise LaunchError(f"{name} {value}: {e}") from None
        else:
            rest.append(arg)
        i += 1
    return keywords, rest


def _official_seed(args: Sequence[str]) -> int | None:
    """The value of the official ``--seed`` flag among the script's flags, if given."""
    for k, arg in enumerate(args):
        if arg == "--seed" and k + 1 < len(args):
            return int(args[k + 1])
        if arg.startswith("--seed="):
            return int(arg.split("=", 1)[1])
    return None


def install(script_dir: Path, create: Callable[..., Any]) -> Any:
    """Import the checkout's ``utils.dataloaders`` and put ``create`` in place of its ``create_dataloader``."""
    if str(script_dir) not in sys.path:
        sys.path.insert(0, str(script_dir))
    try:
        module = importlib.import_module("utils.dataloaders")
    except ImportError as e:
        raise LaunchError(f"cannot import utils.dataloaders from {script_dir} ({e}); run a script of an official "
                          f"YOLOv9 checkout (the folder that holds utils/dataloaders.py)") from None
    where = Path(module.__file__ or "").resolve()
    if script_dir.resolve() not in where.parents:
        raise LaunchError(f"utils.dataloaders was imported from {where}, not from {script_dir}; another 'utils' "
                          f"package shadows the checkout's")
    module.create_dataloader = create
    return module


def run(script: str, args: Sequence[str], create: Callable[..., Any]) -> None:
    """Run ``script`` as ``__main__`` with ``args``, its ``utils.dataloaders.create_dataloader`` being ``create``."""
    path = Path(script)
    if not path.is_file():
        raise LaunchError(f"no script {script}")
    install(path.resolve().parent, create)
    sys.argv = [str(path), *args]
    runpy.run_path(str(path), run_name="__main__")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not argv or argv[0] in ("-h", "--help"):
            print(usage())
            return 0 if argv else 2
        keywords, rest = split_args(argv)
        if not rest:
            raise LaunchError("no script given")
        script, args = rest[0], rest[1:]
        for flag, why in UNSUPPORTED.items():
            if flag in args or any(a.startswith(flag + "=") for a in args):
                raise LaunchError(f"{flag} is not supported by fastload ({why}); drop the flag")
        if "seed" not in keywords and "FASTLOAD_SEED" not in os.environ:
            seed = _official_seed(args)
            if seed is not None:
                keywords["seed"] = seed
        calls = []

        @functools.wraps(dataloader.create_dataloader)
        def create(*a: Any, **kw: Any) -> Any:
            calls.append(1)
            return dataloader.create_dataloader(*a, **{**keywords, **kw})

        log = logging.getLogger("fastload")
        if not log.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(message)s"))
            log.addHandler(handler)
            log.setLevel(logging.INFO)
        where = "not distributed"
        if "RANK" in os.environ:
            env = {k: os.environ.get(k, "?") for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
            where = f"RANK {env['RANK']}, LOCAL_RANK {env['LOCAL_RANK']}, WORLD_SIZE {env['WORLD_SIZE']}"
        print(f"fastload.compat.yolov9: {script} with fastload's create_dataloader ({where})", file=sys.stderr, flush=True)
        run(script, args, create)
        if not calls and int(os.environ.get("RANK", "0")) <= 0:
            print(f"fastload.compat.yolov9: note: {script} never called utils.dataloaders.create_dataloader "
                  f"(it builds its loader some other way); fastload was not used", file=sys.stderr)
        return 0
    except LaunchError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
