"""The `disagg` entry point itself: version and help for a user, not for a reader of the code."""

from __future__ import annotations

import pytest

from disagg.cli import COMMANDS, main


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"disagg {version('disagg')}"


def test_help_lists_every_command_for_a_user(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert all(name in text for name in COMMANDS)
    assert "module" not in text  # says what the tool does, not where its code lives
