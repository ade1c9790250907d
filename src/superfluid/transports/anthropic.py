"""Anthropic Messages route: POST /v1/messages, streaming or not.

Content blocks map onto the chat template's messages: `text` to content, `tool_use` to an
assistant tool call, `tool_result` to a tool message. Replies carry `thinking`, `text`
and `tool_use` blocks; streams send `message_start`, per-block `content_block_start`,
`content_block_delta` and `content_block_stop`, then `message_delta` and
`message_stop`. A tool call arrives whole, as one `input_json_delta`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..chat import ChatError, ChatRequest, ChatRun, Outcome, Piece
from ..daemon import Daemon
from ..model.tools import ToolDeclarationError, normalize_tools
from .chat_http import HttpPolicy, answer, collect, runtime_for, scheduling
from .openai import GONE, Body, sampling, text_of

_ids = itertools.count(1)
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class MessagesRequest(Body):
    """The body of POST /v1/messages."""

    model: str | None = None
    max_tokens: int
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    ignore_eos: bool = False  # an extension: decode to max_tokens


def error(message: str, status: int = 400, kind: str = "invalid_request_error") -> Response:
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status)


def chat_messages(system: str | list[dict[str, Any]] | None, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Anthropic messages (and system) as the chat template wants them."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": system if isinstance(system, str) else text_of(system)})
    for message in messages:
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise ChatError(f"message role {role!r} is not user or assistant")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        texts, calls = [], []
        for block in content or []:
            kind = block.get("type")
            if kind == "text":
                texts.append(block.get("text", ""))
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
                text = result if isinstance(result, str) else text_of(result)
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id", ""), "content": text})
            elif kind == "image":
                raise ChatError("this model takes text only, not image blocks")
        if texts or calls or role == "assistant":
            entry: dict[str, Any] = {"role": role, "content": "".join(texts)}
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
    return out


def usage(outcome: Outcome) -> dict[str, Any]:
    return {
        "input_tokens": outcome.prompt_tokens - outcome.cached_tokens,
        "output_tokens": outcome.completion_tokens,
        "cache_read_input_tokens": outcome.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def stop_reason(outcome: Outcome) -> str:
    return "stop_sequence" if outcome.stopped_by else STOP_REASONS.get(outcome.finish, "end_turn")


def router(daemon: Daemon, policy: HttpPolicy) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/messages")
    async def messages(body: MessagesRequest, http: Request) -> Response:
        try:
            qos, invariant = scheduling(http, policy)
            runtime = await runtime_for(daemon, body.model)
            request = ChatRequest(
                messages=chat_messages(body.system, body.messages),
                params=sampling(runtime.sampling, body.temperature, body.top_p, body.top_k, None, None),
                max_tokens=body.max_tokens,
                tools=normalize_tools(body.tools or []),
                stop=list(body.stop_sequences or []),
                ignore_eos=body.ignore_eos,
                qos=qos,
                batch_invariant=invariant,
            )
            run = ChatRun(daemon, request, runtime)
        except ChatError as e:
            return error(str(e), e.status, "permission_error" if e.status == 403 else "invalid_request_error")
        except ToolDeclarationError as e:
            return error(str(e))
        reply_id = f"msg_superfluid_{next(_ids)}"
        name = body.model or run.runtime.id
        if body.stream:
            return StreamingResponse(_stream(run, reply_id, name), media_type="text/event-stream")
        return await answer(policy, lambda: _reply(run, http, reply_id, name))

    return api


async def _reply(run: ChatRun, http: Request, reply_id: str, name: str) -> Response:
    reply = await collect(run, http)
    if reply is None:
        return error("the client closed the connection", GONE)
    blocks = [_block(piece) for piece in reply.pieces]
    outcome = run.result()
    if isinstance(outcome, str):
        return error(outcome, 500, "api_error")
    return JSONResponse(
        {
            "id": reply_id,
            "type": "message",
            "role": "assistant",
            "model": name,
            "content": blocks,
            "stop_reason": stop_reason(outcome),
            "stop_sequence": outcome.stopped_by,
            "usage": usage(outcome),
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
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _stream(run: ChatRun, reply_id: str, name: str) -> AsyncIterator[str]:
    start = {"id": reply_id, "type": "message", "role": "assistant", "model": name, "content": []}
    start |= {
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": run.prompt_tokens, "output_tokens": 0},
    }
    yield _event("message_start", {"message": start})
    index, open_kind = -1, None
    try:
        async for piece in run.pieces():
            kind = {"text": "text", "reasoning": "thinking"}.get(piece.kind, "tool_use")
            if open_kind is not None and (kind != open_kind or kind == "tool_use"):
                yield _event("content_block_stop", {"index": index})
                open_kind = None
            if kind == "tool_use":
                index += 1
                block = {"type": "tool_use", "id": _tool_id(piece.call_id), "name": piece.name, "input": {}}
                yield _event("content_block_start", {"index": index, "content_block": block})
                delta = {"type": "input_json_delta", "partial_json": piece.arguments}
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
    if open_kind is not None:
        yield _event("content_block_stop", {"index": index})
    outcome = run.result()
    if isinstance(outcome, str):
        yield _event("error", {"error": {"type": "api_error", "message": outcome}})
        return
    delta = {"stop_reason": stop_reason(outcome), "stop_sequence": outcome.stopped_by}
    yield _event("message_delta", {"delta": delta, "usage": usage(outcome)})
    yield _event("message_stop", {})
