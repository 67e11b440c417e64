"""Is the loader being built by a script's top-level code outside ``if __name__ == "__main__":``?

Processes started with ``spawn`` (DALI's ``external_source`` workers) import the parent's main script
again. A script that builds the loader at its top level then builds it once more in every worker, which
cannot start processes of its own: DALI waits and fails with "Workers initialization failed" after
about half a minute, saying nothing about why. :func:`unguarded_main_line` lets an engine that spawns
say so at once, before it starts anything.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = (test.left, test.comparators[0])
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    consts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(consts) == 1


def unguarded_main_line() -> tuple[str, int] | None:
    """``(script, line)`` when the caller runs in the main script's top-level code outside a main guard.

    None when it does not, and whenever it cannot be told (interactive sessions, ``python -c`` and
    notebooks have no script that a spawned process would re-run; a script without readable source).
    """
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    if main is None or not script:
        return None
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None:  # called from a function the script's top level did not call (a thread, a callback)
        return None
    line = frame.f_lineno
    try:
        tree = ast.parse(Path(script).read_text(encoding="utf-8"), script)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.If) and _is_main_test(node.test) and node.lineno <= line <= (node.end_lineno or line):
            return None
    return script, line
