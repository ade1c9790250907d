"""The Responses API (/v1/responses), driven by the official `openai` client's `client.responses`.

Every assertion holds on any machine: forced lengths (`ignore_eos`), the same request
giving the same text, forced tool calls, and what the daemon reports about its cache.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from conftest import CITY, CITY_FUNCTION, HttpDaemon, openai_at

from superfluid.protocol.schema import Request

pytestmark = pytest.mark.e2e

# end-of-generation banned: a reply of exactly max_output_tokens on every machine
FORCED = {"ignore_eos": True}
WEATHER = {"type": "function", **CITY_FUNCTION}  # the Responses API's flat function tool


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    proc = HttpDaemon(tmp_path_factory.mktemp("responses"), max_context=2048, max_batch=4).start()
    yield proc
    proc.stop()


@pytest.fixture
def oa(api: HttpDaemon) -> openai.OpenAI:
    return openai_at(api.url)


def forced(oa: openai.OpenAI, tokens: int, **fields: object) -> openai.types.responses.Response:
    """A response of exactly `tokens` tokens, greedy."""
    return oa.responses.create(model="smollm2", max_output_tokens=tokens, temperature=0, extra_body=FORCED, **fields)


def ended(oa: openai.OpenAI, **fields: object) -> openai.types.responses.Response:
    """A greedy response whose turn ends normally on every machine: a city in JSON."""
    reply = oa.responses.create(model="smollm2", text={"format": CITY}, temperature=0, max_output_tokens=64, **fields)
    assert reply.status == "completed" and json.loads(reply.output_text)["city"] in ("Paris", "Oslo")
    return reply


def parent_of(daemon: HttpDaemon, child: str, parent: str) -> bool:
    """Whether the session of response `child` was forked from the session of response `parent`."""
    sessions = [
        json.loads((daemon.sessions / "responses" / f"{i}.json").read_text())["session"] for i in (child, parent)
    ]
    with daemon.client() as sf:
        tree = {node: (up, at) for node, up, at in sf.call(Request.Tree()).nodes}
    return tree[sessions[0]][0] == sessions[1]


def test_create_and_a_forced_length(oa: openai.OpenAI) -> None:
    reply = forced(oa, 12, input="Name three rivers.", instructions="Be brief.", metadata={"run": "1"})
    assert reply.id.startswith("resp_") and len(reply.id) == len("resp_") + 32
    assert reply.object == "response" and reply.model == "smollm2" and reply.metadata == {"run": "1"}
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == 12 and reply.usage.input_tokens > 0
    assert reply.usage.total_tokens == reply.usage.input_tokens + 12
    assert reply.usage.output_tokens_details.reasoning_tokens == 0
    (message,) = reply.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and reply.output_text
    again = forced(oa, 12, input="Name three rivers.", instructions="Be brief.")
    assert again.output_text == reply.output_text, "greedy is reproducible"
    assert again.id != reply.id


def test_streaming_events_in_order(oa: openai.OpenAI, api: HttpDaemon) -> None:
    events = list(forced(oa, 10, input="Tell me about the sea.", stream=True))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text == events[-4].text
    assert final.usage.output_tokens == 10 and final.status == "incomplete"
    assert oa.responses.retrieve(final.id).output_text == text, "a streamed response is stored"
    unary = forced(oa, 10, input="Tell me about the sea.")
    assert unary.output_text == text, "streaming changes nothing of the text"
    body = {"model": "smollm2", "input": "Hi", "max_output_tokens": 3, "stream": True, **FORCED}
    raw = httpx.post(f"{api.url}/v1/responses", json=body, timeout=120).text
    assert raw.startswith("event: response.created\ndata: {") and "[DONE]" not in raw


def test_a_chain_continues_warm(oa: openai.OpenAI, api: HttpDaemon) -> None:
    question = "Which city is the capital of France? Answer in JSON."
    first = ended(oa, input=question, instructions="Be brief.")
    second = forced(oa, 8, input="And one more?", instructions="Be brief.", previous_response_id=first.id)
    assert second.previous_response_id == first.id and second.usage.output_tokens == 8
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached > 0
    # the session is forked after the first turn: all of it, the reply included, is cached
    assert parent_of(api, second.id, first.id)
    assert cached >= first.usage.total_tokens - 1
    assert second.usage.input_tokens > first.usage.total_tokens
    # other instructions: the conversation is rendered anew from the stored items, without the old ones
    rebuilt = forced(oa, 8, input="And one more?", instructions="Answer in French.", previous_response_id=first.id)
    assert rebuilt.instructions == "Answer in French." and not parent_of(api, rebuilt.id, first.id)
    assert rebuilt.usage.input_tokens > first.usage.input_tokens, "the earlier turn is in the prompt"
    again = forced(oa, 8, input="And one more?", instructions="Answer in French.", previous_response_id=first.id)
    assert again.output_text == rebuilt.output_text
    # a turn cut by max_output_tokens is not continued in place either
    cut = forced(oa, 8, input="And another?", previous_response_id=second.id, instructions="Be brief.")
    assert cut.status == "incomplete" and not parent_of(api, cut.id, second.id)


def test_a_function_tool_round_trip(oa: openai.OpenAI, api: HttpDaemon) -> None:
    asked = oa.responses.create(
        model="smollm2",
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
    )
    assert asked.status == "completed"
    (call,) = asked.output
    assert call.type == "function_call" and call.name == "get_weather" and call.id.startswith("fc_")
    assert json.loads(call.arguments)["city"] in ("Paris", "Oslo", "Lima") and call.call_id
    answered = forced(
        oa,
        8,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"celsius": 18})}],
        tools=[WEATHER],
        previous_response_id=asked.id,
    )
    assert answered.status == "incomplete" and answered.usage.output_tokens == 8 and answered.output
    assert parent_of(api, answered.id, asked.id), "the output is appended to the forked session"
    assert answered.usage.input_tokens_details.cached_tokens >= asked.usage.total_tokens - 1
    (item,) = oa.responses.input_items.list(answered.id)
    assert item.type == "function_call_output" and item.call_id == call.call_id


def test_a_forced_call_streams(oa: openai.OpenAI) -> None:
    events = list(
        oa.responses.create(
            model="smollm2",
            input="What is the weather in Oslo?",
            tools=[WEATHER],
            tool_choice="required",
            temperature=0,
            stream=True,
        )
    )
    types = [e.type for e in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[3].delta == events[4].arguments == events[-1].response.output[0].arguments


def test_stored_records_input_items_and_delete(oa: openai.OpenAI) -> None:
    inputs = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Name a river."}]},
    ]
    reply = forced(oa, 6, input=inputs)
    stored = oa.responses.retrieve(reply.id)
    assert stored.output_text == reply.output_text and stored.usage == reply.usage
    items = list(oa.responses.input_items.list(reply.id, order="asc"))
    assert [(i.role, i.content[0].text) for i in items] == [("developer", "Be brief."), ("user", "Name a river.")]
    assert [i.id for i in oa.responses.input_items.list(reply.id)] == [i.id for i in reversed(items)]
    oa.responses.delete(reply.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(reply.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.delete(reply.id)
    with pytest.raises(openai.NotFoundError):
        forced(oa, 4, input="More?", previous_response_id=reply.id)
    unstored = forced(oa, 4, input="Hi", store=False)
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(unstored.id)


def test_refusals(oa: openai.OpenAI) -> None:
    refused = [
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "unsupported_tool"),
        ({"background": True}, "unsupported_parameter"),
        ({"conversation": "conv_1"}, "unsupported_parameter"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "unsupported_parameter"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]},
            "unsupported_parameter",
        ),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "invalid_request_error"),
    ]
    for fields, code in refused:
        body = {"model": "smollm2", "input": "Hi", **fields}
        with pytest.raises(openai.BadRequestError) as caught:
            oa.responses.create(**body)
        assert caught.value.code == code, (fields, caught.value)
    with pytest.raises(openai.BadRequestError):
        oa.responses.cancel(forced(oa, 2, input="Hi").id)


def test_a_record_survives_a_restart_and_belongs_to_its_key(tmp_path: Path) -> None:
    policy = tmp_path / "keys.json"
    policy.write_text(json.dumps({"keys": [{"name": "alice", "key": "alice-key"}, {"name": "bob", "key": "bob-key"}]}))
    daemon = HttpDaemon(tmp_path, "--key-policy", str(policy), max_context=1024, max_batch=2).start()

    def as_(key: str) -> openai.OpenAI:
        return openai_at(daemon.url, api_key=key)

    try:
        first = ended(as_("alice-key"), input="Which city is the capital of France? Answer in JSON.")
        daemon.stop()
        daemon.start()
        alice, bob = as_("alice-key"), as_("bob-key")
        assert alice.responses.retrieve(first.id).output_text == first.output_text
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            forced(bob, 4, input="Another?", previous_response_id=first.id)
        second = forced(alice, 4, input="Another?", previous_response_id=first.id)
        assert second.status == "incomplete" and second.usage.input_tokens > first.usage.total_tokens
        assert parent_of(daemon, second.id, first.id), "the stored session is forked after a restart too"
    finally:
        daemon.stop()


def test_namespace_tools_are_served_and_web_search_is_left_out(api: HttpDaemon) -> None:
    """What Codex declares: functions grouped in a namespace, and a web search only OpenAI runs."""
    namespace = {"type": "namespace", "name": "weather_v1", "description": "Weather tools", "tools": [WEATHER]}
    body = {
        "model": "smollm2",
        "input": "What is the weather in Oslo?",
        "tools": [{"type": "web_search", "external_web_access": False}, namespace],
        "tool_choice": "required",
        "temperature": 0,
    }
    asked = httpx.post(f"{api.url}/v1/responses", json=body, timeout=120)
    assert asked.status_code == 200, asked.text
    (call,) = asked.json()["output"]
    assert (call["type"], call["name"], call["namespace"]) == ("function_call", "get_weather", "weather_v1")
    assert json.loads(call["arguments"])["city"] in ("Paris", "Oslo", "Lima")
    history = [
        {"role": "user", "content": "What is the weather in Oslo?"},
        {k: call[k] for k in ("type", "call_id", "name", "namespace", "arguments")},
        {"type": "function_call_output", "call_id": call["call_id"], "output": '{"celsius": -3}'},
    ]
    answered = httpx.post(
        f"{api.url}/v1/responses",
        json={**body, "input": history, "tool_choice": "auto", "max_output_tokens": 4, "store": False},
        timeout=120,
    )
    assert answered.status_code == 200, answered.text
    # the earlier call is rendered under the name the model was offered: its prompt is served warm
    assert (
        answered.json()["usage"]["input_tokens_details"]["cached_tokens"] > asked.json()["usage"]["input_tokens"] // 2
    )
    bad = {**namespace, "tools": [{"type": "web_search"}]}
    refused = httpx.post(f"{api.url}/v1/responses", json={**body, "tools": [bad]}, timeout=60)
    assert refused.status_code == 400 and "namespace holds function tools" in refused.json()["error"]["message"]
