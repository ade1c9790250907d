"""`superfluid run MODEL PROMPT`: one answer on stdout, with piped input before the prompt."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import HttpDaemon, free_port

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    proc = HttpDaemon(tmp_path_factory.mktemp("run"), max_context=2048, max_batch=2).start()
    yield proc
    proc.stop()


def run(api: HttpDaemon, *argv: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    address = api.url.removeprefix("http://")
    command = [sys.executable, "-m", "superfluid", "run", *argv, "--http", address]
    return subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=120)


def test_run_streams_the_answer_the_api_gives(api: HttpDaemon) -> None:
    done = run(api, "smollm2", "Summarise", "this.", "--max-tokens", "12", "--temperature", "0", stdin="The sea.\n")
    assert done.returncode == 0, done.stderr
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "The sea.\n\nSummarise this."}],
        "max_tokens": 12,
        "temperature": 0,
    }
    whole = httpx.post(f"{api.url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    assert done.stdout.rstrip("\n") == whole["content"].rstrip("\n"), "piped input, a blank line, then the prompt"


def test_run_says_what_is_missing(api: HttpDaemon) -> None:
    empty = run(api, "smollm2")
    assert empty.returncode == 2 and "no prompt" in empty.stderr
    unknown = run(api, "no-such-model.gguf", "Hi")
    assert unknown.returncode == 1 and "cannot serve no-such-model.gguf" in unknown.stderr


def test_ps_shows_what_the_daemon_has_loaded(api: HttpDaemon) -> None:
    address = api.url.removeprefix("http://")
    done = subprocess.run(
        [sys.executable, "-m", "superfluid", "ps", "--http", address], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    header, row = done.stdout.splitlines()
    assert header.split() == ["MODEL", "CONTEXT", "KERNELS", "WORKER", "MEMORY", "DEFAULT"]
    served = httpx.get(f"{api.url}/v1/models").json()["data"][0]
    assert row.split()[:4] == [served["id"], "2048", served["runtime"]["kernels"], str(served["runtime"]["worker_pid"])]
    assert row.split()[-1] == "yes" and row.split()[5] == "MiB"
    gone = subprocess.run(
        [sys.executable, "-m", "superfluid", "ps", "--http", "127.0.0.1:9"], capture_output=True, text=True
    )
    assert gone.returncode == 1 and "no daemon answers at 127.0.0.1:9" in gone.stderr


def test_run_starts_a_daemon_when_none_answers(tmp_path: Path) -> None:
    environment = {**os.environ, "SUPERFLUID_HOME": str(tmp_path)}
    address = f"127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "superfluid", "run", "smollm2", "Hi", "--max-tokens", "4", "--http", address]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=environment)
        assert done.returncode == 0, done.stderr
        assert f"starting a daemon at {address}" in done.stderr, "a name the daemon knows starts the default one"
        assert httpx.get(f"http://{address}/health").status_code == 200, "it keeps serving for the next run"
    finally:
        subprocess.run([sys.executable, "-m", "superfluid", "stop"], env=environment, timeout=60)
