"""Responses API items: the input a request sends, and the output a reply is built into.

Input items (`message`, `function_call`, `function_call_output`, `reasoning`) are checked
and given ids, so a stored response can list them; they become OpenAI chat messages for
the chat template. `Output` turns a generation's pieces into output items (`reasoning`,
`message`, `function_call`) and, for a stream, the events that build them.
"""

from __future__ import annotations

import secrets
from typing import Any

from .chat import ChatError, Piece

ROLES = ("user", "system", "developer", "assistant")
PARTS = ("input_text", "output_text", "refusal", "input_image", "input_audio")
ITEMS = ("message", "function_call", "function_call_output", "reasoning")
# the items a stored conversation can be continued with as plain turns (see `appendable`)
TURNS = ("message", "function_call_output")

Event = dict[str, Any]


def new_id(prefix: str) -> str:
    """An id of 128 random bits: `prefix_` and 32 hex digits."""
    return f"{prefix}_{secrets.token_hex(16)}"


def _refuse(message: str, param: str, code: str = "invalid_request_error") -> ChatError:
    return ChatError(message, code=code, param=param)


def input_items(raw: str | list[Any]) -> list[dict[str, Any]]:
    """A request's `input` as items with ids; ChatError for what is not accepted."""
    if isinstance(raw, str):
        raw = [{"type": "message", "role": "user", "content": raw}]
    if not raw:
        raise _refuse("input is empty: send a string or a list of items", "input")
    return [_item(item, f"input[{index}]") for index, item in enumerate(raw)]


def _item(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise _refuse(f"{where} is not an object", where)
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "item_reference":
        raise _refuse(f"{where}: item_reference is not supported; send the item itself", where, "unsupported_parameter")
    if kind not in ITEMS:
        raise _refuse(f"{where}: item type {kind!r} is not one of {', '.join(ITEMS)}", f"{where}.type")
    if kind == "message":
        return _message(item, where)
    if kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise _refuse(f"{where}: a function_call needs {key} as a string", f"{where}.{key}")
        return _stamped(item, "fc")
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise _refuse(f"{where}: a function_call_output needs call_id as a string", f"{where}.call_id")
        output = item.get("output")
        if not isinstance(output, (str, list)):
            raise _refuse(f"{where}: output must be a string or a list of content parts", f"{where}.output")
        if isinstance(output, list):
            _check_parts(output, f"{where}.output")
        return _stamped(item, "fco")
    return _stamped(item, "rs")


def _stamped(item: dict[str, Any], prefix: str) -> dict[str, Any]:
    """An item as stored: with an id (its own, or a new one) and a status."""
    return {**item, "id": item.get("id") or new_id(prefix), "status": item.get("status") or "completed"}


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise _refuse(f"{where}: message role {role!r} is not one of {', '.join(ROLES)}", f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        content = [{"type": "output_text" if role == "assistant" else "input_text", "text": content}]
    elif isinstance(content, list):
        _check_parts(content, f"{where}.content")
    else:
        raise _refuse(f"{where}: content must be a string or a list of content parts", f"{where}.content")
    return {**_stamped(item, "msg"), "type": "message", "content": content}


def _check_parts(parts: list[Any], where: str) -> None:
    for index, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_file" or (kind == "input_image" and part.get("file_id")):
            raise _refuse(
                f"{where}[{index}]: files are not supported; send text (images only as data URLs)",
                f"{where}[{index}]",
                "unsupported_parameter",
            )
        if kind not in PARTS:
            raise _refuse(f"{where}[{index}]: content part type {kind!r} is not one of {', '.join(PARTS)}", where)


def appendable(items: list[dict[str, Any]]) -> bool:
    """Whether `items` can be appended to a stored conversation as turns of text."""
    return all(item["type"] in TURNS for item in items)


def chat_turns(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items as OpenAI chat messages: function calls join the assistant turn they follow; reasoning
    of earlier turns is dropped, as chat templates do."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": item["role"], "content": item["content"]})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function"}
            call["function"] = {"name": qualified(item["name"], item.get("namespace")), "arguments": item["arguments"]}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def qualified(name: str, namespace: str | None) -> str:
    """The name the model knows a function by: `namespace.name` for a function of a namespace tool
    (function names have no dots, so the first one splits it back)."""
    return f"{namespace}.{name}" if namespace else name


def split_name(name: str) -> dict[str, str]:
    """A called function's `name`, and its `namespace` when it has one."""
    namespace, dot, inner = name.partition(".")
    return {"name": inner, "namespace": namespace} if dot else {"name": name}


class Output:
    """A reply's output items, built from its pieces in order.

    `feed` and `close` return the stream events that build the items (each a dict with its
    `type`, before its sequence number is stamped); a reply that is not streamed ignores them.
    """

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the message or reasoning item text is going to
        self._text = ""

    def feed(self, piece: Piece) -> list[Event]:
        kind = "message" if piece.kind == "text" else "reasoning" if piece.kind == "reasoning" else "function_call"
        events: list[Event] = []
        if self._open is not None and self._open["type"] != kind:
            events += self._finish("completed")
        if kind == "function_call":
            return events + self._call(piece)
        if self._open is None:
            events += self._start(kind)
        assert self._open is not None
        self._text += piece.text
        events.append(
            {"type": f"response.{_part(kind)}.delta", **self._where(), "delta": piece.text, **_logprobs(kind)}
        )
        return events

    def close(self, status: str) -> list[Event]:
        """The last events: the open item ends with `status` (completed or incomplete). A reply with
        no output at all still gets an (empty) message."""
        events: list[Event] = []
        if self._open is None and not self.items:
            events += self._start("message")
        if self._open is not None:
            events += self._finish(status)
        return events

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.items), "content_index": 0}

    def _start(self, kind: str) -> list[Event]:
        if kind == "message":
            self._open = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant"}
        else:
            self._open = {"id": new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": []}
        self._open["content"] = []
        self._text = ""
        return [
            {"type": "response.output_item.added", "output_index": len(self.items), "item": dict(self._open)},
            {"type": "response.content_part.added", **self._where(), "part": _content(kind, "")},
        ]

    def _finish(self, status: str) -> list[Event]:
        assert self._open is not None
        kind, where = self._open["type"], self._where()
        part = _content(kind, self._text)
        item = {**self._open, "status": status, "content": [part]}
        self.items.append(item)
        self._open = None
        return [
            {"type": f"response.{_part(kind)}.done", **where, "text": self._text, **_logprobs(kind)},
            {"type": "response.content_part.done", **where, "part": part},
            {"type": "response.output_item.done", "output_index": where["output_index"], "item": item},
        ]

    def _call(self, piece: Piece) -> list[Event]:
        index = len(self.items)
        item = {
            "id": new_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": piece.call_id,
            **split_name(piece.name),
            "arguments": "",
        }
        where = {"item_id": item["id"], "output_index": index}
        done = {**item, "status": "completed", "arguments": piece.arguments}
        self.items.append(done)
        return [
            {"type": "response.output_item.added", "output_index": index, "item": item},
            {"type": "response.function_call_arguments.delta", **where, "delta": piece.arguments},
            {
                "type": "response.function_call_arguments.done",
                **where,
                **split_name(piece.name),
                "arguments": piece.arguments,
            },
            {"type": "response.output_item.done", "output_index": index, "item": done},
        ]


def _part(kind: str) -> str:
    return "output_text" if kind == "message" else "reasoning_text"


def _content(kind: str, text: str) -> dict[str, Any]:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


def _logprobs(kind: str) -> dict[str, Any]:
    return {"logprobs": []} if kind == "message" else {}
