"""engine="dali": the CPU-only DALI graph applies the same records as the CPU reference.

Boxes, paths and shapes must be identical; pixels within the stated tolerance (DALI's float
bilinear and antialiased resize vs OpenCV). DALI's CPU mode is slow: few images, imgsz 128.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed (pip install fastload[dali])")

from fastload.augment.hyp import load_hyp  # noqa: E402
from fastload.fastloader import loader  # noqa: E402
from store_helpers import converted_stores  # noqa: E402

IMGSZ = 128


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def small_yaml(tmp_path_factory):
    from fastload.data.synthetic import make_synthetic_dataset

    return make_synthetic_dataset(tmp_path_factory.mktemp("dali_synth"), n_train=10, n_val=2, nc=3, seed=1)


@pytest.fixture(scope="module")
def converted(small_yaml, tmp_path_factory):
    """The small set converted to lmdb and ram (private shm root)."""
    with converted_stores(small_yaml, "lmdb,ram", tmp_path_factory.mktemp("dali"), imgsz=IMGSZ, tag="dali") as yaml_path:
        yield yaml_path


def run(data, engine, epochs=1, with_stats=False, **kw):
    args = dict(imgsz=IMGSZ, batch_size=4, workers=1, seed=11, store="lmdb")
    args.update(kw)
    out = []
    with loader(data, engine=engine, **args) as fl:
        for _ in range(epochs):
            out.append([(b[0].cpu().clone(), b[1].cpu().clone(), b[2], b[3]) for b in fl])
        stats = fl.stats()
    return (out, stats) if with_stats else out


def hyp_no_hsv() -> dict:
    hyp = load_hyp(None)
    hyp.update(hsv_h=0.0, hsv_s=0.0, hsv_v=0.0, mixup=0.5)  # mixup often: exercise the blend slots
    return hyp


def compare(ref, got, *, mean_diff: float, frac_over_3: float):
    assert len(ref) == len(got)
    for ea, eb in zip(ref, got):
        assert len(ea) == len(eb)
        for a, b in zip(ea, eb):
            assert a[2] == b[2] and a[3] == b[3]
            assert torch.equal(a[1], b[1]), "boxes must be identical"
            assert a[0].shape == b[0].shape and b[0].dtype == torch.uint8
            assert b[0].is_contiguous(memory_format=torch.channels_last)  # layout="nhwc", the default
            d = (a[0].int() - b[0].int()).abs()
            assert float(d.float().mean()) <= mean_diff
            assert float((d > 3).float().mean()) <= frac_over_3


@pytest.mark.parametrize("store,partners", [("lmdb", "dataset"), ("lmdb", "batch"), ("ram", "batch")])
def test_dali_cpu_matches_cpu_engine(converted, store, partners):
    """Two epochs (plan files, pipeline reset), mosaic + mixup + flips, without HSV; with
    partners="batch" the graph gathers the tiles from the batch (fn.permute_batch) and decodes
    each sample's own image once, padded last batch included (10 images, batches of 4)."""
    ref = run(converted, "cpu", epochs=2, store=store, hyp=hyp_no_hsv(), workers=0, partners=partners)
    got, stats = run(converted, "dali", epochs=2, store=store, hyp=hyp_no_hsv(), device="cpu", partners=partners,
                     with_stats=True)
    compare(ref, got, mean_diff=0.6, frac_over_3=0.02)
    assert stats["partners"] == partners and stats["images"] == 20
    if store == "ram":
        assert stats["decodes"] == 0  # decoded store: nothing to decode
    elif partners == "batch":
        assert stats["decodes"] == 2 * 12  # one per sample of 3 batches of 4 (the last padded), per epoch
    else:
        assert stats["decodes"] > 3 * 20  # every tile of every sample (4 per mosaic, + 4 with mixup)


def test_dali_cpu_renders_the_ultralytics_recipe(converted):
    """Ultralytics' recipe (its loaded image, its own image top left, partners from the recent images, mixup after
    any sample, the additive hue applied to the output batch), two epochs from the encoded store: the CPU
    engine's batches within the same bounds as YOLOv9's."""
    hyp = load_hyp(None)
    hyp.update(mixup=0.5)
    kw = dict(epochs=2, store="lmdb", recipe="ultralytics", partners="recent", hyp=hyp)
    compare(run(converted, "cpu", workers=0, **kw), run(converted, "dali", device="cpu", **kw), mean_diff=0.6,
            frac_over_3=0.02)


def test_dali_validation_letterbox_and_hsv(converted):
    """Letterboxed validation batches (rect shapes) and full HSV on the training path."""
    kw = dict(augment=False, rect=True, shuffle=False, pad=0.5, store="ram")
    compare(run(converted, "cpu", workers=0, **kw), run(converted, "dali", device="cpu", **kw), mean_diff=0.3, frac_over_3=0.01)
    ref = run(converted, "cpu", store="ram", workers=0, partners="batch")  # DALI's default partners
    got = run(converted, "dali", store="ram", device="cpu")
    compare(ref, got, mean_diff=1.0, frac_over_3=0.05)


def test_dali_sharding_and_close_mosaic(converted):
    seen = []
    for rank in range(2):
        with loader(converted, imgsz=IMGSZ, batch_size=4, workers=1, store="ram", engine="dali", device="cpu",
                    rank=rank, world_size=2, close_mosaic=1, epochs=2) as fl:
            fl.set_epoch(0)
            first = [b for b in fl]
            fl.set_epoch(1)
            last = [b for b in fl]
            n = fl.n
            assert len(first) == len(fl)
            seen.append([p for b in first for p in b[2]])
            assert any(s is None for b in first for s in b[3]) or n < 4
            assert all(s is not None for b in last for s in b[3])
    assert len(seen[0]) == len(seen[1]) == -(-n // 2)
    assert set(seen[0]) | set(seen[1]) == set(p for p in seen[0] + seen[1]) and len(set(seen[0] + seen[1])) == n


def test_dali_errors_are_clear(converted):
    from fastload.engines.dali import _device_id

    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="engine='dali' with device='cuda:0': CUDA is not available"):
            _device_id("cuda:0")
    assert _device_id("cpu")[0] is None


def test_missing_dali_message(monkeypatch):
    import builtins

    from fastload.engines import dali as dali_engine

    real = builtins.__import__

    def fake(name, *a, **k):
        if name.startswith("nvidia.dali"):
            raise ImportError("No module named 'nvidia.dali'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(ImportError, match=r"pip install fastload\[dali\]"):
        dali_engine.require_dali()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dali_gpu_matches_cpu_engine(converted):
    ref = run(converted, "cpu", store="lmdb", hyp=hyp_no_hsv(), workers=0)
    got = run(converted, "dali", store="lmdb", hyp=hyp_no_hsv(), device="cuda")
    compare(ref, got, mean_diff=2.0, frac_over_3=0.1)


UNGUARDED = """
import fastload
fl = fastload.loader({data!r}, imgsz={imgsz}, batch_size=2, engine="dali", device="cpu", workers=1, store="lmdb")
next(iter(fl))
"""


def test_script_without_main_guard_fails_at_once_saying_what_to_do(converted, tmp_path, preloaded_python):
    """Without the guard DALI's spawned workers re-run the script and DALI fails ~30 s later with
    "Workers initialization failed"; the engine says why before it starts anything. The script runs as ``python
    SCRIPT`` does, forked from the pre-loaded interpreter (tests/preloaded.py: torch imported already, 2 s of CPU)."""
    import preloaded

    script = tmp_path / "train_dali.py"
    script.write_text(UNGUARDED.format(data=str(converted), imgsz=IMGSZ))
    done = preloaded.run(preloaded_python, [str(script)], tmp_path, preloaded.base_env(Path(__file__).resolve().parents[1]),
                         timeout=120)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert f"runs {script} again from the top, and line 3 builds the loader outside `if __name__ == \"__main__\":`" in last
    assert "Workers initialization failed" not in done.stderr


def test_main_guard_detection(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "s.py"
    script.write_text(
        "from fastload.engines.main_guard import unguarded_main_line\n"
        "def build():\n"
        "    return unguarded_main_line()\n"
        "print('top', build())\n"
        "if '__main__' == __name__:\n"
        "    print('guarded', build())\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == [f"top ({str(script)!r}, 4)", "guarded None"]
    inline = subprocess.run([sys.executable, "-c", script.read_text()], capture_output=True, text=True, check=True)
    assert inline.stdout.splitlines() == ["top None", "guarded None"]  # `python -c`: nothing a worker would re-run
