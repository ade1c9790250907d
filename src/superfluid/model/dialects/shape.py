"""How a dialect writes its tool calls, declared once: the writer, the grammar and the splitter's
markers are all derived from a `CallShape`.

A reply's calls sit in a section: `section_open`, then each call as
`call_open NAME name_close ARGUMENTS call_close` (calls joined by `separator`), then
`section_close`. `{index}` in `name_close` is the call's position in the section (Kimi K2).
Arguments are written as one JSON object (`json`), as one element per parameter (`params`,
framed by `param_open KEY param_mid VALUE param_close`, strings raw and other values as
JSON), or in Gemma's own object syntax (`gemma`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

ArgumentStyle = Literal["json", "params", "gemma"]
GEMMA_QUOTE = '<|"|>'  # Gemma 4 quotes strings in its calls with this token, not '"'


@dataclass(frozen=True)
class CallShape:
    """The markup of a dialect's calls (see the module docstring)."""

    call_open: str
    name_close: str
    call_close: str
    section_open: str = ""
    section_close: str = ""
    separator: str = ""
    arguments: ArgumentStyle = "json"
    param_open: str = ""
    param_mid: str = ""
    param_close: str = ""

    def write(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        """The section that makes `calls` ((name, arguments) pairs), as the model writes it."""
        written = [
            self.call_open + name + self.name_close.replace("{index}", str(index)) + self.write_arguments(arguments)
            for index, (name, arguments) in enumerate(calls)
        ]
        return self.section_open + self.separator.join(w + self.call_close for w in written) + self.section_close

    def write_arguments(self, arguments: dict[str, Any]) -> str:
        if self.arguments == "json":
            return json.dumps(arguments, ensure_ascii=False)
        if self.arguments == "gemma":
            return gemma_value(arguments)
        return "".join(
            self.param_open + key + self.param_mid + param_text(value) + self.param_close
            for key, value in arguments.items()
        )


def param_text(value: Any) -> str:
    """A parameter element's value: a string as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def gemma_value(value: Any) -> str:
    """A value in Gemma 4's call syntax: bare keys, strings between `<|"|>` quotes."""
    if isinstance(value, str):
        return GEMMA_QUOTE + value + GEMMA_QUOTE
    if isinstance(value, dict):
        return "{" + ",".join(f"{key}:{gemma_value(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(gemma_value(item) for item in value) + "]"
    return json.dumps(value)
