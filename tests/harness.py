"""An in-process daemon for verb-level tests: the `Daemon` a serve process runs, with no process, socket or HTTP.

The embedded model runs in the test's own process (no worker), on a small context; requests go
straight to `Daemon.request` and `Daemon.generate` on an event loop of the harness's own. A test
reads what the session API answers, as a client of the socket would, in a fraction of the time a
daemon process takes to start.

    with InProcessDaemon(tmp_path) as daemon:
        session = daemon.created()
        daemon.call(Request.AppendMessage(session, 1, "Hello."))
        outcomes, done = daemon.generate(session, 8, ignore_eos=True)
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from superfluid.config import ServeConfig
from superfluid.core.daemon import Daemon
from superfluid.core.generation import Done, Outcome
from superfluid.core.runtime import Models
from superfluid.metrics import Metrics
from superfluid.protocol.schema import GenParams, Request, Response
from superfluid.store.sessions import SessionStore

GREEDY = GenParams(0.0, 1.0, 0.0, 0, 0)


class InProcessDaemon:
    """A daemon on `root`/sessions, its model in this process; a context manager."""

    def __init__(self, root: Path, *, max_context: int = 1024, max_batch: int = 2) -> None:
        self.config = ServeConfig(
            sessions=root / "sessions",
            socket=root / "sf.sock",
            max_context=max_context,
            max_batch=max_batch,
            threads=2,
            worker_process=False,
            park=False,
            host_cache_mb=0,
            speculate="off",
        )
        self.loop = asyncio.new_event_loop()
        self.daemon: Daemon | None = None

    def __enter__(self) -> InProcessDaemon:
        models = Models(self.config)
        default = models.add(None)
        self.store = SessionStore(self.config.sessions)
        self.daemon = Daemon(self.store, models, metrics=Metrics())
        models.runtime(default)
        self.daemon.start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.daemon is not None
        self.daemon.stop()
        self.store.close()
        self.loop.close()

    def run(self, work: Any) -> Any:
        """Await `work` (a coroutine) on the harness's loop."""
        return self.loop.run_until_complete(work)

    def call(self, request: Any) -> Any:
        """One non-streaming request's reply."""
        assert self.daemon is not None
        return self.run(self.daemon.request(request))

    def created(self, params: GenParams = GREEDY) -> int:
        reply = self.call(Request.Create(None, params))
        assert isinstance(reply, Response.Created), reply
        return reply.session

    def generate(self, session: int, max_tokens: int, *, ignore_eos: bool = False) -> tuple[list[Outcome], Done]:
        """A Generate's outcomes up to its end, and its end."""
        daemon = self.daemon
        assert daemon is not None

        async def collect() -> tuple[list[Outcome], Done]:
            generation = await daemon.generate(
                Request.Generate(session, max_tokens, ignore_eos or None), provisional=False
            )
            outcomes = [outcome async for outcome in generation]
            done = outcomes.pop()
            assert isinstance(done, Done), done
            return outcomes, done

        return self.run(collect())
