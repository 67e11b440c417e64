"""Shared fixtures: the real coco128 set (skipped with a reason where it is absent), small synthetic
sets, a private shared-memory root, a one-thread torch setting and a local Ray instance."""
from __future__ import annotations

import os
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest

from store_helpers import isolated_shm

# Bytecode is cached even where the environment says not to (PYTHONDONTWRITEBYTECODE, as on CI's machine): the
# suite starts about a hundred interpreters (its workers, the official scripts, trainers, CLI runs), and each
# would otherwise compile fastload, yolov9 and the rewritten test modules from source again.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

REPO = Path(__file__).resolve().parents[1]
COCO128 = Path(os.environ.get("FASTLOAD_COCO128", REPO.parent / "shared" / "datasets" / "coco128"))


def _starts_ray(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    return ("local_ray" in getattr(item, "fixturenames", ()) or item.get_closest_marker("starts_ray") is not None
            or (callspec is not None and callspec.params.get("engine") == "ray"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "starts_ray: the test starts a local Ray instance (it runs last)")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks set here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Tests that start Ray run last. Ray leaves gRPC threads in the process after ray.shutdown(), and a
    # fork() while one of them holds a lock can hang the child (grpc/grpc#31885): the tests that fork
    # pools (conversion, CPU workers) hung that way once in a loaded run after the Ray tests. Modules with
    # tests marked slow (the official scripts' runs) run first, so that under xdist the two workers end
    # together instead of one waiting for a long module queued late.
    slow_modules = {item.module for item in items if item.get_closest_marker("slow") is not None}
    ray_tests = Counter(item.module for item in items if _starts_ray(item))  # the larger Ray units first, as well

    def order(item: pytest.Item) -> tuple:
        if _starts_ray(item):
            return True, -ray_tests[item.module], item.module.__name__
        return False, item.module not in slow_modules

    items.sort(key=order)  # stable: the order within a module is kept
    # Under xdist (README: -n 2, with --dist loadgroup --no-loadscope-reorder from pyproject.toml) each group is
    # one unit of work, given out in this order: a module's tests share a worker, so its module fixtures (the
    # official scripts' runs, the bad-input matrix) run once; a module's tests that start Ray are a unit of
    # their own, queued after every unit that does not, so a worker that has started Ray runs nothing else.
    for item in items:
        name = item.module.__name__
        item.add_marker(pytest.mark.xdist_group(f"{name}-ray" if _starts_ray(item) else name))


@pytest.fixture(scope="session")
def coco128_yaml() -> Path:
    """Path to ../shared/datasets/coco128/coco128.yaml; skips when the folder is absent (a user's machine)."""
    yaml_path = COCO128 / "coco128.yaml"
    if not yaml_path.is_file():
        pytest.skip(f"coco128 not found at {yaml_path} (set FASTLOAD_COCO128 to its folder)")
    return yaml_path


@pytest.fixture(scope="session")
def synth_yaml(tmp_path_factory) -> Path:
    """A small synthetic dataset (JPEG and PNG, odd sizes, some empty labels) shared by the session."""
    from fastload.data.synthetic import make_synthetic_dataset

    out = tmp_path_factory.mktemp("synth")
    return make_synthetic_dataset(out, n_train=24, n_val=8, nc=3, seed=0)


@pytest.fixture(scope="session")
def preloaded_python(tmp_path_factory):
    """A fork server with torch, torchvision, pandas and matplotlib imported (tests/preloaded.py), for the tests
    that start the official scripts or the trainer many times; started on first use, one for the session: under
    pytest-xdist the first worker that needs it starts it and the other joins it (in the folder the workers share)."""
    from preloaded import PreloadedPython, base_env

    if "PYTEST_XDIST_WORKER" in os.environ:
        server = PreloadedPython.shared(base_env(REPO), tmp_path_factory.getbasetemp().parent)
    else:
        server = PreloadedPython(base_env(REPO))
    yield server
    server.close()


@pytest.fixture
def shm_root(monkeypatch, request):
    """A private shm root (``FASTLOAD_SHM_DIR``) for one test, removed afterwards."""
    root = isolated_shm(monkeypatch, request.node.name[:24].replace("[", "_").replace("]", ""))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def one_torch_thread():
    """Intra-op threads fight over the few shared CPU cores of CI; one is faster and deterministic.

    Opt in per module with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_OUR_RAY: dict[str, str] = {}  # the GCS address of the local instance that local_ray started, once it has


@pytest.fixture(scope="session")
def _ray_stopped_at_exit():
    """Stops the local Ray instance (if one was started) at the end of the session."""
    yield
    if _OUR_RAY:
        import ray

        ray.shutdown()


@pytest.fixture(scope="module")
def local_ray(_ray_stopped_at_exit):
    """One local Ray instance (2 CPUs, no dashboard) per test process, started by the first module that needs it
    and kept for the next ones (the tests that start Ray run last: start-up is the slow part), shut down at the
    end of the session; skips where Ray is not installed (CI installs it with the ``ray`` extra)."""
    ray = pytest.importorskip("ray", reason='Ray is not installed (pip install "fastload[ray]")')
    ours = ray.is_initialized() and ray.get_runtime_context().gcs_address == _OUR_RAY.get("address")
    if ray.is_initialized() and not ours:  # a connection left by something else (e.g. a bench run) is not ours
        ray.shutdown()
    if not ours:
        # a small object store, so that its usage figures (percentages) resolve a few small batches
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=256 << 20)
        _OUR_RAY["address"] = ray.get_runtime_context().gcs_address
    yield ray
