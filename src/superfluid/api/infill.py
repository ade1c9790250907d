"""llama.cpp's `POST /infill`, the fill-in-the-middle route of llama-server that llama.vscode
and llama.vim call.

The body: `input_prefix` and `input_suffix` around the gap, `prompt` (the text of the
current line before the cursor, added after `input_prefix`), `input_extra` (a list of
`{"filename", "text"}` chunks of other files, put before the FIM prompt as repository
context, `fim.repo_context`; its oldest tokens are dropped when the prompt would leave no
room for the reply), `n_predict`, `stream`, `temperature`, `top_k`, `top_p`, `min_p`,
`seed` (-1 draws one), `stop`, `ignore_eos`, `repeat_penalty`, `presence_penalty`,
`frequency_penalty` and `model`; llama-server's other options (`cache_prompt`, `n_indent`,
`t_max_prompt_ms`, `samplers`...) are accepted and ignored. Without `input_extra` the prompt
is the socket's `Complete` prompt of the same prefix and suffix, prefix-suffix-middle, with
no BOS. The reply is `/completion`'s: `content`, `stop: true`, `tokens_predicted`,
`tokens_evaluated` (the prompt's tokens), `tokens_cached`, `stop_type`, `timings`; a stream
is `data: {"content": ..., "stop": false}` lines and that reply last, with no `[DONE]`.
Errors are llama-server's `{"error": {"code", "message", "type"}}`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..core.daemon import Daemon
from ..protocol.jsoncodec import sse
from .chat import ChatError, ChatRequest, ChatRun, Collected, Outcome, Piece
from .chat_http import HttpPolicy, answer, while_connected
from .extras import ShapedBody
from .fim_request import completion_scheduling, fim_runtime_for, fim_tokens
from .openai import GONE, Body, sampling

REPLY_ROOM = 256  # tokens of the window extra context leaves for a reply of unbounded n_predict


class ExtraChunk(BaseModel):
    """One file of `input_extra`."""

    filename: str = "tmp"
    text: str = ""


class InfillBody(Body):
    """The body of POST /infill."""

    model: str | None = None
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunk] = []
    prompt: str = ""
    n_predict: int = -1
    stream: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


def error(message: str, status: int = 400, code: str = "invalid_request_error") -> Response:
    """llama-server's error object."""
    return JSONResponse({"error": {"code": status, "message": message, "type": code}}, status_code=status)


def router(daemon: Daemon, policy: HttpPolicy) -> APIRouter:
    api = APIRouter()

    @api.post("/infill")
    async def infill(body: InfillBody, http: Request) -> Response:
        try:
            qos, invariant = completion_scheduling(http, policy)
            runtime = await fim_runtime_for(daemon, body.model)
            predict = body.n_predict if body.n_predict > 0 else None
            tokens = fim_tokens(
                runtime,
                body.input_prefix + body.prompt,
                body.input_suffix,
                [(chunk.filename, chunk.text) for chunk in body.input_extra],
                reserve=predict or min(REPLY_ROOM, runtime.window // 4),
            )
            shaped = ShapedBody(
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repeat_penalty=body.repeat_penalty,
            )
            seed = body.seed if body.seed is not None and body.seed >= 0 else None
            request = ChatRequest(
                messages=[],
                prompt_tokens=tokens,
                params=sampling(runtime.sampling, body.temperature, body.top_p, body.top_k, body.min_p, seed),
                max_tokens=predict,
                stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
                ignore_eos=body.ignore_eos,
                qos=qos,
                batch_invariant=invariant,
                shaping=shaped.shaping(runtime.sampling),
            )
            run = await ChatRun.open(daemon, request, runtime)
        except ChatError as e:
            return error(str(e), e.status, e.code)
        name = body.model or runtime.id
        started = time.monotonic()
        if body.stream:
            return StreamingResponse(_stream(run, name, started), media_type="text/event-stream")
        return await answer(policy, lambda: _whole(run, http, name, started))

    return api


def _final(outcome: Outcome, name: str, content: str, started: float, first: float | None) -> dict[str, Any]:
    """`/completion`'s last object: the counts, why it stopped, and how long it took."""
    now = time.monotonic()
    first = now if first is None else first
    prompt_ms, predicted_ms = (first - started) * 1000, (now - first) * 1000
    if outcome.stopped_by is not None:
        stop_type = "word"
    elif outcome.finish == "length":
        stop_type = "limit"
    else:
        stop_type = "eos"
    return {
        "index": 0,
        "content": content,
        "tokens": [],
        "stop": True,
        "model": name,
        "tokens_predicted": outcome.completion_tokens,
        "tokens_evaluated": outcome.prompt_tokens,
        "tokens_cached": outcome.cached_tokens,
        "truncated": False,
        "has_new_line": "\n" in content,
        "stop_type": stop_type,
        "stopping_word": outcome.stopped_by or "",
        "timings": {
            "cache_n": outcome.cached_tokens,
            "prompt_n": outcome.prompt_tokens - outcome.cached_tokens,
            "prompt_ms": round(prompt_ms, 3),
            "predicted_n": outcome.completion_tokens,
            "predicted_ms": round(predicted_ms, 3),
            "predicted_per_second": round(outcome.completion_tokens / (predicted_ms / 1000), 3)
            if predicted_ms > 0
            else 0.0,
        },
    }


async def _whole(run: ChatRun, http: Request, name: str, started: float) -> Response:
    first: list[float] = []  # when the first text came: the prompt's time ends there

    async def timed() -> Collected:
        reply = Collected()
        async for piece in run.pieces():
            if piece.text and not first:
                first.append(time.monotonic())
            reply.add(piece)
        return reply

    reply = await while_connected(timed(), [run], http)
    if reply is None:
        return error("the client closed the connection", GONE, "client_closed")
    outcome = run.result()
    if isinstance(outcome, str):
        return error(outcome, 500, "server_error")
    return JSONResponse(_final(outcome, name, reply.text, started, first[0] if first else None))


async def _stream(run: ChatRun, name: str, started: float) -> AsyncIterator[str]:
    first: float | None = None
    try:
        piece: Piece
        async for piece in run.pieces():
            if piece.kind == "text" and piece.text:
                first = first or time.monotonic()
                yield sse({"index": 0, "content": piece.text, "tokens": [], "stop": False})
    finally:
        run.cancel()
    outcome = run.result()
    if isinstance(outcome, str):
        yield sse({"error": {"code": 500, "message": outcome, "type": "server_error"}})
    else:
        yield sse(_final(outcome, name, "", started, first))
