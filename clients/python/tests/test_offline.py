"""The client's wire behaviour, against a scripted fake of the daemon's web routes."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from superfluid_client import Client, Event, Sampling, SessionBusy, SuperfluidError, ToolCall
from superfluid_client._client import fold_messages

TOKEN = "t0k"


class Fake:
    """Scripted answers per verb, and what the client sent."""

    def __init__(self) -> None:
        self.answers: dict[str, Any] = {}
        self.frames: list[Any] = []
        self.sent: list[tuple[str, Any]] = []


def make_handler(fake: Fake) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/web/health" else 404)
            self.end_headers()

        def do_POST(self) -> None:
            if self.headers.get("authorization") != f"Bearer {TOKEN}" or self.headers.get("x-superfluid-csrf") != TOKEN:
                self._json(401, {"Err": {"message": "bad or missing bearer token"}})
                return
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            if self.path == "/web/stream":
                fake.sent.append(("stream", body))
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.end_headers()
                for frame in fake.frames:
                    self.wfile.write(f"data: {json.dumps(frame)}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(b": keep-alive\n\ndata: [DONE]\n\n")
                return
            ((verb, args),) = body.items()
            fake.sent.append((verb, args))
            answer = fake.answers.get(verb, {"Err": {"message": f"no script for {verb}"}})
            if callable(answer):
                answer = answer(args)
            self._json(200, answer)

        def _json(self, status: int, obj: Any) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


@pytest.fixture
def fake() -> Iterator[tuple[Fake, Client]]:
    script = Fake()
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(script))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = Client(f"http://127.0.0.1:{server.server_address[1]}", TOKEN)
    yield script, client
    server.shutdown()


def event(event_id: int, body: Any) -> dict[str, Any]:
    return {"event_id": event_id, "epoch": 1, "ts_unix_ms": 1, "body": body}


def committed(event_id: int, body: Any) -> Callable[[Any], Any]:
    return lambda args: {"Committed": {"event": event(event_id, body)}}


def test_create_then_system_message(fake: tuple[Fake, Client]) -> None:
    script, client = fake
    script.answers = {"Create": {"Created": {"session": 7}}, "AppendMessage": committed(1, {"Message": {"role": 0}})}
    session = client.session(Sampling(0.5, 0.9, 0.05, 10, 3), system="hi")
    assert session.id == 7 and repr(session) == "Session(7)"
    assert script.sent == [
        (
            "Create",
            {"parent": None, "params": {"temperature": 0.5, "top_p": 0.9, "min_p": 0.05, "top_k": 10, "seed": 3}},
        ),
        ("AppendMessage", {"session": 7, "role": 0, "text": "hi"}),
    ]


def test_session_with_tools_and_a_tool_call(fake: tuple[Fake, Client]) -> None:
    script, client = fake
    script.answers = {
        "Create": {"Created": {"session": 7}},
        "AppendSystem": committed(1, {"Message": {"role": 0}}),
        "AppendToolResult": committed(5, {"ToolResult": {"call_id": 4}}),
    }
    tool = {"type": "function", "function": {"name": "f"}}
    session = client.session(Sampling.greedy(), system="use tools", tools=[tool, '{"name": "g"}'])
    assert script.sent[1] == (
        "AppendSystem",
        {"session": 7, "text": "use tools", "tools": [json.dumps(tool), '{"name": "g"}']},
    )
    script.frames = [
        {"committed": event(4, {"ToolUse": {"name": "f", "arguments": '{"x": 1}'}})},
        {"done": {"tokens_generated": 9, "finish": 1, "warm_prefix": 0}},
    ]
    reply = session.generate(32)
    assert script.sent[-1] == ("stream", {"session": 7, "max_tokens": 32, "provisional": False})
    assert reply.tool_calls == [ToolCall(4, "f", '{"x": 1}')] and reply.tool_calls[0].json() == {"x": 1}
    session.tool_result(reply.tool_calls[0], "sunny")
    assert script.sent[-1] == ("AppendToolResult", {"session": 7, "call_id": 4, "content": "sunny"})


def test_declare_refusal(fake: tuple[Fake, Client]) -> None:
    script, client = fake
    script.answers = {
        "Create": {"Created": {"session": 1}},
        "AppendSystem": {"Err": {"message": "tool 0 is not a function declaration: it has no name"}},
    }
    with pytest.raises(SuperfluidError, match="it has no name"):
        client.session(tools=[{}])
    assert script.sent[-1][1]["text"] is None


def test_fork_defaults_to_head(fake: tuple[Fake, Client]) -> None:
    script, client = fake
    script.answers = {
        "Create": {"Created": {"session": 1}},
        "Read": {"Events": {"events": [event(0, "EpochBump"), event(1, "EpochBump")]}},
        "Fork": {"Created": {"session": 2}},
    }
    session = client.session(Sampling(1.0, 0.95, 0.0, 20, 1))
    child = session.fork(seed=2)
    assert script.sent[-1] == (
        "Fork",
        {
            "session": 1,
            "at_event": 2,
            "params": {"temperature": 1.0, "top_p": 0.95, "min_p": 0.0, "top_k": 20, "seed": 2},
        },
    )
    assert child.sampling.seed == 2 and child.sampling.temperature == 1.0
    session.fork_after(5)
    assert script.sent[-1] == ("Fork", {"session": 1, "at_event": 6, "params": None})


def test_provisional_streaming(fake: tuple[Fake, Client]) -> None:
    script, client = fake
    script.answers = {"Create": {"Created": {"session": 1}}}
    script.frames = [
        {"provisional": {"channel": 1, "text": "hm"}},
        {"provisional": {"channel": 0, "text": "Hel"}},
        {"committed": event(5, {"Generated": {"span": [], "text": "hm", "channel": 1, "finish": 0}})},
        {"provisional": {"channel": 0, "text": "lo"}},
        {"committed": event(6, {"Generated": {"span": [], "text": "Hello", "channel": 0, "finish": 1}})},
        {"committed": event(7, {"ToolUse": {"name": "t", "arguments": "{}"}})},
        {"done": {"tokens_generated": 3, "finish": 1, "warm_prefix": 12}},
    ]
    stream = client.session().stream(32)
    chunks = [(c.kind, c.text) for c in stream]
    assert chunks == [("reasoning", "hm"), ("text", "Hel"), ("text", "lo")]
    assert script.sent[-1] == ("stream", {"session": 1, "max_tokens": 32, "provisional": True})
    reply = stream.reply
    assert reply is not None
    assert (reply.text, reply.reasoning, reply.finish, reply.tokens, reply.warm_prefix) == (
        "Hello",
        "hm",
        "stop",
        3,
        12,
    )
    assert reply.tool_calls == [ToolCall(7, "t", "{}")] and str(reply) == "Hello"


def test_generate_without_callback_uses_committed_text(fake: tuple[Fake, Client]) -> None:
    script, client = fake
    script.answers = {"Create": {"Created": {"session": 1}}}
    script.frames = [
        {"committed": event(3, {"Generated": {"span": [], "text": "abc", "channel": 0, "finish": 2}})},
        {"done": {"tokens_generated": 3, "finish": 2, "warm_prefix": 0}},
    ]
    reply = client.session().generate(3)
    assert reply.text == "abc" and reply.finish == "length"
    assert script.sent[-1][1]["provisional"] is False


def test_an_error_frame_first_raises_busy_without_cancel(fake: tuple[Fake, Client]) -> None:
    script, client = fake
    script.answers = {"Create": {"Created": {"session": 1}}}
    script.frames = [{"error": "session 1 is generating; append/generate after it finishes or cancel it"}]
    with pytest.raises(SessionBusy):
        client.session().generate(5)
    assert not any(verb == "Cancel" for verb, _ in script.sent)


def test_leaving_the_loop_early_cancels(fake: tuple[Fake, Client]) -> None:
    script, client = fake
    script.answers = {"Create": {"Created": {"session": 1}}, "Cancel": "Cancelling"}
    script.frames = [
        {"provisional": {"channel": 0, "text": "a"}},
        {"provisional": {"channel": 0, "text": "b"}},
        {"done": {"tokens_generated": 2, "finish": 4, "warm_prefix": 0}},
    ]
    for _ in client.session().stream(10):
        break
    assert script.sent[-1] == ("Cancel", {"session": 1})


def test_refusals_and_auth(fake: tuple[Fake, Client]) -> None:
    script, client = fake
    script.answers = {"Read": {"Err": {"message": "unknown session 3"}}, "Create": {"Created": {"session": 3}}}
    with pytest.raises(SuperfluidError, match="unknown session 3") as error:
        client.session().events()
    assert error.value.status is None and not isinstance(error.value, SessionBusy)
    wrong = Client(f"http://127.0.0.1:{client._port}", "nope")
    with pytest.raises(SuperfluidError) as unauthorized:
        wrong.tree()
    assert unauthorized.value.status == 401 and "bad or missing bearer token" in unauthorized.value.message
    assert client.health()


def test_cancel_reports_whether_anything_was_running(fake: tuple[Fake, Client]) -> None:
    script, client = fake
    script.answers = {"Create": {"Created": {"session": 2}}, "Cancel": "Cancelling"}
    session = client.session()
    assert session.cancel() is True
    script.answers["Cancel"] = {"Err": {"message": "session 2 has no generation in flight"}}
    assert session.cancel() is False


def test_edit_replaces_from_the_message_to_head(fake: tuple[Fake, Client]) -> None:
    script, client = fake
    events = [event(2, {"Message": {"role": 1, "text": "old", "span": []}}), event(3, "EpochBump")]
    script.answers = {
        "Create": {"Created": {"session": 1}},
        "Read": lambda args: {"Events": {"events": [e for e in events if e["event_id"] >= args["cursor"]]}},
        "Rebase": {"Created": {"session": 5}},
    }
    child = client.session().edit(2, "new")
    assert child.id == 5
    assert script.sent[-1] == (
        "Rebase",
        {"session": 1, "edits": [{"Replace": {"from": 2, "to": 4, "role": 1, "text": "new"}}], "params": None},
    )


def test_folding_messages() -> None:
    raw = [
        event(0, {"Created": {"parent": None, "params": {}}}),
        event(1, {"Message": {"role": 1, "text": "q"}}),
        event(2, {"GenerationPrompt": {"span": []}}),
        event(3, {"Generated": {"text": "think", "channel": 1, "finish": 0}}),
        event(4, {"Generated": {"text": "a", "channel": 0, "finish": 0}}),
        event(5, {"Generated": {"text": "b", "channel": 0, "finish": 1}}),
        event(6, {"Message": {"role": 1, "text": "q2"}}),
    ]
    assert fold_messages([Event.from_wire(e) for e in raw]) == [
        {"role": "user", "content": "q", "event": 1},
        {"role": "assistant", "content": "ab", "reasoning": "think"},
        {"role": "user", "content": "q2", "event": 6},
    ]


def test_client_configuration(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("SUPERFLUID_WEB_URL", "http://127.0.0.1:9999")
    monkeypatch.setenv("SUPERFLUID_WEB_TOKEN", " env-token \n")
    client = Client()
    assert client.url == "http://127.0.0.1:9999" and client._token == "env-token"
    monkeypatch.delenv("SUPERFLUID_WEB_TOKEN")
    monkeypatch.setenv("SUPERFLUID_HOME", str(tmp_path))
    with pytest.raises(SuperfluidError, match=r"no web token at .*web-token"):
        Client()
    (tmp_path / "sessions").mkdir()
    (tmp_path / "sessions" / "web-token").write_text("file-token\n")
    assert Client()._token == "file-token"
    with pytest.raises(ValueError, match="plain http"):
        Client("https://127.0.0.1:8460", "x")
    assert Sampling.greedy().to_wire() == {"temperature": 0.0, "top_p": 1.0, "min_p": 0.0, "top_k": 0, "seed": 0}
    assert 0 <= Sampling().seed < 2**63 and Sampling().seed != Sampling().seed
