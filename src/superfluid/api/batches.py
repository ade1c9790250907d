"""OpenAI's batches: `POST /v1/batches`, `GET /v1/batches`, `GET /v1/batches/{id}` and
`POST /v1/batches/{id}/cancel`, and `BatchRunner`, which does their requests inside the daemon.

A batch reads a JSONL file uploaded with purpose `batch`, one request a line:
`{"custom_id": ..., "method": "POST", "url": <the batch's endpoint>, "body": {...}}`. Every line
is checked before any runs (JSON, a custom_id unique in the file, method POST, the batch's
endpoint, a body object); a file with a bad line fails the batch, its lines' problems in
`errors`. The requests go through the function the endpoint's route calls
(`openai.chat_completion`, `openai.completion`), in the background class, on half the lanes
at most, so the scheduler's other classes still find lanes; batches run one after another,
oldest first.

Each request's line is appended durably (`store/batches.py`) as it finishes: a daemon that
starts again resumes its unfinished batches with the requests that have no line yet, so none
runs twice and none is lost. At the end the lines become files of purpose `batch_output`:
the output file (the replies, status 200) and the error file (every other status, with
`error` set). Cancelling stops the requests in flight; the lines written by then make the
files, and the batch is `cancelled`. Draining (SIGUSR1) starts no new request. Batches
never expire: `completion_window` is "24h" as OpenAI's, and a batch runs until it is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Query
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..core.daemon import Daemon
from ..protocol.schema import QOS_BACKGROUND
from ..store.files import new_id
from .chat import ChatError
from .chat_http import HttpPolicy, owner, problems
from .files import OUTPUT_PURPOSE, page
from .openai import Body, ChatCompletionRequest, CompletionRequest, chat_completion, completion, envelope, error

log = logging.getLogger("superfluid.batches")

UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
MAX_ERRORS = 100  # line problems a failed batch lists
METADATA_KEYS = 16
BATCH_POLICY = HttpPolicy()  # what a batch's replies are built with: whole, no keep-alive spaces
POLL_S = 1.0  # how often an idle runner looks again (a wake-up comes sooner), and a draining one
RETRY_S = 5.0  # before a batch whose step failed (the disk refused) is tried again

Record = dict[str, Any]  # {"batch": OpenAI's batch object, "owner": key name, "outputs": reserved file ids}


async def _chat(daemon: Daemon, fields: dict[str, Any]) -> Response:
    body = ChatCompletionRequest.model_validate(fields)
    return await chat_completion(daemon, body, QOS_BACKGROUND, False, BATCH_POLICY, None)


async def _completion(daemon: Daemon, fields: dict[str, Any]) -> Response:
    body = CompletionRequest.model_validate(fields)
    return await completion(daemon, body, QOS_BACKGROUND, False, BATCH_POLICY, None)


ENDPOINTS: dict[str, Callable[[Daemon, dict[str, Any]], Awaitable[Response]]] = {
    "/v1/chat/completions": _chat,
    "/v1/completions": _completion,
}


class BatchCreate(Body):
    """The body of POST /v1/batches."""

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


@dataclass(frozen=True)
class Line:
    """One request of an input file."""

    custom_id: str
    body: dict[str, Any]


def read_input(data: bytes, endpoint: str) -> tuple[list[Line], list[dict[str, Any]]]:
    """The requests of an input file, and the problems of its lines (OpenAI's batch errors,
    the first MAX_ERRORS of them)."""
    requests: list[Line] = []
    found: list[dict[str, Any]] = []
    seen: set[str] = set()

    def problem(number: int | None, code: str, message: str, param: str | None = None) -> None:
        if len(found) < MAX_ERRORS:
            found.append({"code": code, "message": message, "param": param, "line": number})

    for number, raw in enumerate(data.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            entry = json.loads(raw)
        except ValueError as e:
            problem(number, "invalid_json_line", f"line {number} is not JSON: {e}")
            continue
        if not isinstance(entry, dict):
            problem(number, "invalid_json_line", f"line {number} is not a JSON object")
            continue
        custom_id, method, url = entry.get("custom_id"), entry.get("method"), entry.get("url")
        if not isinstance(custom_id, str) or not custom_id:
            problem(number, "missing_custom_id", "custom_id must be a string that names the request", "custom_id")
        elif custom_id in seen:
            problem(number, "duplicate_custom_id", f"custom_id {custom_id!r} is on an earlier line too", "custom_id")
        elif method != "POST":
            problem(number, "invalid_method", f"method must be POST, not {method!r}", "method")
        elif url != endpoint:
            problem(number, "invalid_url", f"url {url!r} is not the batch's endpoint {endpoint}", "url")
        elif not isinstance(entry.get("body"), dict):
            problem(number, "invalid_body", "body must be a JSON object: the request to send", "body")
        else:
            requests.append(Line(custom_id, entry["body"]))
        if isinstance(custom_id, str):
            seen.add(custom_id)
    if not requests and not found:
        problem(None, "empty_file", "the input file holds no requests")
    return requests, found


def _now() -> int:
    return int(time.time())


def _count(batch: dict[str, Any], lines: list[dict[str, Any]]) -> None:
    """Set the batch's counts of finished requests from its lines."""
    failed = sum(line["error"] is not None for line in lines)
    batch["request_counts"].update(completed=len(lines) - failed, failed=failed)


class BatchRunner:
    """The daemon's batches, in memory as on disk, and the task that runs them; `paused` says
    when to start no new request (the listener drains)."""

    def __init__(self, daemon: Daemon, paused: Callable[[], bool] = lambda: False) -> None:
        self.daemon = daemon
        self.records = daemon.batch_records
        self.paused = paused
        self.batches: dict[str, Record] = {}
        self.width = max(1, daemon.models.config.max_batch // 2)  # requests at a time
        self._wake = asyncio.Event()
        self._writes = asyncio.Lock()  # a record's writes land in the order its changes were made
        self._running: str | None = None  # the batch whose requests run
        self._in_flight: set[asyncio.Task[dict[str, Any]]] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Read the records; resume every unfinished batch."""
        for record in await asyncio.to_thread(self.records.all):
            batch = record["batch"]
            self.batches[batch["id"]] = record
            if batch["status"] in UNFINISHED:
                _count(batch, await asyncio.to_thread(self.records.lines, batch["id"]))
                log.info("batch %s resumes (%s)", batch["id"], batch["status"])
            if batch["status"] == "validating":
                self._spawn(self._validate(record))
            elif batch["status"] == "cancelling":
                self._spawn(self._finish(record))
        self._spawn(self._run())

    async def stop(self) -> None:
        """Stop every request in flight: an unfinished batch goes on when the daemon starts again."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("a batch step failed; it is tried again at the next start", exc_info=task.exception())

    def visible(self, batch_id: str, who: str | None) -> Record | None:
        record = self.batches.get(batch_id)
        return record if record is not None and record["owner"] == who else None

    def listed(self, who: str | None) -> list[dict[str, Any]]:
        """The batches `who` may see, newest first."""
        return [self.batches[i]["batch"] for i in sorted(self.batches, reverse=True) if self.batches[i]["owner"] == who]

    def reading(self, file_id: str) -> str | None:
        """The unfinished batch whose input is `file_id`, if one is."""
        return next(
            (
                batch_id
                for batch_id, record in self.batches.items()
                if record["batch"]["input_file_id"] == file_id and record["batch"]["status"] in UNFINISHED
            ),
            None,
        )

    async def create(self, body: BatchCreate, who: str | None) -> dict[str, Any]:
        """A new batch, validating; ChatError for a request that names no usable file or endpoint."""
        if body.endpoint not in ENDPOINTS:
            served = ", ".join(ENDPOINTS)
            raise ChatError(f"endpoint {body.endpoint} is not served in a batch here; use {served}", param="endpoint")
        if body.completion_window != "24h":
            raise ChatError(f"completion_window must be 24h, not {body.completion_window!r}", param="completion_window")
        if body.metadata is not None and len(body.metadata) > METADATA_KEYS:
            raise ChatError(f"metadata holds {METADATA_KEYS} pairs at most", param="metadata")
        meta = await asyncio.to_thread(self.daemon.files.get, body.input_file_id)
        if meta is None or meta.get("owner") != who:
            raise ChatError(f"no file {body.input_file_id}", 404, "not_found", "input_file_id")
        if meta["purpose"] != "batch":
            raise ChatError(
                f"file {body.input_file_id} has purpose {meta['purpose']}; a batch reads a file uploaded with "
                "purpose batch",
                param="input_file_id",
            )
        batch: dict[str, Any] = {
            "id": new_id("batch_"),
            "object": "batch",
            "endpoint": body.endpoint,
            "errors": None,
            "input_file_id": body.input_file_id,
            "completion_window": body.completion_window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": _now(),
            "in_progress_at": None,
            "expires_at": None,  # a batch here never expires
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": body.metadata,
        }
        record: Record = {"batch": batch, "owner": who, "outputs": None}
        await self._save(record)
        self.batches[batch["id"]] = record
        self._spawn(self._validate(record))
        return batch

    async def cancel(self, record: Record) -> dict[str, Any]:
        """Cancel a validating or running batch: cancelling now, cancelled once its files are written;
        ChatError 409 for a batch that has ended."""
        batch = record["batch"]
        if batch["status"] in ("cancelling", "cancelled"):
            return batch
        if batch["status"] not in ("validating", "in_progress"):
            raise ChatError(
                f"batch {batch['id']} is {batch['status']}: only a validating or in-progress batch can be cancelled",
                409,
                "batch_not_cancellable",
            )
        batch.update(status="cancelling", cancelling_at=_now())
        if self._running == batch["id"]:  # its runner writes the files once the requests in flight stop
            for task in self._in_flight:
                task.cancel()
        else:
            self._spawn(self._finish(record))
        shown = copy.deepcopy(batch)
        await self._save(record)
        return shown

    async def _save(self, record: Record) -> None:
        async with self._writes:
            await asyncio.to_thread(self.records.put, record["batch"]["id"], copy.deepcopy(record))

    async def _requests(self, record: Record) -> list[Line] | None:
        """The batch's requests; None, the batch failed with its input's problems, when a line is bad."""
        batch = record["batch"]
        path = self.daemon.files.content(batch["input_file_id"])
        requests: list[Line] = []
        if path is None:
            message = f"the input file {batch['input_file_id']} is gone"
            found = [{"code": "missing_file", "message": message, "param": "input_file_id", "line": None}]
        else:
            data = await asyncio.to_thread(path.read_bytes)
            requests, found = await asyncio.to_thread(read_input, data, batch["endpoint"])
        if not found:
            return requests
        if batch["status"] in ("validating", "in_progress"):
            batch.update(status="failed", failed_at=_now(), errors={"object": "list", "data": found})
            await self._save(record)
            log.info("batch %s failed: %d problems in its input", batch["id"], len(found))
        return None

    async def _validate(self, record: Record) -> None:
        batch = record["batch"]
        requests = await self._requests(record)
        if requests is not None and batch["status"] == "validating":
            batch.update(status="in_progress", in_progress_at=_now())
            batch["request_counts"]["total"] = len(requests)
            await self._save(record)
            log.info("batch %s: %d requests, in progress", batch["id"], len(requests))
            self._wake.set()

    async def _run(self) -> None:
        """Run the batches in progress, oldest first, one at a time."""
        while True:
            self._wake.clear()
            runnable = [r for r in self.batches.values() if r["batch"]["status"] in ("in_progress", "finalizing")]
            if self.paused() or not runnable:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), POLL_S)
                continue
            record = min(runnable, key=lambda r: str(r["batch"]["id"]))
            self._running = record["batch"]["id"]
            try:
                await self._execute(record)
            except Exception:  # the disk refused, or a model failed to load: the batch waits, then goes on
                log.exception("batch %s stopped; trying again in %g s", record["batch"]["id"], RETRY_S)
                await asyncio.sleep(RETRY_S)
            finally:
                self._running = None

    async def _execute(self, record: Record) -> None:
        batch = record["batch"]
        if batch["status"] == "in_progress":
            await self._work(record)
        counts = batch["request_counts"]
        done = counts["completed"] + counts["failed"] >= counts["total"]
        if batch["status"] == "cancelling" or (batch["status"] in ("in_progress", "finalizing") and done):
            await self._finish(record)

    async def _work(self, record: Record) -> None:
        """Run the requests that have no line yet, `width` at a time, until every one has its line, the
        batch is cancelled or the listener drains."""
        batch = record["batch"]
        requests = await self._requests(record)
        if requests is None:
            return
        batch["request_counts"]["total"] = len(requests)
        written = await asyncio.to_thread(self.records.lines, batch["id"])
        _count(batch, written)
        done = {line["custom_id"] for line in written}
        pending = deque(request for request in requests if request.custom_id not in done)

        async def worker() -> None:
            while pending and batch["status"] == "in_progress" and not self.paused():
                task = asyncio.ensure_future(self._line(batch["endpoint"], pending.popleft()))
                self._in_flight.add(task)
                try:
                    line = await task
                except asyncio.CancelledError:
                    current = asyncio.current_task()
                    if task.cancelled() and current is not None and not current.cancelling():
                        continue  # the batch was cancelled: this request is left undone
                    raise
                finally:
                    self._in_flight.discard(task)
                await asyncio.to_thread(self.records.append, batch["id"], line)
                counts = batch["request_counts"]
                counts["completed" if line["error"] is None else "failed"] += 1

        async with asyncio.TaskGroup() as group:
            for _ in range(min(self.width, len(pending))):
                group.create_task(worker())

    async def _line(self, endpoint: str, request: Line) -> dict[str, Any]:
        """One request's line of the output (or error) file."""
        status, body = await self._reply(endpoint, request.body)
        return {
            "id": new_id("batch_req_"),
            "custom_id": request.custom_id,
            "response": {"status_code": status, "request_id": new_id("req_"), "body": body},
            "error": None if status == 200 else {"code": body["error"]["code"], "message": body["error"]["message"]},
        }

    async def _reply(self, endpoint: str, fields: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if fields.get("stream"):
            message = "stream is not served in a batch: each reply is written whole to the output file"
            return 400, envelope(message, "invalid_request_error", "stream")
        try:
            reply = await ENDPOINTS[endpoint](self.daemon, fields)
        except ValidationError as e:
            return 400, envelope(problems(e.errors()), "invalid_request_error")
        except Exception as e:  # one request's failure is its line's, never the whole batch's
            log.exception("a batch request failed")
            return 500, envelope(f"the request failed: {e}", "server_error")
        return reply.status_code, json.loads(bytes(reply.body))

    async def _finish(self, record: Record) -> None:
        """Write the lines into the output and error files, and end the batch: completed, or cancelled."""
        batch = record["batch"]
        ending = "cancelled" if batch["status"] == "cancelling" else "completed"
        if ending == "completed" and batch["status"] != "finalizing":
            batch.update(status="finalizing", finalizing_at=_now())
        if record["outputs"] is None:  # the files' ids, kept from a try that a crash cut short
            record["outputs"] = [new_id("file-"), new_id("file-")]
        await self._save(record)
        lines = await asyncio.to_thread(self.records.lines, batch["id"])
        replies = [line for line in lines if line["error"] is None]
        failures = [line for line in lines if line["error"] is not None]
        batch["output_file_id"] = await self._output(record, record["outputs"][0], "output", replies)
        batch["error_file_id"] = await self._output(record, record["outputs"][1], "error", failures)
        _count(batch, lines)
        batch.update(status=ending, **{f"{ending}_at": _now()})
        await self._save(record)
        await asyncio.to_thread(self.records.drop_lines, batch["id"])
        counts = batch["request_counts"]
        log.info("batch %s %s: %d completed, %d failed", batch["id"], ending, counts["completed"], counts["failed"])

    async def _output(self, record: Record, file_id: str, kind: str, lines: list[dict[str, Any]]) -> str | None:
        """The id of the file of `lines`, None when there are none."""
        if not lines:
            return None
        data = b"".join(json.dumps(line, ensure_ascii=False).encode() + b"\n" for line in lines)
        name = f"{record['batch']['id']}_{kind}.jsonl"
        await asyncio.to_thread(self.daemon.files.add, data, name, OUTPUT_PURPOSE, record["owner"], file_id)
        return file_id


def not_found(batch_id: str) -> Response:
    return error(f"no batch {batch_id}", 404, "not_found", "batch_id")


def router(runner: BatchRunner) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/batches")
    async def create(body: BatchCreate, http: Request) -> Response:
        try:
            return JSONResponse(await runner.create(body, owner(http)))
        except ChatError as e:
            return error(str(e), e.status, e.code, e.param)

    @api.get("/v1/batches")
    async def listed(http: Request, limit: int = Query(20, ge=1, le=100), after: str | None = None) -> dict[str, Any]:
        return page(runner.listed(owner(http)), limit, after, descending=True)

    @api.get("/v1/batches/{batch_id}")
    async def retrieve(batch_id: str, http: Request) -> Response:
        record = runner.visible(batch_id, owner(http))
        return JSONResponse(record["batch"]) if record is not None else not_found(batch_id)

    @api.post("/v1/batches/{batch_id}/cancel")
    async def cancel(batch_id: str, http: Request) -> Response:
        record = runner.visible(batch_id, owner(http))
        if record is None:
            return not_found(batch_id)
        try:
            return JSONResponse(await runner.cancel(record))
        except ChatError as e:
            return error(str(e), e.status, e.code, e.param)

    return api
