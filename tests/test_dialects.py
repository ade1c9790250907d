"""Every tool-call and reasoning dialect, read back from its own markup cut into streamed pieces
at every byte: the same calls, arguments, reasoning and text come out, and no markup leaks."""

from __future__ import annotations

import json

import pytest

from superfluid.model.channels import ChannelSplitter
from superfluid.model.dialects import DIALECTS, HARMONY, HERMES, LLAMA3, Dialect, named, recognise
from superfluid.model.dialects.parse import gemma_to_json
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
