"""Ollama-compatible routes: /api/chat, /api/generate, /api/tags, /api/ps, /api/show, /api/pull, /api/version, /.

`/api/tags` and `/api/ps` name each model by the id `/v1/models` gives it. `/api/pull` fetches a
GGUF from Hugging Face (`ollama_pull.py`); the rest of Ollama's model management (`push`, `create`,
`copy`, `delete`, `blobs`) answers 501 in Ollama's error shape, saying what to use instead.

Streaming is on unless `"stream": false`, as in Ollama: one JSON object per line, the
last with `"done": true`, `done_reason`, and the token counts
(`prompt_eval_cached_count` is how much of the prompt came from the cache).

`/api/generate` with a `suffix` fills in the middle between `prompt` and `suffix` with the
model's FIM tokens (`fim_request.py`: the prompt the socket's `Complete` builds, on
`--fim-model`'s model when the request names none; `system`, `raw` and the template do not
apply), in the completion scheduling class unless `x-superfluid-qos` names another.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from .. import __version__
from ..core.daemon import Daemon
from ..core.fim import missing_markers
from ..core.runtime import ModelError, Runtime
from ..model.pull import PullError
from ..model.tools import ToolDeclarationError, normalize_tools
from ..protocol.jsoncodec import compact
from ..transports.access import may_administer
from .chat import ChatError, ChatRequest, ChatRun, Outcome, Piece
from .chat_http import HttpPolicy, answer, collect, model_id_for, runtime_for, scheduling
from .fim_request import completion_scheduling, fim_runtime_for, fim_tokens
from .ollama_pull import PullBody, last, lines, start
from .openai import GONE, Body, sampling

MANAGEMENT = ("/api/push", "/api/create", "/api/copy", "/api/delete", "/api/blobs/{digest}")
OPTIONS = {"num_predict", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "num_ctx", "ignore_eos"}


class ShowBody(Body):
    """The body of POST /api/show."""

    model: str | None = None
    name: str | None = None


class ChatBody(Body):
    """The body of POST /api/chat."""

    keep_alive: int | float | str | None = None
    model: str | None = None
    messages: list[dict[str, Any]] = []
    stream: bool = True
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    think: bool | str | None = None  # thinking on or off, or an effort (gpt-oss: low, medium, high)
    tool_choice: str | dict[str, Any] | None = None  # extension, as on /v1/chat/completions


class GenerateBody(Body):
    """The body of POST /api/generate."""

    keep_alive: int | float | str | None = None
    model: str | None = None
    prompt: str = ""
    suffix: str = ""  # fill in the middle between prompt and suffix
    system: str | None = None
    raw: bool = False
    stream: bool = True
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None


def error(message: str, status: int = 400) -> Response:
    return JSONResponse({"error": message}, status_code=status)


def _now() -> str:
    return datetime.now(tz=UTC).isoformat().replace("+00:00", "Z")


def _request(
    runtime: Runtime,
    http: Request,
    policy: HttpPolicy,
    messages: list[dict[str, Any]],
    options: dict[str, Any] | None,
    fmt: Any,
    completion: bool = False,
    **kw: Any,
) -> ChatRequest:
    options = dict(options or {})
    unknown = sorted(set(options) - OPTIONS)
    if unknown:
        raise ChatError(f"unsupported option: {unknown[0]}")
    if options.get("num_ctx") not in (None, runtime.window):
        raise ChatError(f"num_ctx must be the server's window, {runtime.window}; start superfluid with --max-context")
    qos, invariant = (completion_scheduling if completion else scheduling)(http, policy)
    seed = options.get("seed")
    predict = options.get("num_predict")
    stop = options.get("stop") or []
    return ChatRequest(
        messages=messages,
        params=sampling(
            runtime.sampling,
            options.get("temperature"),
            options.get("top_p"),
            options.get("top_k"),
            options.get("min_p"),
            seed if seed and seed > 0 else None,
        ),
        max_tokens=predict if predict and predict > 0 else None,
        stop=[stop] if isinstance(stop, str) else list(stop),
        json_schema=True if fmt == "json" else (fmt or None),
        ignore_eos=bool(options.get("ignore_eos")),
        qos=qos,
        batch_invariant=invariant,
        **kw,
    )


def _entry(daemon: Daemon, model_id: str) -> dict[str, Any]:
    path = daemon.models.known[model_id].path
    stat = path.stat()
    return {
        "name": model_id,
        "model": model_id,
        "modified_at": datetime.fromtimestamp(stat.st_mtime, tz=UTC).isoformat().replace("+00:00", "Z"),
        "size": stat.st_size,
        "digest": hashlib.sha256(str(path).encode()).hexdigest(),
        "details": {"format": "gguf"},
    }


async def _keep_alive(daemon: Daemon, http: Request, model: str | None, keep_alive: Any) -> str | None:
    """Ollama's keep_alive on a request with nothing to generate: 0 unloads the model (an admin's
    right under `--key-policy`, as `/v1/models/unload` is), anything else loads it."""
    model_id = model_id_for(daemon, model)
    if keep_alive in (0, "0", "0s", "0m"):
        if not may_administer(http.scope):
            raise ChatError("unloading a model needs an admin key", 403, "admin_required")
        try:
            await asyncio.to_thread(daemon.models.unload, model_id)
        except ModelError as e:
            raise ChatError(str(e), e.status) from None
        return "unload"
    await runtime_for(daemon, model_id)
    return "load"


def router(daemon: Daemon, policy: HttpPolicy) -> APIRouter:
    api = APIRouter()

    @api.api_route("/", methods=["GET", "HEAD"])  # Claude Code's first request is HEAD /
    async def root() -> Response:
        return PlainTextResponse("superfluid is running")

    @api.get("/api/version")
    async def version() -> dict[str, Any]:
        return {"version": __version__, "server": "superfluid", "compatibility": "ollama-inference"}

    @api.get("/api/tags")
    async def tags() -> dict[str, Any]:
        return {"models": [_entry(daemon, model_id) for model_id in daemon.models.known]}

    @api.get("/api/ps")
    async def ps() -> dict[str, Any]:
        return {"models": [{**_entry(daemon, r.id), "context_length": r.window} for r in daemon.models.loaded()]}

    async def management(http: Request) -> Response:
        return error(
            f"{http.url.path} is not served by superfluid: models are GGUF files it loads by path or Hugging "
            "Face id (POST /v1/models/load, or --model at start)",
            501,
        )

    for route in MANAGEMENT:
        api.add_api_route(route, management, methods=["POST", "DELETE", "HEAD"], include_in_schema=False)

    @api.post("/api/pull")
    async def pull(body: PullBody, http: Request) -> Response:
        if not may_administer(http.scope):
            return error("pulling a model needs an admin key", 403)
        try:
            pulling, client = await start(body.model or body.name or "")
            if body.stream:
                return StreamingResponse(lines(daemon, pulling, client), media_type="application/x-ndjson")
            return JSONResponse(await last(daemon, pulling, client))
        except PullError as e:
            return error(str(e), e.status)

    @api.post("/api/show")
    async def show(body: ShowBody) -> Response:
        try:
            runtime = await runtime_for(daemon, body.model or body.name)
        except ChatError as e:
            return error(str(e), e.status)
        return JSONResponse(
            {
                "template": runtime.template.source,
                "details": {"format": "gguf"},
                "model_info": {"general.name": runtime.model.name, "context_length": runtime.window},
                "capabilities": ["completion", "tools", *([] if missing_markers(runtime.model) else ["insert"])],
            }
        )

    @api.post("/api/chat")
    async def chat(body: ChatBody, http: Request) -> Response:
        try:
            if not body.messages and body.keep_alive is not None:
                done = await _keep_alive(daemon, http, body.model, body.keep_alive)
                message = {"role": "assistant", "content": ""}
                return JSONResponse(
                    {"model": body.model, "created_at": _now(), "message": message, "done": True, "done_reason": done}
                )
            messages = []
            for m in body.messages:
                if m.get("images"):
                    raise ChatError("this model takes text only, not images")
                converted = {"role": m.get("role"), "content": m.get("content") or ""}
                if m.get("tool_calls"):
                    converted["tool_calls"] = m["tool_calls"]
                messages.append(converted)
            runtime = await runtime_for(daemon, body.model)
            tools = normalize_tools(body.tools or [])
            think = body.think
            switches = {"reasoning_effort": think} if isinstance(think, str) else {"enable_thinking": think}
            request = _request(
                runtime,
                http,
                policy,
                messages,
                body.options,
                body.format,
                tools=tools,
                tool_choice=body.tool_choice or "auto",
                template_vars=switches if think is not None else {},
            )
            run = await ChatRun.open(daemon, request, runtime)
        except ChatError as e:
            return error(str(e), e.status)
        except ToolDeclarationError as e:
            return error(str(e))
        return await _respond(run, http, policy, body.model or runtime.id, body.stream, chat=True)

    @api.post("/api/generate")
    async def generate(body: GenerateBody, http: Request) -> Response:
        try:
            if not body.prompt and not body.suffix:
                done = await _keep_alive(daemon, http, body.model, body.keep_alive)
                return JSONResponse(
                    {"model": body.model, "created_at": _now(), "response": "", "done": True, "done_reason": done}
                )
            if body.suffix:
                runtime = await fim_runtime_for(daemon, body.model)
                tokens = fim_tokens(runtime, body.prompt, body.suffix)
                request = _request(
                    runtime, http, policy, [], body.options, body.format, completion=True, prompt_tokens=tokens
                )
            elif body.raw:
                runtime = await runtime_for(daemon, body.model)
                request = _request(runtime, http, policy, [], body.options, body.format, prompt=body.prompt)
            else:
                runtime = await runtime_for(daemon, body.model)
                messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
                    {"role": "user", "content": body.prompt}
                ]
                request = _request(runtime, http, policy, messages, body.options, body.format)
            run = await ChatRun.open(daemon, request, runtime)
        except ChatError as e:
            return error(str(e), e.status)
        return await _respond(run, http, policy, body.model or runtime.id, body.stream, chat=False)

    return api


def _part(piece: Piece, name: str, chat: bool) -> dict[str, Any]:
    if chat:
        if piece.kind == "tool_call":
            call = {"function": {"name": piece.name, "arguments": json.loads(piece.arguments)}}
            message = {"role": "assistant", "content": "", "tool_calls": [call]}
        elif piece.kind == "reasoning":
            message = {"role": "assistant", "content": "", "thinking": piece.text}
        else:
            message = {"role": "assistant", "content": piece.text}
        return {"model": name, "created_at": _now(), "message": message, "done": False}
    return {"model": name, "created_at": _now(), "response": piece.text if piece.kind == "text" else "", "done": False}


def _final(outcome: Outcome, name: str, chat: bool, started: float) -> dict[str, Any]:
    final: dict[str, Any] = {
        "model": name,
        "created_at": _now(),
        "done": True,
        "done_reason": "length" if outcome.finish == "length" else "stop",
        "total_duration": int((time.monotonic() - started) * 1e9),
        "prompt_eval_count": outcome.prompt_tokens,
        "prompt_eval_cached_count": outcome.cached_tokens,
        "eval_count": outcome.completion_tokens,
    }
    if chat:
        final["message"] = {"role": "assistant", "content": ""}
    else:
        final["response"] = ""
    return final


async def _respond(run: ChatRun, http: Request, policy: HttpPolicy, name: str, stream: bool, chat: bool) -> Response:
    started = time.monotonic()
    if stream:
        return StreamingResponse(_lines(run, name, chat, started), media_type="application/x-ndjson")
    return await answer(policy, lambda: _whole(run, http, name, chat, started))


async def _whole(run: ChatRun, http: Request, name: str, chat: bool, started: float) -> Response:
    reply = await collect(run, http)
    if reply is None:
        return error("the client closed the connection", GONE)
    outcome = run.result()
    if isinstance(outcome, str):
        return error(outcome, 500)
    final = _final(outcome, name, chat, started)
    if chat:
        final["message"] = {"role": "assistant", "content": reply.text}
        if reply.reasoning:
            final["message"]["thinking"] = reply.reasoning
        if reply.calls:
            final["message"]["tool_calls"] = [
                {"function": {"name": c.name, "arguments": json.loads(c.arguments)}} for c in reply.calls
            ]
    else:
        final["response"] = reply.text
    return JSONResponse(final)


async def _lines(run: ChatRun, name: str, chat: bool, started: float) -> AsyncIterator[str]:
    try:
        async for piece in run.pieces():
            yield compact(_part(piece, name, chat)) + "\n"  # Ollama's lines are compact too
    finally:
        run.cancel()
    outcome = run.result()
    if isinstance(outcome, str):
        yield compact({"error": outcome}) + "\n"
        return
    yield compact(_final(outcome, name, chat, started)) + "\n"
