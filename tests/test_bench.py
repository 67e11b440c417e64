"""``fastload bench``: every stage measured (or skipped with a reason), JSON + PNG written, bottleneck named."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastload.bench import pagecache
from fastload.bench.analysis import StoreInfo, analyse, expected_reads
from fastload.bench.decoders import DECODERS, available_decoders
from fastload.bench.stages import STAGES, Measurement, measure_augment, measure_loader
from fastload.store.space import fmt_bytes
import preloaded
from store_helpers import run_cli

REPO = Path(__file__).resolve().parents[1]


def _check_document(doc: dict, stores: list[str]) -> None:
    """Every stage present; every row either positive or skipped with a reason; ceilings positive."""
    for stage in STAGES:
        rows = [m for m in doc["measurements"] if m["stage"] == stage]
        assert rows, f"stage {stage} missing"
        assert any(m["skipped"] is None for m in rows), f"stage {stage} never ran: {rows}"
    for m in doc["measurements"]:
        if m["skipped"] is None:
            assert m["samples"] > 0 and m["seconds"] > 0 and m["bytes"] > 0, m
            assert m["samples_per_s"] > 0 and m["mb_per_s"] > 0, m
        else:
            assert len(m["skipped"]) > 10, m  # a stated reason, not a bare flag
    warm = {m["name"] for m in doc["measurements"] if m["stage"] == "read" and m["skipped"] is None}
    for kind in stores:
        assert f"{kind} warm" in warm
        assert any(m["name"] == f"cpu/{kind}" and m["skipped"] is None for m in doc["measurements"])
    machine = doc["machine"]
    assert machine["cores"] >= 1 and machine["memcpy_mb_s"] > 0
    # a dataset on tmpfs has no disk to read: then the note says so instead of a figure
    assert (machine["raw_read_mb_s"] or 0) > 0 or "memory" in machine["raw_read_note"]
    assert doc["bottleneck"] and doc["analysis"]["bottleneck"] in ("read", "decode", "augment", "workers")
    assert doc["elapsed_s"] > 0 and doc["planned_s"] > 0


def _bench_argv(tmp_path: Path, data: Path, extra: list[str]) -> list[str]:
    # 0.2 s per measurement: every loop measures at least one step (the loader at least one batch after its first),
    # which is all the figures checked below need; 0.4 s cost each run's 6-7 measurements 1.2-1.4 s more
    return ["bench", str(data), "--seconds", "0.2", "--json", str(tmp_path / "bench.json"), "--plot",
            str(tmp_path / "bench.png"), *extra]


def _check_run(tmp_path: Path, out: str, err: str) -> dict:
    """The printed report and budget, the plot, and the JSON document of a run of :func:`_bench_argv`."""
    assert "bottleneck:" in out and "machine:" in out
    assert "measurements x 0.2 s" in err and "done in" in err  # planned and elapsed budget printed
    with Image.open(tmp_path / "bench.png") as im:
        im.verify()
    return json.loads((tmp_path / "bench.json").read_text())


def _run_bench(tmp_path: Path, data: Path, extra: list[str], capsys) -> dict:
    code = run_cli(_bench_argv(tmp_path, data, extra))
    assert code == 0
    out = capsys.readouterr()
    return _check_run(tmp_path, out.out, out.err)


def test_bench_synthetic_all_stages(synth_yaml, tmp_path, preloaded_python):
    """Every stage with the default engines, in a process of its own as a user runs it (forked from the pre-loaded
    interpreter): where Ray is installed, the default engines include ray, and the bench starts a local Ray
    instance for that row and stops it before it returns. (In the test process it would start Ray there: its
    threads can hang a later fork, so the test would have to wait for the end of the suite with the Ray tests.)"""
    state = tmp_path / "state.json"
    run = preloaded.run(preloaded_python, [str(Path(__file__).with_name("bench_run.py")), str(state),
                                           *_bench_argv(tmp_path, synth_yaml, ["--decoders", "fastload,cv2"])],
                        tmp_path, preloaded.base_env(REPO), timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = _check_run(tmp_path, run.stdout, run.stderr)
    _check_document(doc, ["files"])
    decoders = {m["name"] for m in doc["measurements"] if m["stage"] == "decode"}
    assert decoders == {"fastload", "cv2"}
    aug = next(m for m in doc["measurements"] if m["stage"] == "augment")
    # YOLOv9 scratch-high: 4 reads per mosaic, +4 with mixup (p=0.15) -> about 4.6 per sample
    assert 4.0 <= aug["extra"]["reads_per_sample"] <= 8.0
    after = json.loads(state.read_text())
    assert after["code"] == 0
    if importlib.util.find_spec("ray") is not None:  # the default engines include ray where it is installed
        assert any(m["name"] == "ray/files" and m["skipped"] is None for m in doc["measurements"])
        assert after["ray_connected"] is False  # the local Ray instance the bench started is gone


def test_bench_coco128(coco128_yaml, tmp_path, capsys):
    doc = _run_bench(tmp_path, coco128_yaml, ["--decoders", "fastload,reduced", "--engines", "cpu"], capsys)
    _check_document(doc, ["files"])
    from fastload.store import open_store

    assert doc["stores"]["files"]["n"] == len(open_store(coco128_yaml, kind="files"))


def test_convert_builds_missing_stores_in_a_temp_dir(synth_yaml, tmp_path, monkeypatch, capsys):
    import tempfile

    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("FASTLOAD_SHM_DIR", str(shm))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    js = tmp_path / "c.json"
    # ram is copied from a disk store the conversion also builds (not measured here, to save time)
    code = run_cli(["bench", str(synth_yaml), "--seconds", "0.15", "--stages", "read,loader", "--stores",
                 "lmdb,ram", "--engines", "cpu", "--convert", "--quiet", "--json", str(js)])
    assert code == 0
    doc = json.loads(js.read_text())
    for kind in ("lmdb", "ram"):
        assert any(m["name"] == f"{kind} warm" and m["skipped"] is None for m in doc["measurements"]), kind
        assert any(m["name"] == f"cpu/{kind}" and m["skipped"] is None for m in doc["measurements"]), kind
    ram_cold = next(m for m in doc["measurements"] if m["name"] == "ram cold")
    assert "shared memory" in ram_cold["skipped"]
    assert list(scratch.iterdir()) == []  # the temporary stores are gone
    assert [p for p in shm.iterdir() if not p.name.endswith(".lock")] == []  # the ram store was released


def test_missing_store_is_skipped_with_the_command_to_build_it(synth_yaml, tmp_path):
    js = tmp_path / "s.json"
    assert run_cli(["bench", str(synth_yaml), "--seconds", "0.2", "--stages", "read", "--stores", "files,lmdb",
                 "--quiet", "--json", str(js)]) == 0
    lmdb = [m for m in json.loads(js.read_text())["measurements"] if m["name"].startswith("lmdb")]
    assert lmdb and all("fastload convert" in m["skipped"] for m in lmdb)


def test_bad_input_fails_clearly(tmp_path, capsys, synth_yaml):
    missing = tmp_path / "nope.yaml"
    assert run_cli(["bench", str(missing), "--seconds", "0.1"]) == 1  # the data is wrong: exit 1
    assert str(missing) in capsys.readouterr().err
    assert run_cli(["bench", str(synth_yaml), "--stages", "read,telepathy"]) == 2
    assert "telepathy" in capsys.readouterr().err


def test_augment_stage_counts_reads(synth_yaml):
    from fastload.store import open_store

    with open_store(synth_yaml, kind="files") as store:
        m = measure_augment(store, 0.1, 64)
    assert m.ok, m.skipped
    # every sample reads at least its own image; mosaic reads 4 (8 with mixup)
    assert 1.0 <= m.extra["reads_per_sample"] <= 8.0


def test_loader_skip_says_why(synth_yaml):
    try:
        import nvidia.dali  # noqa: F401

        has_dali = True
    except ImportError:
        has_dali = False
    if not has_dali:  # the row stays, with the reason, instead of the bench crashing
        m = measure_loader(synth_yaml, "dali", "files", 0.1, imgsz=64, batch=4, workers=0)
        assert m.skipped and "dali" in m.skipped.lower()


def _format_of(buf: bytes) -> str:
    return "jpeg" if buf[:2] == b"\xff\xd8" else "png" if buf[:4] == b"\x89PNG" else "other"


def test_decoders_agree_on_shape(synth_yaml):
    from fastload.store import open_store

    store = open_store(synth_yaml, kind="files")
    formats = [_format_of(store.read_image(i)) for i in range(len(store))]
    picks = [formats.index(f) for f in ("jpeg", "png") if f in formats]  # one of each in the synthetic set
    assert picks
    decs = available_decoders(640)
    assert [d.name for d in decs] == list(DECODERS)
    for d in decs:
        if d.fn is None:
            assert d.unavailable  # e.g. turbojpeg not installed: the reason is kept for the report
            continue
        for i in picks:
            img = d.fn(store.read_image(i))
            assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3
            if d.name in ("cv2", "pil", "torchvision"):  # plain decoders keep the original size
                assert img.shape[:2] == tuple(int(v) for v in store.shapes[i])
            else:  # fastload / reduced deliver the loaded image: long side = imgsz
                assert max(img.shape[:2]) == 640
    with pytest.raises(ValueError, match="unknown decoder"):
        available_decoders(640, ["jpegxl-magic"])


def test_page_cache_drop_and_residency(tmp_path):
    f = tmp_path / "blob.bin"
    f.write_bytes(np.random.default_rng(0).integers(0, 255, 4 << 20, dtype=np.uint8).tobytes())
    f.read_bytes()
    before = pagecache.resident_fraction([str(f)])
    result = pagecache.drop([str(f)])
    if pagecache.filesystem_type(tmp_path) in pagecache.MEMORY_FS:
        assert not result.ok and "memory filesystem" in result.reason
        return
    if before is None:
        pytest.skip("mincore is not available here")
    assert before > 0.5
    if result.ok:
        assert result.resident_after is not None and result.resident_after <= 0.5
        f.read_bytes()
        assert pagecache.resident_fraction([str(f)]) > 0.5
    else:
        assert result.reason


def _ms(read_cold: float, read_warm: float, decode: float, augment: float, loader: float | None) -> list[Measurement]:
    def row(stage: str, name: str, rate: float, **extra) -> Measurement:
        return Measurement(stage, name, samples=int(rate * 10), bytes=int(rate * 10) * 100_000, seconds=10.0, extra=extra)

    ms = [row("read", "files cold", read_cold), row("read", "files warm", read_warm), row("decode", "fastload", decode),
          row("augment", "cpu", augment, reads_per_sample=4.6)]
    if loader is not None:
        ms.append(row("loader", "cpu/files", loader))
    return ms


def _analyse(ms: list[Measurement], *, in_memory: bool = False, cache: int = 0, big: bool = False) -> dict:
    info = StoreInfo("files", decoded=False, n=1000, bytes=(10**12 if big else 10**8), loaded_bytes=10**9,
                     in_memory=in_memory)
    return analyse(ms, {"files": info}, cores=8, workers=8, ram_available=16e9, hyp={"mosaic": 1.0, "mixup": 0.15},
                   decode_cache_bytes=cache)


def test_analysis_names_each_bottleneck():
    decode = _analyse(_ms(5000, 50000, 100, 200, 160))
    assert decode["bottleneck"] == "decode"
    assert "decode-bound" in decode["sentence"] and "4.6 decodes per mosaic image" in decode["sentence"]
    assert decode["configs"]["files"]["limit_samples_per_s"] == pytest.approx(100 * 8 / 4.6)
    # without a decoded-image cache the loader keeps YOLOv9's draw: the sentence names the remedy and its ceiling
    assert "no decoded-image cache" in decode["sentence"]
    assert 'partners="batch"' in decode["sentence"] and "ceiling ~800 samples/s" in decode["sentence"]
    read = _analyse(_ms(50, 50000, 1000, 200, 10), big=True)  # bigger than RAM: cold reads count
    assert read["bottleneck"] == "read" and "fastload stage" in read["sentence"]
    aug = _analyse(_ms(5000, 50000, 1000, 20, 150), cache=10**10)  # whole set in the decode cache
    assert aug["bottleneck"] == "augment" and "engine=gpu" in aug["sentence"]
    workers = _analyse(_ms(5000, 50000, 1000, 20, 30), cache=10**10)
    assert workers["bottleneck"] == "workers" and "30 samples/s" in workers["sentence"]
    busy = _ms(5000, 50000, 1000, 20, 30)
    busy[-1].extra.update(cpu_loader_cores=4.0, cpu_other_cores=3.5)  # a shared machine
    shared = _analyse(busy, cache=10**10)
    assert shared["bottleneck"] == "workers" and "other processes kept 3.5 of the 8 cores" in shared["sentence"]
    unknown = analyse([], {}, cores=2, workers=2, ram_available=1e9, hyp={}, decode_cache_bytes=0)
    assert unknown["bottleneck"] == "unknown"


def test_decode_ceiling_follows_the_loaders_partners_plan():
    # half the decoded set (1 GB) fits the cache: the loader plans partners="batch", 1 load per sample, half decoded
    larger = _analyse(_ms(5000, 50000, 100, 400, None), cache=5 * 10**8)
    decode = larger["configs"]["files"]["ceilings"]["decode"]
    assert decode["partners"] == "batch" and decode["decodes_per_sample"] == pytest.approx(0.5)
    assert larger["bottleneck"] == "decode" and larger["configs"]["files"]["limit_samples_per_s"] == pytest.approx(1600)
    sentence = larger["sentence"]
    assert "0.5 decodes per mosaic image" in sentence and "already draws mosaic partners from the batch" in sentence
    assert f"partners=batch (the decoded set, {fmt_bytes(10**9)}, exceeds the decode cache, {fmt_bytes(5 * 10**8)})" in sentence
    assert 'partners="dataset" gives YOLOv9\'s draw at ~2.3 decodes per sample' in sentence
    assert "decode_cache_mb" in sentence and "--to ram" in sentence
    # the loader stage ran with that plan: its share of cache misses is per loaded image, one per sample
    ran = _ms(5000, 50000, 100, 400, 900)
    ran[-1].extra.update(decode_miss_fraction=0.8)
    measured = _analyse(ran, cache=5 * 10**8)["configs"]["files"]
    assert measured["ceilings"]["decode"]["decodes_per_sample"] == pytest.approx(0.8)
    assert measured["limit_samples_per_s"] == pytest.approx(1000)
    # a set that fits keeps YOLOv9's draw: only the first epoch decodes, and the sentence says so
    first = _ms(5000, 50000, 100, 400, 300)
    first[-1].extra.update(decode_miss_fraction=0.5)
    fits = _analyse(first, cache=10**10)
    assert fits["configs"]["files"]["ceilings"]["decode"]["partners"] == "dataset"
    assert fits["configs"]["files"]["limit_samples_per_s"] == pytest.approx(100 * 8 / 2.3)
    assert "2.3 decodes per mosaic image" in fits["sentence"]
    assert f"fits its {fmt_bytes(10**10)}); later epochs decode nothing" in fits["sentence"]
    assert 'For a short run: loader(..., partners="batch") decodes each image once per batch' in fits["sentence"]


def test_expected_reads_matches_yolov9_defaults():
    assert expected_reads({"mosaic": 1.0, "mixup": 0.15}) == pytest.approx(4.6)
    assert expected_reads({"mosaic": 0.0, "mixup": 0.15}) == pytest.approx(1.0)
