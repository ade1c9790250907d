"""What every family of verbs shares: the daemon's parts, and finding, guarding and writing a session."""

from __future__ import annotations

import asyncio
import functools
import math
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ...engine.llama import LlamaModel
from ...metrics import Metrics
from ...model.template import ChatTemplate, TemplateProblem
from ...protocol.schema import (
    FINISH_GRAMMAR,
    FINISH_STOP,
    EventBody,
    EventMsg,
    GenParams,
)
from ...scheduler.scheduler import Scheduler
from ...store.media import MediaStore
from ...store.sessions import SessionStore
from ...store.state import SessionState
from ..bus import Bus
from ..cluster import RemoteCommits
from ..errors import DaemonError
from ..generation import GenerationRun, Generations
from ..runtime import Models, Runtime

B = EventBody
T = TypeVar("T")
# A generation that ended its turn with an end-of-turn token: after the end of the grammar
# too, since a complete grammar allows nothing but end-of-generation.
TURN_ENDED = (FINISH_STOP, FINISH_GRAMMAR)


class DaemonBase:
    """The parts of a daemon its verbs use; `Daemon` makes them, each family of verbs adds its own."""

    store: SessionStore
    models: Models
    metrics: Metrics
    bus: Bus
    media: MediaStore
    running: dict[int, GenerationRun]
    generations: Generations
    remote: RemoteCommits
    _purging: set[int]
    _completions: OrderedDict[tuple[str, str, int, int], tuple[str, list[int]]]
    # Every verb that writes runs here, one at a time: a commit waits for the disk or PostgreSQL
    # off the event loop, and writes keep the order their connections sent them in.
    writer: ThreadPoolExecutor

    async def written(self, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` on the writer thread, awaited."""
        return await asyncio.get_running_loop().run_in_executor(self.writer, functools.partial(work, *args))

    @property
    def runtime(self) -> Runtime:
        """The default model, loaded."""
        return self.models.default()

    @property
    def model(self) -> LlamaModel:
        return self.runtime.model

    @property
    def template(self) -> ChatTemplate:
        return self.runtime.template

    @property
    def window(self) -> int:
        return self.runtime.window

    @property
    def scheduler(self) -> Scheduler:
        return self.runtime.scheduler

    def _session(self, session_id: int, *, to_read: bool = False) -> SessionState:
        """A live session, served here from now on; `to_read`: wherever it is served (no lease taken)."""
        state = self.store.view(session_id) if to_read else self.store.get(session_id)
        if state is None:
            raise DaemonError(f"unknown session {session_id}")
        if state.purged:
            raise DaemonError(f"session {session_id} was purged")
        return state

    def _idle(self, state: SessionState) -> None:
        if state.id in self.running:
            raise DaemonError(f"session {state.id} is generating; append/generate after it finishes or cancel it")
        if state.id in self._purging:
            raise DaemonError(f"session {state.id} is being purged")

    def _check_point(self, s: SessionState, n: int) -> None:
        if not 1 <= n <= s.next_id:
            raise DaemonError(f"fork point {n} is outside session {s.id}'s committed events (1..={s.next_id})")

    def _commit_one(self, session_id: int, body: EventBody) -> EventMsg:
        (event,) = self.store.commit([(session_id, body)])
        self.bus.publish(session_id, [event])
        return event

    def _message_span(
        self, has_input: bool, last_input: EventBody | None, role: int, text: str, template: ChatTemplate | None = None
    ) -> list[int]:
        """A message's tokens after the given history (in `template`, the default model's if none): closing a
        finished turn first."""
        template = template or self.template
        try:
            finished = isinstance(last_input, B.Generated) and last_input.finish in TURN_ENDED
            separator = template.separator() if finished else []
            return separator + template.message(role, text, first=not has_input)
        except TemplateProblem as e:
            raise DaemonError(str(e)) from None


def _check_params(params: GenParams) -> None:
    """Sampling parameters the sampler can use: finite, temperature >= 0, top_p and min_p in [0, 1]."""
    for name, value, top in (
        ("temperature", params.temperature, math.inf),
        ("top_p", params.top_p, 1.0),
        ("min_p", params.min_p, 1.0),
    ):
        if not (math.isfinite(value) and 0.0 <= value <= top):
            accepted = "a finite number of at least 0" if top == math.inf else "a number from 0 to 1"
            raise DaemonError(f"params.{name} must be {accepted}, not {value}")
