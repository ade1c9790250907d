"""A call section's text, read back into calls, leniently.

`json_objects` reads dialects whose calls are JSON objects with a name and arguments
(one per section, an array, or several in a row); `delimited` reads dialects that write
the name between markers, from the dialect's `CallShape`. Whitespace between markup is
never significant. A section that holds no readable call is None: the caller returns its
text as text.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..toolcall import ParsedCall, first_object, loads_lenient, parse_tool_call
from .shape import GEMMA_QUOTE, CallShape

_BETWEEN_CALLS = re.compile(r"[\s,;]*")


def json_objects(text: str) -> list[ParsedCall] | None:
    """The `{"name": ..., "arguments": ...}` objects that open `text` (after its markers), in order,
    up to the first text that is not a separator (an array's `]`, say); None if one has no name."""
    calls: list[ParsedCall] = []
    rest = text
    while (start := rest.find("{")) >= 0:
        if calls and not _BETWEEN_CALLS.fullmatch(rest[:start]):
            break
        candidate = first_object(rest[start:])
        if candidate is None:
            break
        parsed = parse_tool_call(candidate)
        if parsed is None:
            return None
        calls.append(parsed)
        rest = rest[start + len(candidate) :]
    return calls or None


def loose(literal: str) -> str:
    """A regex matching `literal` with any whitespace where it has whitespace, and around it."""
    parts = [re.escape(part) for part in literal.split()]
    return r"\s*" + r"\s*".join(parts) + r"\s*" if parts else r"\s*"


def delimited(text: str, shape: CallShape) -> list[ParsedCall] | None:
    """The calls of a section written as `call_open NAME name_close ARGUMENTS call_close`."""
    head, _, tail = shape.name_close.partition("{index}")
    opens = re.escape(shape.param_open.strip() or "{")
    body = text
    if shape.section_close and shape.section_close.strip() in body:
        body = body[: body.rindex(shape.section_close.strip())]
    chunks = re.split(loose(shape.call_open), body)[1:]
    calls: list[ParsedCall] = []
    for chunk in chunks:
        if shape.call_close.strip():
            chunk = re.split(loose(shape.call_close), chunk, maxsplit=1)[0]
        # a name closed by whitespace alone ends where its arguments begin
        name_end = re.search(loose(head), chunk) if head.strip() else re.search(rf"\s|{opens}", chunk)
        if name_end is None and head.strip():
            return None
        if name_end is None:  # a call with no arguments
            name, rest = chunk.strip(), ""
        else:
            name = chunk[: name_end.start()].strip()
            rest = chunk[name_end.end() if head.strip() else name_end.start() :]
        if tail.strip():
            after = re.search(loose(tail), rest)
            rest = rest[after.end() :] if after else rest
        arguments = read_arguments(rest, shape)
        if not name or arguments is None:
            return None
        calls.append(ParsedCall(name, json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))))
    return calls or None


def read_arguments(text: str, shape: CallShape) -> dict[str, Any] | None:
    """A call's arguments in the shape's style, as an object; None when unreadable."""
    if shape.arguments == "params":
        return read_params(text, shape)
    if shape.arguments == "gemma":
        text = gemma_to_json(text)
    text = text.strip()
    if not text:
        return {}
    candidate = first_object(text)
    value = loads_lenient(candidate) if candidate is not None else None
    if isinstance(value, str):  # arguments sent as a JSON string of an object
        value = loads_lenient(value)
    return value if isinstance(value, dict) else None


def read_params(text: str, shape: CallShape) -> dict[str, Any] | None:
    """Parameter elements: each value a string, or JSON where it reads as JSON of another type."""
    element = loose(shape.param_open) + r"(.*?)" + loose(shape.param_mid) + r"(.*?)"
    close = shape.param_close.strip()
    pattern = re.compile(element + (loose(close) if close else r"(?=$)"), re.DOTALL)
    found = pattern.findall(text)
    if not found and text.strip():
        return None
    arguments: dict[str, Any] = {}
    for key, raw in found:
        value = raw.strip("\n")
        try:
            decoded = json.loads(value)
        except json.JSONDecodeError:
            decoded = value
        arguments[key.strip()] = value if isinstance(decoded, str) else decoded
    return arguments


_BARE_KEY = re.compile(r"([{,]\s*)([A-Za-z_][\w\-]*)\s*:")


def gemma_to_json(text: str) -> str:
    """Gemma 4's call object syntax as JSON: `<|"|>`-quoted strings, bare keys."""
    out: list[str] = []
    parts = text.split(GEMMA_QUOTE)
    for index, part in enumerate(parts):
        if index % 2:  # inside a quoted string
            out.append(json.dumps(part, ensure_ascii=False))
        else:
            out.append(_BARE_KEY.sub(r'\1"\2":', part))
    return "".join(out)


_HARMONY_NAME = re.compile(r"to=functions\.([^\s<]+)")


def harmony(text: str) -> list[ParsedCall] | None:
    """gpt-oss calls: `to=functions.NAME` in a header, the arguments after `<|message|>`."""
    calls: list[ParsedCall] = []
    for message in text.split("<|call|>"):
        if not message.strip():
            continue
        name = _HARMONY_NAME.search(message)
        _, found, payload = message.partition("<|message|>")
        if name is None:
            return None
        arguments = read_arguments(payload if found else "", CallShape("", "", ""))
        if arguments is None:
            return None
        calls.append(ParsedCall(name.group(1), json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))))
    return calls or None


_R1_CALL = re.compile(r"function\s*<｜tool▁sep｜>\s*([^\n]+?)\s*\n\s*```(?:json)?\s*(.*?)\s*```", re.DOTALL)


def deepseek(text: str, shape: CallShape) -> list[ParsedCall] | None:
    """DeepSeek calls, V3.1's `NAME<｜tool▁sep｜>{...}` or R1's `function<｜tool▁sep｜>NAME` with a fenced JSON."""
    return delimited(_R1_CALL.sub(r"\1<｜tool▁sep｜>\2", text), shape)
