"""What a user sees from ``fastload monitor``: its rows stay readable beside the child's progress bar (on a terminal
and in a pipe), memory is the tree's PSS rather than RSS summed over processes that share pages, and a command that
cannot start is named plainly."""
from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fastload.monitor import monitor
from fastload.monitor.sampler import HostSampler
from preloaded import base_env
from store_helpers import run_cli

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable

# A child drawing a tqdm-style bar on stderr: "\r" then the bar, never a newline until it ends. Its last state
# goes out with the closing newline in one write: a row the monitor writes between a bar's last redraw and its
# newline erases that state on a terminal, and nothing draws it again (the monitor does not know the child's
# bar); with 10 ms between them a loaded run lost it now and then.
BAR = textwrap.dedent("""
    import sys, time
    for i in range(150):
        sys.stderr.write(f"\\rBAR {i:04d} |#####     |" + ("\\n" if i == 149 else ""))
        sys.stderr.flush()
        time.sleep(0.01)
""")
ROW = re.compile(r"^ +\d+\.\d +\d+\.\d +\d+\.\d +\d+ +\d+\.\d\d$")  # elapsed cpu% iow% tree% memGiB (no GPU here)


def _screen(raw: str) -> list[str]:
    """The lines a terminal shows for ``raw``: ``\\r`` returns to column 0, ``\\n`` starts the next line,
    ``ESC[2K`` erases the current line, other characters overwrite the cell under the cursor."""
    lines: list[list[str]] = [[]]
    col = 0
    for token in re.findall(r"\x1b\[2K|\r|\n|[^\r\n\x1b]", raw):
        if token == "\x1b[2K":
            lines[-1] = []
        elif token == "\r":
            col = 0
        elif token == "\n":
            lines.append([])
            col = 0
        else:
            line = lines[-1]
            line.extend(" " * (col + 1 - len(line)))
            line[col] = token
            col += 1
    return ["".join(line).rstrip() for line in lines]


def _monitor_argv() -> list[str]:
    return [PY, "-c", "import sys; from fastload.cli import main; sys.exit(main())",
            "monitor", "--interval", "0.2", "--", PY, "-c", BAR]


def _env() -> dict[str, str]:
    return {**base_env(REPO), "FASTLOAD_DEBUG": ""}


def _run_on_a_terminal() -> str:
    """Run the monitor with stdout and stderr on a pseudo-terminal (as in an interactive shell); all it showed."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(_monitor_argv(), env=_env(), stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 60)
            if not ready:
                break
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer has closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
        proc.wait(timeout=60)
    assert proc.returncode == 0
    return b"".join(chunks).decode()


def _run_into_a_pipe() -> str:
    # bytes: text mode would turn the bar's "\r" into newlines
    done = subprocess.run(_monitor_argv(), env=_env(), stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stderr.decode()


@pytest.mark.parametrize("where", ["terminal", "pipe"])
def test_rows_keep_their_own_lines_beside_a_progress_bar(where):
    raw = _run_on_a_terminal() if where == "terminal" else _run_into_a_pipe()
    screen = [line for line in _screen(raw) if line]
    rows = [line for line in screen if ROW.match(line)]
    shown = "\n".join(screen)
    assert len(rows) >= 3, shown  # the bar runs for 1.5 s or more, sampled every 0.2 s
    assert any(line.startswith("#  time_s") for line in screen), shown
    for line in screen:
        # every line is the bar alone, a row alone, or the monitor's own text: never two of them run together
        assert ("BAR" in line) + bool(re.search(r"\d+\.\d +\d+\.\d +\d+\.\d", line)) <= 1, shown
        if "BAR" in line:
            assert re.fullmatch(r"BAR \d{4} \|#####     \|", line), shown
    assert sum(line.startswith("BAR 0149") for line in screen) == 1, shown  # the bar's last state is on screen


SHARED_MEMORY = textwrap.dedent("""
    import mmap, os, time
    size = 64 << 20
    shared = mmap.mmap(-1, size)  # anonymous and shared: every forked child maps the same pages
    for page in range(0, size, 4096):  # one byte per page, so no 64 MiB temporary joins the parent's PSS
        shared[page] = 120
    kids = []
    for _ in range(3):
        pid = os.fork()
        if pid == 0:
            total = sum(shared[i] for i in range(0, size, 4096))  # touch every page: it joins this child's RSS
            time.sleep(1.0)  # hold them while the monitor samples (every 0.1 s)
            os._exit(0)
        kids.append(pid)
    for pid in kids:
        os.waitpid(pid, 0)
""")


@pytest.mark.skipif(not HostSampler().pss_available, reason="this platform does not report PSS")
def test_memory_is_pss_not_rss_summed_over_processes_sharing_pages():
    """Four processes map the same 64 MiB: summed RSS counts it four times, PSS once."""
    result = monitor([PY, "-c", SHARED_MEMORY], interval=0.1, echo=None)
    host = result.summary["host"]
    assert result.exit_code == 0
    shared_mib = 64
    assert host["tree_rss_max_mib"] > 4 * shared_mib, host  # the shared pages once per process
    assert shared_mib < host["tree_pss_max_mib"] < 2 * shared_mib, host  # once, plus four small interpreters


def test_a_command_that_cannot_start_is_named_plainly(capsys):
    assert run_cli(["monitor", "--quiet", "--", "nosuchcmd-fastload"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fastload monitor: cannot start 'nosuchcmd-fastload': not an executable file and not found on PATH"]
