"""OpenAI's Responses API: POST/GET/DELETE /v1/responses, and a stored response's input items.

A response runs on the chat path (`ChatRun`), so it is a session like any chat request.
A stored response (`store`, the default) keeps a record under `<sessions>/responses/`,
written before the response is returned: its input and output items, the items of the
turns before it, its usage, its session, the "head" its prompt starts with (model,
instructions, tools, template variables) and, under a key policy, the key that made it
(each key sees only its own). A request naming `previous_response_id` continues that
record: when the model and head are the same and the previous turn ended normally, its
session is forked after its last event and only the new input is appended, so the whole
earlier prompt is served from the cache; otherwise the conversation is rendered anew
from the stored items. Instructions and tools belong to one request: they are never
carried over.

Streams are server-sent events with an `event:` line and a `sequence_number` from 0,
ending with `response.completed` or `response.incomplete` (`error` then
`response.failed` when the generation fails) and no `[DONE]`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..core.daemon import Daemon
from ..core.errors import REFUSED, SessionElsewhere
from ..core.verbs.base import TURN_ENDED
from ..model.tools import ToolDeclarationError, normalize_tool
from ..protocol import schema as sf
from ..protocol.jsoncodec import sse
from .chat import ChatError, ChatRequest, ChatRun, Outcome
from .chat_http import HttpPolicy, answer, collect, may_forward, owner, runtime_for, scheduling
from .openai import GONE, SampledBody, chat_messages, error
from .response_items import Event, Output, appendable, chat_turns, input_items, new_id, qualified

log = logging.getLogger("superfluid.responses")

# request fields for what superfluid does not do, and what to do instead
UNSUPPORTED = {
    "background": "background responses are not supported: a response runs while its request is open",
    "conversation": "conversations are not supported: chain responses with previous_response_id",
    "prompt": "stored prompts are not supported: send instructions and input",
}


class ResponsesRequest(SampledBody):
    """The body of POST /v1/responses."""

    input: str | list[Any] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, Any] | None = None
    # echoed only: superfluid makes calls one at a time and never truncates
    parallel_tool_calls: bool | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension, as on /v1/chat/completions

    def template_vars(self) -> dict[str, Any]:
        """The chat template's variables: `reasoning.effort`, under chat_template_kwargs."""
        effort = (self.reasoning or {}).get("effort")
        return {**({"reasoning_effort": effort} if effort else {}), **(self.chat_template_kwargs or {})}


@dataclass
class Turn:
    """One response being made: its request, the conversation it continues and the run that answers."""

    id: str
    created: int
    model: str
    owner: str | None  # the policy key that made it
    body: ResponsesRequest
    items: list[dict[str, Any]]  # this request's input
    history: list[dict[str, Any]]  # the items of the turns before it
    head: dict[str, Any]
    run: ChatRun


# Built-in tools OpenAI runs on its side. Codex declares web search by default; a model that is
# never offered it just does not search, so it is left out rather than refused.
LEFT_OUT_TOOLS = ("web_search", "web_search_preview")


def function_tools(raw: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Function tools in the chat form, the functions of `namespace` tools among them (named
    `namespace.function`); ChatError for a built-in tool, which only OpenAI runs."""
    tools = []
    for index, tool in enumerate(raw or []):
        kind = tool.get("type")
        if kind in LEFT_OUT_TOOLS:
            continue
        if kind == "namespace":
            inner = tool.get("tools")
            if not isinstance(inner, list) or not isinstance(tool.get("name"), str):
                raise ChatError(
                    f"tools[{index}] is a namespace without a name and a list of tools", param=f"tools[{index}]"
                )
            for number, function in enumerate(inner):
                where = f"tools[{index}].tools[{number}]"
                named = {**function, "name": qualified(str(function.get("name")), tool["name"])}
                tools.append(_function(named, where))
            continue
        if kind != "function":
            raise ChatError(
                f"tools[{index}] is a {kind} tool: superfluid runs no built-in tools; declare function tools "
                "and run them yourself",
                code="unsupported_tool",
                param=f"tools[{index}]",
            )
        tools.append(_function(tool, f"tools[{index}]"))
    return tools


def _function(tool: dict[str, Any], where: str) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise ChatError(f"{where} is a {tool.get('type')} tool: a namespace holds function tools", param=where)
    declared = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
    try:
        return normalize_tool(declared)
    except ToolDeclarationError as e:
        raise ChatError(f"{where} is not a function declaration: {e}", param=where) from None


def tool_choice(raw: str | dict[str, Any] | None) -> str | dict[str, Any]:
    if raw is None:
        return "auto"
    if raw in ("auto", "none", "required"):
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("name"), str):
        return {"type": "function", "name": raw["name"]}
    if isinstance(raw, dict) and raw.get("type") not in (None, "function", "allowed_tools"):
        raise ChatError(
            f"tool_choice names a {raw.get('type')} tool: superfluid runs function tools only",
            code="unsupported_tool",
            param="tool_choice",
        )
    raise ChatError(
        'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}', param="tool_choice"
    )


def json_constraint(text: dict[str, Any] | None) -> Any:
    """The JSON schema `text.format` asks for (True for any object), or None for free text."""
    form = (text or {}).get("format") or {"type": "text"}
    kind = form.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return True
    if kind == "json_schema":
        if not isinstance(form.get("schema"), dict):
            raise ChatError("text.format json_schema needs a schema object", param="text.format.schema")
        return form["schema"]
    raise ChatError(f"text.format type {kind!r} is not one of text, json_object, json_schema", param="text.format")


def usage(outcome: Outcome, reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": outcome.prompt_tokens,
        "input_tokens_details": {"cached_tokens": outcome.cached_tokens},
        "output_tokens": outcome.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
    }


def _status(outcome: Outcome) -> str:
    return "incomplete" if outcome.finish == "length" else "completed"


def _event(event: Event, number: int) -> str:
    return sse({**event, "sequence_number": number}, event["type"])


class Responses:
    """The routes' state: the daemon the responses run on and where their records are kept."""

    def __init__(self, daemon: Daemon, policy: HttpPolicy) -> None:
        self.daemon = daemon
        self.policy = policy
        self.records = daemon.responses
        self._purges: set[asyncio.Task[None]] = set()

    async def record(self, response_id: str, http: Request) -> dict[str, Any] | None:
        """A stored response, if the request's key may see it: under a key policy each key sees its own."""
        record = await asyncio.to_thread(self.records.get, response_id)
        return record if record is not None and record.get("owner") == owner(http) else None

    async def turn(self, body: ResponsesRequest, http: Request) -> Turn:
        """Check a request and start its run; ChatError for what cannot be served."""
        for name, why in UNSUPPORTED.items():
            if getattr(body, name):
                raise ChatError(why, code="unsupported_parameter", param=name)
        if body.input is None:
            raise ChatError("input is required: a string or a list of items", param="input")
        if body.max_output_tokens is not None and body.max_output_tokens < 1:
            raise ChatError("max_output_tokens must be at least 1", param="max_output_tokens")
        tools = function_tools(body.tools)
        choice = tool_choice(body.tool_choice)
        schema = json_constraint(body.text)
        items = input_items(body.input)
        previous = None
        if body.previous_response_id:
            previous = await self.record(body.previous_response_id, http)
            if previous is None:
                raise ChatError(
                    f"no stored response {body.previous_response_id}", 404, "not_found", "previous_response_id"
                )
        qos, invariant = scheduling(http, self.policy)
        runtime = await runtime_for(self.daemon, body.model)
        variables = body.template_vars()
        head = {
            "model": runtime.id,
            "system": body.instructions or "",
            "tools": tools if choice != "none" else [],
            "template": variables,
        }
        history = [*previous["history"], *previous["input"], *previous["response"]["output"]] if previous else []
        fork = self._fork_point(previous, head, items, may_forward(http))
        if fork is not None:
            turns = chat_turns(items)
        else:
            system = [{"role": "system", "content": body.instructions}] if body.instructions else []
            turns = system + chat_turns(history + items)
        log.debug("%s: %s", "forked" if fork else "rendered", body.previous_response_id or "a new conversation")
        request = ChatRequest(
            messages=chat_messages(turns),
            params=body.params(runtime.sampling),
            max_tokens=body.max_output_tokens,
            tools=tools,
            tool_choice=choice,
            parallel_tool_calls=bool(body.parallel_tool_calls),
            json_schema=schema,
            ignore_eos=body.ignore_eos,
            qos=qos,
            batch_invariant=invariant,
            shaping=body.shaping(runtime.sampling),
            template_vars=variables,
            fork=fork,
        )
        run = await ChatRun.open(self.daemon, request, runtime)
        name = body.model or runtime.id
        return Turn(new_id("resp"), int(time.time()), name, owner(http), body, items, history, head, run)

    def _fork_point(
        self, previous: dict[str, Any] | None, head: dict[str, Any], items: list[dict[str, Any]], forward: bool
    ) -> tuple[int, int] | None:
        """Where to continue the previous response's session, when its prompt can be kept as it is. A
        session another daemon of the store serves raises SessionElsewhere when the request may be
        forwarded there (`forward`), where it continues warm; otherwise it is rendered anew here."""
        if previous is None or previous["head"] != head or not previous["turn_ended"] or not appendable(items):
            return None
        try:
            state = self.daemon.store.get(previous["session"])
        except SessionElsewhere as e:
            if forward and e.api:
                raise
            return None
        except REFUSED:  # the store away: render it anew
            return None
        if state is None or state.purged:
            return None
        return previous["session"], previous["events"]

    def response(self, turn: Turn, status: str, output: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        """The response object, as created and as finished."""
        body = turn.body
        return {
            "id": turn.id,
            "object": "response",
            "created_at": turn.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": turn.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": body.reasoning or {"effort": None, "summary": None},
            "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": body.truncation or "disabled",
            "metadata": body.metadata or {},
            "background": False,
            "usage": None,
            "user": None,
            **fields,
        }

    async def finish(self, turn: Turn, outcome: Outcome, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The finished response, stored (durably) when asked; OSError when the disk refuses."""
        reasoning = "".join(p["text"] for item in output if item["type"] == "reasoning" for p in item["content"])
        reasoning_tokens = len(turn.run.runtime.model.tokenize(reasoning, False)) if reasoning else 0
        status = _status(outcome)
        response = self.response(turn, status, output, usage=usage(outcome, reasoning_tokens))
        session = turn.run.session
        if not turn.body.store:
            return response
        events, ended = await asyncio.to_thread(self._session_end, session)
        record = {
            "response": response,
            "input": turn.items,
            "history": turn.history,
            "head": turn.head,
            "session": session,
            "events": events,
            "turn_ended": ended and status == "completed",
            "owner": turn.owner,
        }
        await asyncio.to_thread(self.records.put, turn.id, record)
        return response

    def _session_end(self, session: int) -> tuple[int, bool]:
        """The session's next event id, and whether its last turn ended normally."""
        with self.daemon.store.lock:
            state = self.daemon.store.get(session)
            return (state.next_id if state else 0), state is not None and state.last_finish in TURN_ENDED

    def forget_unstored(self, turn: Turn) -> None:
        """Purge the session of a `store: false` response however it ended (served, failed, or its
        client gone), in a task of its own: this runs where nothing may be awaited any more."""
        if turn.body.store:
            return
        task = asyncio.get_running_loop().create_task(self.purge(turn.run.session))
        self._purges.add(task)
        task.add_done_callback(self._purges.discard)

    async def purge(self, session: int) -> None:
        """Purge a response's session; sessions forked from it keep their history (reroot)."""
        state = self.daemon.store.get(session)
        if state is None or state.purged:
            return
        reply = await self.daemon.request(sf.Request.Purge(session, state.generation, sf.PurgeMode.Reroot()))
        if isinstance(reply, sf.Response.Err):
            log.warning("the session of a deleted response stays: %s", reply.message)

    async def reply(self, turn: Turn, http: Request) -> Response:
        try:
            return await self._reply(turn, http)
        finally:
            self.forget_unstored(turn)

    async def _reply(self, turn: Turn, http: Request) -> Response:
        collected = await collect(turn.run, http)
        if collected is None:
            return error("the client closed the connection", GONE, "client_closed")
        outcome = turn.run.result()
        if isinstance(outcome, str):
            return error(outcome, 500, "server_error")
        output = Output()
        for piece in collected.pieces:
            output.feed(piece)
        output.close(_status(outcome))
        try:
            response = await self.finish(turn, outcome, output.items)
        except OSError as e:
            return error(f"the response could not be stored: {e}", 500, "server_error")
        return JSONResponse(response, headers={"x-superfluid-warm": str(outcome.cached_tokens)})

    async def stream(self, turn: Turn) -> AsyncIterator[str]:
        try:
            async for event in self._stream(turn):
                yield event
        finally:
            turn.run.cancel()  # a client gone mid-stream leaves the inner generator unfinished
            self.forget_unstored(turn)

    async def _stream(self, turn: Turn) -> AsyncIterator[str]:
        numbers = itertools.count()
        started = self.response(turn, "in_progress", [])
        yield _event({"type": "response.created", "response": started}, next(numbers))
        yield _event({"type": "response.in_progress", "response": started}, next(numbers))
        output = Output()
        try:
            async for piece in turn.run.pieces():
                for event in output.feed(piece):
                    yield _event(event, next(numbers))
        finally:
            turn.run.cancel()  # the client hung up mid-stream, or the generation is over
        outcome = turn.run.result()
        if isinstance(outcome, str):
            failure = outcome
        else:
            for event in output.close(_status(outcome)):
                yield _event(event, next(numbers))
            try:
                response = await self.finish(turn, outcome, output.items)
            except OSError as e:
                failure = f"the response could not be stored: {e}"
            else:
                yield _event({"type": f"response.{response['status']}", "response": response}, next(numbers))
                return
        yield _event({"type": "error", "code": "server_error", "message": failure, "param": None}, next(numbers))
        failed = self.response(turn, "failed", output.items, error={"code": "server_error", "message": failure})
        yield _event({"type": "response.failed", "response": failed}, next(numbers))


def _not_found(response_id: str) -> Response:
    return error(f"no stored response {response_id}", 404, "not_found", "response_id")


def router(daemon: Daemon, policy: HttpPolicy) -> APIRouter:
    api = APIRouter()
    responses = Responses(daemon, policy)

    @api.post("/v1/responses")
    async def create(body: ResponsesRequest, http: Request) -> Response:
        try:
            turn = await responses.turn(body, http)
        except ChatError as e:
            return error(str(e), e.status, e.code, e.param)
        if body.stream:
            return StreamingResponse(responses.stream(turn), media_type="text/event-stream")
        return await answer(policy, lambda: responses.reply(turn, http))

    @api.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, http: Request) -> Response:
        record = await responses.record(response_id, http)
        return _not_found(response_id) if record is None else JSONResponse(record["response"])

    @api.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, http: Request) -> Response:
        record = await responses.record(response_id, http)
        if record is None:
            return _not_found(response_id)
        await asyncio.to_thread(responses.records.delete, response_id)
        await responses.purge(record["session"])
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    @api.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> Response:
        return error(
            "only background responses can be cancelled, and superfluid runs none: a response is done before "
            "it is stored (close a stream to stop one)",
            param="response_id",
        )

    @api.get("/v1/responses/{response_id}/input_items")
    async def items(
        response_id: str, http: Request, limit: int = 20, order: str = "desc", after: str | None = None
    ) -> Response:
        if not 1 <= limit <= 100:
            return error("limit must be from 1 to 100", param="limit")
        if order not in ("asc", "desc"):
            return error('order must be "asc" or "desc"', param="order")
        record = await responses.record(response_id, http)
        if record is None:
            return _not_found(response_id)
        listed = record["input"] if order == "asc" else record["input"][::-1]
        ids = [item["id"] for item in listed]
        if after is not None and after not in ids:
            return error(f"after names {after!r}, which is not an input item of {response_id}", param="after")
        start = ids.index(after) + 1 if after is not None else 0
        page = listed[start : start + limit]
        return JSONResponse(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": start + limit < len(listed),
            }
        )

    return api
