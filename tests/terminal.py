"""A program on a real pseudo-terminal, under a tmux server of the test's own: keys in, the screen out.

with Terminal("chat") as term:
    term.start(["superfluid", "chat"])
    term.wait_for(">>> ")
    term.type("Hello")
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import pytest


class Terminal:
    """One tmux window of a given size, on a tmux server no other test shares."""

    def __init__(self, name: str, width: int = 160, height: int = 48) -> None:
        if shutil.which("tmux") is None:
            pytest.fail("tmux is needed: apt-get install tmux (make test does it)")
        self.server = ["tmux", "-L", f"sf-test-{name}-{os.getpid()}"]
        self.name = name
        self.size = (width, height)

    def start(self, command: list[str], env: dict[str, str] | None = None, exit_file: Path | None = None) -> None:
        """Run `command` in the window; its exit status goes to `exit_file` when one is given."""
        line = " ".join(shlex.quote(word) for word in command)
        if env:
            line = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + line
        if exit_file is not None:
            line += f"; echo exited $? > {shlex.quote(str(exit_file))}"
        width, height = self.size
        subprocess.run(
            [*self.server, "new-session", "-d", "-s", self.name, "-x", str(width), "-y", str(height), line],
            check=True,
        )

    def screen(self, history: bool = False) -> str:
        """What the window shows (with its scrollback when `history`)."""
        scroll = ["-S", "-2000"] if history else []
        return subprocess.run(
            [*self.server, "capture-pane", "-p", *scroll, "-t", self.name], capture_output=True, text=True
        ).stdout

    def keys(self, *keys: str) -> None:
        """tmux key names (`Enter`, `C-c`) or literal text."""
        subprocess.run([*self.server, "send-keys", "-t", self.name, *keys], check=True)

    def type(self, line: str) -> None:
        """A line of text, then Enter."""
        subprocess.run([*self.server, "send-keys", "-t", self.name, "-l", line], check=True)
        self.keys("Enter")

    def wait_for(self, seen: str | Callable[[str], bool], timeout: float = 60.0) -> str:
        """The screen (with scrollback) once `seen` is on it, or holds for it; fails with the screen otherwise."""
        test = seen if callable(seen) else (lambda screen: seen in screen)
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen(history=True)
            if test(screen):
                return screen
            assert time.monotonic() < deadline, f"not seen in {timeout:.0f} s: {seen!r}\n{screen}"
            time.sleep(0.1)

    def close(self) -> None:
        subprocess.run([*self.server, "kill-server"], capture_output=True)

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()
