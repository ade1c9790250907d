"""Session state replayed from the log.

`SessionTable.apply` is the only way state changes, at start-up (replay) and live
(after each commit), so what the daemon holds in memory is always what a restart
would rebuild from the log.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..protocol.schema import (
    LEDGER_CANCEL_REQUESTED,
    LEDGER_CANCELLED,
    LEDGER_CANCELLED_WITH_LATE_EFFECT,
    LEDGER_EXPIRED,
    LEDGER_FAILED,
    LEDGER_OPEN,
    LEDGER_SUCCEEDED,
    OUTCOME_CANCELLED,
    QOS_AGENT,
    TOKEN_BEARING,
    EventBody,
    EventMsg,
    GenParams,
    LedgerEntry,
    SessionSummary,
)

B = EventBody
FORKS = (B.Forked, B.Rebased)  # a record that starts a session from a parent's events


@dataclass
class ToolCallState:
    """Ledger entry of one tool call, as the log has moved it along."""

    name: str
    arguments: str
    state: int = LEDGER_OPEN
    cancel_requested: bool = False
    lease_deadline_unix_ms: int | None = None
    late_effects: int = 0

    def entry(self) -> LedgerEntry:
        return LedgerEntry(
            self.name,
            self.arguments,
            self.state,
            self.cancel_requested,
            self.lease_deadline_unix_ms,
            self.late_effects,
        )


@dataclass
class SessionState:
    """Everything the daemon knows about one session, derived from its events."""

    id: int
    parent: int | None
    base: int
    params: GenParams
    epoch: int = 1
    events: list[EventMsg] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    last_finish: int = 0
    last_input: EventBody | None = None  # the last record that carries tokens
    open_calls: dict[int, tuple[str, str]] = field(default_factory=dict)
    ledger: dict[int, ToolCallState] = field(default_factory=dict)
    permissions: dict[int, tuple[int, str]] = field(default_factory=dict)
    fingerprint: int | None = None
    meta_version: int = 0
    title: str | None = None
    archived: bool = False
    generation: int = 0
    purged: bool = False
    rerooted: bool = False
    qos_class: int = QOS_AGENT
    batch_invariant: bool = False
    pin_deadline_unix_ms: int = 0
    children: list[int] = field(default_factory=list)
    # the store's bookkeeping, not the log's: when this daemon last used the session (least recent goes first)
    last_used: int = field(default=0, compare=False)

    @property
    def next_id(self) -> int:
        return len(self.events)

    def summary(self) -> SessionSummary:
        """The session's line in a listing."""
        return SessionSummary(
            self.id,
            self.parent,
            self.base,
            self.title,
            self.archived,
            self.meta_version,
            self.generation,
            len(self.events),
            len(self.tokens),
            len(self.open_calls),
        )

    def inherit(self, events: list[EventMsg]) -> None:
        """Take `events` (a parent's first events) as this session's own beginning.

        Only the history comes along: tool calls, permissions and metadata stay the
        parent's (a call made before the fork is answered in the parent).
        """
        for event in events:
            self._absorb(event)

    def apply(self, event: EventMsg) -> None:
        body = event.body
        if isinstance(body, B.Purged):
            self._purge(body.generation)
            return
        self._absorb(event)
        self.epoch = max(self.epoch, event.epoch)  # a fork's own epoch starts at 1, whatever it inherits
        self._track(event.event_id, body)

    def _absorb(self, event: EventMsg) -> None:
        body = event.body
        self.events.append(event)
        if isinstance(body, TOKEN_BEARING):
            self.tokens.extend(body.span)
            self.last_input = body
            if isinstance(body, B.Generated):
                self.last_finish = body.finish

    def _track(self, event_id: int, body: EventBody) -> None:
        """Tool, permission, metadata and scheduling records."""
        if isinstance(body, B.ToolUse):
            self.open_calls[event_id] = (body.name, body.arguments)
            self.ledger[event_id] = ToolCallState(body.name, body.arguments)
        elif isinstance(body, B.ToolResult):
            self._close_call(body.call_id, LEDGER_SUCCEEDED)
        elif isinstance(body, B.ToolOutcome):
            self._close_call(body.call_id, LEDGER_CANCELLED if body.outcome == OUTCOME_CANCELLED else LEDGER_FAILED)
        elif isinstance(body, B.ToolExpired):
            self._close_call(body.call_id, LEDGER_EXPIRED)
        elif isinstance(body, B.ToolCancelRequested):
            call = self.ledger.get(body.call_id)
            if call is not None:
                call.cancel_requested = True
                if call.state == LEDGER_OPEN:
                    call.state = LEDGER_CANCEL_REQUESTED
        elif isinstance(body, B.ToolReconciliation):
            call = self.ledger.get(body.call_id)
            if call is not None:
                call.late_effects += 1
                if call.state == LEDGER_CANCELLED:
                    call.state = LEDGER_CANCELLED_WITH_LATE_EFFECT
        elif isinstance(body, B.ToolLease):
            call = self.ledger.get(body.call_id)
            if call is not None:
                call.lease_deadline_unix_ms = body.deadline_unix_ms
        elif isinstance(body, B.PermissionRequest):
            self.permissions[event_id] = (body.call_id, body.text)
        elif isinstance(body, B.PermissionResponse):
            self.permissions.pop(body.request_id, None)
        elif isinstance(body, B.GenerationFingerprint):
            self.fingerprint = body.digest
        elif isinstance(body, B.MetaUpdated):
            self.meta_version = body.version
            if body.title is not None:
                self.title = body.title
            if body.archived is not None:
                self.archived = body.archived
        elif isinstance(body, B.QosSet):
            self.qos_class = body.class_
            self.batch_invariant = body.batch_invariant
        elif isinstance(body, B.Pinned):
            self.pin_deadline_unix_ms = body.deadline_unix_ms

    def _close_call(self, call_id: int, state: int) -> None:
        self.open_calls.pop(call_id, None)
        call = self.ledger.get(call_id)
        if call is not None:
            call.state = state

    def _purge(self, generation: int) -> None:
        self.purged = True
        self.generation = generation
        self.events = []
        self.tokens = []
        self.open_calls = {}
        self.permissions = {}
        self.title = None
        self.last_input = None
        self.pin_deadline_unix_ms = 0


class SessionTable:
    """All sessions, purged ones included (their ids are never reused)."""

    def __init__(self) -> None:
        self.sessions: dict[int, SessionState] = {}

    def apply(self, session_id: int, event: EventMsg) -> None:
        body = event.body
        if isinstance(body, B.Created):
            self._start(SessionState(session_id, body.parent, 0, body.params), body.parent)
        elif isinstance(body, FORKS):
            state = SessionState(session_id, body.parent, body.fork_at, body.params)
            parent = self.sessions[body.parent]
            state.qos_class, state.batch_invariant = parent.qos_class, parent.batch_invariant
            state.inherit(parent.events[: body.fork_at])
            self._start(state, body.parent)
        elif isinstance(body, B.Rerooted):
            state = self.sessions[session_id]
            if len(state.events) < state.base:
                prefix = [EventMsg(event_id, 0, 0, inherited) for event_id, inherited in body.prefix]
                state.events, state.tokens = [], []
                state.inherit(prefix)
            self._detach(state)
            state.rerooted = True
        self.sessions[session_id].apply(event)

    def _start(self, state: SessionState, parent: int | None) -> None:
        self.sessions[state.id] = state
        if parent is not None and parent in self.sessions:
            self.sessions[parent].children.append(state.id)

    def _detach(self, state: SessionState) -> None:
        if state.parent is not None and state.parent in self.sessions:
            siblings = self.sessions[state.parent].children
            if state.id in siblings:
                siblings.remove(state.id)
        state.parent = None
