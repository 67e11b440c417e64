"""``fastload bench`` in a process of its own, for test_bench.py: ``python bench_run.py STATE_JSON ARGV...`` runs
``fastload ARGV...`` and writes to ``STATE_JSON`` its exit code and whether this process is still connected to Ray
afterwards (a local instance the bench started for its ray row must be gone), then exits with that code."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path


def main(state_path: str, argv: list[str]) -> int:
    from fastload.cli import main as fastload_main

    code = fastload_main(argv)
    connected = None  # Ray is not installed
    if importlib.util.find_spec("ray") is not None:
        import ray

        connected = ray.is_initialized()
    Path(state_path).write_text(json.dumps({"code": code, "ray_connected": connected}))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
