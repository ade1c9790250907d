"""Each tool-call dialect end to end on the embedded model: the daemon serves a real family's chat
template (`--chat-template`), a required call makes the model write that family's markup under the
grammar, and every route returns it parsed, streamed and not; the tool's result goes back in and
the next turn renders and generates. What holds on every CPU: a grammar-forced call parses, with a
city from the tool's enum."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import CITY_FUNCTION, ENDS_TURN, FAMILY_TEMPLATES, TEMPLATES, HttpDaemon, free_port

from superfluid.model.dialects import named

pytestmark = pytest.mark.e2e

PARAMETERS = CITY_FUNCTION["parameters"]
CITIES = PARAMETERS["properties"]["city"]["enum"]
WEATHER = {"type": "function", "function": CITY_FUNCTION}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0, "seed": 1}
# room for a call written with markers the embedded model's vocabulary spells in pieces (Kimi's take ~100 tokens)
CALL_TOKENS = 192


class FamilyDaemon(HttpDaemon):
    """A daemon on one family's template, with the HTTP APIs and the browser's session API."""

    def __init__(self, root: Path, template: Path) -> None:
        self.web_port = free_port()
        super().__init__(
            root, "--chat-template", str(template), "--web", f"127.0.0.1:{self.web_port}", max_context=4096
        )
        self.http = httpx.Client(base_url=self.url, timeout=120)

    def post(self, path: str, body: dict) -> dict:
        """A reply that succeeds, as JSON."""
        reply = self.http.post(path, json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()

    def web_headers(self) -> dict[str, str]:
        token = (self.sessions / "web-token").read_text()
        return {"authorization": f"Bearer {token}", "x-superfluid-csrf": token}

    def rpc(self, body: object) -> dict:
        """A session API call that succeeds."""
        reply = self.http.post(f"http://127.0.0.1:{self.web_port}/web/rpc", json=body, headers=self.web_headers())
        assert reply.status_code == 200 and "Err" not in reply.json(), reply.text
        return reply.json()

    def generate(self, body: dict) -> list[dict]:
        """The frames of one session API generation."""
        url = f"http://127.0.0.1:{self.web_port}/web/stream"
        with self.http.stream("POST", url, json=body, headers=self.web_headers()) as response:
            return sse(response)


def sse(response: httpx.Response) -> list[dict]:
    """The JSON data lines of a server-sent event stream."""
    assert response.status_code == 200, response.read()
    lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def stream(daemon: FamilyDaemon, path: str, body: dict) -> list[dict]:
    with daemon.http.stream("POST", path, json={**body, "stream": True}) as response:
        return sse(response)


@pytest.fixture(params=list(FAMILY_TEMPLATES), ids=list(FAMILY_TEMPLATES))
def family(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, FamilyDaemon]]:
    daemon = FamilyDaemon(tmp_path, TEMPLATES / FAMILY_TEMPLATES[request.param]).start()
    try:
        yield request.param, daemon
    finally:
        daemon.stop()


def no_markup(name: str, text: str | None) -> None:
    dialect = named(name)
    markup = [m.open for m in dialect.markers if len(m.open) > 1] + [m.close for m in dialect.markers if m.close]
    assert not any(m in (text or "") for m in markup), (name, text)


def city_of(arguments: str | dict) -> str:
    parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert set(parsed) == {"city"} and parsed["city"] in CITIES, parsed
    return parsed["city"]


def test_a_family_calls_on_every_route(family: tuple[str, FamilyDaemon]) -> None:
    name, daemon = family
    assert f"in the {name} dialect" in daemon.log.read_text()
    model = daemon.http.get("/v1/models").json()["data"][0]["id"]
    chat = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": CALL_TOKENS, **GREEDY}

    # OpenAI chat, whole and streamed: the same call
    reply = daemon.post("/v1/chat/completions", chat)
    message = reply["choices"][0]["message"]
    assert reply["choices"][0]["finish_reason"] == "tool_calls", reply
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"]
    city = city_of(call["function"]["arguments"])
    no_markup(name, message.get("content"))
    deltas = [c["choices"][0]["delta"] for c in stream(daemon, "/v1/chat/completions", chat) if c["choices"]]
    pieces = [piece for d in deltas for piece in d.get("tool_calls", [])]
    assert {p["index"] for p in pieces} == {0} and pieces[0]["function"]["name"] == "get_weather"
    assert city_of("".join(p["function"].get("arguments", "") for p in pieces)) == city
    no_markup(name, "".join(d.get("content") or "" for d in deltas))

    # the call and its result go back in; the next turn renders and generates
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": f"Sunny in {city}, 21 C"},
    ]
    after = daemon.post(
        "/v1/chat/completions",
        {"messages": history, "tools": [WEATHER], "max_tokens": 4, "ignore_eos": True, **GREEDY},
    )
    assert after["usage"]["completion_tokens"] == 4, after
    assert after["usage"]["prompt_tokens"] > reply["usage"]["prompt_tokens"]

    # Anthropic: a tool_use block, whole and streamed
    anthropic = {
        "model": model,
        "max_tokens": CALL_TOKENS,
        "messages": ASK,
        "tools": [{"name": "get_weather", "description": "weather", "input_schema": PARAMETERS}],
        "tool_choice": {"type": "any"},
        **GREEDY,
    }
    message = daemon.post("/v1/messages", anthropic)
    uses = [block for block in message["content"] if block["type"] == "tool_use"]
    assert message["stop_reason"] == "tool_use" and len(uses) == 1 and uses[0]["name"] == "get_weather", message
    assert city_of(uses[0]["input"]) == city
    no_markup(name, "".join(block.get("text", "") for block in message["content"]))
    events = stream(daemon, "/v1/messages", anthropic)
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [b["name"] for b in starts if b["type"] == "tool_use"] == ["get_weather"]
    partial = "".join(
        e["delta"]["partial_json"] for e in events if e.get("delta", {}).get("type") == "input_json_delta"
    )
    assert city_of(partial) == city

    # Responses: a function_call item
    response = daemon.post(
        "/v1/responses",
        {
            "input": ASK[0]["content"],
            "tools": [{"type": "function", "name": "get_weather", "parameters": PARAMETERS}],
            "tool_choice": "required",
            "max_output_tokens": CALL_TOKENS,
            **GREEDY,
        },
    )
    items = [item for item in response["output"] if item["type"] == "function_call"]
    assert len(items) == 1 and items[0]["name"] == "get_weather", response
    assert city_of(items[0]["arguments"]) == city

    # Ollama: tool_calls on the message
    ollama = daemon.post(
        "/api/chat",
        {
            "model": model,
            "messages": ASK,
            "tools": [WEATHER],
            "tool_choice": "required",
            "stream": False,
            "options": {"temperature": 0, "seed": 1, "num_predict": CALL_TOKENS},
        },
    )
    (called,) = ollama["message"]["tool_calls"]
    assert called["function"]["name"] == "get_weather" and city_of(called["function"]["arguments"]) == city
    no_markup(name, ollama["message"]["content"])

    # the session API: a ToolUse event, its result appended, and a next turn
    params = {"temperature": 0.0, "top_p": 1.0, "min_p": 0.0, "top_k": 0, "seed": 0}
    session = daemon.rpc({"Create": {"parent": None, "params": params}})["Created"]["session"]
    daemon.rpc({"AppendSystem": {"session": session, "text": "Use the tools.", "tools": [json.dumps(WEATHER)]}})
    daemon.rpc({"AppendMessage": {"session": session, "role": 1, "text": ASK[0]["content"]}})
    frames = daemon.generate({"session": session, "max_tokens": CALL_TOKENS, "tool": WEATHER})
    events = [f["committed"] for f in frames if "committed" in f]
    uses = [e for e in events if isinstance(e["body"], dict) and "ToolUse" in e["body"]]
    assert len(uses) == 1 and uses[0]["body"]["ToolUse"]["name"] == "get_weather", frames
    city_of(uses[0]["body"]["ToolUse"]["arguments"])
    generated = [e["body"]["Generated"] for e in events if isinstance(e["body"], dict) and "Generated" in e["body"]]
    no_markup(name, "".join(g["text"] for g in generated if g["channel"] == 0))
    result = {"session": session, "call_id": uses[0]["event_id"], "content": "Sunny, 21 C"}
    daemon.rpc({"AppendToolResult": result})
    frames = daemon.generate({"session": session, "max_tokens": 64, "grammar": ENDS_TURN})
    assert frames[-1]["done"]["finish"] == 3, frames[-1]


def test_a_reply_that_looks_like_a_call_but_is_none_comes_back_as_text(tmp_path: Path) -> None:
    """Llama 3 writes a call as a bare JSON object; a JSON answer with no name is not one, and is the reply's text."""
    daemon = FamilyDaemon(tmp_path, TEMPLATES / FAMILY_TEMPLATES["llama3"]).start()
    try:
        schema = {"type": "object", "properties": {"answer": {"enum": ["yes"]}}, "required": ["answer"]}
        body = {
            "messages": ASK,
            "max_tokens": 32,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
            **GREEDY,
        }
        reply = daemon.post("/v1/chat/completions", body)["choices"][0]
        assert json.loads(reply["message"]["content"]) == {"answer": "yes"} and not reply["message"].get("tool_calls")
        assert reply["finish_reason"] == "stop"
        assert "a llama3 tool call that does not parse, kept as text" in daemon.log.read_text()
    finally:
        daemon.stop()
