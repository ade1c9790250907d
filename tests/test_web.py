"""The browser transport over real HTTP and WebSocket, on the real model."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets
from conftest import WebDaemon, free_port
from websockets.exceptions import InvalidStatus

pytestmark = pytest.mark.e2e

ORIGIN = "http://127.0.0.1:5999"
QUESTION = "Write a long story about a lighthouse keeper and the sea."
GREEDY = {"temperature": 0.0, "top_p": 1.0, "min_p": 0.0, "top_k": 0, "seed": 0}


@pytest.fixture(scope="module")
def web(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDaemon]:
    proc = WebDaemon(tmp_path_factory.mktemp("web"), origins=(ORIGIN,)).start()
    yield proc
    proc.stop()


def rpc(web: WebDaemon, request: object, **headers: str) -> httpx.Response:
    merged = {**web.headers(), **headers}
    return httpx.post(f"{web.url}/web/rpc", json=request, headers=merged, timeout=60)


def call(web: WebDaemon, request: object) -> dict:
    response = rpc(web, request)
    assert response.status_code == 200, response.text
    return response.json()


def new_session(web: WebDaemon, text: str = QUESTION) -> int:
    session = call(web, {"Create": {"parent": None, "params": GREEDY}})["Created"]["session"]
    call(web, {"AppendMessage": {"session": session, "role": 1, "text": text}})
    return session


def sse(web: WebDaemon, body: dict) -> Iterator[dict | str]:
    """Each SSE data payload: a parsed frame, or the string "[DONE]"."""
    with httpx.stream("POST", f"{web.url}/web/stream", json=body, headers=web.headers(), timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                payload = line[len("data: ") :]
                yield "[DONE]" if payload == "[DONE]" else json.loads(payload)


def test_token_file_and_health(web: WebDaemon) -> None:
    token_file = web.sessions / "web-token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert len(web.token) == 64 and all(c in "0123456789abcdef" for c in web.token)
    health = httpx.get(f"{web.url}/web/health")
    assert health.status_code == 200 and health.content == b""
    assert f"web: {web.url}/web/#token={web.token} (the token is also in {token_file})" in web.log.read_text()


def test_a_new_token_at_every_start(tmp_path: Path) -> None:
    proc = WebDaemon(tmp_path).start()
    try:
        first = proc.token
        proc.stop()
        proc.start()
        assert proc.token != first
        assert (
            httpx.post(
                f"{proc.url}/web/rpc",
                json="List",
                headers={"authorization": f"Bearer {first}", "x-superfluid-csrf": first},
            ).status_code
            == 401
        )
    finally:
        proc.stop()


def test_rpc_statuses_in_order(web: WebDaemon) -> None:
    ok = rpc(web, "List")
    assert ok.status_code == 200 and "Sessions" in ok.json()
    assert ok.headers.get("access-control-allow-origin") is None, "no CORS headers, ever"

    def status(headers: dict[str, str]) -> tuple[int, str]:
        response = httpx.post(f"{web.url}/web/rpc", json="List", headers=headers)
        return response.status_code, response.json()["Err"]["message"]

    token = web.token
    assert status({}) == (401, "bad or missing bearer token")
    assert status({"authorization": "Bearer wrong", "x-superfluid-csrf": token}) == (401, "bad or missing bearer token")
    assert status({"authorization": f"bearer {token}", "x-superfluid-csrf": token})[0] == 401
    assert status({"authorization": f"Bearer {token}"}) == (403, "missing or bad CSRF token")
    assert status({"authorization": f"Bearer {token}", "x-superfluid-csrf": "x" * 64}) == (
        403,
        "missing or bad CSRF token",
    )
    assert status({**web.headers(), "origin": "http://evil.example"}) == (403, "origin not allowed")
    # a wrong token wins over a bad origin: 401 comes first
    assert status({"authorization": "Bearer nope", "origin": "http://evil.example"})[0] == 401
    assert rpc(web, "List", origin=ORIGIN).status_code == 200
    # two Authorization headers where one is wrong fail
    two = httpx.Headers(
        [("authorization", f"Bearer {token}"), ("authorization", "Bearer x"), ("x-superfluid-csrf", token)]
    )
    assert httpx.post(f"{web.url}/web/rpc", json="List", headers=two).status_code == 401


def test_rpc_refusals_are_200_with_err(web: WebDaemon) -> None:
    assert call(web, {"Read": {"session": 4242, "cursor": 0}}) == {"Err": {"message": "unknown session 4242"}}
    for verb in (
        {"Generate": {"session": 1, "max_tokens": 3}},
        {"Subscribe": {"session": 1, "cursor": 0, "provisional": False}},
        {"Unsubscribe": {"sub": 1}},
    ):
        assert call(web, verb) == {
            "Err": {"message": "streaming verbs use the WebSocket surface (/web/ws) or SSE (/web/stream), not /web/rpc"}
        }
    assert call(web, {"Tree": None})["Tree"]["nodes"] is not None, "a unit verb may come as {verb: null}"


def test_bad_bodies(web: WebDaemon) -> None:
    url = f"{web.url}/web/rpc"
    syntax = httpx.post(url, content=b"{nope", headers={**web.headers(), "content-type": "application/json"})
    assert syntax.status_code == 400 and syntax.json()["Err"]["message"].startswith("invalid JSON body")
    shape = rpc(web, {"Create": {"parent": None}})
    assert (
        shape.status_code == 422
        and shape.json()["Err"]["message"] == "invalid request: missing field `params` at Create"
    )
    plain = httpx.post(url, content=b'"List"', headers={**web.headers(), "content-type": "text/plain"})
    assert plain.status_code == 415
    huge = rpc(web, {"PutMedia": {"bytes": [0] * (1 << 20), "mime": "x"}})
    assert huge.status_code == 413 and "limit" in huge.json()["Err"]["message"]


def test_complete_is_metered_per_listener(web: WebDaemon) -> None:
    body = {"Complete": {"prefix": "def f(", "suffix": "", "mode": 0, "max_tokens": 4}}
    replies = []
    with httpx.Client(headers=web.headers(), timeout=30) as client:
        for _ in range(60):
            replies.append(client.post(f"{web.url}/web/rpc", json=body))
            if replies[-1].status_code == 429:
                break
    statuses = [r.status_code for r in replies]
    assert statuses[-1] == 429 and statuses[:20] == [200] * 20, statuses
    throttled = replies[-1]
    assert int(throttled.headers["retry-after"]) >= 1
    assert throttled.json()["Throttled"]["retry_after_ms"] >= 1
    # what got through is the daemon's own answer: this model has no FIM tokens
    assert "no FIM dialect" in replies[0].json()["Err"]["message"]


def test_sse_framing(web: WebDaemon) -> None:
    session = new_session(web)
    frames = list(sse(web, {"session": session, "max_tokens": 16, "provisional": True, "ignore_eos": True}))
    assert frames[-1] == "[DONE]"
    done = frames[-2]["done"]
    assert done["tokens_generated"] == 16 and done["finish"] == 2 and done["warm_prefix"] >= 0
    committed = [f["committed"] for f in frames[:-2] if "committed" in f]
    provisional = "".join(f["provisional"]["text"] for f in frames[:-2] if "provisional" in f)
    text = "".join(e["body"].get("Generated", {}).get("text", "") for e in committed)
    # provisional text runs ahead of the commits; only a held-back tail (half a marker) can lag
    assert provisional and text.startswith(provisional), "provisional text is the committed text, ahead of it"
    assert committed[-1]["body"]["Generated"]["finish"] == 2
    events = call(web, {"Read": {"session": session, "cursor": 0}})["Events"]["events"]
    assert committed == events[-len(committed) :]

    quiet = list(sse(web, {"session": new_session(web), "max_tokens": 4}))
    assert not any("provisional" in f for f in quiet if isinstance(f, dict)), "provisional defaults to false"

    assert list(sse(web, {"session": 99999, "max_tokens": 4})) == [{"error": "unknown session 99999"}, "[DONE]"]


def test_closing_the_stream_cancels_the_generation(web: WebDaemon) -> None:
    session = new_session(web)
    with httpx.stream(
        "POST",
        f"{web.url}/web/stream",
        json={"session": session, "max_tokens": 500, "provisional": True, "ignore_eos": True},
        headers=web.headers(),
        timeout=60,
    ) as response:
        lines = response.iter_lines()
        seen = 0
        for line in lines:
            seen += line.startswith("data: ")
            if seen >= 5:
                break
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        events = call(web, {"Read": {"session": session, "cursor": 0}})["Events"]["events"]
        last = events[-1]["body"]
        if "Generated" in last and last["Generated"]["finish"] == 4:
            break
        time.sleep(0.05)
    assert last["Generated"]["finish"] == 4, last
    call(web, {"AppendMessage": {"session": session, "role": 1, "text": "idle again"}})


def test_cancel_on_rpc_while_streaming(web: WebDaemon) -> None:
    session = new_session(web)
    frames: list = []

    def consume() -> None:
        frames.extend(sse(web, {"session": session, "max_tokens": 500, "provisional": True, "ignore_eos": True}))

    reader = threading.Thread(target=consume)
    reader.start()
    deadline = time.monotonic() + 20
    while not frames and time.monotonic() < deadline:
        time.sleep(0.02)
    assert call(web, {"Cancel": {"session": session}}) == "Cancelling"
    reader.join(30)
    assert frames[-1] == "[DONE]" and frames[-2]["done"]["finish"] == 4
    assert call(web, {"Cancel": {"session": session}}) == {
        "Err": {"message": f"session {session} has no generation in flight"}
    }
    busy_session = new_session(web)
    frames.clear()
    reader = threading.Thread(target=consume)
    started: list = []

    def consume_busy() -> None:
        for frame in sse(web, {"session": busy_session, "max_tokens": 300, "ignore_eos": True, "provisional": True}):
            started.append(frame)

    second = threading.Thread(target=consume_busy)
    second.start()
    deadline = time.monotonic() + 20
    while not started and time.monotonic() < deadline:
        time.sleep(0.02)
    busy = list(sse(web, {"session": busy_session, "max_tokens": 3}))
    assert busy[0] == {"error": f"session {busy_session} is generating; append/generate after it finishes or cancel it"}
    call(web, {"Cancel": {"session": busy_session}})
    second.join(30)


# ---- WebSocket ----


async def ws_connect(web: WebDaemon, *, origin: str | None = ORIGIN, protocols: list[str] | None = None, **kw: object):
    headers = {} if origin is None else {"Origin": origin}
    offered = protocols if protocols is not None else ["superfluid.v1", f"superfluid.token.{web.token}"]
    return await websockets.connect(
        f"ws://127.0.0.1:{web.port}/web/ws",
        subprotocols=offered or None,
        additional_headers={**headers, **kw.get("headers", {})},
        origin=None,
        max_size=None,
    )


def ws_status(web: WebDaemon, **kw: object) -> int:
    async def attempt() -> int:
        try:
            conn = await ws_connect(web, **kw)
        except InvalidStatus as e:
            return e.response.status_code
        await conn.close()
        return 101

    return asyncio.run(attempt())


def test_websocket_auth(web: WebDaemon) -> None:
    token = web.token
    assert ws_status(web) == 101
    assert ws_status(web, protocols=["superfluid.v1"]) == 401
    assert ws_status(web, protocols=["superfluid.v1", "superfluid.token.bad"]) == 401
    assert ws_status(web, origin=None) == 403
    assert ws_status(web, origin="http://evil.example") == 403
    assert ws_status(web, protocols=[f"superfluid.token.{token}"]) == 400
    assert ws_status(web, protocols=[], headers={"Authorization": f"Bearer {token}"}) == 101

    async def echoed() -> str | None:
        conn = await ws_connect(web)
        try:
            return conn.subprotocol
        finally:
            await conn.close()

    assert asyncio.run(echoed()) == "superfluid.v1", "only superfluid.v1 is echoed, never the token"


def test_websocket_session_and_bad_frames(web: WebDaemon) -> None:
    async def run() -> None:
        conn = await ws_connect(web)
        try:

            async def ask(request: object) -> dict:
                await conn.send(json.dumps(request))
                return json.loads(await conn.recv())

            session = (await ask({"Create": {"parent": None, "params": GREEDY}}))["Created"]["session"]
            assert "Committed" in await ask({"AppendMessage": {"session": session, "role": 1, "text": "Hi!"}})
            assert (await ask("{not json"))["Err"]["message"].startswith("invalid request frame:")
            assert "unknown variant `Nope`" in (await ask({"Nope": {}}))["Err"]["message"]
            generate = {"Generate": {"session": session, "max_tokens": 6, "ignore_eos": True}}
            await conn.send(json.dumps(generate).encode())  # binary frame
            deltas = []
            while True:
                reply = json.loads(await conn.recv())
                if "Delta" in reply:
                    deltas.append(reply["Delta"]["event"])
                else:
                    break
            assert reply["Generated"]["tokens_generated"] == 6 and reply["Generated"]["events"] == deltas
            assert "Sessions" in await ask("List"), "the socket stayed open through the bad frames"
        finally:
            await conn.close()

    asyncio.run(run())


def test_subscribe_backlog_live_and_endings(web: WebDaemon) -> None:
    async def run() -> None:
        conn = await ws_connect(web)
        other = await ws_connect(web)
        try:
            session = new_session(web, "Say hello.")
            await conn.send(json.dumps({"Subscribe": {"session": session, "cursor": 0, "provisional": True}}))
            sub = json.loads(await conn.recv())["Subscribed"]["sub"]
            await other.send(json.dumps({"Generate": {"session": session, "max_tokens": 8, "ignore_eos": True}}))
            seen: list[int] = []
            provisional = ""
            while True:
                reply = json.loads(await conn.recv())
                if "SubEvent" in reply:
                    assert reply["SubEvent"]["sub"] == sub
                    event = reply["SubEvent"]["event"]
                    seen.append(event["event_id"])
                    body = event["body"]
                    if isinstance(body, dict) and "Generated" in body and body["Generated"]["finish"]:
                        break
                elif "SubProvisional" in reply:
                    provisional += reply["SubProvisional"]["text"]
            assert seen == list(range(len(seen))), "backlog then live, each event once, in order"
            assert provisional
            await conn.send(json.dumps({"Unsubscribe": {"sub": sub}}))
            replies = [json.loads(await conn.recv()) for _ in range(2)]
            assert "Unsubscribed" in replies
            assert {"SubEnded": {"sub": sub, "reason": "unsubscribed"}} in replies
            await conn.send(json.dumps({"Unsubscribe": {"sub": sub}}))
            assert json.loads(await conn.recv()) == {"Err": {"message": f"no subscription {sub} on this connection"}}

            await conn.send(json.dumps({"Subscribe": {"session": session, "cursor": 2, "provisional": False}}))
            sub2 = json.loads(await conn.recv())["Subscribed"]["sub"]
            assert sub2 > sub
            first = json.loads(await conn.recv())["SubEvent"]["event"]
            assert first["event_id"] == 2
            generation = call(web, {"Inspect": {"session": session}})["Inspection"]["inspection"]["summary"][
                "generation"
            ]
            purged = call(web, {"Purge": {"session": session, "expected_generation": generation, "mode": "Cascade"}})
            assert purged == {"Purged": {"sessions": [session]}}
            while True:
                reply = json.loads(await conn.recv())
                if "SubEnded" in reply:
                    break
            assert reply == {"SubEnded": {"sub": sub2, "reason": "purged"}}
        finally:
            await conn.close()
            await other.close()

    asyncio.run(run())


def test_metrics_and_log_level(web: WebDaemon) -> None:
    text = call(web, "Metrics")["Text"]["text"]
    for name in (
        "superfluid_requests_total",
        "superfluid_generations_total",
        "superfluid_prefill_tokens_total",
        "superfluid_decode_tokens_total",
        "superfluid_warm_prefix_tokens_total",
        "superfluid_lanes_active",
        "superfluid_commit_seconds_bucket",
    ):
        assert name in text, name
    assert re.search(r'^superfluid_queue_depth\{[^}]*class="interactive_chat"', text, re.MULTILINE)
    assert call(web, {"SetLogLevel": {"directive": "superfluid=debug,info"}}) == "Ack"
    refused = call(web, {"SetLogLevel": {"directive": "superfluid=loud"}})
    message = refused["Err"]["message"]
    assert message.startswith("invalid log directive 'superfluid=loud': expected LEVEL or TARGET=LEVEL"), message
    call(web, {"SetLogLevel": {"directive": "info"}})


def test_media_put_and_gc(web: WebDaemon) -> None:
    data = os.urandom(300)
    digest = call(web, {"PutMedia": {"bytes": list(data), "mime": "image/png"}})["Media"]["hash"]
    import hashlib

    assert digest == hashlib.sha256(data).hexdigest()
    blob = web.sessions / "media" / digest
    assert blob.read_bytes() == data and stat.S_IMODE(blob.stat().st_mode) == 0o600
    gc = call(web, "GcMedia")["Gc"]
    assert gc["removed"] >= 1 and not blob.exists()


def test_web_refuses_a_non_loopback_address(tmp_path: Path) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "superfluid", "serve", "--web", "0.0.0.0:8460", "--sessions", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "listens on loopback only; give 127.0.0.1:PORT, [::1]:PORT or localhost:PORT" in result.stderr


def test_subscription_lags_when_its_reader_stalls(web: WebDaemon) -> None:
    from superfluid.client import SocketClient
    from superfluid.protocol.schema import Request, Response

    with SocketClient(web.socket) as writer:
        session = call(web, {"Create": {"parent": None, "params": GREEDY}})["Created"]["session"]
        filler = list(range(300, 3300))
        for _ in range(2500):  # a long backlog, so delivery is still busy when live events pile up
            writer.send(Request.Append(session, None, filler[:8]))
        for _ in range(2500):
            writer.receive()
        stalled = socket.socket(socket.AF_UNIX)
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(str(web.socket))
        from superfluid.protocol import postcard

        payload = postcard.encode(Request.Subscribe(session, 0, False))
        stalled.sendall(len(payload).to_bytes(4, "little") + payload)
        time.sleep(0.5)
        for _ in range(1200):
            writer.send(Request.Append(session, None, [400]))
        for _ in range(1200):
            assert isinstance(writer.receive(), Response.Committed)
        stalled.settimeout(30)
        received = b""
        deadline = time.monotonic() + 60
        while b"lagged" not in received and time.monotonic() < deadline:
            chunk = stalled.recv(1 << 20)
            if not chunk:
                break
            received += chunk
        stalled.close()
        assert b"lagged" in received


def test_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    import subprocess
    import sys

    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "superfluid",
                "serve",
                "--web",
                f"127.0.0.1:{port}",
                "--sessions",
                str(tmp_path / "s"),
                "--socket",
                str(tmp_path / "s.sock"),
                "--max-context",
                "512",
                "--max-batch",
                "1",
                "--no-http",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
