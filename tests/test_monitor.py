"""``fastload monitor``: CSV rows on schedule, the child's exit code, signal forwarding, NVML present or absent."""
from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastload.monitor import monitor, summarise
from fastload.monitor.sampler import HostSampler, NvmlSampler
from store_helpers import run_cli

PY = sys.executable


def _read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _child_script(stamp: Path, seconds: float, code: int) -> str:
    # The child records its own start / end so the test can compare the row count with its real duration, and
    # the CPU share its busy half got.
    return textwrap.dedent(
        f"""
        import time, sys
        t0 = time.time()
        while time.time() - t0 < {seconds / 2}:
            pass
        busy_pct = 100 * time.process_time() / (time.time() - t0)  # what a loaded machine let it have
        time.sleep({seconds / 2})
        open({str(stamp)!r}, "w").write(f"{{t0}} {{time.time()}} {{busy_pct}}")
        sys.exit({code})
        """
    )


def test_rows_follow_interval_and_exit_code_is_the_childs(tmp_path, capsys):
    out, png, stamp, js = tmp_path / "run.csv", tmp_path / "run.png", tmp_path / "stamp", tmp_path / "s.json"
    interval = 0.2
    code = run_cli(
        ["monitor", "--interval", str(interval), "--out", str(out), "--plot", str(png), "--json", str(js),
         "--", PY, "-c", _child_script(stamp, 1.6, 3)]
    )
    assert code == 3
    rows = _read_csv(out)
    t0, t1, busy_pct = (float(v) for v in stamp.read_text().split())
    child_s = t1 - t0
    # Sampling covers at least the child's own run and no more than the monitor's life.
    assert len(rows) >= int(child_s / interval) - 1
    elapsed = np.array([float(r["elapsed_s"]) for r in rows])
    assert len(rows) <= elapsed[-1] / interval + 2
    steps = np.diff(elapsed)
    assert np.all(steps > 0)
    assert 0.7 * interval <= np.median(steps) <= 1.5 * interval
    wall = np.array([float(r["time"]) for r in rows])
    assert wall[0] <= t0 + 2 * interval and wall[-1] >= t1 - 2 * interval
    # The busy half of the child shows up as the watched tree's CPU: at least half the share it measured itself
    # (a loaded machine gives it less than a core, so no fixed figure)
    assert busy_pct > 5 and max(float(r["proc_cpu_pct"]) for r in rows) > 0.5 * busy_pct
    assert all(float(r["proc_rss_mib"]) > 0 for r in rows[:2])
    with Image.open(png) as im:
        im.verify()
    summary = json.loads(js.read_text())
    assert summary["exit_code"] == 3 and summary["samples"] == len(rows)
    assert "fastload monitor" in capsys.readouterr().err


def test_zero_exit_and_child_shorter_than_one_interval(tmp_path):
    out = tmp_path / "short.csv"
    js = tmp_path / "short.json"
    started = time.monotonic()
    assert run_cli(["monitor", "--quiet", "--interval", "5", "--out", str(out), "--json", str(js), "--", PY, "-c",
                 "import time; time.sleep(0.6)"]) == 0
    took = time.monotonic() - started
    assert len(_read_csv(out)) == 1  # never an empty CSV
    assert 0.6 <= json.loads(js.read_text())["span_s"] <= took  # the run's length, not "0.0 s"


def test_missing_command_is_a_clear_error(capsys):
    assert run_cli(["monitor", "--quiet", "--", "/nonexistent/fastload-binary"]) == 2
    assert "/nonexistent/fastload-binary" in capsys.readouterr().err


def test_sigterm_is_forwarded_to_the_child(tmp_path):
    ready, got = tmp_path / "ready", tmp_path / "got"
    child = textwrap.dedent(
        f"""
        import signal, sys, time
        def bye(sig, frame):
            open({str(got)!r}, "w").write(str(sig)); sys.exit(7)
        signal.signal(signal.SIGTERM, bye)
        open({str(ready)!r}, "w").write("1")
        time.sleep(30)
        """
    )
    driver = (
        "import sys; from fastload.monitor import monitor; "
        f"sys.exit(monitor([sys.executable, '-c', {child!r}], interval=0.1, echo=None).exit_code)"
    )
    proc = subprocess.Popen([PY, "-c", driver])
    try:
        deadline = time.time() + 20
        while not ready.exists() and time.time() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "child never started"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 7
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert got.read_text() == str(int(signal.SIGTERM))


def test_signal_death_reports_128_plus_signal(tmp_path):
    script = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    result = monitor([PY, "-c", script], interval=0.1, echo=None)
    assert result.exit_code == 128 + int(signal.SIGKILL)


def test_without_pynvml_records_cpu_and_says_no_gpu(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    sampler = NvmlSampler()
    assert not sampler.available and "pynvml" in sampler.reason
    out, png = tmp_path / "cpu.csv", tmp_path / "cpu.png"
    result = monitor([PY, "-c", "import time; time.sleep(0.5)"], interval=0.1, out=out, plot=png, echo=None)
    assert result.exit_code == 0 and not result.gpu_found
    rows = _read_csv(out)
    assert rows and not any(k.startswith("gpu") for k in rows[0])
    assert result.summary["verdict"].startswith("no GPU found")
    with Image.open(png) as im:
        im.verify()


class _FakeNvml(types.ModuleType):
    """Just enough of pynvml for two GPUs whose utilisation alternates 10 / 90 % (GPU 1 always 100 %)."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.calls = 0
        self.shut = False

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"Fake GPU"

    def nvmlDeviceGetUtilizationRates(self, h):
        if h == 0:
            self.calls += 1
        gpu = 100 if h == 1 else (10 if self.calls % 2 else 90)
        return types.SimpleNamespace(gpu=gpu, memory=5)

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(used=2 * 1024**3, total=80 * 1024**3)

    def nvmlDeviceGetPowerUsage(self, h):
        raise RuntimeError("not supported")  # an unsupported field must become a blank, not a crash

    def nvmlDeviceGetClockInfo(self, h, kind):
        return 1500 if kind == self.NVML_CLOCK_SM else 2600

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return []


def test_gpu_columns_and_summary_with_a_fake_nvml(tmp_path, monkeypatch):
    fake = _FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    out, png = tmp_path / "gpu.csv", tmp_path / "gpu.png"
    result = monitor([PY, "-c", "import time; time.sleep(0.8)"], interval=0.1, out=out, plot=png, gpus=[0], echo=None)
    assert result.gpu_found and fake.shut
    rows = _read_csv(out)
    assert "gpu0_util_pct" in rows[0] and "gpu1_util_pct" not in rows[0]
    util = np.array([float(r["gpu0_util_pct"]) for r in rows])
    assert set(util.tolist()) <= {10.0, 90.0}
    assert all(r["gpu0_power_w"] == "" for r in rows)
    assert float(rows[0]["gpu0_mem_used_mib"]) == 2048
    g = result.summary["gpus"][0]
    assert g["frac_under_50"] == pytest.approx(float((util < 50).mean()))
    assert g["util_mean_pct"] == pytest.approx(util.mean())
    assert g["util_p5_pct"] == pytest.approx(np.percentile(util, 5))
    with Image.open(png) as im:
        im.verify()


def test_bad_gpu_index_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml())
    with pytest.raises(ValueError, match="out of range"):
        NvmlSampler([5])


def _table(util: list[float], cpu: float, iowait: float = 0.0) -> list[dict[str, str]]:
    return [
        {"elapsed_s": str(i), "cpu_pct": str(cpu), "iowait_pct": str(iowait), "proc_cpu_pct": "100",
         "proc_rss_mib": "100", "gpu0_util_pct": str(u), "gpu0_mem_used_mib": "1", "gpu0_power_w": "100"}
        for i, u in enumerate(util)
    ]


@pytest.mark.parametrize(
    "util, cpu, iowait, words",
    [
        ([95, 97, 99, 96], 40, 0, "busy"),
        ([10, 20, 95, 30], 95, 0, "CPU-bound"),
        ([10, 20, 95, 30], 30, 25, "storage"),
        ([10, 20, 95, 30], 30, 0, "workers"),
    ],
)
def test_verdict_names_the_cause(util, cpu, iowait, words):
    summary = summarise(_table(util, cpu, iowait), [0], ["g"], 1.0, 8)
    assert words in summary["verdict"]
    assert summary["gpus"][0]["frac_under_50"] == pytest.approx(np.mean(np.array(util) < 50))


def test_pid_mode_ends_with_the_process(tmp_path):
    proc = subprocess.Popen([PY, "-c", "import time; time.sleep(0.8)"])
    try:
        out = tmp_path / "pid.csv"
        result = monitor(pid=proc.pid, interval=0.1, out=out, echo=None)
    finally:
        proc.wait()
    assert result.exit_code == 0 and result.rows >= 2
    assert len(_read_csv(out)) == result.rows


def test_duration_stops_whole_machine_mode(tmp_path):
    result = monitor(interval=0.1, duration=0.5, echo=None)
    assert 2 <= result.rows <= 8 and result.exit_code == 0


# Steps on stdin: "map" faults in a 32 MiB memory-mapped file, "alloc" 32 MiB of anonymous memory.
_MAPPER = """
import sys
import numpy as np
held = []
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "map":
        m = np.memmap(sys.argv[1], np.uint8, mode="r")
        held.append((m, int(m[::4096].sum())))
    else:
        held.append(np.ones(32 << 20, np.uint8))
    print("done", flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="psutil reports shared pages on Linux")
def test_host_sampler_splits_rss_into_anonymous_and_file_backed(tmp_path):
    data = tmp_path / "store.bin"
    data.write_bytes(np.random.default_rng(0).integers(0, 255, 32 << 20, dtype=np.uint8).tobytes())
    child = subprocess.Popen([sys.executable, "-c", _MAPPER, str(data)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        sampler = HostSampler(child.pid)
        readings = [sampler.read()]
        for step in ("map", "alloc"):
            child.stdin.write(step + "\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "done"
            readings.append(sampler.read())
    finally:
        child.kill()
        child.wait()
    mib = 32.0
    (a0, f0), (a1, f1), (a2, f2) = ((r.proc_anon_mib, r.proc_file_mib) for r in readings)
    assert f1 - f0 > 0.9 * mib and abs(a1 - a0) < 0.25 * mib  # the mapped file: file-backed, not anonymous
    assert a2 - a1 > 0.9 * mib and abs(f2 - f1) < 0.25 * mib  # the allocation: anonymous
    for r in readings:
        assert abs(r.proc_anon_mib + r.proc_file_mib - r.proc_rss_mib) < 1e-6
