"""Every tool-call and reasoning dialect, read back from its own markup cut into streamed pieces
at every byte: the same calls, arguments, reasoning and text come out, and no markup leaks."""

from __future__ import annotations

import json

import pytest
from conftest import CITY_FUNCTION, FAMILY_TEMPLATES, TEMPLATES

from superfluid.engine.grammar import Grammar, tool_call_grammar
from superfluid.engine.llama import LlamaModel
from superfluid.model.channels import ChannelSplitter
from superfluid.model.dialects import DIALECTS, HARMONY, HERMES, LLAMA3, Dialect, named, recognise, table
from superfluid.model.dialects.parse import gemma_to_json
from superfluid.model.resolve import embedded_model
from superfluid.model.template import ChatTemplate
from superfluid.protocol.schema import CHANNEL_REASONING, CHANNEL_TEXT, CHANNEL_TOOL_CALL

CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("read_file", {"path": "/tmp/ü.txt", "lines": [1, 2]})]

# the reasoning, text and calls of one reply as each dialect's model writes it
REASONING = "The user wants weather; I should call it."


def reply_of(dialect: Dialect, calls: list[tuple[str, dict]]) -> tuple[str, str, str]:
    """What the model writes after the generation prompt, the prompt's own tail to prime with, and
    the reply's text."""
    if dialect is HARMONY:
        analysis = f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant"
        return analysis + dialect.write(calls), "<|start|>assistant", ""
    think = dialect.reasoning[0]
    preamble = "" if any(m.leading for m in dialect.calls) else "Let me check. "
    return f"{think.open}{REASONING}{think.close}{preamble}{dialect.write(calls)}", "", preamble


def split(dialect: Dialect, pieces: list[bytes], prime: str = "") -> tuple[str, str, list[tuple[str, dict]]]:
    """Text, reasoning and calls of a reply streamed as `pieces` (each a token)."""
    vocabulary = [prime.encode(), *pieces]
    splitter = ChannelSplitter(vocabulary, dialect.markers)
    if prime:
        splitter.prime([0])
    text, reasoning, calls = "", "", []

    def take(out) -> None:
        nonlocal text, reasoning
        for piece in out:
            if piece.channel == CHANNEL_TEXT:
                text += piece.text
            elif piece.channel == CHANNEL_REASONING:
                reasoning += piece.text
            if piece.call is not None:
                parsed = dialect.parse(piece.call)
                assert parsed is not None, piece.call
                calls.extend((c.name, json.loads(c.arguments)) for c in parsed)

    for token in range(1, len(vocabulary)):
        take(splitter.feed(token))
    take(splitter.flush())
    if splitter.channel == CHANNEL_TOOL_CALL:
        parsed = dialect.parse(splitter.call_text)
        assert parsed is not None, splitter.call_text
        calls.extend((c.name, json.loads(c.arguments)) for c in parsed)
    return text, reasoning, calls


@pytest.mark.parametrize("dialect", DIALECTS, ids=lambda d: d.name)
def test_every_byte_cut_gives_the_same_calls_and_leaks_no_markup(dialect: Dialect) -> None:
    calls = CALLS[:1] if dialect is LLAMA3 else CALLS  # Llama 3 writes one call per reply
    written, prime, want_text = reply_of(dialect, calls)
    data = written.encode()
    whole = split(dialect, [bytes([b]) for b in data], prime)
    assert (whole[0].strip(), *whole[1:]) == (want_text.strip(), REASONING, calls), written
    for cut in range(1, len(data)):
        assert split(dialect, [data[:cut], data[cut:]], prime) == whole, (dialect.name, cut)


def test_harmony_final_answer_and_preamble_are_text_without_headers() -> None:
    written = (
        "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>Hello there.<|return|>"
    )
    data = written.encode()
    for cut in range(1, len(data)):
        text, reasoning, calls = split(HARMONY, [data[:cut], data[cut:]], "<|start|>assistant")
        assert (text, reasoning, calls) == ("Hello there.", "think", []), cut
    # the other header order: the recipient after the channel
    other = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>'
    assert split(HARMONY, [bytes([b]) for b in other.encode()], "<|start|>assistant")[2] == [
        ("get_weather", {"city": "Paris"})
    ]


def test_llama3_bare_json_opens_a_call_only_before_any_text() -> None:
    prose = 'Use {"name": "x"} as the key.'
    assert split(LLAMA3, [bytes([b]) for b in prose.encode()]) == (prose, "", [])
    tagged = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert split(LLAMA3, [tagged.encode()])[2] == [("get_weather", {"city": "Oslo"})]


def test_hermes_repairs_what_is_safe_and_refuses_a_call_without_a_name() -> None:
    assert HERMES.parse('<tool_call>\n```json\n{"name": "f", "arguments": {"a": 1,},}\n```\n</tool_call>')
    assert HERMES.parse('<tool_call>{"arguments": {"a": 1}}</tool_call>') is None


def test_gemma_object_syntax_reads_as_json() -> None:
    text = 'call:f{city:<|"|>Paris, "France"<|"|>,days:2,flags:{x:true}}'
    assert json.loads(gemma_to_json(text[text.index("{") :])) == {
        "city": 'Paris, "France"',
        "days": 2,
        "flags": {"x": True},
    }


def test_names_and_errors() -> None:
    assert named("qwen3-coder").name == "qwen3-coder"
    with pytest.raises(ValueError, match="known: harmony"):
        named("nope")
    assert recognise("{{ messages }}") is None


WEATHER = {"type": "function", "function": CITY_FUNCTION}
# a whole exchange: system, user, an assistant's reasoning and call, the tool's result, the answer and
# a question after it
EXCHANGE = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I should look it up.",
        "tool_calls": [
            {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_7", "name": "get_weather", "content": "Sunny, 21 C"},
    {"role": "assistant", "content": "It is sunny."},
    {"role": "user", "content": "And tomorrow?"},
]


def byte_tokens(text: str, special: bool) -> list[int]:
    return list(text.encode())


@pytest.mark.parametrize("name", FAMILY_TEMPLATES)
def test_a_family_template_renders_a_whole_exchange_and_is_recognised(name: str) -> None:
    path = TEMPLATES / FAMILY_TEMPLATES[name]
    assert path.exists(), f"{path} is missing: `make` links the llama.cpp source's templates there"
    template = ChatTemplate(path.read_text(), byte_tokens, bos_text="<s>", eos_text="</s>")
    assert template.dialect.name == name
    tokens, _ = template.conversation(EXCHANGE, [WEATHER], {})
    text = bytes(tokens).decode()
    for wanted in ("You answer briefly.", "Weather in Paris?", "Sunny, 21 C", "And tomorrow?", "get_weather"):
        assert wanted in text, (wanted, text)
    # the earlier call is in the prompt as the model writes calls: the dialect reads it back
    turn = text[text.index("Weather in Paris?") :]
    opens = [m for m in template.dialect.calls if not m.leading and m.open in turn]
    if opens:
        section = min(opens, key=lambda m: turn.find(m.open))
        call = turn[turn.find(section.open) :]
        if section.close:
            call = call[: call.index(section.close) + len(section.close)]
    else:  # Llama 3: a bare JSON object as the whole turn
        call = turn[turn.index('{"name"') : turn.index("Sunny, 21 C")]
    calls = template.dialect.parse(call)
    assert calls is not None, call
    assert (calls[0].name, json.loads(calls[0].arguments)) == ("get_weather", {"city": "Paris"})
    assert "It is sunny." in text


def test_thinking_switches_map_to_what_the_template_takes(caplog: pytest.LogCaptureFixture) -> None:
    harmony = ChatTemplate((TEMPLATES / FAMILY_TEMPLATES["harmony"]).read_text(), byte_tokens)
    assert harmony.request_variables({"reasoning_effort": "high"}) == {"reasoning_effort": "high"}
    with caplog.at_level("INFO"):
        assert harmony.request_variables({"reasoning_effort": "xhigh"}) == {"reasoning_effort": "high"}
    assert "not a level this template knows" in caplog.text
    assert harmony.request_variables({"reasoning_effort": "minimal"}) == {"reasoning_effort": "low"}
    prompt = bytes(harmony.conversation(EXCHANGE[:2], [], {"reasoning_effort": "low"})[0]).decode()
    assert "Reasoning: low" in prompt
    qwen = ChatTemplate((TEMPLATES / FAMILY_TEMPLATES["hermes"]).read_text(), byte_tokens)
    assert qwen.request_variables({"reasoning_effort": "none"}) == {"enable_thinking": False}
    deepseek = ChatTemplate((TEMPLATES / FAMILY_TEMPLATES["deepseek"]).read_text(), byte_tokens)
    assert deepseek.request_variables({"reasoning_effort": "minimal"}) == {"enable_thinking": False}
    glm47 = ChatTemplate((TEMPLATES / FAMILY_TEMPLATES["glm-4.7"]).read_text(), byte_tokens)
    assert glm47.reasoning_left_open() == "</think>", "GLM-4.7's generation prompt opens <think>"


def test_the_docs_table_is_the_dialects_own() -> None:
    docs = (TEMPLATES.parent.parent / "docs" / "dialects.md").read_text()
    assert table() in docs, "docs/dialects.md: paste superfluid.model.dialects.table() in again"


@pytest.fixture(scope="module")
def vocabulary() -> LlamaModel:
    return LlamaModel(embedded_model().path, vocab_only=True)


def grammar_takes(model: LlamaModel, gbnf: str, text: str) -> bool:
    """Whether the grammar accepts `text` (as the model tokenizes it) whole and then lets the reply end."""
    grammar = Grammar(model, gbnf)
    try:
        for token in model.tokenize(text, False):
            if not grammar.allows(token):
                return False
            grammar.accept(token)
        return any(grammar.allows(token) for token in model.end_of_generation)
    finally:
        grammar.close()


@pytest.mark.parametrize("dialect", DIALECTS, ids=lambda d: d.name)
def test_a_forced_call_is_the_dialects_own_markup(dialect: Dialect, vocabulary: LlamaModel) -> None:
    weather = [("get_weather", WEATHER["function"]["parameters"])]
    one = dialect.write([("get_weather", {"city": "Paris"})])
    two = dialect.write([("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})])
    single = tool_call_grammar(weather, dialect.shape)
    assert grammar_takes(vocabulary, single, one)
    assert not grammar_takes(vocabulary, single, two), "one call unless parallel calls are asked for"
    assert grammar_takes(vocabulary, tool_call_grammar(weather, dialect.shape, parallel=True), two)
    foreign = HERMES if dialect is not HERMES else LLAMA3
    assert not grammar_takes(vocabulary, single, foreign.write([("get_weather", {"city": "Paris"})]))
