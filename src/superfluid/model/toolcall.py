"""A tool call's text, parsed into a name and JSON arguments.

The wire is `{"name": ..., "arguments": {...}}` between the tool-call markers. Small
models get it slightly wrong, so the parser repairs what it safely can: a markdown
fence around the JSON, text before or after the first balanced object, trailing commas,
an object left unterminated at the end, a `{"function": {...}}` wrapper, arguments under
`arguments`, `parameters`, `args` or `input`, arguments sent as a JSON string. It never
invents a call: without a name, the text is a parse failure.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_TRAILING_COMMA = re.compile(r",\s*([}\]])")
_FENCE = re.compile(r"^```[a-zA-Z]*\s*|\s*```$")
ARGUMENT_KEYS = ("arguments", "parameters", "args", "input")


@dataclass(frozen=True)
class ParsedCall:
    """A tool call read from text: its name and its arguments as compact JSON."""

    name: str
    arguments: str  # compact JSON of an object


def parse_tool_call(text: str) -> ParsedCall | None:
    """The call in `text`, or None when it cannot be read as one."""
    candidate = first_object(_FENCE.sub("", text.strip()))
    if candidate is None:
        return None
    obj = loads_lenient(candidate)
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    arguments: Any = {}
    for key in ARGUMENT_KEYS:
        if key in obj:
            arguments = obj[key]
            break
    if isinstance(arguments, str):
        arguments = loads_lenient(arguments) if arguments.strip() else {}
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(name.strip(), json.dumps(arguments, ensure_ascii=False, separators=(",", ":")))


def first_object(text: str) -> str | None:
    """The first balanced `{...}`, or the unterminated tail from the first `{`, closed."""
    start = text.find("{")
    if start < 0:
        return None
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    tail = text[start:].rstrip()
    if in_string:
        tail += '"'
    return tail + "}" * depth


def loads_lenient(text: str) -> Any:
    for attempt in (text, _TRAILING_COMMA.sub(r"\1", text)):
        try:
            return json.loads(attempt)
        except json.JSONDecodeError:
            continue
    return None
