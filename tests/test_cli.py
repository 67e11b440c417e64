"""Every sub-command answers --help, and the dispatcher fails cleanly without one."""
from __future__ import annotations

import subprocess
import sys

import pytest

from fastload.cli import COMMANDS, main


@pytest.mark.parametrize("name", [name for name, _ in COMMANDS])
def test_every_command_has_help(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: fastload " + name)
    assert "``" not in out, "help is plain text, not reStructuredText"


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "convert" in capsys.readouterr().out


def test_console_entry_point_runs():
    done = subprocess.run([sys.executable, "-m", "fastload", "--version"], capture_output=True, text=True, check=True)
    assert done.stdout.strip().startswith("fastload ")
