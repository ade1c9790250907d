"""The command line explains itself and refuses bad flags before loading anything."""

from __future__ import annotations

import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "superfluid", *args], capture_output=True, text=True, timeout=60)


def test_help_explains_every_serve_flag() -> None:
    result = run("serve", "--help")
    assert result.returncode == 0
    for flag in (
        "--sessions",
        "--socket",
        "--max-context",
        "--max-batch",
        "--no-http",
        "--no-tui",
        "--web",
        "--web-origin",
    ):
        assert flag in result.stdout
    assert "SUPERFLUID_HOME" in result.stdout and "org/repo-GGUF:QUANT" in result.stdout


def test_version_and_bad_flags() -> None:
    assert run("--version").stdout.strip() == "superfluid 0.1.0"
    bad = run("serve", "--max-batch", "0")
    assert bad.returncode == 2 and "must be a positive integer" in bad.stderr
    small = run("serve", "--max-context", "100")
    assert small.returncode == 2 and "at least 512" in small.stderr
    unknown = run("serve", "--max-bach=3")
    assert (
        unknown.returncode == 2 and "unrecognized arguments: --max-bach=3 (did you mean --max-batch?)" in unknown.stderr
    )


def test_a_missing_model_file_is_a_clear_start_up_error(tmp_path) -> None:
    result = run(
        "serve", str(tmp_path / "nope.gguf"), "--sessions", str(tmp_path / "s"), "--socket", str(tmp_path / "s.sock")
    )
    assert result.returncode == 1
    assert f"model file {tmp_path / 'nope.gguf'} does not exist" in result.stderr
