"""The command line explains itself and refuses bad flags before loading anything."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import DaemonProcess, generate, new_session, say

from superfluid import __version__
from superfluid.protocol.schema import Request


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
    assert run("--version").stdout.strip() == f"superfluid {__version__}"
    bad = run("serve", "--max-batch", "0")
    assert bad.returncode == 2 and "expected an integer of at least 1, not '0'" in bad.stderr
    small = run("serve", "--max-context", "100")
    assert small.returncode == 2 and "at least 512" in small.stderr
    unknown = run("serve", "--max-bach=3")
    assert (
        unknown.returncode == 2 and "unrecognized arguments: --max-bach=3 (did you mean --max-batch?)" in unknown.stderr
    )


def test_a_missing_model_file_is_a_clear_start_up_error(tmp_path: Path) -> None:
    result = run(
        "serve", str(tmp_path / "nope.gguf"), "--sessions", str(tmp_path / "s"), "--socket", str(tmp_path / "s.sock")
    )
    assert result.returncode == 1
    assert f"model file {tmp_path / 'nope.gguf'} does not exist" in result.stderr


# the tests below that take `populated` talk to a daemon on the real model: e2e, marked one by one
@pytest.fixture(scope="module")
def populated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    proc = DaemonProcess(tmp_path_factory.mktemp("cli")).start()
    with proc.client() as c:
        root = new_session(c)
        say(c, root, "Please remember my key sk-abcdefghijklmnopqrstuvwx and say hi.")
        generate(c, root, 4)
        c.call(Request.SetMeta(root, 0, "first", None))
        c.call(Request.Fork(root, 2, None))
    yield proc
    proc.stop()


def client(proc: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return run(*args, "--socket", str(proc.socket))


@pytest.mark.e2e
def test_session_ls_and_tree(populated: DaemonProcess) -> None:
    ls = client(populated, "session", "ls")
    assert ls.returncode == 0
    header, first, second = ls.stdout.strip().splitlines()
    assert header.split() == ["ID", "PARENT", "FORK_AT", "EVENTS", "TOKENS", "OPEN_CALLS", "TITLE"]
    assert first.split()[0] == "1" and first.split()[-1] == "first"
    assert second.split()[:3] == ["2", "1", "2"]
    tree = client(populated, "session", "tree")
    assert tree.stdout.strip().splitlines() == ["1", "└─ 2  (forked at event 2)"]


@pytest.mark.e2e
def test_session_inspect(populated: DaemonProcess) -> None:
    text = client(populated, "session", "inspect", "1").stdout.splitlines()
    assert text[0].startswith('session 1  parent -  fork_at 0  title "first"  archived false')
    assert text[1].startswith("epoch 1  generation 0  meta_version 1  qos agent")
    # parked once the daemon has parked its idle KV state (within seconds), cold until then
    assert text[2].startswith(("tier cold  tokens ", "tier parked  tokens ")), text[2]
    events = [line for line in text if line.startswith("#")]
    assert events[0].startswith("#0 e1 ") and " Created " in events[0]
    assert " Message role=1 text=" in events[1] and "span=" in events[1]
    as_json = json.loads(client(populated, "session", "inspect", "1", "--json").stdout)
    assert as_json["summary"]["id"] == 1 and len(as_json["events"]) == len(events)
    missing = client(populated, "session", "inspect", "77")
    assert missing.returncode == 1 and missing.stderr.strip() == "superfluid: unknown session 77"


@pytest.mark.e2e
def test_session_export(populated: DaemonProcess, tmp_path: Path) -> None:
    done = client(populated, "session", "export", "1", "--format", "jsonl", "--out", str(tmp_path))
    path = tmp_path / "session-1.jsonl"
    assert done.stdout.strip() == f"wrote {path}" and path.stat().st_mode & 0o777 == 0o600
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["event_id"] for r in lines] == list(range(len(lines)))
    message = lines[1]
    assert message["kind"] == "Message" and "text" not in message["fields"] and message["fields"]["text_len"] > 0
    client(populated, "session", "export", "1", "--out", str(tmp_path), "--include-content")  # jsonl, the default
    text = json.loads(path.read_text().splitlines()[1])["fields"]["text"]
    assert "[redacted]" in text and "sk-abcdefghijklmnopqrstuvwx" not in text


@pytest.mark.e2e
def test_media_put_and_gc(populated: DaemonProcess, tmp_path: Path) -> None:
    blob = tmp_path / "picture.png"
    blob.write_bytes(b"\x89PNG fake image bytes")
    put = client(populated, "media", "put", str(blob))
    digest = hashlib.sha256(blob.read_bytes()).hexdigest()
    assert put.returncode == 0 and put.stdout.strip() == digest
    assert (populated.sessions / "media" / digest).exists()
    assert client(populated, "media", "gc").stdout.strip() == "kept 0, removed 1"
    assert client(populated, "media", "put", str(tmp_path / "nope")).stderr.startswith("superfluid: cannot read")


def test_commands_without_a_daemon(tmp_path: Path) -> None:
    result = run("session", "ls", "--socket", str(tmp_path / "none.sock"))
    assert result.returncode == 1
    assert "cannot connect to the superfluid socket" in result.stderr and "superfluid serve" in result.stderr


def test_a_socket_path_too_long_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    long_socket = tmp_path / ("s" * 120)
    result = run(
        "serve", "--sessions", str(tmp_path / "s"), "--socket", str(long_socket), "--no-http", "--max-context", "512"
    )
    assert result.returncode == 2 and "a unix socket allows; pass a shorter --socket" in result.stderr
    assert "loaded" not in result.stderr
