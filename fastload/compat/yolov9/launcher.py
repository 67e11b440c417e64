"""Run an unmodified official YOLOv9 script with fastload's ``create_dataloader``.

``python -m fastload.compat.yolov9 SCRIPT.py [official flags] [--fastload-* flags]`` (and the same
after ``torchrun ... -m``): the ``--fastload-*`` flags are taken out, the script's own folder goes
first on ``sys.path`` (as when Python runs it; the checkout's root after it, for the scripts in ``segment/``),
the checkout's ``utils.dataloaders`` is imported and its ``create_dataloader`` replaced, and so is
``utils.segment.dataloaders``' (by :func:`fastload.compat.yolov9.segment.create_dataloader`) when the script
imports it (``segment/train.py``, ``segment/train_dual.py``, ``segment/val.py`` ...); then the script runs as
``__main__`` with the remaining flags. Every ``from utils.dataloaders import create_dataloader`` (or the segment
one) that follows (the script's, and the validation script's when the trainer imports it) gets fastload's.
Nothing on disk changes.
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

from fastload.compat.yolov9 import dataloader, segment
from fastload.compat.yolov9.options import OPTIONS

PROG = "python -m fastload.compat.yolov9"
# official flags fastload refuses, with the reason printed in the one line that says so
UNSUPPORTED = {"--quad": "the quad collate (4 images tiled into one) is not implemented"}


class LaunchError(Exception):
    """A launcher usage error: printed as one line, exit status 2."""


def usage() -> str:
    lines = [f"usage: {PROG} SCRIPT.py [official flags] [fastload flags]", "",
             "Runs an official YOLOv9 script (train_dual.py, train.py, val_dual.py, val.py, segment/train.py ...)",
             "unchanged, with fastload's create_dataloader in place of utils.dataloaders.create_dataloader (and of",
             "utils.segment.dataloaders.create_dataloader). Every flag that is not a fastload flag goes to the",
             "script. fastload flags (environment variable in brackets):", ""]
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


#: the official modules whose ``create_dataloader`` the launcher replaces, and the fastload module whose
#: ``create_dataloader`` replaces it (looked up at each call)
LOADER_MODULES = {"utils.dataloaders": dataloader, "utils.segment.dataloaders": segment}


def checkout_root(script_dir: Path) -> Path:
    """The official checkout a script belongs to: its folder or the nearest one above that holds
    ``utils/dataloaders.py`` (the scripts of ``segment/`` live one level down)."""
    for folder in (script_dir, *script_dir.parents):
        if (folder / "utils" / "dataloaders.py").is_file():
            return folder
    raise LaunchError(f"no utils/dataloaders.py in {script_dir} or above it; run a script of an official YOLOv9 "
                      f"checkout")


def install(script_dir: Path, create: Callable[[str], Callable[..., Any]], modules: Sequence[str]) -> list[Any]:
    """Import each of ``modules`` (of :data:`LOADER_MODULES`) from the checkout of ``script_dir`` and put
    ``create(module name)`` in place of its ``create_dataloader``."""
    root = checkout_root(script_dir.resolve())
    if str(script_dir) not in sys.path:
        sys.path.insert(0, str(script_dir))
    if str(root) not in sys.path:
        sys.path.append(str(root))  # as the scripts of segment/ append it themselves
    replaced = []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            raise LaunchError(f"cannot import {name} from {root} ({e}); run a script of an official YOLOv9 "
                              f"checkout") from None
        where = Path(module.__file__ or "").resolve()
        if root not in where.parents:
            raise LaunchError(f"{name} was imported from {where}, not from {root}; another 'utils' package shadows "
                              f"the checkout's")
        module.create_dataloader = create(name)
        replaced.append(module)
    return replaced


def run(script: str, args: Sequence[str], create: Callable[[str], Callable[..., Any]]) -> None:
    """Run ``script`` as ``__main__`` with ``args``, the ``create_dataloader`` of each official loader module it
    imports (:data:`LOADER_MODULES`; ``utils.dataloaders`` always) being ``create(module name)``."""
    path = Path(script)
    if not path.is_file():
        raise LaunchError(f"no script {script}")
    text = path.read_text(errors="replace")
    modules = [name for name in LOADER_MODULES if name == "utils.dataloaders" or name in text]
    install(path.resolve().parent, create, modules)
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

        def create(module: str) -> Callable[..., Any]:
            ours = LOADER_MODULES[module]

            @functools.wraps(ours.create_dataloader)
            def create_dataloader(*a: Any, **kw: Any) -> Any:
                calls.append(module)
                return ours.create_dataloader(*a, **{**keywords, **kw})

            return create_dataloader

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
            print(f"fastload.compat.yolov9: note: {script} never called the create_dataloader of "
                  f"{' or '.join(LOADER_MODULES)} (it builds its loader some other way); fastload was not used",
                  file=sys.stderr)
        return 0
    except LaunchError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
