"""Ollama's `POST /api/pull`, served by `model/pull.py`: a GGUF from Hugging Face into the local cache.

The name is one `superfluid pull` takes: `hf.co/org/repo-GGUF:QUANT` (as Ollama accepts it) or
`org/repo-GGUF:QUANT`; without a tag (or with `latest`), the repository's one GGUF or the first of
Q4_K_M, Q4_K_S, Q4_0, Q8_0 it has. A bare Ollama library name (`llama3`) names no repository and is
refused with 400. The repository is listed before the answer starts, so a wrong name or quantisation
gets its own status (400, 404, 502); the download then runs on a thread of its own and its progress
comes back as Ollama's status objects, one a line, unless `"stream": false` asks for the last one
alone. A client that hangs up stops the download at its next chunk: the `.incomplete` file stays for
the next pull to resume. A pulled model is known to the daemon at once (`/api/tags` lists it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import httpx

from ..core.daemon import Daemon
from ..core.runtime import ModelError
from ..model.pull import Progress, Pull, PullError, client, fetch, plan
from .openai import Body


class PullBody(Body):
    """The body of POST /api/pull."""

    model: str | None = None
    name: str | None = None  # the field's name in Ollama's older API
    insecure: bool = False  # for Ollama's own registries; the hub is reached as HF_ENDPOINT says
    stream: bool = True


async def start(name: str) -> tuple[Pull, httpx.Client]:
    """What pulling `name` fetches, and the client to fetch it with; PullError for a name, repository or
    quantisation that is not there (or a hub out of reach)."""
    if not name:
        raise PullError("model is required: a Hugging Face GGUF such as hf.co/org/repo-GGUF:Q4_K_M", 400)
    http = client()
    try:
        return await asyncio.to_thread(plan, name, http, default_quant=True), http
    except BaseException:
        http.close()
        raise


async def statuses(daemon: Daemon, pull: Pull, http: httpx.Client) -> AsyncGenerator[dict[str, Any], None]:
    """Ollama's status objects as `pull` downloads on a thread (which closes `http`); PullError if it fails."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Progress | Exception | None] = asyncio.Queue()
    stop = threading.Event()

    def hand(item: Progress | Exception | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed under a pull the daemon's stop ended
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def run() -> None:
        outcome: Exception | None = None
        try:
            fetch(pull, http, hand, stop)
        except Exception as e:
            outcome = e
        finally:
            http.close()
        hand(outcome)

    whole = [part for part in pull.parts if part.complete()]  # the thread reports on the others
    threading.Thread(target=run, name="ollama-pull", daemon=True).start()
    try:
        yield {"status": "pulling manifest"}
        for part in whole:
            yield _status(Progress(part, part.on_disk()))
        while (item := await queue.get()) is not None:
            if isinstance(item, Exception):
                raise item
            yield _status(item)
    finally:
        stop.set()  # a client that left, or a pull that failed: the thread ends at its next chunk
    yield {"status": "writing manifest"}
    try:
        await asyncio.to_thread(daemon.models.add, pull.ref)
    except ModelError as e:
        raise PullError(str(e), e.status) from None
    yield {"status": "success"}


def _status(progress: Progress) -> dict[str, Any]:
    part = progress.part
    if progress.verifying:
        return {"status": "verifying sha256 digest"}
    # Ollama names a layer by the start of its digest
    name = (part.sha256 or part.name)[:12]
    return {"status": f"pulling {name}", "digest": part.digest, "total": part.size or 0, "completed": progress.done}


async def lines(daemon: Daemon, pull: Pull, http: httpx.Client) -> AsyncIterator[str]:
    """The streamed answer: one status a line, a failure as a last `{"error": ...}` line."""
    async with contextlib.aclosing(statuses(daemon, pull, http)) as steps:
        try:
            async for step in steps:
                yield json.dumps(step) + "\n"
        except PullError as e:
            yield json.dumps({"error": str(e)}) + "\n"


async def last(daemon: Daemon, pull: Pull, http: httpx.Client) -> dict[str, Any]:
    """The unstreamed answer: the last status; PullError if the pull fails."""
    final: dict[str, Any] = {}
    async with contextlib.aclosing(statuses(daemon, pull, http)) as steps:
        async for step in steps:
            final = step
    return final
