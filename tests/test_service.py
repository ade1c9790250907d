"""`superfluid service`: a systemd user unit that systemd itself accepts, written where it looks."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from superfluid.cli.main import main
from superfluid.cli.service import unit_text

ANALYZE = shutil.which("systemd-analyze")


def verified(unit: str, directory: Path) -> str:
    """What `systemd-analyze verify` says of a unit: nothing for one it accepts whole."""
    assert ANALYZE, "Debian's systemd is needed: apt-get install systemd (make test does it)"
    path = directory / "superfluid.service"
    path.write_text(unit)
    done = subprocess.run([ANALYZE, "verify", str(path)], capture_output=True, text=True, cwd=directory)
    assert done.returncode == 0, done.stderr
    return done.stderr.strip()


def test_the_unit_is_one_systemd_accepts_with_awkward_flags(tmp_path: Path) -> None:
    assert verified(unit_text(["--max-context", "4096"]), tmp_path) == ""
    awkward = unit_text(["/models/my model.gguf", "--chat-template", "100%.jinja", "--log-filter", 'a"b'])
    assert verified(awkward, tmp_path) == ""
    assert '"/models/my model.gguf"' in awkward and "100%%.jinja" in awkward and r'"a\"b"' in awkward
    broken = unit_text([]).replace("Type=notify", "Type=sometimes")
    assert "Failed to parse service type" in verified(broken, tmp_path), "the check can fail"


def test_install_writes_the_user_unit_with_the_flags_after_the_dashes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert main(["service", "install", "--", "--max-batch", "4"]) == 0
    unit = (tmp_path / "systemd" / "user" / "superfluid.service").read_text()
    assert "Type=notify" in unit and unit.splitlines()[7].endswith("serve --no-tui --max-batch 4")
    assert "systemctl --user enable --now superfluid" in capsys.readouterr().out
