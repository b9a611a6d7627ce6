"""Every subcommand answers --help; unknown commands are a clear error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.cli import COMMANDS, main


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_subcommand_has_help(command: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert f"kvgate {command}" in out


def test_top_level_help_lists_commands(capsys) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert command in out


def test_unknown_command(capsys) -> None:
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_console_script_installed() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "--help"], capture_output=True, text=True, check=True
    )
    assert "kvgate" in out.stdout
