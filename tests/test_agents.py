"""The coding agents people run, run against the daemon through `superfluid launch`.

Claude Code, Codex, aider and llm are the real programs (`make test` installs them into
.venv/agents; opencode too, whose 7,700-token prompt takes minutes to prefill on two cores,
so it is run by hand: docs/agents/opencode.md). Each is pointed at a recording proxy in front
of the daemon, so a test sees every request the agent made and every answer it got: none may
be refused or fail, each must claim the agent QoS class, and the agent must print the reply
the model gave. On the embedded model the replies are nonsense; what is asserted is the
protocol and the serving.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from agents import AGENT_BIN, embedded_dialect, with_tools_in_the_system_prompt  # bench/ runs the agents too
from conftest import CITY_FUNCTION, HttpDaemon, free_port

pytestmark = pytest.mark.e2e

SUPERFLUID = [sys.executable, "-m", "superfluid"]


@dataclass
class Exchange:
    """One request an agent made, and the daemon's answer."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    status: int
    reply: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class RecordingProxy:
    """Forwards to the daemon and keeps every exchange (replies are passed on whole, streams too)."""

    upstream: str
    exchanges: list[Exchange] = field(default_factory=list)

    def __post_init__(self) -> None:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
                answer = httpx.request(
                    self.command, proxy.upstream + self.path, headers=headers, content=body, timeout=600
                )
                exchange = Exchange(
                    self.command, self.path.split("?")[0], {k.lower(): v for k, v in self.headers.items()}, body,
                    answer.status_code, answer.content,
                )  # fmt: skip
                proxy.exchanges.append(exchange)
                self.send_response(answer.status_code)
                for key, value in answer.headers.items():
                    if key.lower() not in ("content-length", "transfer-encoding", "content-encoding", "connection"):
                        self.send_header(key, value)
                self.send_header("content-length", str(len(answer.content)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(answer.content)

            do_GET = do_POST = do_HEAD = do_DELETE = forward

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.address = f"127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def generations(self, path: str) -> list[Exchange]:
        return [e for e in self.exchanges if e.method == "POST" and e.path == path]

    def check(self) -> None:
        """Nothing refused or failed, and every generation in the agent class."""
        failed = [(e.method, e.path, e.status, e.reply[:300]) for e in self.exchanges if e.status >= 400]
        assert not failed, failed
        for exchange in self.exchanges:
            if exchange.method == "POST" and exchange.path.startswith(("/v1/", "/api/")):
                assert exchange.headers.get("x-superfluid-qos") == "agent", (exchange.path, exchange.headers)


def streamed_text(exchange: Exchange) -> str:
    """The text of a reply, streamed (server-sent events) or whole, in any of the three APIs."""
    if not exchange.reply.lstrip().startswith((b"event:", b"data:")):
        body = json.loads(exchange.reply)
        if "choices" in body:
            return body["choices"][0]["message"]["content"] or ""
        if "output" in body:
            return "".join(p["text"] for i in body["output"] if i["type"] == "message" for p in i["content"])
        return "".join(b.get("text", "") for b in body["content"] if b["type"] == "text")
    text = ""
    for line in exchange.reply.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: ") :])
        if event.get("type") == "content_block_delta" and event["delta"]["type"] == "text_delta":
            text += event["delta"]["text"]
        elif event.get("type") == "response.output_text.delta":
            text += event["delta"]
        elif event.get("choices"):
            text += event["choices"][0].get("delta", {}).get("content") or ""
    return text


def reported_usage(exchange: Exchange) -> dict[str, int]:
    """The usage an Anthropic stream ended with (its `message_delta`)."""
    for line in exchange.reply.decode().splitlines():
        if line.startswith("data: ") and '"message_delta"' in line:
            return json.loads(line[len("data: ") :])["usage"]
    raise AssertionError(f"no message_delta in {exchange.reply[-300:]!r}")


def words(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    # a request that names no limit (Codex, aider, llm) stops at 200 tokens: a 135M model may ramble to the window
    daemon = HttpDaemon(tmp_path_factory.mktemp("agents"), "--max-tokens", "200", max_context=8192, max_batch=2)
    daemon.start()
    yield daemon
    daemon.stop()


@pytest.fixture
def proxy(served: HttpDaemon) -> RecordingProxy:
    recorder = RecordingProxy(served.url)
    yield recorder
    recorder.server.shutdown()


def launch(address: str, agent: str, args: list[str], home: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """`superfluid launch AGENT --http ADDRESS -- ARGS` with the installed agents on PATH, in `home`."""
    home.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PATH": f"{AGENT_BIN}:{os.environ['PATH']}",
        "HOME": str(home),
        "SUPERFLUID_HOME": str(home / ".superfluid"),
        # Claude Code asks for 32,000 tokens: a 135M model's reply may fill the window. It continues a reply
        # cut at the cap three times before it gives up, so a reply that rambles on costs four caps
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "300",
    }
    command = [*SUPERFLUID, "launch", agent, "--http", address, "--", *args]
    return subprocess.run(command, cwd=home, env=env, capture_output=True, text=True, timeout=timeout)


def ran(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, (result.returncode, result.stdout[-2000:], result.stderr[-3000:])
    return result.stdout


def claude_turn(proxy: RecordingProxy, question: str, home: Path) -> dict:
    """A `claude -p` turn's JSON result, with the default system prompt and two tools (about 2,800
    tokens: its 25 tools are 23,000). Claude Code fails a turn whose sampled reply runs past its
    token cap; such a turn is asked again, three times at most."""
    lean = ["--tools", "Read,Bash", "--output-format", "json", "-p", question]
    for _ in range(3):
        result = launch(proxy.address, "claude", lean, home)
        if "output token maximum" not in result.stdout:
            return json.loads(ran(result))
    raise AssertionError(f"three replies in a row ran past the cap: {result.stdout[-500:]}")


def test_claude_code_answers_and_its_second_run_with_the_same_tools_is_warm(
    proxy: RecordingProxy, served: HttpDaemon, tmp_path: Path
) -> None:
    first = claude_turn(proxy, "Say hello.", tmp_path)
    assert first["is_error"] is False and first["subtype"] == "success", first
    asked = proxy.generations("/v1/messages")
    # (a reply cut at its token cap is continued in a request of its own, whose text is the last one printed)
    assert asked and words(streamed_text(asked[-1])) in words(first["result"])
    body = asked[-1].json()
    assert any("cache_control" in block for block in body["system"])  # what the warm turn relies on
    warm_before = served.metric("superfluid_generation_warm_prefix_tokens_total")
    seen = len(proxy.exchanges)
    second = claude_turn(proxy, "Say goodbye.", tmp_path)
    assert second["is_error"] is False, second
    # the turn's first request with the tools (a reply may call one, and the next request carry its output)
    turn = next(e for e in proxy.exchanges[seen:] if e.path == "/v1/messages" and e.json().get("tools"))
    usage = reported_usage(turn)
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
    assert usage["cache_read_input_tokens"] >= 0.9 * prompt, usage
    warm = served.metric("superfluid_generation_warm_prefix_tokens_total") - warm_before
    assert warm >= 0.9 * prompt, (warm, prompt)
    # the bench sends llama-server, which drops tools SmolLM2's template has no place for, this request
    # with its tools written into the system prompt: to superfluid both are the same prompt
    folded = with_tools_in_the_system_prompt(turn.json(), embedded_dialect())
    assert "tools" not in folded and "<tools>" in folded["system"]
    assert counted_tokens(served, folded) == counted_tokens(served, turn.json())
    proxy.check()


def counted_tokens(daemon: HttpDaemon, body: dict) -> int:
    """The prompt tokens the daemon counts for a Messages request (`/v1/messages/count_tokens`)."""
    asked = {key: body[key] for key in ("model", "system", "messages", "tools") if key in body}
    reply = httpx.post(f"{daemon.url}/v1/messages/count_tokens", json=asked, timeout=60)
    assert reply.status_code == 200, reply.text
    return int(reply.json()["input_tokens"])


def test_codex_answers_through_the_responses_api(proxy: RecordingProxy, tmp_path: Path) -> None:
    # Codex's own instructions are about 4,000 tokens; with a short file in their place its prompt
    # (its tools, namespace ones among them) is about 5,100. Codex fails a turn cut at its length, so
    # the reply is held to a schema (Codex's --output-schema), whose end every machine reaches.
    instructions = tmp_path / "instructions.md"
    instructions.write_text("You are a coding agent. Answer in one short sentence.\n")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({**CITY_FUNCTION["parameters"], "additionalProperties": False}))
    args = ["exec", "--skip-git-repo-check", "-c", f"model_instructions_file={json.dumps(str(instructions))}"]
    args += ["--output-schema", str(schema)]
    out = ran(launch(proxy.address, "codex", [*args, "Which city is the capital of Norway?"], tmp_path))
    asked = proxy.generations("/v1/responses")
    assert asked and words(streamed_text(asked[-1])) in words(out)
    assert json.loads(streamed_text(asked[-1]))["city"] in ("Paris", "Oslo", "Lima")
    tools = asked[-1].json()["tools"]
    assert any(tool["type"] == "namespace" for tool in tools), [tool["type"] for tool in tools]
    proxy.check()


def test_aider_answers_a_message(proxy: RecordingProxy, tmp_path: Path) -> None:
    args = ["--message", "Say hello.", "--no-git", "--yes-always", "--no-pretty", "--no-analytics"]
    out = ran(launch(proxy.address, "aider", args, tmp_path))
    asked = proxy.generations("/v1/chat/completions")
    assert asked and words(streamed_text(asked[-1])) in words(out)
    proxy.check()


def test_llm_answers_a_prompt(proxy: RecordingProxy, tmp_path: Path) -> None:
    out = ran(launch(proxy.address, "llm", ["Say hello."], tmp_path))
    asked = proxy.generations("/v1/chat/completions")
    assert asked and words(out) == words(streamed_text(asked[-1]))
    proxy.check()


def test_launch_starts_a_daemon_when_none_answers_and_stop_stops_only_that_one(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    home = tmp_path / "home"
    record = home / ".superfluid" / "launch" / "launch.json"
    started = launch(address, "llm", ["-o", "max_tokens", "8", "Say hello."], home)
    ran(started)
    assert "starting a daemon" in started.stderr
    pid = json.loads(record.read_text())["pid"]
    assert httpx.get(f"http://{address}/health").status_code == 200
    again = launch(address, "llm", ["-o", "max_tokens", "8", "Say hello."], home)  # the running one is used
    ran(again)
    assert "starting a daemon" not in again.stderr and json.loads(record.read_text())["pid"] == pid
    env = {**os.environ, "SUPERFLUID_HOME": str(home / ".superfluid")}
    stop = subprocess.run([*SUPERFLUID, "stop"], env=env, capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0 and f"pid {pid}" in stop.stderr, stop.stderr
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://{address}/health")
    stop = subprocess.run([*SUPERFLUID, "stop"], env=env, capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0 and "no daemon" in stop.stderr


def test_launch_refuses_what_cannot_run(served: HttpDaemon, tmp_path: Path) -> None:
    address = served.url.removeprefix("http://")
    env = {**os.environ, "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SUPERFLUID_HOME": str(tmp_path)}
    missing = subprocess.run(
        [*SUPERFLUID, "launch", "claude", "--http", address], env=env, capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 1 and "npm install -g @anthropic-ai/claude-code" in missing.stderr
    # Claude Code as it comes sends 23,000 tokens; this model's window is 8,192: refused before it runs
    whole = launch(address, "claude", ["-p", "Say hello."], tmp_path)
    assert whole.returncode == 1, whole.stdout
    assert "23,000 tokens" in whole.stderr and "8,192" in whole.stderr and "--tools Read,Bash" in whole.stderr
    unknown = launch(address, "cursor", [], tmp_path)
    assert unknown.returncode == 1 and "known agents: claude, codex" in unknown.stderr


def test_a_daemon_that_fails_to_start_is_reported_with_its_log(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": f"{AGENT_BIN}:{os.environ['PATH']}", "SUPERFLUID_HOME": str(tmp_path)}
    missing = tmp_path / "no-such-model.gguf"
    command = [*SUPERFLUID, "launch", "llm", "--http", f"127.0.0.1:{free_port()}", "--model", str(missing)]
    failed = subprocess.run([*command, "--", "Say hello."], env=env, capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1 and "the daemon exited with status" in failed.stderr, failed.stderr
    assert "no-such-model.gguf" in failed.stderr.split("status", 1)[1]  # the log's last lines say why
    assert not (tmp_path / "launch" / "launch.json").exists()
