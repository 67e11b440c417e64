"""The package's shape: every module imports on its own in any order, module-level imports form a
DAG that follows the layering of docs/design.md, function-local imports say why they are local,
``fastload`` never imports ``yolov9``, and ``import fastload`` (and the CLI's parser) stays light."""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "fastload"

# Lowest layer first: a module may import modules of its own layer or below (docs/design.md).
LAYERS = (
    ("fastload._version",),
    ("fastload.data",),
    ("fastload.store",),
    ("fastload.augment",),
    ("fastload.engines",),
    ("fastload.order", "fastload.fastloader"),
    ("fastload.cli", "fastload.bench", "fastload.compat", "fastload.monitor", "fastload.__main__", "fastload"),
)
# Engines never import each other: each engine's own modules (base and factory are shared, and so are
# cpu_render, the host renderer the cpu engine's workers and the ray engine's actors both run,
# shm_cache, the machine's decoded-image cache that renderer reads through, and inflight, the ordered
# in-flight window of the cpu and ray engines).
ENGINE_FAMILIES = {
    "cpu": ("cpu", "cpu_workers", "shm_batch"),
    "gpu": ("gpu",),
    "dali": ("dali", "dali_graph", "dali_source"),
    "ray": ("ray_engine", "ray_actor"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}
# modules that need an optional dependency to be imported at all (a subclass of one of its classes)
NEEDS_AT_IMPORT = {"fastload.compat.ultralytics.trainer": "ultralytics"}
IMPORTABLE = sorted(m for m in MODULES if not m.endswith(".__main__")  # importing a __main__ runs its program
                    and importlib.util.find_spec(NEEDS_AT_IMPORT.get(m, "fastload")) is not None)


def layer(name: str) -> int:
    best, depth = None, -1
    for k, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > depth:
                best, depth = k, len(prefix)
    assert best is not None, f"{name} is in no layer of LAYERS"
    return best


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _targets(node: ast.Import | ast.ImportFrom, module: str) -> list[str]:
    """The modules an import statement names (``from pkg import sub`` names the submodule)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:  # relative import
        parent = module.split(".")[: len(module.split(".")) - node.level + (1 if MODULES[module].name == "__init__.py" else 0)]
        base = ".".join(parent + ([node.module] if node.module else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def module_level_imports(module: str) -> set[str]:
    """fastload modules ``module`` imports when it is imported (TYPE_CHECKING blocks excluded)."""
    tree = ast.parse(MODULES[module].read_text())
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.update(t for t in _targets(node, module) if t.split(".")[0] == "fastload")
            elif isinstance(node, (ast.If, ast.Try)) and not _is_type_checking(node):
                for part in ("body", "orelse", "finalbody"):
                    visit(getattr(node, part, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return found


def test_module_level_imports_follow_the_layers_without_cycles():
    graph = {m: module_level_imports(m) for m in MODULES}
    upward = [f"{m} -> {t}" for m, ts in graph.items() for t in ts if layer(t) > layer(m)]
    assert not upward, "imports that point up the layering:\n" + "\n".join(upward)
    unknown = [f"{m} -> {t}" for m, ts in graph.items() for t in ts if t not in MODULES]
    assert not unknown, "imports of modules that do not exist:\n" + "\n".join(unknown)
    # a cycle leaves nodes that never reach in-degree 0 (Kahn's algorithm)
    pending = {m: set(ts) for m, ts in graph.items()}
    while True:
        free = [m for m, ts in pending.items() if not ts]
        if not free:
            break
        for m in free:
            del pending[m]
        for ts in pending.values():
            ts.difference_update(free)
    assert not pending, "import cycle among: " + ", ".join(sorted(pending))
    family_of = {f"fastload.engines.{m}": fam for fam, mods in ENGINE_FAMILIES.items() for m in mods}
    crossing = [f"{m} -> {t}" for m, ts in graph.items() for t in ts
                if m in family_of and t in family_of and family_of[m] != family_of[t]]
    assert not crossing, "engines importing each other:\n" + "\n".join(crossing)


def test_fastload_never_imports_yolov9_and_local_imports_say_why():
    unexplained = []
    for module, path in MODULES.items():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                assert not any(t.split(".")[0] == "yolov9" for t in _targets(node, module)), f"{module} imports yolov9"
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for body in _bodies(fn):
                for group in _import_runs(body):
                    first = group[0].lineno
                    text = lines[first - 2 : group[-1].end_lineno]  # the line above and the imports
                    if not any("#" in t for t in text):
                        unexplained.append(f"{path.relative_to(REPO)}:{first}")
    assert not unexplained, ("function-local imports need a one-line comment saying why they are local "
                             "(an optional dependency, or keeping `import fastload` / `fastload --help` light):\n"
                             + "\n".join(unexplained))


def _bodies(fn: ast.AST):
    for node in ast.walk(fn):
        for part in ("body", "orelse", "finalbody"):
            body = getattr(node, part, None)
            if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
                yield body
        for handler in getattr(node, "handlers", []):
            yield handler.body


def _import_runs(body: list[ast.stmt]):
    run: list[ast.stmt] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            run.append(node)
        elif run:
            yield run
            run = []
    if run:
        yield run


# Each order in a process of its own that has imported no fastload module: forked from a run of the pre-loaded
# interpreter (tests/preloaded.py: third-party packages only, torch and torchvision among them, 3 s of the 4 s an
# interpreter spent on the whole list), which the suite's other runs share
IMPORT_ORDERS = """
import importlib, json, os, sys, traceback
import torch, torchvision
failed = []
for seed, order in json.loads(sys.argv[1]).items():
    pid = os.fork()
    if pid == 0:
        try:
            for name in order:
                importlib.import_module(name)
        except BaseException:
            print(f"import order (seed {seed}): {order}", file=sys.stderr)
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        os._exit(0)
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        failed.append(seed)
sys.exit(f"orders that failed: seeds {failed}" if failed else 0)
"""


def test_every_module_imports_in_a_fresh_interpreter_in_random_order(tmp_path, preloaded_python):
    import preloaded

    orders = {}
    for seed in (0, 1):
        orders[seed] = list(IMPORTABLE)
        random.Random(seed).shuffle(orders[seed])
    script = tmp_path / "import_orders.py"
    script.write_text(IMPORT_ORDERS)
    # importing ultralytics writes its settings file and may look for updates: a temporary folder, offline
    env = dict(preloaded.base_env(REPO), YOLO_CONFIG_DIR=str(tmp_path), YOLO_OFFLINE="1")
    res = preloaded.run(preloaded_python, [str(script), json.dumps(orders)], REPO, env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


def test_import_fastload_and_the_cli_parser_stay_light():
    code = (
        "import sys, fastload, fastload.cli\n"
        "fastload.cli.build_parser()\n"
        "print(','.join(m for m in ('torch', 'cv2', 'lmdb', 'matplotlib', 'nvidia.dali') if m in sys.modules))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "", f"`import fastload` / `fastload --help` imported {res.stdout.strip()}"


def _names_engine(node: ast.AST) -> bool:
    """``engine``, ``opts.engine``, ``engine_name``...: an expression that holds an engine's name."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return "engine" in name.lower()


def _engine_names(node: ast.AST, names: set[str]) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in names
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(_engine_names(e, names) for e in node.elts)


def test_no_engine_name_is_compared_outside_the_engines():
    """What an engine can do is declared on its class (Engine.renderers, renders_on, accepts_gpu_store...):
    code outside fastload.engines reads the declarations and never compares an engine's name."""
    from fastload.engines.factory import ENGINES

    names = set(ENGINES)
    found = []
    for module, path in MODULES.items():
        if module.startswith("fastload.engines"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            if any(_names_engine(a) for a in sides) and any(_engine_names(b, names) for b in sides):
                found.append(f"{module}:{node.lineno}")
    assert not found, "engine names compared outside fastload.engines: " + ", ".join(found)
