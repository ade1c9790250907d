"""The OpenAI chat extras agents send (n, logprobs, logit bias, penalties, template variables,
warm prefix on streams), through the official `openai` client where it can say them.

Every assertion is a property that holds on any CPU: greedy text differs between machines,
so a test compares a reply with another reply, never with a wording.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from conftest import HttpDaemon

from superfluid.engine.llama import LlamaModel
from superfluid.model.resolve import embedded_model
from superfluid.model.template import ChatTemplate

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "Tell me about the sea."}]
FORCED = {"ignore_eos": True}  # end-of-generation banned: exactly max_tokens tokens on every machine


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    proc = HttpDaemon(tmp_path_factory.mktemp("extras"), max_context=2048, max_batch=4).start()
    yield proc
    proc.stop()


@pytest.fixture
def oa(api: HttpDaemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused")


@pytest.fixture(scope="module")
def vocab() -> LlamaModel:
    return LlamaModel(embedded_model().path, vocab_only=True)


def token_ids(vocab: LlamaModel, entries: list) -> list[int]:
    """The ids of a reply's tokens, from the bytes its logprobs give each one."""
    return [vocab.pieces.index(bytes(entry.bytes)) for entry in entries]


def test_n_choices_are_independent_generations(oa: openai.OpenAI) -> None:
    greedy = oa.chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=8, temperature=0, n=3, extra_body=FORCED
    )
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.message.content for c in greedy.choices}) == 1, "greedy choices are the same reply"
    assert greedy.usage.completion_tokens == 3 * 8
    sampled = oa.chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=8, temperature=1, seed=41, n=2, extra_body=FORCED
    )
    assert [c.index for c in sampled.choices] == [0, 1]
    # choice i samples with seed + i: each is the one-choice reply of its seed
    for index, choice in enumerate(sampled.choices):
        alone = oa.chat.completions.create(
            model="smollm2", messages=QUESTION, max_tokens=8, temperature=1, seed=41 + index, extra_body=FORCED
        )
        assert alone.choices[0].message.content == choice.message.content


def test_several_choices_do_not_stream(oa: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        oa.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=4, n=2, stream=True)
    assert refused.value.body["code"] == "unsupported_parameter" and refused.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError):
        oa.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=4, n=129)


def test_logprobs_describe_the_greedy_reply(oa: openai.OpenAI) -> None:
    reply = oa.chat.completions.create(
        model="smollm2",
        messages=QUESTION,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body=FORCED,
    )
    choice = reply.choices[0]
    entries = choice.logprobs.content
    assert entries, "a reply's tokens come with their log probabilities"
    assert "".join(e.token for e in entries) == choice.message.content
    for entry in entries:
        assert entry.logprob <= 0.0
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        # greedy draws the most probable token
        assert entry.top_logprobs[0].bytes == entry.bytes and entry.top_logprobs[0].logprob == entry.logprob
    plain = oa.chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=12, temperature=0, extra_body=FORCED
    )
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == choice.message.content, "asking for logprobs changes no token"


def test_streamed_logprobs_follow_the_streamed_text(oa: openai.OpenAI) -> None:
    stream = oa.chat.completions.create(
        model="smollm2",
        messages=QUESTION,
        max_tokens=12,
        temperature=0,
        stream=True,
        logprobs=True,
        top_logprobs=2,
        extra_body=FORCED,
    )
    text, tokens = "", ""
    for chunk in stream:
        choice = chunk.choices[0]
        if choice.delta.content:
            text += choice.delta.content
            assert choice.logprobs is not None and choice.logprobs.content
            tokens += "".join(e.token for e in choice.logprobs.content)
            assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
    assert text and tokens == text


def test_a_banned_first_token_never_starts_the_reply(oa: openai.OpenAI, vocab: LlamaModel) -> None:
    def first_tokens(extra_body: dict = FORCED, **fields: object) -> list[int]:
        reply = oa.chat.completions.create(
            model="smollm2", messages=QUESTION, max_tokens=3, logprobs=True, extra_body=extra_body, **fields
        )
        return [token_ids(vocab, c.logprobs.content)[0] for c in reply.choices]

    [greedy_first] = first_tokens(temperature=0)
    ban = {str(greedy_first): -100}
    [banned_greedy] = first_tokens(temperature=0, logit_bias=ban)
    assert banned_greedy != greedy_first
    # sampled from the whole vocabulary, hot: the banned token has no chance at all
    sampled = first_tokens(temperature=1.5, seed=7, n=6, logit_bias=ban, extra_body={**FORCED, "top_k": 0})
    assert greedy_first not in sampled


@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
def test_a_huge_penalty_never_repeats_a_token(oa: openai.OpenAI, vocab: LlamaModel, penalty: str) -> None:
    # a drawn token loses 1000 from its logit: far more than any two logits of the model are apart
    reply = oa.chat.completions.create(
        model="smollm2",
        messages=QUESTION,
        max_tokens=40,
        temperature=0,
        logprobs=True,
        extra_body=FORCED,
        **{penalty: 1000.0},
    )
    ids = token_ids(vocab, reply.choices[0].logprobs.content)
    assert reply.usage.completion_tokens == 40
    assert len(ids) == len(set(ids)), "no token twice"


def test_penalised_sampling_is_reproducible(oa: openai.OpenAI) -> None:
    body = {
        "model": "smollm2",
        "messages": QUESTION,
        "max_tokens": 24,
        "temperature": 0.9,
        "seed": 1234,
        "presence_penalty": 0.6,
        "frequency_penalty": 0.4,
        "logit_bias": {"28": 2.5, "30": -100},
    }
    first = oa.chat.completions.create(**body, extra_body={"repeat_penalty": 1.3, **FORCED})
    again = oa.chat.completions.create(**body, extra_body={"repetition_penalty": 1.3, **FORCED})
    assert first.choices[0].message.content == again.choices[0].message.content
    assert first.usage.completion_tokens == 24


def test_template_variables_are_accepted(oa: openai.OpenAI) -> None:
    plain = oa.chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=8, temperature=0, extra_body=FORCED
    )
    # the embedded model's template reads neither switch: the prompt, and so the reply, is unchanged
    switched = oa.chat.completions.create(
        model="smollm2",
        messages=QUESTION,
        max_tokens=8,
        temperature=0,
        reasoning_effort="minimal",
        extra_body={**FORCED, "chat_template_kwargs": {"enable_thinking": False}, "enable_thinking": True},
    )
    assert switched.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError):
        oa.chat.completions.create(
            model="smollm2", messages=QUESTION, max_tokens=2, extra_body={"chat_template_kwargs": {"messages": []}}
        )


def test_a_thinking_template_turns_thinking_off_for_no_effort(vocab: LlamaModel) -> None:
    source = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
    )
    template = ChatTemplate(source, vocab.tokenize)

    def opener(variables: dict) -> str:
        return vocab.detokenize(template.conversation(QUESTION, None, variables)[1], special=True)

    assert "<think>" not in opener({})
    assert "<think>" in opener({"enable_thinking": False})
    assert "<think>" in opener({"reasoning_effort": "none"})
    assert "<think>" not in opener({"reasoning_effort": "high"})


def stream_frames(api: HttpDaemon, body: dict) -> tuple[httpx.Headers, list[dict]]:
    frames = []
    with httpx.stream("POST", f"{api.url}/v1/chat/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: "):
                frames.append(line[len("data: ") :])
    assert frames[-1] == "[DONE]"
    return reply.headers, [json.loads(f) for f in frames[:-1]]


def test_a_second_turn_streams_warm(api: HttpDaemon) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three rivers."}]
    body = {"model": "smollm2", "messages": messages, "max_tokens": 6, "temperature": 0, "stream": True, **FORCED}
    _, first = stream_frames(api, body)
    said = "".join(f["choices"][0]["delta"].get("content") or "" for f in first)
    messages = [*messages, {"role": "assistant", "content": said}, {"role": "user", "content": "And one more?"}]
    headers, second = stream_frames(api, {**body, "messages": messages})
    last = second[-1]
    assert last["superfluid"]["warm"] > 0
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == last["superfluid"]["warm"]
    assert int(headers["x-superfluid-warm"]) == last["superfluid"]["warm"]


def test_a_worker_killed_mid_stream_ends_it_with_an_error_chunk(api: HttpDaemon) -> None:
    models = httpx.get(f"{api.url}/v1/models").json()["data"]
    pid = next(m["runtime"]["worker_pid"] for m in models if m["default"])
    body = {"model": "smollm2", "messages": QUESTION, "max_tokens": 1500, "temperature": 0, "stream": True, **FORCED}
    frames = []
    with httpx.stream("POST", f"{api.url}/v1/chat/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            frames.append(line[len("data: ") :])
            if len(frames) == 3:  # the reply is under way
                os.kill(pid, signal.SIGKILL)
    assert frames[-1] == "[DONE]"
    error = json.loads(frames[-2])["error"]
    assert "worker" in error["message"] and error["code"] == "server_error"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # a new worker serves the next request
        again = httpx.post(f"{api.url}/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2})
        if again.status_code == 200:
            break
        time.sleep(0.2)
    assert again.status_code == 200


def test_a_reply_that_ends_like_the_start_of_a_marker_keeps_its_end(oa: openai.OpenAI, vocab: LlamaModel) -> None:
    # "<" could open <think> or <tool_call>, so the splitter holds it back until the next token;
    # at the end of a reply there is none, and what it held must still reach the client
    (angle,) = vocab.tokenize("<", False)
    for stream in (False, True):
        reply = oa.chat.completions.create(
            model="smollm2",
            messages=QUESTION,
            max_tokens=4,
            temperature=0,
            logit_bias={str(angle): 100},  # outweighs every other logit: each token drawn is "<"
            extra_body=FORCED,
            stream=stream,
        )
        text = (
            "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
            if stream
            else reply.choices[0].message.content
        )
        assert text == "<<<<", (stream, text)
