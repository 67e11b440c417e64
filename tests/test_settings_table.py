"""docs/design.md's settings table and option signatures against the engine classes: what each engine
refuses there is what its declarations (Engine.renderers, min_workers, min_prefetch, hsv_modes,
accepts_gpu_store, tasks) make it refuse, and each options class is listed with its fields and their defaults."""
from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from fastload.engines.base import TASKS
from fastload.engines.factory import ENGINES

DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"


def _settings_table() -> dict[str, dict[str, str]]:
    """{setting: {engine: cell}} of the table whose header is ``| setting | cpu | gpu | ...``."""
    lines = [ln.strip() for ln in DESIGN.read_text().splitlines()]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| setting |"))
    engines = [c.strip() for c in lines[start].strip("|").split("|")][1:]
    assert engines == list(ENGINES), f"the table's columns {engines} are not the engines {list(ENGINES)}"
    table = {}
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip("|").split("|")]
        table[cells[0]] = dict(zip(engines, cells[1:]))
    return table


def test_the_settings_table_says_what_the_declarations_refuse():
    table = _settings_table()
    for name, cls in ENGINES.items():
        workers, prefetch = table["`workers`"][name], table["`prefetch`"][name]
        assert ("refused unless 0" in workers) == (cls.renderers != "workers"), (name, workers)
        assert ("0 refused" in workers) == (cls.min_workers >= 1), (name, workers)
        assert ("0 refused" in prefetch) == (cls.min_prefetch >= 1), (name, prefetch)
        hsv = table['`hsv_on="worker"`'][name]
        assert hsv.startswith("refused") == ("worker" not in cls.hsv_modes), (name, hsv)
        gpu_store = table['`store="gpu"` (not a setting)'][name]
        assert (gpu_store == "refused") == (not cls.accepts_gpu_store), (name, gpu_store)
        task = table["`task` (`mask_ratio`, `overlap_mask`)"][name]
        assert (task == 'refused unless `"detect"`') == (cls.tasks == ("detect",)), (name, task)
        assert task.startswith("every task") == (set(cls.tasks) == set(TASKS)), (name, task)


def test_the_option_signatures_list_every_field_with_its_default():
    text = " ".join(DESIGN.read_text().split())  # the signatures wrap over lines
    for name, cls in ENGINES.items():
        options = cls.Options
        found = re.search(rf"`\w+\.{options.__name__}\(([^)]*)\)`", text)
        assert found, f"docs/design.md lists no {options.__name__}(...) signature"
        documented = {}
        for part in found.group(1).split(", "):
            field, _, default = part.partition("=")
            documented[field] = ast.literal_eval(default)
        actual = {f.name: f.default for f in dataclasses.fields(options)}
        assert documented == actual, f"{options.__name__}: docs/design.md says {documented}, the class has {actual}"
