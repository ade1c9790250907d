"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions and /v1/models.

Each request runs as a fresh session (see `chat.py`), so a conversation that is sent
again with one more turn starts from its cached prefix. Streaming answers are
server-sent events of `chat.completion.chunk` objects ending with `data: [DONE]`; the
last chunk carries `usage`, with the prompt tokens served from the cache as
`prompt_tokens_details.cached_tokens` and `superfluid.warm` (and, on every reply, the
`x-superfluid-warm` header). A failure mid-stream is an `{"error": ...}` chunk, then
`data: [DONE]`. The chat extras (n, logprobs, logit bias, penalties, template variables)
are read by `extras.py`.

`/v1/completions` continues a raw prompt, or with `suffix` fills in the middle between
`prompt` and `suffix` (`fim_request.py`: the prompt the socket's `Complete` builds, on
`--fim-model`'s model when the request names none). `echo` puts the prompt before the
text, and the legacy integer `logprobs` (0-20 alternatives) answers OpenAI's completions
object `{tokens, token_logprobs, top_logprobs, text_offset}` for the generated tokens
(the prompt's tokens are not scored). Completions run in the completion scheduling class
unless `x-superfluid-qos` names another.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..config import SamplingDefaults
from ..core.daemon import Daemon
from ..engine.shaping import MAX_TOP_LOGPROBS
from ..model.tools import ToolDeclarationError, normalize_tools
from ..protocol.jsoncodec import sse
from ..protocol.schema import GenParams
from .chat import ChatError, ChatRequest, ChatRun, Collected, Outcome, Piece, seed_for
from .chat_http import HttpPolicy, answer, collect, collect_all, runtime_for, scheduling, while_connected
from .extras import ChatExtras, ShapedBody, choice_requests, logprobs_json
from .fim_request import completion_scheduling, fim_runtime_for, fim_tokens
from .logprobs import TokenLogprob

_ids = itertools.count(1)


class Body(BaseModel):
    """Unknown fields are ignored, as OpenAI's servers do."""

    model_config = ConfigDict(extra="allow")


class SampledBody(ShapedBody):
    """The fields both OpenAI endpoints share: the model, its sampling, bias and penalties, stops and streaming."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    ignore_eos: bool = False

    def params(self, defaults: SamplingDefaults) -> GenParams:
        return sampling(defaults, self.temperature, self.top_p, self.top_k, self.min_p, self.seed)


class ChatCompletionRequest(SampledBody, ChatExtras):
    """The body of POST /v1/chat/completions."""

    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(SampledBody):
    """The body of POST /v1/completions; with `suffix` (even empty) it fills in the middle."""

    prompt: str
    suffix: str | None = None
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None  # the legacy count of alternatives, 0 to 20

    def logprob_count(self) -> int:
        """-1 for no log probabilities, else how many alternatives each token lists."""
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ChatError(f"logprobs must be from 0 to {MAX_TOP_LOGPROBS}, not {self.logprobs}", param="logprobs")
        return -1 if self.logprobs is None else self.logprobs


def error(message: str, status: int = 400, code: str = "invalid_request_error", param: str | None = None) -> Response:
    return JSONResponse(envelope(message, code, param), status_code=status)


def envelope(message: str, code: str, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error object, as a reply body or a stream's error chunk."""
    return {"error": {"message": message, "type": code, "param": param, "code": code}}


GONE = 499  # the client closed its connection before the reply: nobody reads this status


def sampling(
    defaults: SamplingDefaults,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    min_p: float | None,
    seed: int | None,
) -> GenParams:
    """The request's sampling; what it leaves out comes from the model's defaults (`--temperature`
    and friends, or its GGUF's), else temperature 1 and top-k 40 when nothing else cuts."""
    asked = SamplingDefaults(temperature, top_p, top_k, min_p).over(defaults)
    t = 1.0 if asked.temperature is None else asked.temperature
    p = 1.0 if asked.top_p is None else asked.top_p
    m = 0.0 if asked.min_p is None else asked.min_p
    k = asked.top_k if asked.top_k is not None else (40 if t > 0 and p >= 1.0 and m <= 0.0 else 0)
    return GenParams(t, p, m, max(k, 0), seed_for(seed))


def _stops(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def text_of(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "input_text", "output_text"):
            parts.append(part.get("text", ""))
        elif kind in ("image_url", "input_image", "input_audio", "image"):
            raise ChatError(f"this model takes text only, not {kind} parts", code="unsupported_input")
    return "".join(parts)


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as the chat template wants them."""
    out = []
    for message in messages:
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise ChatError(f"message role {role!r} is not one of system, developer, user, assistant, tool")
        converted: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            "content": text_of(message.get("content")),
        }
        if message.get("tool_calls"):
            converted["tool_calls"] = message["tool_calls"]
        for key in ("tool_call_id", "name"):
            if message.get(key):
                converted[key] = message[key]
        out.append(converted)
    return out


def usage(outcome: Outcome, *more: Outcome) -> dict[str, Any]:
    """The usage of a reply: its prompt once (as the first choice saw it), the completions of every choice."""
    completion = outcome.completion_tokens + sum(o.completion_tokens for o in more)
    return {
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": outcome.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
    }


def router(daemon: Daemon, policy: HttpPolicy) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        try:
            qos, invariant = scheduling(http, policy)
        except ChatError as e:
            return error(str(e), e.status, e.code, e.param)
        return await chat_completion(daemon, body, qos, invariant, policy, http)

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request) -> Response:
        try:
            qos, invariant = completion_scheduling(http, policy)
        except ChatError as e:
            return error(str(e), e.status, e.code, e.param)
        return await completion(daemon, body, qos, invariant, policy, http)

    return api


async def chat_completion(
    daemon: Daemon, body: ChatCompletionRequest, qos: int, invariant: bool, policy: HttpPolicy, http: Request | None
) -> Response:
    """The reply to a chat completion run in class `qos`: the route's, and a batch's (`http` None: no
    client to watch for a hang-up)."""
    try:
        n = body.choices(body.stream)
        logprobs = body.logprob_count()
        tools = normalize_tools(body.tools or [])
        choice = body.tool_choice or "auto"
        schema = None
        if body.response_format and body.response_format.get("type") == "json_object":
            schema = True
        elif body.response_format and body.response_format.get("type") == "json_schema":
            schema = (body.response_format.get("json_schema") or {}).get("schema")
            if schema is None:
                return error("response_format json_schema needs a schema", param="response_format")
        runtime = await runtime_for(daemon, body.model)
        request = ChatRequest(
            messages=chat_messages(body.messages),
            params=body.params(runtime.sampling),
            max_tokens=body.max_completion_tokens or body.max_tokens,
            tools=tools,
            tool_choice=choice,
            parallel_tool_calls=bool(body.parallel_tool_calls),
            stop=_stops(body.stop),
            json_schema=schema,
            ignore_eos=body.ignore_eos,
            qos=qos,
            batch_invariant=invariant,
            shaping=body.shaping(runtime.sampling, logprobs),
            template_vars=body.template_vars(),
        )
        runs = [await ChatRun.open(daemon, one, runtime) for one in choice_requests(request, n)]
    except ToolDeclarationError as e:
        return error(str(e), param="tools")
    except ChatError as e:
        return error(str(e), e.status, e.code, e.param)
    reply_id = f"chatcmpl-superfluid-{next(_ids)}"
    name = body.model or runtime.id
    if body.stream:
        usage_apart = bool((body.stream_options or {}).get("include_usage"))
        return await _chat_stream_reply(runs[0], http, reply_id, name, logprobs >= 0, usage_apart)
    return await answer(policy, lambda: _chat_reply(runs, http, reply_id, name, logprobs >= 0))


async def completion(
    daemon: Daemon, body: CompletionRequest, qos: int, invariant: bool, policy: HttpPolicy, http: Request | None
) -> Response:
    """The reply to a completion run in class `qos`: the route's, and a batch's (`http` None, as
    `chat_completion`)."""
    try:
        logprobs = body.logprob_count()
        prompt: dict[str, Any]  # the request's prompt as text, or as token ids (a FIM prompt)
        if body.suffix is not None:
            runtime = await fim_runtime_for(daemon, body.model)
            prompt = {"prompt_tokens": fim_tokens(runtime, body.prompt, body.suffix, param="suffix")}
        else:
            runtime = await runtime_for(daemon, body.model)
            prompt = {"prompt": body.prompt}
        request = ChatRequest(
            messages=[],
            **prompt,
            params=body.params(runtime.sampling),
            max_tokens=body.max_tokens,
            stop=_stops(body.stop),
            ignore_eos=body.ignore_eos,
            qos=qos,
            batch_invariant=invariant,
            shaping=body.shaping(runtime.sampling, logprobs),
        )
        run = await ChatRun.open(daemon, request, runtime)
    except ChatError as e:
        return error(str(e), e.status, e.code, e.param)
    reply_id = f"cmpl-superfluid-{next(_ids)}"
    name = body.model or run.runtime.id
    echo = body.prompt if body.echo else ""
    if body.stream:
        return StreamingResponse(
            _completion_stream(run, reply_id, name, echo, logprobs >= 0), media_type="text/event-stream"
        )
    return await answer(policy, lambda: _completion_reply(run, http, reply_id, name, echo, logprobs >= 0))


def completion_logprobs(entries: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
    """The legacy completions `logprobs` object of tokens whose text starts at character `offset` of
    the choice's text: each token, its log probability, its best alternatives (with the drawn
    token) and where its text starts."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        drawn = entry.drawn
        top = {c.token: c.logprob for c in entry.top}
        top[drawn.token] = drawn.logprob  # the drawn token is always among them
        out["tokens"].append(drawn.token)
        out["token_logprobs"].append(drawn.logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(drawn.token)
    return out


async def _completion_reply(
    run: ChatRun, http: Request | None, reply_id: str, name: str, echo: str, logprobs: bool
) -> Response:
    reply = await collect(run, http)
    if reply is None:
        return error("the client closed the connection", GONE, "client_closed")
    outcome = run.result()
    if isinstance(outcome, str):
        return error(outcome, 500, "server_error")
    shown = completion_logprobs(reply.logprobs, len(echo)) if logprobs else None
    choice = {"index": 0, "text": echo + reply.text, "finish_reason": outcome.finish, "logprobs": shown}
    return JSONResponse(_reply(reply_id, "text_completion", name, [choice], [outcome]))


async def _chat_reply(runs: list[ChatRun], http: Request | None, reply_id: str, name: str, logprobs: bool) -> Response:
    replies = await collect_all(runs, http)
    if replies is None:
        return error("the client closed the connection", GONE, "client_closed")
    outcomes = []
    for run in runs:
        outcome = run.result()
        if isinstance(outcome, str):
            return error(outcome, 500, "server_error")
        outcomes.append(outcome)
    choices = [
        _chat_choice(index, reply, outcome, logprobs)
        for index, (reply, outcome) in enumerate(zip(replies, outcomes, strict=True))
    ]
    return JSONResponse(
        _reply(reply_id, "chat.completion", name, choices, outcomes),
        headers={"x-superfluid-warm": str(outcomes[0].cached_tokens)},
    )


def _chat_choice(index: int, reply: Collected, outcome: Outcome, logprobs: bool) -> dict[str, Any]:
    calls = [
        {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in reply.calls
    ]
    message: dict[str, Any] = {"role": "assistant", "content": reply.text or (None if calls else "")}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    if calls:
        message["tool_calls"] = calls
    return {
        "index": index,
        "message": message,
        "finish_reason": outcome.finish,
        "logprobs": logprobs_json(reply.logprobs) if logprobs else None,
    }


def _reply(
    reply_id: str, kind: str, name: str, choices: list[dict[str, Any]], outcomes: list[Outcome]
) -> dict[str, Any]:
    """The body of a whole (non-streamed) reply of either endpoint."""
    return {
        "id": reply_id,
        "object": kind,
        "created": int(time.time()),
        "model": name,
        "choices": choices,
        "usage": usage(*outcomes),
        "superfluid": superfluid_extras(outcomes),
    }


def superfluid_extras(outcomes: list[Outcome]) -> dict[str, Any]:
    """What a reply says beyond OpenAI's fields: the prompt tokens served warm and, when speculation
    drafted, its drafts proposed and accepted."""
    extras: dict[str, Any] = {"warm": outcomes[0].cached_tokens}
    proposed = sum(o.spec[0] for o in outcomes)
    if proposed:
        accepted = sum(o.spec[1] for o in outcomes)
        extras["spec"] = {"proposed": proposed, "accepted": accepted, "acceptance_rate": round(accepted / proposed, 4)}
    return extras


async def _first_pieces(pieces: AsyncIterator[Piece]) -> list[Piece]:
    """The first piece of a reply, or none when it ended without one (so that None can mean the client left)."""
    piece = await anext(pieces, None)
    return [] if piece is None else [piece]


async def _chat_stream_reply(
    run: ChatRun, http: Request | None, reply_id: str, name: str, logprobs: bool, usage_apart: bool
) -> Response:
    """A streamed reply, answered once the run has its first piece (by then its warm prefix is known),
    or has failed before it: a failure is an error chunk then `[DONE]` either way. `usage_apart`
    (the client's `stream_options.include_usage`) sends the usage in a chunk of its own with no
    choices, as the API has it; without it the usage rides on the last chunk, as llama-server's."""
    pieces = run.pieces()
    first = await while_connected(_first_pieces(pieces), [run], http)
    if first is None:
        return error("the client closed the connection", GONE, "client_closed")
    return StreamingResponse(
        _chat_stream(run, first, pieces, reply_id, name, logprobs, usage_apart),
        media_type="text/event-stream",
        headers={"x-superfluid-warm": str(run.warm)},
    )


async def _chat_stream(
    run: ChatRun,
    first: list[Piece],
    rest: AsyncIterator[Piece],
    reply_id: str,
    name: str,
    logprobs: bool,
    usage_apart: bool,
) -> AsyncIterator[str]:
    base = {"id": reply_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": name}

    def chunk(delta: dict[str, Any], finish: str | None = None, piece: Piece | None = None, **extra: Any) -> str:
        shown = logprobs_json(piece.logprobs) if logprobs and piece is not None else None
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": shown}
        return sse({**base, "choices": [choice], **extra})

    async def pieces() -> AsyncIterator[Piece]:
        for piece in first:
            yield piece
        async for piece in rest:
            yield piece

    yield chunk({"role": "assistant", "content": ""})
    calls = 0
    try:
        async for piece in pieces():
            if piece.kind == "text":
                yield chunk({"content": piece.text}, piece=piece)
            elif piece.kind == "reasoning":
                yield chunk({"reasoning_content": piece.text})
            else:
                call = {"index": calls, "id": piece.call_id, "type": "function"}
                call["function"] = {"name": piece.name, "arguments": piece.arguments}
                yield chunk({"tool_calls": [call]})
                calls += 1
    finally:
        run.cancel()  # the client hung up mid-stream, or the generation is over
    outcome = run.result()
    if isinstance(outcome, str):
        yield sse(envelope(outcome, "server_error"))
    else:
        extras = superfluid_extras([outcome])
        if usage_apart:
            yield chunk({}, outcome.finish, superfluid=extras)
            yield sse({**base, "choices": [], "usage": usage(outcome)})
        else:
            yield chunk({}, outcome.finish, usage=usage(outcome), superfluid=extras)
    yield "data: [DONE]\n\n"


async def _completion_stream(
    run: ChatRun, reply_id: str, name: str, echo: str = "", logprobs: bool = False
) -> AsyncIterator[str]:
    created = int(time.time())
    base = {"id": reply_id, "object": "text_completion", "created": created, "model": name}

    def chunk(text: str, shown: dict[str, Any] | None) -> str:
        return sse({**base, "choices": [{"index": 0, "text": text, "finish_reason": None, "logprobs": shown}]})

    offset = len(echo)
    try:
        if echo:
            yield chunk(echo, completion_logprobs((), 0) if logprobs else None)
        async for piece in run.pieces():
            if piece.kind == "text" and (piece.text or (logprobs and piece.logprobs)):
                yield chunk(piece.text, completion_logprobs(piece.logprobs, offset) if logprobs else None)
                offset += sum(len(entry.drawn.token) for entry in piece.logprobs) if logprobs else 0
    finally:
        run.cancel()
    outcome = run.result()
    if isinstance(outcome, str):
        yield sse(envelope(outcome, "server_error"))
    else:
        choice = {"index": 0, "text": "", "finish_reason": outcome.finish, "logprobs": None}
        yield sse({**base, "choices": [choice], "usage": usage(outcome)})
    yield "data: [DONE]\n\n"
