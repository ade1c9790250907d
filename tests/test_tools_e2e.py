"""Tools, reasoning, grammars, permissions, blocks, media and FIM, end to end on the real model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import DaemonProcess, WebDaemon

from superfluid.protocol.schema import Request, Response

pytestmark = pytest.mark.e2e

GREEDY = {"temperature": 0.0, "top_p": 1.0, "min_p": 0.0, "top_k": 0, "seed": 0}
CITIES = ["Paris", "Oslo", "Lima", "Cairo", "Perth"]
# the city is one of a few names, so a call forced by a grammar completes on any machine
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": CITIES}},
            "required": ["city"],
        },
    },
}
# plain prose, for turns that answer in words: no markup the model could open a channel with
PROSE = "root ::= [A-Za-z0-9 ,.]+"
MARKERS = ("<tool_call>", "</tool_call>", "<think>", "</think>")


class Web:
    """JSON calls and SSE streams against one daemon."""

    def __init__(self, daemon: WebDaemon) -> None:
        self.daemon = daemon
        self.http = httpx.Client(base_url=daemon.url, timeout=120)

    @property
    def headers(self) -> dict[str, str]:
        return self.daemon.headers()

    def call(self, request: object) -> object:
        response = self.http.post("/web/rpc", json=request, headers=self.headers)
        assert response.status_code == 200, response.text
        return response.json()

    def stream(self, body: dict) -> list[dict]:
        frames = []
        with self.http.stream("POST", "/web/stream", json=body, headers=self.headers) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    frames.append(json.loads(line[6:]))
        return frames

    def session(self, system: str | None = None, tools: list[dict] | None = None) -> int:
        session = self.call({"Create": {"parent": None, "params": GREEDY}})["Created"]["session"]
        if system is not None or tools:
            tool_texts = [json.dumps(t) for t in tools or []]
            self.call({"AppendSystem": {"session": session, "text": system, "tools": tool_texts}})
        return session

    def say(self, session: int, text: str, role: int = 1) -> dict:
        return self.call({"AppendMessage": {"session": session, "role": role, "text": text}})["Committed"]["event"]

    def events(self, session: int, cursor: int = 0) -> list[dict]:
        return self.call({"Read": {"session": session, "cursor": cursor}})["Events"]["events"]

    def err(self, request: object) -> str:
        reply = self.call(request)
        assert isinstance(reply, dict) and "Err" in reply, reply
        return reply["Err"]["message"]


def kind(event: dict) -> str:
    body = event["body"]
    return body if isinstance(body, str) else next(iter(body))


def committed(frames: list[dict]) -> list[dict]:
    return [f["committed"] for f in frames if "committed" in f]


def done(frames: list[dict]) -> dict:
    return next(f["done"] for f in frames if "done" in f)


def texts(events: list[dict], channel: int) -> str:
    return "".join(
        e["body"]["Generated"]["text"]
        for e in events
        if kind(e) == "Generated" and e["body"]["Generated"]["channel"] == channel
    )


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDaemon]:
    proc = WebDaemon(tmp_path_factory.mktemp("tools"), max_context=4096, max_batch=2).start()
    yield proc
    proc.stop()


@pytest.fixture
def web(daemon: WebDaemon) -> Web:
    return Web(daemon)


def force_call(web: Web, session: int) -> dict:
    """A generation constrained to one get_weather call; returns its ToolUse event."""
    frames = web.stream({"session": session, "max_tokens": 64, "tool": WEATHER})
    assert done(frames)["finish"] == 3
    uses = [e for e in committed(frames) if kind(e) == "ToolUse"]
    assert len(uses) == 1, frames
    return uses[0]


def test_a_fifty_turn_tool_session_survives_a_restart(tmp_path: Path) -> None:
    proc = WebDaemon(tmp_path, max_context=8192, max_batch=2).start()
    try:
        web = Web(proc)
        session = web.session("You are a weather assistant. Use the tools.", [WEATHER])
        calls: dict[int, dict] = {}
        for turn in range(1, 51):
            city = CITIES[turn % len(CITIES)]
            if turn % 2:
                web.say(session, f"What is the weather in {city} now?")
                frames = web.stream({"session": session, "max_tokens": 64, "tool": WEATHER})
                assert done(frames)["finish"] == 3
            else:
                frames = web.stream({"session": session, "max_tokens": 24, "grammar": PROSE})
            events = committed(frames)
            uses = [e for e in events if kind(e) == "ToolUse"]
            assert not [e for e in events if kind(e) == "ToolParseFailure"], events
            if turn % 2:
                assert len(uses) == 1 and isinstance(json.loads(uses[0]["body"]["ToolUse"]["arguments"])["city"], str)
            text = texts(events, 0)
            assert not any(marker in text for marker in MARKERS), text
            for use in uses:
                assert use["body"]["ToolUse"]["name"] == "get_weather"
                calls[use["event_id"]] = use["body"]["ToolUse"]
                args = json.loads(use["body"]["ToolUse"]["arguments"])
                result = web.call(
                    {
                        "AppendToolResult": {
                            "session": session,
                            "call_id": use["event_id"],
                            "content": f"{args}: sunny, 21 C",
                        }
                    }
                )
                assert result["Committed"]["event"]["body"]["ToolResult"]["call_id"] == use["event_id"]
        assert len(calls) >= 25
        ledger = web.call({"Ledger": {"session": session}})["Ledger"]["entries"]
        assert {call_id: (e["name"], e["arguments"], e["state"]) for call_id, e in ledger} == {
            call_id: (use["name"], use["arguments"], 2) for call_id, use in calls.items()
        }
        assert web.call({"OpenToolCalls": {"session": session}}) == {"ToolCalls": {"calls": []}}
        before = web.events(session)
        proc.kill()
        proc.start()
        web = Web(proc)
        after = web.events(session)
        assert after[: len(before)] == before and [kind(e) for e in after[len(before) :]] == ["EpochBump"]
        assert web.call({"Ledger": {"session": session}})["Ledger"]["entries"] == ledger
    finally:
        proc.stop()


def test_reasoning_lands_in_channel_one(web: Web) -> None:
    session = web.session()
    web.say(session, "What is two plus two?")
    web.call({"Append": {"session": session, "text": "<|im_start|>assistant\n<think>\n", "span": []}})
    full = "Two and two make four, I am sure of it.\n</think>\nThe answer is 4."
    grammar = f"root ::= {json.dumps(full)}"
    cut = web.stream({"session": session, "max_tokens": 4, "provisional": True, "grammar": grammar})
    assert done(cut)["finish"] == 2
    assert {e["body"]["Generated"]["channel"] for e in committed(cut) if kind(e) == "Generated"} == {1}
    so_far = texts(committed(cut), 1)
    assert full.startswith(so_far) and so_far
    rest_grammar = f"root ::= {json.dumps(full[len(so_far) :])}"
    rest = web.stream({"session": session, "max_tokens": 64, "provisional": True, "grammar": rest_grammar})
    events = committed(cut) + committed(rest)
    assert texts(events, 1) == "Two and two make four, I am sure of it.\n"
    assert texts(events, 0) == "\nThe answer is 4."
    provisional = [f["provisional"] for f in cut + rest if "provisional" in f]
    assert {p["channel"] for p in provisional} == {0, 1}
    assert not any(m in p["text"] for p in provisional for m in MARKERS)


def test_json_schema_and_grammar_constraints(web: Web) -> None:
    session = web.session()
    web.say(session, "How many legs does a spider have? Answer in JSON.")
    schema = {"type": "object", "properties": {"legs": {"type": "integer"}}, "required": ["legs"]}
    frames = web.stream({"session": session, "max_tokens": 40, "json_schema": schema})
    assert done(frames)["finish"] == 3
    answer = json.loads(texts(committed(frames), 0))
    assert isinstance(answer["legs"], int)
    bad = web.http.post(
        "/web/stream", json={"session": session, "max_tokens": 5, "grammar": "root ::= ("}, headers=web.headers
    )
    assert bad.status_code == 200 and bad.text.startswith('data: {"error":"the grammar does not parse')
    both = web.http.post(
        "/web/stream",
        json={"session": session, "max_tokens": 5, "grammar": 'root ::= "a"', "json_schema": schema},
        headers=web.headers,
    )
    assert (
        both.status_code == 422 and "give one constraint, not grammar and json_schema" in both.json()["Err"]["message"]
    )


def test_tool_bookkeeping_errors_and_ledger_states(web: Web) -> None:
    session = web.session("Use the tools.", [WEATHER])
    web.say(session, "Weather in Oslo?")
    first = force_call(web, session)["event_id"]
    assert web.call({"OpenToolCalls": {"session": session}})["ToolCalls"]["calls"][0][:2] == [first, "get_weather"]
    unknown = web.err({"AppendToolResult": {"session": session, "call_id": 999, "content": "x"}})
    assert unknown == "tool call 999 is unknown or already closed"
    child = web.call({"Fork": {"session": session, "at_event": len(web.events(session)), "params": None}})["Created"][
        "session"
    ]
    assert web.err({"AppendToolResult": {"session": child, "call_id": first, "content": "x"}}) == (
        f"tool call {first} belongs to an ancestor's timeline; only that session can close it"
    )
    assert web.err({"AppendToolOutcome": {"session": session, "call_id": first, "outcome": 7, "note": ""}}).startswith(
        "unknown tool outcome 7"
    )
    web.call({"RequestToolCancel": {"session": session, "call_id": first}})
    entry = dict(web.call({"Ledger": {"session": session}})["Ledger"]["entries"])[first]
    assert entry["state"] == 1 and entry["cancel_requested"] is True
    web.call({"AppendToolOutcome": {"session": session, "call_id": first, "outcome": 2, "note": "user stopped it"}})
    assert dict(web.call({"Ledger": {"session": session}})["Ledger"]["entries"])[first]["state"] == 4
    late = web.err({"AppendToolResult": {"session": session, "call_id": first, "content": "sunny"}})
    assert (
        late
        == f"tool call {first} already reached a terminal outcome; the late result was recorded as a reconciliation"
    )
    entry = dict(web.call({"Ledger": {"session": session}})["Ledger"]["entries"])[first]
    assert (entry["state"], entry["late_effects"]) == (6, 1)
    assert kind(web.events(session)[-1]) == "ToolReconciliation"

    web.say(session, "And in Lima?")
    second = force_call(web, session)["event_id"]
    web.call({"AppendToolResult": {"session": session, "call_id": second, "content": "cloudy"}})
    assert web.err({"AppendToolResult": {"session": session, "call_id": second, "content": "again"}}) == (
        f"tool call {second} is unknown or already closed"
    )
    web.say(session, "And in Perth?")
    third = force_call(web, session)["event_id"]
    web.call({"AppendToolOutcome": {"session": session, "call_id": third, "outcome": 1, "note": "network down"}})
    states = {call: e["state"] for call, e in web.call({"Ledger": {"session": session}})["Ledger"]["entries"]}
    assert states == {first: 6, second: 2, third: 3}


def test_permissions_hold_generation(web: Web) -> None:
    session = web.session()
    web.say(session, "Delete the files?")
    assert web.err({"RequestPermission": {"session": session, "call_id": 42, "text": "x"}}) == (
        "tool call 42 is unknown or already closed"
    )
    request = web.call({"RequestPermission": {"session": session, "call_id": 0, "text": "May I delete them?"}})
    request_id = request["Committed"]["event"]["event_id"]
    frames = web.stream({"session": session, "max_tokens": 4})
    assert frames == [{"error": f"session {session} has an open permission request; answer it before generating"}]
    web.call({"RespondPermission": {"session": session, "request_id": request_id, "granted": True}})
    assert web.err({"RespondPermission": {"session": session, "request_id": request_id, "granted": False}}) == (
        f"permission request {request_id} is unknown or already answered"
    )
    assert done(web.stream({"session": session, "max_tokens": 4, "ignore_eos": True}))["tokens_generated"] == 4


def test_blocks(web: Web) -> None:
    session = web.session()
    diff = {"path": "src/app.py", "diff": "-x = 1\n+x = 2"}
    block = web.call({"AppendBlock": {"session": session, "role": 1, "kind": 1, "payload": json.dumps(diff)}})
    body = block["Committed"]["event"]["body"]["Block"]
    assert body["kind"] == 1 and body["visibility_version"] == 2 and body["span"]
    assert (
        web.err({"AppendBlock": {"session": session, "role": 1, "kind": 9, "payload": "{}"}}) == "unknown block kind 9"
    )
    assert "is not JSON" in web.err({"AppendBlock": {"session": session, "role": 1, "kind": 2, "payload": "{"}})
    missing = web.err({"AppendBlock": {"session": session, "role": 1, "kind": 1, "payload": '{"path": "a"}'}})
    assert missing == "a file diff block needs path, diff; the payload lacks diff"
    assert "AppendImage" in web.err({"AppendBlock": {"session": session, "role": 1, "kind": 7, "payload": "{}"}})
    assert (
        web.err({"AppendBlock": {"session": session, "role": 5, "kind": 1, "payload": "{}"}})
        == "unknown message role 5"
    )
    frames = web.stream({"session": session, "max_tokens": 4, "ignore_eos": True})
    prompts = [e for e in web.events(session) if kind(e) == "GenerationPrompt"]
    assert prompts and done(frames)["tokens_generated"] == 4, "a block is an input turn: generation opens a reply"


def test_images_need_a_stored_blob_and_a_vision_model(web: Web) -> None:
    session = web.session()
    missing = "ab" * 32
    assert web.err(
        {"AppendImage": {"session": session, "role": 1, "blob": missing, "pre_text": "", "post_text": ""}}
    ) == (f"media blob {missing} is not in the pool (put it first)")
    digest = web.call({"PutMedia": {"bytes": list(b"\x89PNG not really"), "mime": "image/png"}})["Media"]["hash"]
    refusal = web.err({"AppendImage": {"session": session, "role": 1, "blob": digest, "pre_text": "", "post_text": ""}})
    assert "text-only model" in refusal and "cannot take images" in refusal
    assert web.events(session)[-1]["event_id"] == 0, "nothing was written"


def test_fill_in_the_middle(tmp_path: Path) -> None:
    proc = DaemonProcess(tmp_path, "--fim-tokens", "3,5,6", max_context=1024, max_batch=1).start()
    try:
        with proc.client() as c:
            first = c.call(Request.Complete("def add(a, b):\n    return ", "\n\nprint(add(1, 2))", 0, 8))
            assert isinstance(first, Response.Completion) and len(first.tokens) <= 8 and not first.cached
            longer = c.call(Request.Complete("def add(a, b):\n    return ", "\n\nprint(add(1, 2))", 0, 9))
            assert not longer.cached and longer.tokens[: len(first.tokens)] == first.tokens, "greedy infill is stable"
            again = c.call(Request.Complete("def add(a, b):\n    return ", "\n\nprint(add(1, 2))", 0, 8))
            assert again.cached and (again.text, again.tokens) == (first.text, first.tokens)
            spm = c.call(Request.Complete("def add(a, b):\n    return ", "\n\nprint(add(1, 2))", 1, 8))
            assert isinstance(spm, Response.Completion) and not spm.cached
            assert c.call(Request.Complete("x", "y", 5, 8)) == Response.Err(
                "unknown FIM mode 5 (0 prefix-suffix-middle, 1 suffix-prefix-middle)"
            )
            metrics = c.call(Request.Metrics()).text
            assert 'superfluid_fim_completions_total{result="cached"} 1.0' in metrics
    finally:
        proc.stop()
