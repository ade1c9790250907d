"""`superfluid service unit|install [SERVE FLAGS]`: run the daemon as a systemd user service.

The unit starts `superfluid serve` with the flags given (after `--`), with this Python, so it
finds the same packages and model. It is `Type=notify`: the daemon says READY=1 once every
listener is up, so `systemctl --user start` returns when clients can connect, and a unit
that depends on it starts after. SIGTERM stops it cleanly (in-flight generations end, the
log is closed); it restarts after a crash, and the sessions come back from the log.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

UNIT_NAME = "superfluid.service"
# a first start loads the model, and on a fresh machine may download it
START_TIMEOUT_S = 600
STOP_TIMEOUT_S = 90  # SIGTERM first; --drain-timeout's default is 60 s


def _quoted(argument: str) -> str:
    """An ExecStart word: `%` doubled (a specifier otherwise), quoted when it holds blanks or quotes."""
    word = argument.replace("%", "%%")
    if word and not any(c in word for c in " \t\"'\\;$"):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


def unit_text(serve_args: list[str], python: str = sys.executable) -> str:
    """The unit that runs `superfluid serve SERVE_ARGS` with `python`."""
    command = " ".join(_quoted(word) for word in [python, "-m", "superfluid", "serve", "--no-tui", *serve_args])
    return "\n".join(
        [
            "[Unit]",
            "Description=superfluid: local LLM serving with durable sessions",
            "After=network-online.target",
            "",
            "[Service]",
            "Type=notify",
            "NotifyAccess=main",
            f"ExecStart={command}",
            "Restart=on-failure",
            "RestartSec=2",
            "KillSignal=SIGTERM",
            f"TimeoutStartSec={START_TIMEOUT_S}",
            f"TimeoutStopSec={STOP_TIMEOUT_S}",
            "",
            "[Install]",
            "WantedBy=default.target",
            "",
        ]
    )


def user_unit_path() -> Path:
    """Where systemd looks for a user's own units."""
    config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return config / "systemd" / "user" / UNIT_NAME


def install(serve_args: list[str]) -> Path:
    """Write the user unit; its path."""
    path = user_unit_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(unit_text(serve_args))
    return path


def main_service(action: str, serve_args: list[str]) -> int:
    if action == "unit":
        print(unit_text(serve_args), end="")
        return 0
    path = install(serve_args)
    print(f"wrote {path}; start it now and at every login with:")
    print("  systemctl --user daemon-reload && systemctl --user enable --now superfluid")
    print("  loginctl enable-linger $USER   # to keep it running while you are logged out")
    print("  journalctl --user -u superfluid -f   # its log")
    return 0
