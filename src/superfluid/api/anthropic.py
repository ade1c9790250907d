"""Anthropic Messages routes: POST /v1/messages, streaming or not, and /v1/messages/count_tokens.

Content blocks map onto the chat template's messages: `text` (and plain-text `document`s)
to content, `tool_use` to an assistant tool call, `tool_result` to a tool message; the
model's earlier `thinking` is left out, as templates do. System entries inside `messages`
(Claude Code sends them) join the system prompt before the first turn and the user's turn
after it. `cache_control` breakpoints pin the prompt up to them (see
`scheduler/prompt_pins.py`), and usage says what was read from the cache
(`cache_read_input_tokens`) and what was written under a breakpoint
(`cache_creation_input_tokens`). Replies carry `thinking`, `text` and `tool_use` blocks;
streams send `message_start` (with the first block, once the cached part is known),
per-block `content_block_start`, `content_block_delta` and `content_block_stop`, then
`message_delta` and `message_stop`. A tool call arrives whole, as one `input_json_delta`.
Every refusal is in Anthropic's error shape.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..core.daemon import Daemon
from ..model.tools import ToolDeclarationError, normalize_tools
from ..protocol.jsoncodec import sse
from ..protocol.schema import GenParams
from ..scheduler.prompt_pins import DEFAULT_TTL_MS, TTLS_MS
from . import anthropic_errors
from .anthropic_errors import ROUTE
from .chat import ChatError, ChatRequest, ChatRun, Outcome, Piece, rendered
from .chat_http import HttpPolicy, answer, collect, runtime_for, scheduling
from .openai import GONE, Body, sampling

_ids = itertools.count(1)
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class CountRequest(Body):
    """The body of POST /v1/messages/count_tokens: a message request without its sampling.

    Fields these clients send that change nothing here are accepted: `metadata` (a user id),
    `context_management`, `output_config.effort`, `service_tier`.
    """

    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None

    def json_schema(self) -> dict[str, Any] | None:
        """The schema of structured output (`output_config.format`), which the reply is constrained to."""
        form = (self.output_config or {}).get("format")
        if form is None:
            return None
        if not isinstance(form, dict) or form.get("type") != "json_schema" or not isinstance(form.get("schema"), dict):
            raise ChatError('output_config.format must be {"type": "json_schema", "schema": {...}}')
        return form["schema"]

    def template_vars(self) -> dict[str, Any]:
        """`thinking` as the chat template's switch: on when enabled, off when disabled, its own default else."""
        kind = (self.thinking or {}).get("type")
        return {"enable_thinking": kind == "enabled"} if kind in ("enabled", "disabled") else {}


class MessagesRequest(CountRequest):
    """The body of POST /v1/messages."""

    max_tokens: int
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    ignore_eos: bool = False  # an extension: decode to max_tokens


def error(message: str, status: int = 400) -> Response:
    """A refusal in Anthropic's error shape."""
    return JSONResponse(anthropic_errors.body(message, status), status_code=status)


# Claude Code opens its system prompt with a block that bills the call; it names a hash of the
# first message, so left in it would make every conversation's prompt differ from its first token.
BILLING_BLOCK = "x-anthropic-billing-header:"
CACHE_TTLS = ", ".join(TTLS_MS)
BLOCK_KINDS = "text, image, document, tool_use, tool_result, thinking, redacted_thinking"


@dataclass
class Conversation:
    """A request's messages as the chat template wants them, with its prompt-cache breakpoints."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    marks: list[tuple[int, int]] = field(default_factory=list)  # (message, characters of its content)
    ttl_ms: int = DEFAULT_TTL_MS

    def mark(self, block: dict[str, Any], message: int, chars: int) -> None:
        """Note a block's `cache_control` breakpoint, if it has one."""
        control = block.get("cache_control")
        if control is None:
            return
        if not isinstance(control, dict) or control.get("type") != "ephemeral":
            raise ChatError('cache_control must be {"type": "ephemeral"}, with an optional ttl')
        ttl = control.get("ttl", "5m")
        if ttl not in TTLS_MS:
            raise ChatError(f"cache_control.ttl must be one of {CACHE_TTLS}, not {ttl!r}")
        self.marks.append((message, chars))
        self.ttl_ms = max(self.ttl_ms, TTLS_MS[ttl])

    def system(self, text: str, block: dict[str, Any] | None = None, joined: str = "\n\n") -> None:
        """System text: part of the system prompt before the first turn, else folded into the user's turn
        (Claude Code sends system entries mid-conversation; most chat templates allow a system turn only
        first). Folded text only ever extends the conversation, so its prefix stays cached."""
        if all(m["role"] == "system" for m in self.messages):
            if self.messages:
                prior = self.messages[0]["content"]
                self.messages[0]["content"] = f"{prior}{joined}{text}" if prior else text
            else:
                self.messages.append({"role": "system", "content": text})
        elif self.messages[-1]["role"] == "user":
            prior = self.messages[-1]["content"]
            self.messages[-1]["content"] = f"{prior}\n\n{text}" if prior else text
        else:
            self.messages.append({"role": "user", "content": text})
        if block is not None:
            self.mark(block, len(self.messages) - 1, len(self.messages[-1]["content"]))


def conversation(
    system: str | list[dict[str, Any]] | None, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> Conversation:
    """Anthropic messages (and system, and the tools' breakpoints) as the chat template wants them."""
    out = Conversation()
    if isinstance(system, str) and system:
        out.system(system)
    elif isinstance(system, list):
        blocks = [b for b in system if not str(b.get("text", "")).startswith(BILLING_BLOCK)]
        for index, block in enumerate(blocks):
            if block.get("type") != "text":
                raise ChatError(f"system[{index}] is a {block.get('type')} block: the system prompt takes text blocks")
            out.system(block.get("text", ""), block, joined="")
    for tool in tools:
        if out.messages:
            out.mark(tool, 0, sys.maxsize)  # the whole system turn, with the tools it declares
    for number, message in enumerate(messages):
        role = message.get("role")
        content = message.get("content")
        if role == "system":
            out.system(content if isinstance(content, str) else _texts(content, f"messages[{number}]"))
            continue
        if role not in ("user", "assistant"):
            raise ChatError(f"messages[{number}].role is {role!r}: it must be user, assistant or system")
        if isinstance(content, str):
            out.messages.append({"role": role, "content": content})
            continue
        _turn(out, role, content or [], f"messages[{number}]")
    return out


def _turn(out: Conversation, role: str, blocks: list[dict[str, Any]], where: str) -> None:
    """One user or assistant message of content blocks."""
    text, calls, marks = "", [], []
    for index, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text":
            text += block.get("text", "")
        elif kind == "document":
            text += _document(block, f"{where}.content[{index}]")
        elif kind == "tool_use":
            calls.append(
                {
                    "id": block.get("id", ""),
                    "type": "function",
                    "function": {"name": block.get("name", ""), "arguments": block.get("input", {})},
                }
            )
        elif kind == "tool_result":
            result = block.get("content")
            body = result if isinstance(result, str) else _texts(result, f"{where}.content[{index}].content")
            out.messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id", ""), "content": body})
            out.mark(block, len(out.messages) - 1, len(body))
            continue
        elif kind in ("thinking", "redacted_thinking"):
            continue  # the model's earlier reasoning: templates leave it out of later turns
        elif kind == "image":
            raise ChatError(f"{where}.content[{index}] is an image: this model takes text only")
        else:
            raise ChatError(f"{where}.content[{index}] is a {kind!r} block; accepted blocks: {BLOCK_KINDS}")
        marks.append((block, len(text)))
    if text or calls or role == "assistant":
        entry: dict[str, Any] = {"role": role, "content": text}
        if calls:
            entry["tool_calls"] = calls
        out.messages.append(entry)
        for block, chars in marks:
            out.mark(block, len(out.messages) - 1, chars)


def _texts(blocks: Any, where: str) -> str:
    """The text of a list of text blocks (a tool result, a system entry); images refused."""
    if blocks is None:
        return ""
    parts = []
    for index, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append(block.get("text", ""))
        elif kind == "document":
            parts.append(_document(block, f"{where}[{index}]"))
        elif kind == "image":
            raise ChatError(f"{where}[{index}] is an image: this model takes text only")
        else:
            raise ChatError(f"{where}[{index}] is a {kind!r} block; only text and documents are accepted here")
    return "".join(parts)


def _document(block: dict[str, Any], where: str) -> str:
    source = block.get("source") or {}
    if source.get("type") == "text" and isinstance(source.get("data"), str):
        return source["data"]
    raise ChatError(
        f"{where} is a document of {source.get('type')!r} source: this model reads plain-text documents only"
    )


def tool_choice(raw: dict[str, Any] | None) -> Any:
    """Anthropic's tool_choice as the chat request's."""
    kind = (raw or {}).get("type", "auto")
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool" and isinstance((raw or {}).get("name"), str):
        return {"function": {"name": raw["name"]}}  # type: ignore[index]
    raise ChatError(
        'tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or {"type": "tool", "name": ...}'
    )


def client_tools(raw: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The request's tools in the chat form; ChatError for a server tool, which only Anthropic runs."""
    for index, tool in enumerate(raw or []):
        if tool.get("type") not in (None, "custom"):
            raise ChatError(
                f"tools[{index}] is a {tool['type']} server tool: superfluid runs no server tools; declare a "
                "client tool (name, description, input_schema) and run it yourself"
            )
    try:
        return normalize_tools(raw or [])
    except ToolDeclarationError as e:
        raise ChatError(str(e)) from None


def usage(outcome: Outcome, marked: int) -> dict[str, Any]:
    """Tokens read from the cache, written to it under a breakpoint (`marked`: the prompt up to the last
    one pinned), and the rest of the prompt."""
    written = max(0, marked - outcome.cached_tokens)
    return {
        "input_tokens": outcome.prompt_tokens - outcome.cached_tokens - written,
        "output_tokens": outcome.completion_tokens,
        "cache_read_input_tokens": outcome.cached_tokens,
        "cache_creation_input_tokens": written,
    }


def stop_reason(outcome: Outcome) -> str:
    return "stop_sequence" if outcome.stopped_by else STOP_REASONS.get(outcome.finish, "end_turn")


def chat_request(body: CountRequest, params: GenParams, **fields: Any) -> ChatRequest:
    """The chat request of a message body, sampled with `params` (its limits and scheduling in `fields`)."""
    tools = client_tools(body.tools)
    chat = conversation(body.system, body.messages, body.tools or [])
    return ChatRequest(
        messages=chat.messages,
        params=params,
        tools=tools,
        tool_choice=tool_choice(body.tool_choice),
        json_schema=body.json_schema(),
        template_vars=body.template_vars(),
        cache_marks=chat.marks,
        cache_ttl_ms=chat.ttl_ms,
        **fields,
    )


def router(daemon: Daemon, policy: HttpPolicy) -> APIRouter:
    api = APIRouter()

    @api.post(ROUTE)
    async def messages(body: MessagesRequest, http: Request) -> Response:
        try:
            qos, invariant = scheduling(http, policy)
            runtime = await runtime_for(daemon, body.model)
            request = chat_request(
                body,
                sampling(runtime.sampling, body.temperature, body.top_p, body.top_k, None, None),
                max_tokens=body.max_tokens,
                stop=list(body.stop_sequences or []),
                ignore_eos=body.ignore_eos,
                qos=qos,
                batch_invariant=invariant,
            )
            run = await ChatRun.open(daemon, request, runtime)
        except ChatError as e:
            return error(str(e), e.status)
        reply_id = f"msg_superfluid_{next(_ids)}"
        name = body.model or run.runtime.id
        if body.stream:
            return StreamingResponse(_stream(run, reply_id, name), media_type="text/event-stream")
        return await answer(policy, lambda: _reply(run, http, reply_id, name))

    @api.post(f"{ROUTE}/count_tokens")
    async def count_tokens(body: CountRequest) -> Response:
        try:
            runtime = await runtime_for(daemon, body.model)
            request = chat_request(body, sampling(runtime.sampling, None, None, None, None, None))
            prompt, opener, _ = rendered(request, runtime)
        except ChatError as e:
            return error(str(e), e.status)
        return JSONResponse({"input_tokens": len(prompt) + len(opener)})

    return api


async def _reply(run: ChatRun, http: Request, reply_id: str, name: str) -> Response:
    reply = await collect(run, http)
    if reply is None:
        return error("the client closed the connection", GONE)
    blocks = [_block(piece) for piece in reply.pieces]
    outcome = run.result()
    if isinstance(outcome, str):
        return error(outcome, 500)
    return JSONResponse(
        {
            "id": reply_id,
            "type": "message",
            "role": "assistant",
            "model": name,
            "content": blocks,
            "stop_reason": stop_reason(outcome),
            "stop_sequence": outcome.stopped_by,
            "usage": usage(outcome, run.marked),
        }
    )


def _block(piece: Piece) -> dict[str, Any]:
    """One content block of a whole reply."""
    if piece.kind == "tool_call":
        return {
            "type": "tool_use",
            "id": _tool_id(piece.call_id),
            "name": piece.name,
            "input": json.loads(piece.arguments),
        }
    if piece.kind == "reasoning":
        return {"type": "thinking", "thinking": piece.text, "signature": ""}
    return {"type": "text", "text": piece.text}


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _event(name: str, data: dict[str, Any]) -> str:
    return sse({"type": name, **data}, name)


def _started(run: ChatRun, reply_id: str, name: str) -> str:
    """`message_start`, sent with the first block, once the prompt's cached part is known."""
    prompt = Outcome("", run.prompt_tokens, 0, run.warm)
    message: dict[str, Any] = {"id": reply_id, "type": "message", "role": "assistant", "model": name, "content": []}
    message |= {"stop_reason": None, "stop_sequence": None, "usage": usage(prompt, run.marked)}
    return _event("message_start", {"message": message})


async def _stream(run: ChatRun, reply_id: str, name: str) -> AsyncIterator[str]:
    index, open_kind, started = -1, None, False
    try:
        async for piece in run.pieces():
            if not started:
                started = True
                yield _started(run, reply_id, name)
            kind = {"text": "text", "reasoning": "thinking"}.get(piece.kind, "tool_use")
            if open_kind is not None and (kind != open_kind or kind == "tool_use"):
                yield _event("content_block_stop", {"index": index})
                open_kind = None
            if kind == "tool_use":
                index += 1
                block = {"type": "tool_use", "id": _tool_id(piece.call_id), "name": piece.name, "input": {}}
                yield _event("content_block_start", {"index": index, "content_block": block})
                delta: dict[str, str | None] = {"type": "input_json_delta", "partial_json": piece.arguments}
                yield _event("content_block_delta", {"index": index, "delta": delta})
                yield _event("content_block_stop", {"index": index})
                continue
            if open_kind is None:
                index += 1
                open_kind = kind
                block = (
                    {"type": "text", "text": ""}
                    if kind == "text"
                    else {"type": "thinking", "thinking": "", "signature": ""}
                )
                yield _event("content_block_start", {"index": index, "content_block": block})
            delta = (
                {"type": "text_delta", "text": piece.text}
                if kind == "text"
                else {"type": "thinking_delta", "thinking": piece.text}
            )
            yield _event("content_block_delta", {"index": index, "delta": delta})
    finally:
        run.cancel()
    if not started:
        yield _started(run, reply_id, name)
    if open_kind is not None:
        yield _event("content_block_stop", {"index": index})
    outcome = run.result()
    if isinstance(outcome, str):
        yield _event("error", {"error": anthropic_errors.body(outcome, 500)["error"]})
        return
    delta = {"stop_reason": stop_reason(outcome), "stop_sequence": outcome.stopped_by}
    yield _event("message_delta", {"delta": delta, "usage": usage(outcome, run.marked)})
    yield _event("message_stop", {})
