"""Tool-call and reasoning dialects: how each model family marks its reasoning and writes its calls.

A `Dialect` is recognised from the chat template's own text (`recognise`), or named with
`--tool-call-parser`. It gives the channel splitter its markers (reasoning, call sections,
and markup that is neither, such as Harmony's headers), reads a closed call section back
into calls (`parse`), and writes calls the way the model does (`shape`), which the
grammar of a constrained call and the rendering of earlier calls for a template without
tool support are derived from.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from ...protocol.schema import CHANNEL_REASONING, CHANNEL_TEXT, CHANNEL_TOOL_CALL
from ..channels import THINK, Markers
from ..toolcall import ParsedCall
from .parse import deepseek, delimited, harmony, json_objects
from .shape import CallShape

Parser = Callable[[str, CallShape], "list[ParsedCall] | None"]


def _objects(text: str, shape: CallShape) -> list[ParsedCall] | None:
    return json_objects(text)


def _harmony(text: str, shape: CallShape) -> list[ParsedCall] | None:
    return harmony(text)


@dataclass(frozen=True)
class Dialect:
    """One family's markup for reasoning and tool calls."""

    name: str
    families: str  # the models that write it, for --help and the docs
    signatures: tuple[str, ...]  # template text that identifies it (any one of them)
    shape: CallShape
    calls: tuple[Markers, ...]  # what opens and closes a call section ("" closes at the end of the reply)
    reasoning: tuple[Markers, ...] = (THINK,)
    drops: tuple[str, ...] = ()  # markup of the reply that is neither text nor a call
    parser: Parser = delimited
    call_ids: Callable[[str], str] = field(default=lambda given: given)  # an id as the template accepts it

    @property
    def markers(self) -> tuple[Markers, ...]:
        """Everything the channel splitter watches for."""
        drops = tuple(Markers(CHANNEL_TEXT, text, "") for text in self.drops)
        return (*self.reasoning, *self.calls, *drops)

    def parse(self, text: str) -> list[ParsedCall] | None:
        """The calls of a closed section (its markers included), or None when none can be read."""
        return self.parser(text, self.shape)

    def write(self, calls: Sequence[tuple[str, dict]]) -> str:
        """The markup of `calls` ((name, arguments) pairs), as the model writes it."""
        return self.shape.write(list(calls))


def _section(open_text: str, close_text: str = "", *, leading: bool = False) -> Markers:
    return Markers(CHANNEL_TOOL_CALL, open_text, close_text, leading)


def hermes_with(open_text: str, close_text: str) -> Dialect:
    """Hermes-style JSON calls between a template's own tags (learned from the template)."""
    return replace(
        HERMES,
        shape=replace(HERMES.shape, call_open=f'{open_text}\n{{"name": "', call_close=f"}}\n{close_text}"),
        calls=(_section(open_text, close_text),),
    )


def _mistral_id(given: str) -> str:
    """Mistral templates take call ids of nine letters and digits: others are mapped, stably."""
    if len(given) == 9 and given.isalnum():
        return given
    return hashlib.sha1(given.encode()).hexdigest()[:9]


HERMES = Dialect(
    "hermes",
    "Qwen2.5, Qwen3, Hermes 2 and 3, Granite 4, and templates that know no tools (the embedded SmolLM2's)",
    ("<tool_call>",),
    CallShape('<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", separator="\n"),
    (_section("<tool_call>", "</tool_call>"),),
    parser=_objects,
)

QWEN3_CODER = Dialect(
    "qwen3-coder",
    "Qwen3-Coder, Qwen3.5, Nemotron 3 Nano, Step 3.5 (a parameter element each)",
    ("<parameter=",),
    CallShape(
        "<tool_call>\n<function=",
        ">\n",
        "</function>\n</tool_call>",
        separator="\n",
        arguments="params",
        param_open="<parameter=",
        param_mid=">\n",
        param_close="\n</parameter>\n",
    ),
    (_section("<tool_call>", "</tool_call>"),),
)

HARMONY = Dialect(
    "harmony",
    "gpt-oss (Harmony: analysis, commentary and final channels)",
    ("<|channel|>analysis", "to=functions."),
    CallShape(" to=functions.", "<|channel|>commentary json<|message|>", "<|call|>", separator="<|start|>assistant"),
    (_section("<|start|>assistant to=", "<|call|>"), _section("<|channel|>commentary to=", "<|call|>")),
    reasoning=(Markers(CHANNEL_REASONING, "<|channel|>analysis<|message|>", "<|end|>"),),
    drops=(
        "<|start|>assistant",
        "<|channel|>final<|message|>",
        "<|channel|>commentary<|message|>",
        "<|end|>",
        "<|return|>",
    ),
    parser=_harmony,
)

LLAMA3 = Dialect(
    "llama3",
    "Llama 3.1, 3.2, 3.3 (a JSON call as the whole reply, or after the python tag)",
    ("<|python_tag|>", '"parameters": dictionary'),
    CallShape('{"name": "', '", "parameters": ', "}", separator="; "),
    (_section("<|python_tag|>"), _section("{", leading=True)),
    parser=_objects,
)

MISTRAL = Dialect(
    "mistral",
    "Mistral Small 3.2, Devstral, Ministral 3, Magistral (name and arguments apart)",
    ("[ARGS]",),
    CallShape("[TOOL_CALLS]", "[ARGS]", ""),
    (_section("[TOOL_CALLS]"),),
    reasoning=(Markers(CHANNEL_REASONING, "[THINK]", "[/THINK]"), THINK),
    call_ids=_mistral_id,
)

MISTRAL_JSON = Dialect(
    "mistral-json",
    "Mistral Nemo, Mistral 7B v0.3 (an array of JSON calls)",
    ("[TOOL_CALLS]",),
    CallShape('{"name": "', '", "arguments": ', "}", section_open="[TOOL_CALLS][", section_close="]", separator=", "),
    (_section("[TOOL_CALLS]"),),
    parser=_objects,
    call_ids=_mistral_id,
)

DEEPSEEK = Dialect(
    "deepseek",
    "DeepSeek V3.1, R1 and its distillations (R1's fenced JSON read too)",
    ("<｜tool▁calls▁begin｜>",),
    CallShape(
        "<｜tool▁call▁begin｜>",
        "<｜tool▁sep｜>",
        "<｜tool▁call▁end｜>",
        section_open="<｜tool▁calls▁begin｜>",
        section_close="<｜tool▁calls▁end｜>",
    ),
    (_section("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),),
    parser=deepseek,
)

KIMI = Dialect(
    "kimi",
    "Kimi K2 (calls numbered in a section)",
    ("<|tool_calls_section_begin|>",),
    CallShape(
        "<|tool_call_begin|>functions.",
        ":{index}<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        section_open="<|tool_calls_section_begin|>",
        section_close="<|tool_calls_section_end|>",
    ),
    (_section("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),),
)

GLM = Dialect(
    "glm",
    "GLM-4.5, GLM-4.6, Ling 3.0 (argument keys and values on lines of their own)",
    ("<arg_key>",),
    CallShape(
        "<tool_call>",
        "\n",
        "</tool_call>",
        separator="\n",
        arguments="params",
        param_open="<arg_key>",
        param_mid="</arg_key>\n<arg_value>",
        param_close="</arg_value>\n",
    ),
    (_section("<tool_call>", "</tool_call>"),),
)

GLM47 = replace(
    GLM,
    name="glm-4.7",
    families="GLM-4.7 (argument keys and values with no line breaks)",
    signatures=("</arg_key><arg_value>",),
    shape=replace(
        GLM.shape, name_close="", separator="", param_mid="</arg_key><arg_value>", param_close="</arg_value>"
    ),
)

GRANITE = Dialect(
    "granite",
    "Granite 3.x (an array of JSON calls)",
    ("<|tool_call|>",),
    CallShape('{"name": "', '", "arguments": ', "}", section_open="<|tool_call|>[", section_close="]", separator=", "),
    (_section("<|tool_call|>"),),
    parser=_objects,
)

GEMMA = Dialect(
    "gemma",
    "Gemma 4 (its own object syntax, a thought channel)",
    ("<|tool_call>",),
    CallShape("<|tool_call>call:", "", "<tool_call|>", arguments="gemma"),
    (_section("<|tool_call>", "<tool_call|>"),),
    reasoning=(Markers(CHANNEL_REASONING, "<|channel>thought", "<channel|>"),),
)

# most particular first: the first whose signature the template holds is its dialect
DIALECTS: tuple[Dialect, ...] = (
    HARMONY,
    GEMMA,
    KIMI,
    DEEPSEEK,
    MISTRAL,
    MISTRAL_JSON,
    GRANITE,
    QWEN3_CODER,
    GLM47,
    GLM,
    LLAMA3,
    HERMES,
)
NAMES = tuple(d.name for d in DIALECTS)


def recognise(source: str) -> Dialect | None:
    """The dialect a chat template's text shows, or None when it shows none."""
    return next((d for d in DIALECTS if any(s in source for s in d.signatures)), None)


def named(name: str) -> Dialect:
    """The dialect called `name`; ValueError listing the names otherwise."""
    for dialect in DIALECTS:
        if dialect.name == name:
            return dialect
    raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(NAMES)}")


def table() -> str:
    """The dialects as a Markdown table (docs/dialects.md holds it; a test checks they agree)."""
    rows = [
        "| `--tool-call-parser` | families | recognised by the template holding | reasoning "
        "| a call, as the model writes it |",
        "|---|---|---|---|---|",
    ]
    for d in DIALECTS:
        signatures = " or ".join(_code(s) for s in d.signatures)
        reasoning = ", ".join(f"{_code(m.open)}…{_code(m.close)}" for m in d.reasoning)
        call = _code(d.write([("get_weather", {"city": "Paris"})]).replace("\n", "⏎"))
        rows.append(f"| `{d.name}` | {d.families} | {signatures} | {reasoning} | {call} |")
    return "\n".join(rows) + "\n"


def _code(text: str) -> str:
    return "`" + text.replace("|", "\\|") + "`"  # a bare bar would end the table cell
