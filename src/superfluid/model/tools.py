"""Tool declarations: the shapes clients send, normalised to one.

A tool may arrive as an OpenAI function tool (`{"type": "function", "function": {...}}`),
a bare function (`{"name", "description", "parameters"}`) or an Anthropic tool
(`{"name", "description", "input_schema"}`). All become the OpenAI form, which is what
chat templates expect in their `tools` variable.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .dialects import Dialect


class ToolDeclarationError(ValueError):
    """A tool declaration is not a function declaration; the text says why."""


def normalize_tool(raw: Any) -> dict[str, Any]:
    """One tool (a dict or its JSON text) in OpenAI function-tool form."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ToolDeclarationError(f"it is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ToolDeclarationError("it is not a JSON object")
    if raw.get("type") == "function" or isinstance(raw.get("function"), dict):
        function = raw.get("function")
        if not isinstance(function, dict):
            raise ToolDeclarationError('"function" must be an object')
    else:
        function = raw
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ToolDeclarationError("it has no name")
    parameters = function.get("parameters", function.get("input_schema", {"type": "object", "properties": {}}))
    if not isinstance(parameters, dict):
        raise ToolDeclarationError("its parameters must be a JSON schema object")
    declared: dict[str, Any] = {"name": name}
    description = function.get("description", "")  # templates read it unguarded (gpt-oss's does)
    if not isinstance(description, str):
        raise ToolDeclarationError("its description must be a string")
    declared["description"] = description
    declared["parameters"] = parameters
    return {"type": "function", "function": declared}


def normalize_tools(raw_tools: list[Any]) -> list[dict[str, Any]]:
    """All tools of a declaration; the error names the first bad one by index."""
    tools = []
    for index, raw in enumerate(raw_tools):
        try:
            tools.append(normalize_tool(raw))
        except ToolDeclarationError as e:
            raise ToolDeclarationError(f"tool {index} is not a function declaration: {e}") from None
    return tools


def fallback_system_text(text: str, tools: list[dict[str, Any]], dialect: Dialect) -> str:
    """A system prompt that declares tools, for templates with no tool support of their own.

    Calls are asked for in the dialect's own markup (by default Hermes-style
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), which the channel splitter recognises.
    """
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    preamble = f"{text}\n\n" if text else ""
    example = dialect.write([("function_name", {"argument": "value"})])
    return (
        f"{preamble}# Tools\n\n"
        "You can call the functions described below. Each is a JSON object:\n"
        f"<tools>\n{listing}\n</tools>\n\n"
        "To call one, answer with its name and its arguments like this:\n"
        f"{example}"
    )
