"""`superfluid completion`: scripts written from the parser, so every command and flag completes."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from superfluid.cli.completion import command_flags, script
from superfluid.cli.main import build_parser


def completions(*words: str) -> list[str]:
    """What bash offers after `words` (the last one being typed), with the script sourced."""
    generated = subprocess.run(
        [sys.executable, "-m", "superfluid", "completion", "bash"], capture_output=True, text=True, check=True
    ).stdout
    line = " ".join(f"'{w}'" for w in words)
    ask = f"COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; _superfluid"
    probe = f'{generated}\n{ask}; printf "%s\\n" "${{COMPREPLY[@]}}"'
    return subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True).stdout.split()


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_bash_completes_commands_verbs_flags_and_values() -> None:
    assert completions("superfluid", "se") == ["serve", "service", "session"]
    assert completions("superfluid", "serve", "--cors") == ["--cors-origin"]
    assert completions("superfluid", "session", "ex") == ["export"]
    assert completions("superfluid", "session", "export", "--f") == ["--format"]
    assert completions("superfluid", "completion", "") == ["bash", "fish", "zsh", "--help"]


def test_every_shell_names_every_command_and_no_hidden_flag() -> None:
    parser = build_parser()
    table = command_flags(parser)
    assert "--metallib" not in table["serve"], "flags kept only for old scripts stay out of completion"
    for shell in ("bash", "zsh", "fish"):
        text = script(shell, parser)
        for command in ("serve", "run", "models", "ps", "session", "launch"):
            assert command in text, (shell, command)
        assert "max-batch" in text
