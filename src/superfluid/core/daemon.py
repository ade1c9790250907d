"""The session API, independent of any transport: a `Request` in, `Response`s out.

`Daemon` is every family of verbs (`verbs/`: sessions, generation, tools, media, admin)
behind one dispatcher. A verb that writes runs on the daemon's writer thread, one at a
time under the store's writer lock, so a slow commit (an fsync, a PostgreSQL round trip)
never holds up the event loop; one that only reads runs on another thread and takes no lock,
since whatever is in memory is on disk already. Refusals raise `DaemonError` (`errors.py`),
whose text is the `Err` message the client sees; nothing is written when a request is refused.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..metrics import Metrics
from ..protocol.schema import (
    Request,
    Response,
)
from ..store.batches import BatchRecords
from ..store.files import FileStore
from ..store.media import MediaStore
from ..store.postgres import PostgresLog
from ..store.responses import ResponseRecords, ResponseStore, SharedResponseRecords
from ..store.sessions import SessionStore
from .bus import Bus
from .cluster import RemoteCommits
from .errors import REFUSED, DaemonError, refusal
from .generation import GenerationRun, Generations
from .runtime import Models, Runtime
from .verbs.admin import AdminVerbs
from .verbs.generate import GenerationVerbs
from .verbs.media import MediaVerbs
from .verbs.sessions import SessionVerbs
from .verbs.tools import ToolVerbs

log = logging.getLogger("superfluid.core.daemon")
R = Request
# Verbs that only read what is in memory: they never wait for a commit (one of a session not
# loaded yet loads it, under the writer lock, once).
READS = (R.Read, R.List, R.Sessions, R.Tree, R.Inspect, R.OpenToolCalls, R.Ledger, R.Metrics)


class Daemon(SessionVerbs, GenerationVerbs, ToolVerbs, MediaVerbs, AdminVerbs):
    """The sessions: the store, the models that generate, and the verbs between them.

    The session API generates with the default model; the HTTP routes name theirs.
    """

    def __init__(self, store: SessionStore, models: Models, *, metrics: Metrics) -> None:
        self.store = store
        self.models = models
        self.metrics = metrics
        self.bus = Bus()
        self.media = MediaStore(store.directory / "media")
        # what the HTTP APIs keep beside the sessions (/v1/files, /v1/batches), reached through the daemon
        self.files = FileStore(store.directory / "files")
        self.batch_records = BatchRecords(store.directory / "batches")
        # shared by the daemons of a PostgreSQL store, so that any of them continues a response chain
        self.responses: ResponseStore = (
            SharedResponseRecords(store.log.run)
            if isinstance(store.log, PostgresLog)
            else ResponseRecords(store.directory / "responses")
        )
        self.running: dict[int, GenerationRun] = {}
        self.generations = Generations(store, self._release, metrics)
        self.remote = RemoteCommits(store, self.bus)
        store.on_commit = self.bus.publish  # the EpochBump of a session taken back
        store.busy = self.running.__contains__  # a generating session stays in memory
        models.on_load = self._attach
        self._purging: set[int] = set()
        self._completions: OrderedDict[tuple[str, str, int, int], tuple[str, list[int]]] = OrderedDict()
        metrics.attach(self)
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="superfluid-writer")
        self._handlers: dict[type, Callable[[Any], Response]] = {
            R.Create: self._create,
            R.Append: self._append,
            R.AppendMessage: self._append_message,
            R.AppendSystem: self._append_system,
            R.Read: self._read,
            R.List: self._list,
            R.Sessions: self._sessions,
            R.Tree: self._tree,
            R.Inspect: self._inspect,
            R.SetMeta: self._set_meta,
            R.Fork: self._fork,
            R.Rebase: self._rebase,
            R.Trim: self._trim,
            R.Cancel: self._cancel,
            R.SetQos: self._set_qos,
            R.Pin: self._pin,
            R.SetBackgroundRate: self._set_background_rate,
            R.SetLogLevel: self._set_log_level,
            R.Metrics: self._metrics,
            R.OpenToolCalls: self._open_tool_calls,
            R.Ledger: self._ledger,
            R.AppendToolResult: self._append_tool_result,
            R.AppendToolOutcome: self._append_tool_outcome,
            R.RequestToolCancel: self._request_tool_cancel,
            R.RequestPermission: self._request_permission,
            R.RespondPermission: self._respond_permission,
            R.AppendBlock: self._append_block,
            R.AppendImage: self._append_image,
            R.PutMedia: self._put_media,
            R.GcMedia: self._gc_media,
        }

    def _attach(self, runtime: Runtime) -> None:
        """A model was loaded: what its scheduler produces is committed at the end of its ticks."""
        scheduler = runtime.scheduler
        scheduler.on_tick = lambda: self.generations.on_tick(scheduler)

    def start(self) -> int:
        """Re-arm the pins of sessions the log holds; returns how many sessions it holds.

        Every other session waits in the log until it is first used (the store fences it then).
        """
        scheduler = self.scheduler
        for s in self.store.pinned():
            scheduler.pin(s.tokens, s.pin_deadline_unix_ms)
            scheduler.warm(s.tokens)
        return self.store.count()

    def stop(self) -> None:
        self.models.close()
        self.generations.stop()
        self.writer.shutdown(wait=True)

    async def request(self, request: Any) -> Response:
        """Answer one non-streaming request."""
        started = time.perf_counter()
        name = type(request).__name__
        try:
            if isinstance(request, R.Purge):
                return await self._purge(request)
            if isinstance(request, R.Complete):
                return await self._complete(request)
            handler = self._handlers.get(type(request))
            if handler is None:
                raise DaemonError(f"{name} is not served by this version of superfluid")
            if type(request) in READS:  # no lock, no commit: the loop's own pool, beside the writer
                return await asyncio.to_thread(handler, request)
            return await self.written(handler, request)
        except REFUSED as e:
            return refusal(e)
        except (sqlite3.Error, OSError) as e:  # the disk refused: nothing was committed
            log.exception("%s failed to reach the disk", name)
            return Response.Err(f"io: {e}")
        finally:
            self.metrics.requests.labels(verb=name).inc()
            self.metrics.request_seconds.observe(time.perf_counter() - started)
