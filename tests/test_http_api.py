"""The OpenAI, Anthropic and Ollama routes, driven by those vendors' own Python clients."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import anthropic
import httpx
import ollama
import openai
import pytest
from conftest import CITY_FUNCTION, HttpDaemon

pytestmark = pytest.mark.e2e

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    proc = HttpDaemon(tmp_path_factory.mktemp("api"), max_context=2048, max_batch=4).start()
    yield proc
    proc.stop()


@pytest.fixture
def oa(api: HttpDaemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused")


# end-of-generation banned: a reply of exactly max_tokens on every machine
FORCED = {"ignore_eos": True}
CITY_TOOL = {"type": "function", "function": CITY_FUNCTION}


def test_openai_chat_and_a_warm_second_turn(oa: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three rivers."}]
    first = oa.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=24, temperature=0, extra_body=FORCED
    )
    choice = first.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert first.usage.completion_tokens == 24 and first.usage.prompt_tokens > 0
    again = oa.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=24, temperature=0, extra_body=FORCED
    )
    assert again.choices[0].message.content == choice.message.content, "greedy is reproducible"
    messages += [{"role": "assistant", "content": choice.message.content}, {"role": "user", "content": "And one more?"}]
    second = oa.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1, "the history is cached"


def test_openai_streaming(oa: openai.OpenAI) -> None:
    stream = oa.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Tell me about the sea."}],
        max_tokens=16,
        temperature=0,
        stream=True,
        extra_body=FORCED,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = oa.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Tell me about the sea."}],
        max_tokens=16,
        temperature=0,
        extra_body=FORCED,
    )
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 16


def test_openai_stream_usage_apart_when_asked(oa: openai.OpenAI) -> None:
    stream = oa.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Tell me about the sea."}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=FORCED,
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8, "usage in a chunk of its own"
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-2].usage is None
    assert all(c.usage is None for c in chunks[:-1])


def test_openai_tool_calls_and_json(oa: openai.OpenAI) -> None:
    forced = oa.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Is it raining in Paris?"}],
        tools=[CITY_TOOL],
        tool_choice="required",
        max_tokens=64,
        temperature=0,
    )
    message = forced.choices[0].message
    assert forced.choices[0].finish_reason == "tool_calls" and not message.content
    call = message.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    answered = oa.chat.completions.create(
        model="smollm2",
        messages=[
            {"role": "user", "content": "Is it raining in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "Light rain, 14 C"},
        ],
        tools=[WEATHER],
        max_tokens=16,
        temperature=0,
    )
    assert answered.choices[0].finish_reason in ("length", "stop", "tool_calls")
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24}, "legs": {"type": "integer"}},
    }
    schema["required"] = ["name", "legs"]
    as_json = oa.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Describe a cat."}],
        response_format={"type": "json_schema", "json_schema": {"name": "cat", "schema": schema}},
        max_tokens=200,
        temperature=0,
    )
    assert as_json.choices[0].finish_reason == "stop"
    cat = json.loads(as_json.choices[0].message.content)
    assert isinstance(cat["name"], str) and isinstance(cat["legs"], int)


def test_openai_completions_stops_and_errors(oa: openai.OpenAI) -> None:
    completion = oa.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0, extra_body=FORCED
    )
    assert completion.usage.completion_tokens == 8 and completion.choices[0].finish_reason == "length"
    count = {"model": "smollm2", "messages": [{"role": "user", "content": "Count from 1 to 10."}], "temperature": 0}
    whole = oa.chat.completions.create(**count, max_tokens=32, extra_body=FORCED).choices[0].message.content
    stop = whole[len(whole) // 2 :][:2]  # two characters from the middle of this machine's reply
    at = whole.index(stop)
    stopped = oa.chat.completions.create(**count, max_tokens=32, stop=[stop], extra_body=FORCED).choices[0]
    assert stopped.message.content == whole[:at] and stopped.finish_reason == "stop"
    assert [m.id for m in oa.models.list().data] == ["SmolLM2-135M-Instruct"]
    with pytest.raises(openai.BadRequestError, match="maximum context length is 2048 tokens"):
        oa.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "word " * 3000}])
    with pytest.raises(openai.BadRequestError, match="messages"):
        oa.chat.completions.create(model="smollm2", messages="not a list")  # type: ignore[arg-type]


def test_anthropic_messages(api: HttpDaemon) -> None:
    client = anthropic.Anthropic(base_url=api.url, api_key="unused")
    reply = client.messages.create(
        model="smollm2",
        max_tokens=16,
        system="Be brief.",
        messages=[{"role": "user", "content": "Name a river."}],
        extra_body={"temperature": 0, **FORCED},
    )
    assert reply.content and reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 16
    with client.messages.stream(
        model="smollm2",
        max_tokens=16,
        system="Be brief.",
        messages=[{"role": "user", "content": "Name a river."}],
        extra_body={"temperature": 0, **FORCED},
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(b.text for b in reply.content if b.type == "text") and final.stop_reason == "max_tokens"
    tool_turn = client.messages.create(
        model="smollm2",
        max_tokens=12,
        tools=[{"name": "get_weather", "description": "weather", "input_schema": WEATHER["function"]["parameters"]}],
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Snow, -3 C"}]},
        ],
        extra_body={"temperature": 0},
    )
    assert tool_turn.stop_reason in ("max_tokens", "end_turn", "tool_use")


CITY_ANTHROPIC = {
    "name": CITY_FUNCTION["name"],
    "description": CITY_FUNCTION["description"],
    "input_schema": CITY_FUNCTION["parameters"],
}


def test_anthropic_tool_choice_forces_the_call_or_leaves_the_tools_out(api: HttpDaemon) -> None:
    client = anthropic.Anthropic(base_url=api.url, api_key="unused")
    question = [{"role": "user", "content": "Weather in Oslo?"}]
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "any"}):
        reply = client.messages.create(
            model="smollm2", max_tokens=64, tools=[CITY_ANTHROPIC], tool_choice=choice, messages=question
        )
        calls = [block for block in reply.content if block.type == "tool_use"]
        assert reply.stop_reason == "tool_use" and calls, (choice, reply)
        assert calls[0].name == "get_weather" and calls[0].input["city"] in ("Paris", "Oslo", "Lima")
    count = client.messages.count_tokens
    with_tools = count(model="smollm2", tools=[CITY_ANTHROPIC], messages=question).input_tokens
    without = count(model="smollm2", tools=[CITY_ANTHROPIC], tool_choice={"type": "none"}, messages=question)
    assert without.input_tokens == count(model="smollm2", messages=question).input_tokens < with_tools


def test_anthropic_structured_output_ends_on_its_schema(api: HttpDaemon) -> None:
    """`output_config.format`, which Claude Code sends to title a session: the reply is held to the schema."""
    schema = {**CITY_FUNCTION["parameters"], "additionalProperties": False}
    body = {
        "model": "smollm2",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "Which city is the capital of Norway?"}],
        "output_config": {"effort": "high", "format": {"type": "json_schema", "schema": schema}},
    }
    reply = httpx.post(f"{api.url}/v1/messages", json=body, timeout=120).json()
    assert reply["stop_reason"] == "end_turn", reply
    assert json.loads(reply["content"][0]["text"])["city"] in ("Paris", "Oslo", "Lima")
    wrong = {**body, "output_config": {"format": {"type": "xml"}}}
    refused = httpx.post(f"{api.url}/v1/messages", json=wrong, timeout=60)
    assert refused.status_code == 400 and "output_config.format" in refused.json()["error"]["message"]


def test_anthropic_what_claude_code_sends(api: HttpDaemon) -> None:
    """System entries inside messages, a billing block, cache_control breakpoints, and the cache they ask for."""
    client = anthropic.Anthropic(base_url=api.url, api_key="unused")
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.7d4; cc_entrypoint=cli;"},
        {"type": "text", "text": "You are a fastidious harbour master. " * 40, "cache_control": {"type": "ephemeral"}},
    ]
    first_turn = [
        {"type": "text", "text": "<reminder>Today is a Tuesday.</reminder>"},
        {"type": "text", "text": "Which ship came in?", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
    ]
    messages = [{"role": "user", "content": first_turn}, {"role": "system", "content": "Tools: none today."}]
    counted = client.messages.count_tokens(model="smollm2", system=system, messages=messages).input_tokens
    billed = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.a01;"}, system[1]]
    assert client.messages.count_tokens(model="smollm2", system=billed, messages=messages).input_tokens == counted
    cold = client.messages.create(model="smollm2", max_tokens=4, system=system, messages=messages)
    prompt = cold.usage.input_tokens + cold.usage.cache_read_input_tokens + cold.usage.cache_creation_input_tokens
    assert prompt == counted and cold.usage.cache_creation_input_tokens >= 0.8 * counted, cold.usage
    assert cold.usage.cache_read_input_tokens < 0.2 * counted, cold.usage
    warm = client.messages.create(model="smollm2", max_tokens=4, system=billed, messages=messages)
    assert warm.usage.cache_read_input_tokens >= 0.9 * counted and warm.usage.cache_creation_input_tokens == 0
    assert api.metric("superfluid_generation_warm_prefix_tokens_total") >= warm.usage.cache_read_input_tokens


def test_anthropic_refusals_are_in_anthropic_shape(api: HttpDaemon) -> None:
    client = anthropic.Anthropic(base_url=api.url, api_key="unused")
    question = [{"role": "user", "content": "Hi"}]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    refused = [
        ({"messages": question}, 400, "max_tokens"),  # no max_tokens
        ({"max_tokens": 4, "messages": question, "model": "no-such-model"}, 404, "not served here"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [image]}]}, 400, "text only"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "audio"}]}]}, 400, "accepted blocks"),
        ({"max_tokens": 4, "messages": question, "tool_choice": {"type": "tool"}}, 400, "tool_choice"),
        (
            {"max_tokens": 4, "messages": question, "tools": [{"type": "web_search_20250305", "name": "s"}]},
            400,
            "server",
        ),
    ]
    for body, status, words in refused:
        answer = httpx.post(f"{api.url}/v1/messages", json={"model": "smollm2", **body}, timeout=60)
        error = answer.json()
        assert answer.status_code == status and error["type"] == "error", (body, error)
        assert error["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
        assert words in error["error"]["message"], error
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=4, messages=question)


def test_ollama_chat_generate_and_tags(api: HttpDaemon) -> None:
    client = ollama.Client(host=api.url)
    options = {"temperature": 0, "num_predict": 12, **FORCED}
    reply = client.chat(model="smollm2", messages=[{"role": "user", "content": "Name a river."}], options=options)
    assert reply.done and reply.done_reason == "length" and reply.eval_count == 12
    streamed = "".join(
        part.message.content
        for part in client.chat(
            model="smollm2", messages=[{"role": "user", "content": "Name a river."}], options=options, stream=True
        )
    )
    assert streamed == reply.message.content
    generated = client.generate(model="smollm2", prompt="Name a river.", options=options)
    assert generated.done and generated.eval_count == 12
    served = [m["id"] for m in httpx.get(f"{api.url}/v1/models").json()["data"]]
    assert [m.model for m in client.list().models] == served, "listed under the id /v1/models gives"
    assert [m.model for m in client.ps().models] == served
    for manage in (lambda: client.delete("smollm2"), lambda: client.copy("a", "b")):  # pull: test_pull.py
        with pytest.raises(ollama.ResponseError, match="not served by superfluid") as refused:
            manage()
        assert refused.value.status_code == 501
    with pytest.raises(ollama.ResponseError, match="unsupported option: mirostat"):
        client.chat(model="smollm2", messages=[{"role": "user", "content": "x"}], options={"mirostat": 1})


def test_health_metrics_and_origin_checks(api: HttpDaemon) -> None:
    assert httpx.get(f"{api.url}/health").json()["status"] == "ok"
    assert "superfluid_requests_total" in httpx.get(f"{api.url}/metrics").text
    refused = httpx.get(f"{api.url}/v1/models", headers={"Origin": "http://evil.example"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "origin_refused"
    rebinding = httpx.get(f"{api.url}/v1/models", headers={"Host": "evil.example"})
    assert rebinding.status_code == 403
    assert httpx.get(f"{api.url}/v1/models", headers={"Origin": "http://localhost:5173"}).status_code == 200
    assert httpx.get(f"{api.url}/").text == "superfluid is running"


def _hang_up_when(api: HttpDaemon, path: str, body: dict, told: threading.Event) -> None:
    """A non-streaming request whose client closes its socket before the reply, once `told` (or after 10 s)."""
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    with socket.create_connection(("127.0.0.1", api.port)) as raw:
        raw.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
        told.wait(10)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"model": "smollm2", "max_tokens": 2000, "ignore_eos": True}),
        ("/v1/messages", {"model": "smollm2", "max_tokens": 2000, "ignore_eos": True}),
        ("/api/chat", {"model": "smollm2", "stream": False, "options": {"num_predict": 2000, "ignore_eos": True}}),
    ],
)
def test_a_non_streaming_client_that_hangs_up_frees_its_lane(api: HttpDaemon, path: str, body: dict) -> None:
    body = {**body, "messages": [{"role": "user", "content": "Write a very long story."}]}
    hang_up = threading.Event()
    clients = [threading.Thread(target=_hang_up_when, args=(api, path, body, hang_up)) for _ in range(4)]
    for client in clients:
        client.start()
    started = time.monotonic()
    while api.metric("superfluid_lanes_active") < 4 and time.monotonic() - started < 3.5:
        time.sleep(0.05)
    running = api.metric("superfluid_lanes_active")
    time.sleep(0.3)  # well into their 2,000 tokens
    hang_up.set()
    for client in clients:
        client.join()
    assert running == 4, "the four generations were running"
    hung_up = time.monotonic()
    while api.metric("superfluid_lanes_active") > 0 and time.monotonic() - hung_up < 5:
        time.sleep(0.05)
    assert time.monotonic() - hung_up < 1.0, "every lane is free within a second of the hang-up"
