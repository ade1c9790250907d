"""Session verbs: create, append, read, list, inspect, fork, rebase, trim and purge.

Each checks its input against the session state and commits under the store's writer lock;
reads take no lock: what is in memory is on disk already.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import numpy as np

from ...model.template import TemplateProblem
from ...model.tools import ToolDeclarationError, fallback_system_text, normalize_tools
from ...protocol.schema import (
    ROLE_ASSISTANT,
    ROLE_SYSTEM,
    TOKEN_BEARING,
    EventBody,
    EventMsg,
    GenParams,
    Inspection,
    PurgeMode,
    RebaseEdit,
    Request,
    Response,
    Tier,
)
from ...store.state import SessionState
from ..bus import END_PURGED, Subscription
from ..errors import DaemonError
from .base import DaemonBase, _check_params

B = EventBody
R = Request

PURGE_WAIT_S = 10.0


class SessionVerbs(DaemonBase):
    """Creating, appending to, reading, branching and purging sessions."""

    def _create(self, req: R.Create) -> Response:
        _check_params(req.params)
        with self.store.lock:
            if req.parent is not None:
                self._session(req.parent)
            session = self.store.reserve_id()
            self.store.commit([(session, B.Created(req.parent, req.params))])
        return Response.Created(session)

    def _append(self, req: R.Append) -> Response:
        with self.store.lock:
            state = self._session(req.session)
            self._idle(state)
            span = list(req.span) or self.model.tokenize(req.text or "", True)
            if not span:
                raise DaemonError("Append needs text or a non-empty span of token ids")
            bad = next((t for t in span if t >= self.model.n_vocab), None)
            if bad is not None:
                raise DaemonError(f"token id {bad} is outside the vocabulary (0..{self.model.n_vocab - 1})")
            return Response.Committed(self._commit_one(state.id, B.Appended(req.text, span)))

    def _append_message(self, req: R.AppendMessage) -> Response:
        if req.role > ROLE_ASSISTANT:
            raise DaemonError(f"unknown message role {req.role}")
        with self.store.lock:
            state = self._session(req.session)
            self._idle(state)
            span = self._message_span(bool(state.tokens), state.last_input, req.role, req.text)
            return Response.Committed(self._commit_one(state.id, B.Message(req.role, req.text, span)))

    def _append_system(self, req: R.AppendSystem) -> Response:
        if req.text is None and not req.tools:
            raise DaemonError("AppendSystem needs text, tools, or both")
        try:
            tools = normalize_tools(req.tools)
        except ToolDeclarationError as e:
            raise DaemonError(str(e)) from None
        with self.store.lock:
            state = self._session(req.session)
            self._idle(state)
            if state.tokens:
                raise DaemonError(
                    f"session {state.id} already has a prompt; AppendSystem must come before any other turn"
                )
            text = req.text or ""
            try:
                if not tools:
                    span = self.template.message(ROLE_SYSTEM, text, first=True)
                else:
                    span = self._system_with_tools(text, tools)
            except TemplateProblem as e:
                raise DaemonError(str(e)) from None
            return Response.Committed(self._commit_one(state.id, B.Message(ROLE_SYSTEM, text, span)))

    def _system_with_tools(self, text: str, tools: list[dict[str, Any]]) -> list[int]:
        """A first system turn declaring `tools`: through the template where it renders one such turn on its
        own, else (a template that knows no tools, or puts the system text in a later turn) in our words."""
        template = self.template
        if template.supports_tools:
            with contextlib.suppress(TemplateProblem):
                return template.framed(template.system_with_tools(tools), text, first=True)
        return template.message(ROLE_SYSTEM, fallback_system_text(text, tools, template.dialect), first=True)

    # Reads take no lock: a record is in memory only once it is on disk, and a list's slice is taken whole.

    def _read(self, req: R.Read) -> Response:
        state = self._session(req.session, to_read=True)
        return Response.Events(state.events[req.cursor :])

    def _list(self, req: R.List) -> Response:
        return Response.Sessions([s.id for s in self.store.summaries()])

    def _sessions(self, req: R.Sessions) -> Response:
        return Response.SessionList([s for s in self.store.summaries() if req.include_archived or not s.archived])

    def _tree(self, req: R.Tree) -> Response:
        return Response.Tree([(s.id, s.parent, s.fork_at) for s in self.store.summaries() if not s.archived])

    def _inspect(self, req: R.Inspect) -> Response:
        s = self._session(req.session)
        inspection = Inspection(
            summary=s.summary(),
            params=s.params,
            epoch=s.epoch,
            last_finish=s.last_finish,
            qos_class=s.qos_class,
            batch_invariant=s.batch_invariant,
            pin_deadline_unix_ms=s.pin_deadline_unix_ms,
            behavior_fingerprint=s.fingerprint,
            open_tool_calls=[(call, name, args) for call, (name, args) in s.open_calls.items()],
            tier=self._tier(s),
            tokens=list(s.tokens),
            events=list(s.events),
            wal_version=2,
            store_id=self.store.store_id,
        )
        return Response.Inspection(inspection)

    def _tier(self, s: SessionState) -> Tier:
        """Resident while generating, Parked when the park holds a prefix of its tokens, else Cold."""
        if s.id in self.running:
            return Tier.Resident()
        park = self.scheduler.tiers.park
        found = park.lookup(np.asarray(s.tokens, dtype=np.int32), len(s.tokens)) if park and s.tokens else None
        return Tier.Parked(found[1], 0) if found else Tier.Cold()

    def _set_meta(self, req: R.SetMeta) -> Response:
        with self.store.lock:
            s = self._session(req.session)
            if req.expected_version != s.meta_version:
                raise DaemonError(
                    f"session {s.id} metadata version is {s.meta_version}, command expected {req.expected_version}"
                )
            version = req.expected_version + 1
            self._commit_one(s.id, B.MetaUpdated(version, req.title, req.archived))
            return Response.Meta(version)

    def _fork(self, req: R.Fork) -> Response:
        if req.params is not None:
            _check_params(req.params)
        with self.store.lock:
            parent = self._session(req.session)
            self._check_point(parent, req.at_event)
            child = self.store.reserve_id()
            self.store.commit([(child, B.Forked(parent.id, req.at_event, req.params or parent.params))])
            return Response.Created(child)

    def _rebase(self, req: R.Rebase) -> Response:
        if req.params is not None:
            _check_params(req.params)
        with self.store.lock:
            parent = self._session(req.session)
            return Response.Created(self._rebase_into(parent, req.edits, req.params))

    def _trim(self, req: R.Trim) -> Response:
        with self.store.lock:
            parent = self._session(req.session)
            self._check_point(parent, req.to_event)
            if req.to_event == parent.next_id:
                return self._fork(R.Fork(parent.id, req.to_event, None))
            return Response.Created(self._rebase_into(parent, [RebaseEdit.Drop(req.to_event, parent.next_id)], None))

    def _rebase_into(self, parent: SessionState, edits: list[Any], params: GenParams | None) -> int:
        _check_edits(edits, parent.next_id)
        start = edits[0].from_
        child = self.store.reserve_id()
        writes: list[tuple[int, EventBody]] = [(child, B.Rebased(parent.id, start, params or parent.params, edits))]
        inherited = parent.events[:start]
        has_input = any(isinstance(e.body, TOKEN_BEARING) and e.body.span for e in inherited)
        last_input = next((e.body for e in reversed(inherited) if isinstance(e.body, TOKEN_BEARING)), None)
        calls = {e.event_id for e in inherited if isinstance(e.body, B.ToolUse)}
        remap: dict[int, int] = {}
        next_id = start + 1
        ranges = iter(edits)
        edit = next(ranges, None)
        for event in parent.events[start:]:
            while edit is not None and event.event_id >= edit.to:
                edit = next(ranges, None)
            body: EventBody | None
            if edit is not None and edit.from_ <= event.event_id < edit.to:
                if not (isinstance(edit, RebaseEdit.Replace) and event.event_id == edit.from_):
                    continue
                span = self._message_span(has_input, last_input, edit.role, edit.text)
                body = B.Message(edit.role, edit.text, span)
            else:
                body = _copy(event, calls, remap)
            if body is None:
                continue
            if isinstance(body, B.ToolUse):
                remap[event.event_id] = next_id
                calls.add(next_id)
            if isinstance(body, TOKEN_BEARING):
                has_input = has_input or bool(body.span)
                last_input = body
            writes.append((child, body))
            next_id += 1
        self.store.commit(writes)
        return child

    async def _purge(self, req: R.Purge) -> Response:
        """Wait for the sessions' generations to stop, then write their end; both writes on the writer thread."""
        s, targets = await self.written(self._purge_targets, req)
        try:
            await self._quiesce(targets)
            await self.written(self._purge_commit, s, targets, req.mode)
        finally:
            self._purging.difference_update(targets)
        for target in targets:
            self.bus.end_session(target, END_PURGED)
        return Response.Purged(targets)

    def _purge_targets(self, req: R.Purge) -> tuple[SessionState, list[int]]:
        """The session a purge names and those it takes along (deepest first, itself last), marked as purging."""
        with self.store.lock:
            s = self._session(req.session)
            if req.expected_generation != s.generation:
                raise DaemonError(
                    f"session {s.id} generation is {s.generation}, command expected {req.expected_generation}"
                )
            descendants = self._descendants(s) if isinstance(req.mode, PurgeMode.Cascade) else []
            targets = [*descendants, s.id]
            if self._purging.intersection(targets):
                raise DaemonError(f"session {s.id} is being purged")
            self._purging.update(targets)
            return s, targets

    def _purge_commit(self, s: SessionState, targets: list[int], mode: Any) -> None:
        """Expire the targets' open calls, reroot the children a purge that does not cascade leaves, end them."""
        with self.store.lock:
            writes: list[tuple[int, EventBody]] = []
            for target in targets:
                state = self._session(target)
                writes += [(target, B.ToolExpired(call, "purged")) for call in state.open_calls]
            if not isinstance(mode, PurgeMode.Cascade):
                for child_id in list(s.children):
                    child = self.store.get(child_id)
                    if child is not None and not child.purged:
                        prefix = [(e.event_id, e.body) for e in child.events[: child.base]]
                        writes.append((child_id, B.Rerooted(s.id, prefix)))
            for target in targets:
                state = self._session(target)
                writes.append((target, B.Purged(state.generation + 1, mode)))
            self.store.commit(writes)

    def _descendants(self, s: SessionState) -> list[int]:
        """Every live descendant, deepest first (reverse depth-first order)."""
        order: list[int] = []
        stack = [s]
        while stack:
            node = stack.pop()
            for child_id in node.children:
                child = self.store.get(child_id)
                if child is not None and not child.purged:
                    order.append(child_id)
                    stack.append(child)
        return order[::-1]

    async def _quiesce(self, targets: list[int]) -> None:
        for target in targets:
            run = self.running.get(target)
            if run is not None:
                run.cancel()
        deadline = time.monotonic() + PURGE_WAIT_S
        while any(t in self.running for t in targets):
            if time.monotonic() > deadline:
                busy = next(t for t in targets if t in self.running)
                raise DaemonError(f"session {busy} did not quiesce for purge (lane still running)")
            await asyncio.sleep(0.005)

    def subscribe(self, session: int, cursor: int, provisional: bool) -> Subscription:
        """Attach a subscriber: the backlog from `cursor`, then live events, deduplicated by id (an event
        committed meanwhile may come in both; no lock is taken, since a commit is applied before it is published)."""
        state = self._session(session, to_read=True)
        sub = self.bus.subscribe(session, cursor, provisional, lambda c: state.events[c:])
        self.remote.watch(session, max(cursor, state.next_id))
        return sub


def _check_edits(edits: list[Any], next_id: int) -> None:
    def invalid(why: str) -> DaemonError:
        return DaemonError(f"rebase edit spec invalid: {why}")

    if not edits:
        raise invalid("no edits")
    previous_end = 0
    for edit in edits:
        if edit.from_ == 0:
            raise invalid("edits never include Created (id 0)")
        if edit.from_ >= edit.to:
            raise invalid("empty range")
        if edit.to > next_id:
            raise invalid("range beyond the parent's committed events")
        if edit.from_ < previous_end:
            raise invalid("ranges must be sorted and non-overlapping")
        if isinstance(edit, RebaseEdit.Replace) and edit.role > ROLE_ASSISTANT:
            raise DaemonError(f"unknown message role {edit.role}")
        previous_end = edit.to


def _copy(event: EventMsg, calls: set[int], remap: dict[int, int]) -> EventBody | None:
    """The record a rebased branch gets for one of its parent's later events, or None."""
    body = event.body
    if isinstance(
        body, (B.Appended, B.Message, B.GenerationPrompt, B.Generated, B.ToolUse, B.ToolParseFailure, B.Block)
    ):
        return body
    if isinstance(body, B.ToolResult):
        call = remap.get(body.call_id, body.call_id)
        if call in calls:
            return B.ToolResult(call, body.content, body.span)
        return B.Message(3, body.content, body.span)
    return None
