"""`superfluid serve` says it serves by systemd's notify protocol (READY=1 to $NOTIFY_SOCKET), which
tests/conftest.py waits for: readiness that no version, heading or log format change can break."""

from __future__ import annotations

import logging
import os
import secrets
import socket
from collections.abc import Iterator

import pytest

from superfluid.cli.serve import notify, notify_socket


@pytest.fixture
def supervisor() -> Iterator[tuple[str, socket.socket]]:
    """A listening notify socket in the abstract namespace, as `@name`, the form systemd also gives."""
    name = f"superfluid-test-{secrets.token_hex(8)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        yield "@" + name, sock


def test_ready_reaches_the_supervisor(supervisor: tuple[str, socket.socket]) -> None:
    address, sock = supervisor
    notify(address, "READY=1")
    notify(address, "STOPPING=1")
    assert [sock.recv(4096), sock.recv(4096)] == [b"READY=1", b"STOPPING=1"]


def test_the_workers_do_not_inherit_the_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "@somewhere")
    assert notify_socket() == "@somewhere"
    assert "NOTIFY_SOCKET" not in os.environ
    assert notify_socket() is None


def test_without_a_supervisor_nothing_is_sent_and_a_gone_one_is_only_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    notify(None, "READY=1")
    with caplog.at_level(logging.WARNING, logger="superfluid"):
        notify(f"@superfluid-test-gone-{secrets.token_hex(8)}", "READY=1")
    assert "could not tell $NOTIFY_SOCKET" in caplog.text
