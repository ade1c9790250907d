"""Tool verbs: the ledger of a session's tool calls, their results and outcomes, and permission requests."""

from __future__ import annotations

from ...protocol.schema import (
    LEDGER_CANCEL_REQUESTED,
    LEDGER_OPEN,
    LEDGER_SUCCEEDED,
    OUTCOME_CANCELLED,
    OUTCOME_FAILED,
    ROLE_TOOL,
    EventBody,
    Request,
    Response,
)
from ...store.state import SessionState, ToolCallState
from ..errors import DaemonError
from .base import DaemonBase

B = EventBody
R = Request


class ToolVerbs(DaemonBase):
    """The tool-call ledger and permission requests."""

    def _open_tool_calls(self, req: R.OpenToolCalls) -> Response:
        s = self._session(req.session)
        return Response.ToolCalls([(call, name, args) for call, (name, args) in list(s.open_calls.items())])

    def _ledger(self, req: R.Ledger) -> Response:
        s = self._session(req.session)
        return Response.Ledger([(call, entry.entry()) for call, entry in list(s.ledger.items())])

    def _tool_call(self, s: SessionState, call_id: int) -> ToolCallState:
        """The session's own ledger entry of `call_id`, or the Err the protocol gives."""
        call = s.ledger.get(call_id)
        if call is None:
            inherited = call_id < s.base and isinstance(_body_at(s, call_id), B.ToolUse)
            if inherited:
                raise DaemonError(
                    f"tool call {call_id} belongs to an ancestor's timeline; only that session can close it"
                )
            raise DaemonError(f"tool call {call_id} is unknown or already closed")
        return call

    def _append_tool_result(self, req: R.AppendToolResult) -> Response:
        with self.store.lock:
            s = self._session(req.session)
            self._idle(s)
            call = self._tool_call(s, req.call_id)
            if call.state == LEDGER_SUCCEEDED:
                raise DaemonError(f"tool call {req.call_id} is unknown or already closed")
            if call.state not in (LEDGER_OPEN, LEDGER_CANCEL_REQUESTED):
                note = f"late result: {len(req.content.encode())} bytes"
                self._commit_one(s.id, B.ToolReconciliation(req.call_id, note))
                raise DaemonError(
                    f"tool call {req.call_id} already reached a terminal outcome; "
                    "the late result was recorded as a reconciliation"
                )
            span = self._message_span(True, s.last_input, ROLE_TOOL, req.content)
            return Response.Committed(self._commit_one(s.id, B.ToolResult(req.call_id, req.content, span)))

    def _append_tool_outcome(self, req: R.AppendToolOutcome) -> Response:
        if req.outcome not in (OUTCOME_FAILED, OUTCOME_CANCELLED):
            raise DaemonError(f"unknown tool outcome {req.outcome} (1 failed, 2 cancelled)")
        with self.store.lock:
            s = self._session(req.session)
            call = self._tool_call(s, req.call_id)
            if call.state not in (LEDGER_OPEN, LEDGER_CANCEL_REQUESTED):
                raise DaemonError(f"tool call {req.call_id} is unknown or already closed")
            event = self._commit_one(s.id, B.ToolOutcome(req.call_id, req.outcome, req.note))
            return Response.Committed(event)

    def _request_tool_cancel(self, req: R.RequestToolCancel) -> Response:
        with self.store.lock:
            s = self._session(req.session)
            call = self._tool_call(s, req.call_id)
            if call.state not in (LEDGER_OPEN, LEDGER_CANCEL_REQUESTED):
                raise DaemonError(f"tool call {req.call_id} is unknown or already closed")
            return Response.Committed(self._commit_one(s.id, B.ToolCancelRequested(req.call_id)))

    def _request_permission(self, req: R.RequestPermission) -> Response:
        with self.store.lock:
            s = self._session(req.session)
            self._idle(s)
            if req.call_id != 0 and req.call_id not in s.open_calls:
                raise DaemonError(f"tool call {req.call_id} is unknown or already closed")
            return Response.Committed(self._commit_one(s.id, B.PermissionRequest(req.call_id, req.text)))

    def _respond_permission(self, req: R.RespondPermission) -> Response:
        with self.store.lock:
            s = self._session(req.session)
            if req.request_id not in s.permissions:
                raise DaemonError(f"permission request {req.request_id} is unknown or already answered")
            event = self._commit_one(s.id, B.PermissionResponse(req.request_id, req.granted))
            return Response.Committed(event)


def _body_at(s: SessionState, event_id: int) -> EventBody | None:
    return s.events[event_id].body if 0 <= event_id < len(s.events) else None
