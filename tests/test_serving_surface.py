"""The reference's `serve` command line, its environment fallbacks, keys and limits, draining,
non-streaming keep-alive, default sampling, class lane caps and JSON logs, on the real model."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import HttpDaemon, chat_body

from superfluid.metrics import read_metric
from superfluid.model.resolve import embedded_model

pytestmark = pytest.mark.e2e

GOOD, ADMIN, AGENT = "good-secret", "admin-secret", "agent-secret"


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`superfluid serve ...` that is expected to stop before loading anything."""
    return subprocess.run(
        [sys.executable, "-m", "superfluid", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_the_reference_command_line_serves(tmp_path: Path) -> None:
    model = str(embedded_model().path)
    proc = HttpDaemon(
        tmp_path,
        "--model", model, "--runtime", "llamacpp", "--no-tui", "--speculate", "off",
        "--prefill-chunk", "256", "--tui",
        max_context=1024, max_batch=2,
    )  # fmt: skip
    proc.start()
    try:
        reply = httpx.post(f"{proc.url}/v1/chat/completions", json=chat_body("Hello.", 3, False), timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
        log = proc.log.read_text()
        assert "--prefill-chunk is retired" in log and "with 2 lanes of 1024 tokens" in log
        # the last of --no-tui and --tui wins: the monitor ran, and the log went to <sessions>/logs
        assert (proc.sessions / "logs" / "superfluid.0.jsonl").exists()
    finally:
        proc.stop()


def test_flags_come_from_the_environment_and_the_command_line_wins(tmp_path: Path) -> None:
    env = {
        "SUPERFLUID_MAX_BATCH": "3",
        "SUPERFLUID_MAX_TOKENS": "5",
        "SUPERFLUID_TEMPERATURE": "0",
        "SUPERFLUID_REPEAT_PENALTY": "1.3",
    }
    os.environ.update(env)
    try:
        proc = HttpDaemon(tmp_path, max_context=1024, max_batch=2)
        proc.args.remove("--max-batch")
        proc.args.remove("2")
        proc.start()
    finally:
        for name in env:
            del os.environ[name]
    try:
        assert "with 3 lanes" in proc.log.read_text()
        body = chat_body("Name a colour.", 0, False)
        del body["max_tokens"], body["temperature"]
        replies = [httpx.post(f"{proc.url}/v1/chat/completions", json=body, timeout=60).json() for _ in range(2)]
        assert [r["usage"]["completion_tokens"] for r in replies] == [5, 5], "--max-tokens caps a request"
        greedy = httpx.post(
            f"{proc.url}/v1/chat/completions",
            json={**body, "max_tokens": 5, "temperature": 0, "repeat_penalty": 1.3},
            timeout=60,
        ).json()
        texts = {r["choices"][0]["message"]["content"] for r in [*replies, greedy]}
        assert len(texts) == 1, "a request that names no sampling gets --temperature and --repeat-penalty"
    finally:
        proc.stop()
    usage = serve("--help").stdout
    assert "[$SUPERFLUID_MAX_BATCH]" in usage and "[$SUPERFLUID_API_KEY]" in usage
    refused = serve(env={"SUPERFLUID_MAX_BATCH": "many"})
    assert refused.returncode == 2 and "$SUPERFLUID_MAX_BATCH" in refused.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--runtime", "mlx"], "this build has llamacpp"),
        (["--speculate", "eagle3:x"], "choose one of off, auto, prompt-lookup"),
        (["--class-lanes", "bulk=2"], "unknown QoS class"),
        (["--max-bach", "2"], "did you mean --max-batch"),
    ],
)
def test_bad_flags_are_refused_before_anything_loads(args: list[str], says: str) -> None:
    refused = serve(*args)
    assert refused.returncode == 2 and says in refused.stderr, refused.stderr


@pytest.mark.parametrize(
    ("keys", "says"),
    [
        ([], "the key list is empty"),
        ([{"name": "a", "key": "x", "colour": "red"}], "unknown field 'colour'"),
        ([{"name": "a", "key": "x"}, {"name": "b", "key": "x"}], "the same key as an earlier entry"),
        ([{"name": "a", "key": "a"}], "must not equal its name"),
        ([{"name": "a", "key": GOOD}], "the same as --api-key"),
        ([{"name": "a b", "key": "x"}], "name must be"),
        ([{"name": "a", "key_env": "SF_TEST_UNSET_KEY"}], "which is not set"),
        ([{"name": "a", "key": "x", "class": "agent", "max_class": "background"}], "max_class must be"),
        ([{"name": "a", "key": "x", "max_concurrent": -1}], "max_concurrent must be"),
    ],
)
def test_a_bad_key_policy_is_refused_at_start(tmp_path: Path, keys: list[dict], says: str) -> None:
    policy = tmp_path / "keys.json"
    policy.write_text(json.dumps({"keys": keys}))
    refused = serve("--key-policy", str(policy), "--api-key", GOOD)
    assert refused.returncode == 2 and says in refused.stderr, refused.stderr


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    root = tmp_path_factory.mktemp("keyed")
    policy = root / "keys.json"
    os.environ["SF_TEST_ADMIN_KEY"] = ADMIN
    policy.write_text(
        json.dumps(
            {
                "keys": [
                    {"name": "ops", "key_env": "SF_TEST_ADMIN_KEY", "admin": True, "class": "interactive"},
                    {"name": "agents", "key": AGENT, "class": "background", "max_class": "agent", "max_concurrent": 1},
                ]
            }
        )
    )
    proc = HttpDaemon(root, "--api-key", GOOD, "--key-policy", str(policy), max_context=1024, max_batch=4).start()
    yield proc
    proc.stop()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/models", None),
        ("GET", "/metrics", None),
        ("GET", "/api/tags", None),
        ("POST", "/v1/chat/completions", chat_body("Hi.", 2, False)),
        (
            "POST",
            "/v1/messages",
            {"model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
        ),
        (
            "POST",
            "/api/chat",
            {
                "model": "smollm2",
                "messages": [{"role": "user", "content": "Hi"}],
                "stream": False,
                "options": {"num_predict": 2},
            },
        ),
        ("GET", "/no/such/route", None),
    ],
)
def test_every_route_but_health_needs_a_key(keyed: HttpDaemon, method: str, path: str, body: dict | None) -> None:
    for headers in ({}, bearer("wrong"), {"X-Api-Key": "wrong"}):
        refused = httpx.request(method, f"{keyed.url}{path}", json=body, headers=headers, timeout=60)
        assert refused.status_code == 401, (path, headers)
        if path.startswith("/v1/messages"):  # Anthropic's shape
            assert refused.json()["type"] == "error"
            assert refused.json()["error"]["type"] == "authentication_error"
            continue
        error = refused.json()["error"]
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    for headers in (bearer(GOOD), {"X-Api-Key": GOOD}, bearer(ADMIN)):
        answered = httpx.request(method, f"{keyed.url}{path}", json=body, headers=headers, timeout=60)
        assert answered.status_code == (404 if path == "/no/such/route" else 200), (path, answered.text)
    assert httpx.get(f"{keyed.url}/health").status_code == 200


def test_admin_routes_need_an_admin_key(keyed: HttpDaemon) -> None:
    default = httpx.get(f"{keyed.url}/v1/models", headers=bearer(GOOD)).json()["data"][0]["id"]
    refused = httpx.post(f"{keyed.url}/v1/models/load", json={"model": default}, headers=bearer(AGENT))
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_required"
    for key in (ADMIN, GOOD):  # a policy key with admin, and the global key
        loaded = httpx.post(f"{keyed.url}/v1/models/load", json={"model": default}, headers=bearer(key), timeout=60)
        assert loaded.status_code == 200 and loaded.json()["loaded"] is True


def test_a_key_runs_in_its_class_and_may_not_claim_above_its_ceiling(keyed: HttpDaemon) -> None:
    body = chat_body("Hi.", 2, False)
    above = httpx.post(
        f"{keyed.url}/v1/chat/completions",
        json=body,
        headers={**bearer(AGENT), "x-superfluid-qos": "interactive"},
        timeout=60,
    )
    assert above.status_code == 403 and "may claim agent at most" in above.json()["error"]["message"]
    at = httpx.post(
        f"{keyed.url}/v1/chat/completions",
        json=body,
        headers={**bearer(AGENT), "x-superfluid-qos": "agent"},
        timeout=60,
    )
    assert at.status_code == 200


def test_a_key_holds_at_most_its_concurrent_requests(keyed: HttpDaemon) -> None:
    started = threading.Event()
    ended: list[str] = []

    def long_stream() -> None:
        with httpx.stream(
            "POST", f"{keyed.url}/v1/chat/completions", json=chat_body("Count.", 400, True), headers=bearer(AGENT),
            timeout=120,
        ) as r:  # fmt: skip
            for line in r.iter_lines():
                started.set()
                if line.startswith("data: "):
                    ended.append(line)

    holder = threading.Thread(target=long_stream)
    holder.start()
    assert started.wait(60)
    second = httpx.post(f"{keyed.url}/v1/chat/completions", json=chat_body("Hi.", 2, False), headers=bearer(AGENT))
    assert second.status_code == 429 and second.json()["error"]["code"] == "concurrency_limit_exceeded"
    assert second.headers["retry-after"] == "1"
    other_key = httpx.post(
        f"{keyed.url}/v1/chat/completions", json=chat_body("Hi.", 2, False), headers=bearer(GOOD), timeout=60
    )
    assert other_key.status_code == 200, "the limit is the key's alone"
    holder.join(300)
    assert not holder.is_alive() and ended[-1] == "data: [DONE]"
    again = httpx.post(
        f"{keyed.url}/v1/chat/completions", json=chat_body("Hi.", 2, False), headers=bearer(AGENT), timeout=60
    )
    assert again.status_code == 200, "the slot is free once the stream ended"
    metrics = httpx.get(f"{keyed.url}/metrics", headers=bearer(GOOD)).text
    assert read_metric(metrics, 'superfluid_key_rejected_total{key="agents",reason="concurrency"}') >= 1


def test_a_client_over_the_rate_limit_waits_and_recovers(tmp_path: Path) -> None:
    proc = HttpDaemon(tmp_path, "--rate-limit", "120", max_context=1024, max_batch=2).start()
    try:
        answers: list[httpx.Response] = []
        while len(answers) < 1000 and (not answers or answers[-1].status_code == 200):
            answers.append(httpx.get(f"{proc.url}/v1/models"))
        limited = answers[-1]
        assert limited.status_code == 429 and len(answers) > 120, "a full bucket lets a minute's requests through"
        assert limited.json()["error"]["code"] == "rate_limit_exceeded" and limited.headers["retry-after"] == "1"
        assert (
            httpx.get(f"{proc.url}/health").status_code == 200 and httpx.get(f"{proc.url}/metrics").status_code == 200
        )
        time.sleep(1.1)
        assert httpx.get(f"{proc.url}/v1/models").status_code == 200
    finally:
        proc.stop()


def test_drain_finishes_what_runs_refuses_the_rest_and_exits_0(tmp_path: Path) -> None:
    proc = HttpDaemon(tmp_path, "--drain-timeout", "120", max_context=1024, max_batch=4).start()
    replies: list[dict] = []

    def ask(i: int) -> None:
        body = chat_body(f"Tell a story about the number {i}.", 200, False)  # still running at the signal
        replies.append(httpx.post(f"{proc.url}/v1/chat/completions", json=body, timeout=120).json())

    askers = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for asker in askers:
        asker.start()
    while proc.metric("superfluid_lanes_active") < 3:
        time.sleep(0.02)
    assert proc.proc is not None
    proc.proc.send_signal(signal.SIGUSR1)
    time.sleep(0.3)
    refused = httpx.post(f"{proc.url}/v1/chat/completions", json=chat_body("Hi.", 2, False), timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    assert int(refused.headers["retry-after"]) >= 1
    health = httpx.get(f"{proc.url}/health", timeout=10)  # a load balancer takes it out of rotation
    assert health.status_code == 503 and health.json() == {"status": "draining"}
    for asker in askers:
        asker.join(120)
    assert proc.proc.wait(60) == 0
    assert [r["usage"]["completion_tokens"] for r in replies] == [200, 200, 200], "nothing running was cut"


def test_a_non_streaming_reply_is_kept_alive_with_spaces(tmp_path: Path) -> None:
    proc = HttpDaemon(tmp_path, "--nonstream-keepalive", "0.05", max_context=1024, max_batch=2).start()
    try:
        with httpx.stream(
            "POST", f"{proc.url}/v1/chat/completions", json=chat_body("Hi.", 200, False), timeout=60
        ) as r:
            assert r.status_code == 200 and r.headers["x-superfluid-keepalive"] == "whitespace"
            raw = r.read().decode()
        assert raw.startswith(" "), "spaces came before the body"
        assert json.loads(raw)["usage"]["completion_tokens"] == 200

        # a client that hangs up is noticed, and its generation cancelled
        data = json.dumps(chat_body("Hi.", 1000, False)).encode()
        with socket.create_connection(("127.0.0.1", proc.port)) as s:
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(data)}\r\n\r\n".encode()
                + data
            )
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
        deadline = time.monotonic() + 10
        while proc.metric("superfluid_generations_running") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.metric("superfluid_generations_running") == 0
        assert proc.metric("superfluid_decode_tokens_total") < 200 + 1000
    finally:
        proc.stop()


def test_class_lanes_cap_a_class(tmp_path: Path) -> None:
    proc = HttpDaemon(tmp_path, "--class-lanes", "background=2", max_context=1024, max_batch=4).start()
    replies: list[int] = []
    most = 0

    def ask(i: int) -> None:
        r = httpx.post(
            f"{proc.url}/v1/chat/completions",
            json=chat_body(f"Story {i}.", 40, False),
            headers={"x-superfluid-qos": "background"},
            timeout=120,
        )
        replies.append(r.json()["usage"]["completion_tokens"])

    try:
        askers = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for asker in askers:
            asker.start()
        while any(asker.is_alive() for asker in askers):
            most = max(most, int(proc.metric("superfluid_lanes_active")))
            time.sleep(0.02)
        assert most == 2 and replies == [40] * 4
    finally:
        proc.stop()


def test_a_busy_daemon_sheds_stateless_requests_when_asked(tmp_path: Path) -> None:
    proc = HttpDaemon(tmp_path, "--shed-when-busy", "429", max_context=1024, max_batch=2).start()
    replies: list[int] = []

    def ask(i: int) -> None:
        r = httpx.post(f"{proc.url}/v1/chat/completions", json=chat_body(f"Story {i}.", 300, False), timeout=120)
        replies.append(r.json()["usage"]["completion_tokens"])

    try:
        askers = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for asker in askers:
            asker.start()
        deadline = time.monotonic() + 30
        while proc.metric("superfluid_lanes_active") < 2:
            assert time.monotonic() < deadline, "the two generations never ran together"
            time.sleep(0.02)
        shed = httpx.post(f"{proc.url}/v1/chat/completions", json=chat_body("Hi.", 4, False), timeout=30)
        assert shed.status_code == 429 and shed.headers["retry-after"] == "1", shed.text
        assert shed.json()["error"]["code"] == "busy"
        tokens = httpx.post(f"{proc.url}/v1/tokenize", json={"content": "Hi."}, timeout=30)
        assert tokens.status_code == 200, "only generations that carry no session are shed"
        for asker in askers:
            asker.join(120)
        assert replies == [300, 300], "what was running was not cut"
        again = httpx.post(f"{proc.url}/v1/chat/completions", json=chat_body("Hi.", 4, False), timeout=60)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.stop()


def test_log_dir_holds_private_json_lines_without_content(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    proc = HttpDaemon(tmp_path, "--log-dir", str(logs), "-v", max_context=1024, max_batch=2).start()
    marker = "zebra-quartz-lantern"
    try:
        httpx.post(f"{proc.url}/v1/chat/completions", json=chat_body(f"Say {marker}.", 4, False), timeout=60)
    finally:
        proc.stop()
    files = list(logs.iterdir())
    assert [f.name for f in files] == ["superfluid.0.jsonl"]
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600
    lines = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert lines and all({"ts", "level", "target", "message"} <= set(line) for line in lines)
    assert any(line["level"] == "debug" for line in lines)
    assert marker not in files[0].read_text() and marker not in proc.log.read_text()


def test_http_connections_send_each_chunk_at_once() -> None:
    """asyncio turns Nagle's algorithm off (TCP_NODELAY) only on the connections of a socket that
    names IPPROTO_TCP; left 0, a streamed chunk waits for the client's delayed ACK of the one
    before (40 ms on Linux), which doubled an idle chat's first token."""
    import asyncio

    from superfluid.transports.listener import HttpListener

    async def app(scope: dict, receive: object, send: object) -> None:
        raise AssertionError("no request is made")

    async def listening_protocols() -> set[int]:
        listener = HttpListener(app, "127.0.0.1", 0, "a test listener")
        await listener.start()
        try:
            return {sock.proto for server in listener._server.servers for sock in server.sockets}
        finally:
            await listener.stop()

    assert asyncio.run(listening_protocols()) == {socket.IPPROTO_TCP}
