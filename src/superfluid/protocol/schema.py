"""The session protocol, declared once.

Every request, reply and session-log record, with its fields, in wire order: the
order of variants is the postcard discriminant and the order of fields is the order of
bytes. Variants are only ever appended. The postcard codec (`postcard.py`) and the JSON
codec (`jsoncodec.py`) are both driven by these declarations; neither lists fields.
"""

from __future__ import annotations

from typing import Annotated

from .types import F32, U8, U32, U64, Blob, Enum, Fixed, Struct, TrailingOptional

# ---- numeric constants of the protocol ----

ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT, ROLE_TOOL = 0, 1, 2, 3
ROLE_NAMES = {ROLE_SYSTEM: "system", ROLE_USER: "user", ROLE_ASSISTANT: "assistant", ROLE_TOOL: "tool"}

CHANNEL_TEXT, CHANNEL_REASONING, CHANNEL_TOOL_CALL = 0, 1, 2

FINISH_NONE, FINISH_STOP, FINISH_LENGTH, FINISH_GRAMMAR, FINISH_CANCELLED, FINISH_ERROR = range(6)
FINISH_NAMES = {0: "none", 1: "stop", 2: "length", 3: "grammar", 4: "cancelled", 5: "error"}

BLOCK_FILE_DIFF, BLOCK_ARTIFACT, BLOCK_CITATION, BLOCK_PROGRESS = 1, 2, 3, 4
BLOCK_DIAGNOSTIC, BLOCK_WORKSPACE_REF, BLOCK_IMAGE = 5, 6, 7
MODEL_VISIBILITY_VERSION = 2

OUTCOME_FAILED, OUTCOME_CANCELLED = 1, 2

LEDGER_OPEN, LEDGER_CANCEL_REQUESTED, LEDGER_SUCCEEDED, LEDGER_FAILED = 0, 1, 2, 3
LEDGER_CANCELLED, LEDGER_EXPIRED, LEDGER_CANCELLED_WITH_LATE_EFFECT = 4, 5, 6

QOS_INTERACTIVE, QOS_COMPLETION, QOS_AGENT, QOS_BACKGROUND = 0, 1, 2, 3
QOS_NAMES = {0: "interactive", 1: "completion", 2: "agent", 3: "background"}

FIM_PSM, FIM_SPM = 0, 1

StoreId = Annotated[bytes, Fixed(16)]


# ---- shared structs ----


class GenParams(Struct):
    """Sampling parameters of a session; all five are required on the wire."""

    temperature: F32
    top_p: F32
    min_p: F32
    top_k: U32
    seed: U64


class RebaseEdit(Enum):
    """One edit of a Rebase: half-open ranges of event ids."""

    class Drop(Struct):
        from_: U64
        to: U64

    class Replace(Struct):
        from_: U64
        to: U64
        role: U32
        text: str


class PurgeMode(Enum):
    """What happens to a purged session's descendants."""

    class Cascade(Struct):
        pass

    class Reroot(Struct):
        pass


class EventBody(Enum):
    """One record of the session log."""

    class Created(Struct):
        parent: U64 | None
        params: GenParams

    class Appended(Struct):
        text: str | None
        span: list[U32]

    class Message(Struct):
        role: U32
        text: str
        span: list[U32]

    class GenerationPrompt(Struct):
        span: list[U32]

    class Generated(Struct):
        span: list[U32]
        text: str
        channel: U32
        finish: U32

    class ToolUse(Struct):
        name: str
        arguments: str

    class ToolResult(Struct):
        call_id: U64
        content: str
        span: list[U32]

    class EpochBump(Struct):
        pass

    class GenerationFingerprint(Struct):
        digest: U64

    class ToolParseFailure(Struct):
        raw: str

    class Forked(Struct):
        parent: U64
        fork_at: U64
        params: GenParams

    class MetaUpdated(Struct):
        version: U64
        title: str | None
        archived: bool | None

    class Rebased(Struct):
        parent: U64
        fork_at: U64
        params: GenParams
        edits: list[RebaseEdit]

    class ToolExpired(Struct):
        call_id: U64
        reason: str

    class Purged(Struct):
        generation: U64
        descendants: PurgeMode

    class Rerooted(Struct):
        purged_parent: U64
        prefix: list[tuple[U64, EventBody]]

    class QosSet(Struct):
        class_: U8
        batch_invariant: bool

    class Block(Struct):
        role: U32
        kind: U32
        payload: str
        span: list[U32]
        visibility_version: U32

    class PermissionRequest(Struct):
        call_id: U64
        text: str

    class PermissionResponse(Struct):
        request_id: U64
        granted: bool

    class ToolCancelRequested(Struct):
        call_id: U64

    class ToolOutcome(Struct):
        call_id: U64
        outcome: U8
        note: str

    class ToolReconciliation(Struct):
        call_id: U64
        note: str

    class ToolLease(Struct):
        call_id: U64
        deadline_unix_ms: U64

    class Pinned(Struct):
        deadline_unix_ms: U64


# Records whose span is part of the session's model input.
TOKEN_BEARING = (
    EventBody.Appended,
    EventBody.Message,
    EventBody.GenerationPrompt,
    EventBody.Generated,
    EventBody.ToolResult,
    EventBody.Block,
)


class EventMsg(Struct):
    """A committed event as it travels: id, epoch, commit time and record."""

    event_id: U64
    epoch: U64
    ts_unix_ms: U64
    body: EventBody


class SessionSummary(Struct):
    id: U64
    parent: U64 | None
    fork_at: U64
    title: str | None
    archived: bool
    meta_version: U64
    generation: U64
    events: U64
    tokens: U64
    open_tool_calls: U64


class LedgerEntry(Struct):
    name: str
    arguments: str
    state: U8
    cancel_requested: bool
    lease_deadline_unix_ms: U64 | None
    late_effects: U32


class Tier(Enum):
    """Where a session's KV state lives."""

    class Resident(Struct):
        pass

    class Parked(Struct):
        covered: U64
        encoding: U8

    class Cold(Struct):
        pass


class Inspection(Struct):
    summary: SessionSummary
    params: GenParams
    epoch: U64
    last_finish: U32
    qos_class: U8
    batch_invariant: bool
    pin_deadline_unix_ms: U64
    behavior_fingerprint: U64 | None
    open_tool_calls: list[tuple[U64, str, str]]
    tier: Tier
    tokens: list[U32]
    events: list[EventMsg]
    wal_version: U8
    store_id: Annotated[StoreId | None, TrailingOptional()]


class Request(Enum):
    """What a client asks of the daemon."""

    class Create(Struct):
        parent: U64 | None
        params: GenParams

    class Append(Struct):
        session: U64
        text: str | None
        span: list[U32]

    class AppendMessage(Struct):
        session: U64
        role: U32
        text: str

    class Generate(Struct):
        session: U64
        max_tokens: U32

    class Read(Struct):
        session: U64
        cursor: U64

    class AppendToolResult(Struct):
        session: U64
        call_id: U64
        content: str

    class OpenToolCalls(Struct):
        session: U64

    class List(Struct):
        pass

    class Cancel(Struct):
        session: U64

    class Subscribe(Struct):
        session: U64
        cursor: U64
        provisional: bool

    class Unsubscribe(Struct):
        sub: U64

    class Fork(Struct):
        session: U64
        at_event: U64
        params: GenParams | None

    class Tree(Struct):
        pass

    class Sessions(Struct):
        include_archived: bool

    class SetMeta(Struct):
        session: U64
        expected_version: U64
        title: str | None
        archived: bool | None

    class Rebase(Struct):
        session: U64
        edits: list[RebaseEdit]
        params: GenParams | None

    class Purge(Struct):
        session: U64
        expected_generation: U64
        mode: PurgeMode

    class SetQos(Struct):
        session: U64
        class_: U8
        batch_invariant: bool

    class SetBackgroundRate(Struct):
        divisor: U32

    class Inspect(Struct):
        session: U64

    class SetLogLevel(Struct):
        directive: str

    class Metrics(Struct):
        pass

    class AppendBlock(Struct):
        session: U64
        role: U32
        kind: U32
        payload: str

    class RequestPermission(Struct):
        session: U64
        call_id: U64
        text: str

    class RespondPermission(Struct):
        session: U64
        request_id: U64
        granted: bool

    class RequestToolCancel(Struct):
        session: U64
        call_id: U64

    class AppendToolOutcome(Struct):
        session: U64
        call_id: U64
        outcome: U8
        note: str

    class Ledger(Struct):
        session: U64

    class PutMedia(Struct):
        bytes: Blob
        mime: str

    class AppendImage(Struct):
        session: U64
        role: U32
        blob: str
        pre_text: str
        post_text: str

    class GcMedia(Struct):
        pass

    class Complete(Struct):
        prefix: str
        suffix: str
        mode: U8
        max_tokens: U32

    class Trim(Struct):
        session: U64
        to_event: U64

    class Pin(Struct):
        session: U64
        ttl_ms: U64

    class AppendSystem(Struct):
        session: U64
        text: str | None
        tools: list[str]


class Response(Enum):
    """What the daemon answers."""

    class Created(Struct):
        session: U64

    class Delta(Struct):
        event: EventMsg

    class Cancelling(Struct):
        pass

    class Committed(Struct):
        event: EventMsg

    class Generated(Struct):
        events: list[EventMsg]
        tokens_generated: U32
        finish: U32
        warm_prefix: U64

    class Events(Struct):
        events: list[EventMsg]

    class Sessions(Struct):
        ids: list[U64]

    class ToolCalls(Struct):
        calls: list[tuple[U64, str, str]]

    class Subscribed(Struct):
        sub: U64

    class SubEvent(Struct):
        sub: U64
        event: EventMsg

    class SubProvisional(Struct):
        sub: U64
        channel: U32
        text: str

    class SubEnded(Struct):
        sub: U64
        reason: str

    class Unsubscribed(Struct):
        pass

    class Err(Struct):
        message: str

    class Tree(Struct):
        nodes: list[tuple[U64, U64 | None, U64]]

    class SessionList(Struct):
        sessions: list[SessionSummary]

    class Meta(Struct):
        version: U64

    class Purged(Struct):
        sessions: list[U64]

    class Ack(Struct):
        pass

    class Inspection(Struct):
        inspection: Inspection

    class Text(Struct):
        text: str

    class Ledger(Struct):
        entries: list[tuple[U64, LedgerEntry]]

    class Media(Struct):
        hash: str

    class Gc(Struct):
        kept: U64
        removed: U64

    class Completion(Struct):
        text: str
        tokens: list[U32]
        cached: bool
        expired: bool

    class Pinned(Struct):
        deadline_unix_ms: U64

    class Throttled(Struct):
        retry_after_ms: U64
