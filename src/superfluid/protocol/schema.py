"""The session protocol, declared once.

Every request, reply and session-log record, with its fields, in wire order: the
order of variants is the postcard discriminant and the order of fields is the order of
bytes. Variants are only ever appended. The postcard codec (`postcard.py`) and the JSON
codec (`jsoncodec.py`) are both driven by these declarations; neither lists fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, TypeAlias

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
# every name a class goes by (`_` spellings too): the HTTP header, --http-default-qos, key policies
QOS_ALIASES = {
    "interactive": 0,
    "interactive-chat": 0,
    "completion": 1,
    "inline-completion": 1,
    "agent": 2,
    "foreground": 2,
    "foreground-agent": 2,
    "background": 3,
    "background-agent": 3,
}


def qos_class(name: str) -> int:
    """The class a QoS name stands for; ValueError naming the accepted ones otherwise."""
    found = QOS_ALIASES.get(name.strip().lower().replace("_", "-"))
    if found is None:
        raise ValueError(f"unknown QoS class {name!r}: use interactive, completion, agent or background")
    return found


FIM_PSM, FIM_SPM = 0, 1

StoreId = Annotated[bytes, Fixed(16)]

if TYPE_CHECKING:
    # to the type checker an enum's variants are values of the enum, as the codecs read a
    # field annotated with it (`mode: PurgeMode` holds any variant); at run time these bases
    # are `object`, so a variant derives from Struct alone
    _RebaseEdit: TypeAlias = "RebaseEdit"
    _PurgeMode: TypeAlias = "PurgeMode"
    _EventBody: TypeAlias = "EventBody"
    _Tier: TypeAlias = "Tier"
    _Request: TypeAlias = "Request"
    _Response: TypeAlias = "Response"
else:
    _RebaseEdit = _PurgeMode = _EventBody = _Tier = _Request = _Response = object


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

    class Drop(Struct, _RebaseEdit):
        """Leave out events [from, to)."""

        from_: U64
        to: U64

    class Replace(Struct, _RebaseEdit):
        """Put one new message where events [from, to) were."""

        from_: U64
        to: U64
        role: U32
        text: str


class PurgeMode(Enum):
    """What happens to a purged session's descendants."""

    class Cascade(Struct, _PurgeMode):
        """Purge every descendant too."""

    class Reroot(Struct, _PurgeMode):
        """Keep the children, each taking its inherited history as its own."""


class EventBody(Enum):
    """One record of the session log."""

    class Created(Struct, _EventBody):
        """A new session (event 0): its sampling, and the session it was created under, if any."""

        parent: U64 | None
        params: GenParams

    class Appended(Struct, _EventBody):
        """Raw tokens put on the input, with the text they came from if any."""

        text: str | None
        span: list[U32]

    class Message(Struct, _EventBody):
        """A message of a role, rendered through the chat template into `span`."""

        role: U32
        text: str
        span: list[U32]

    class GenerationPrompt(Struct, _EventBody):
        """The assistant opener a generation started its turn with."""

        span: list[U32]

    class Generated(Struct, _EventBody):
        """A run of generated tokens in one channel; `finish` is set on a turn's last run."""

        span: list[U32]
        text: str
        channel: U32
        finish: U32

    class ToolUse(Struct, _EventBody):
        """A tool call the model made; its event id is the call id."""

        name: str
        arguments: str

    class ToolResult(Struct, _EventBody):
        """The answer to a tool call, rendered as a tool turn."""

        call_id: U64
        content: str
        span: list[U32]

    class EpochBump(Struct, _EventBody):
        """The daemon restarted: later events carry the next epoch."""

    class GenerationFingerprint(Struct, _EventBody):
        """What generated the following tokens: the model and its template."""

        digest: U64

    class ToolParseFailure(Struct, _EventBody):
        """Tool-call text that could not be read as a call."""

        raw: str

    class Forked(Struct, _EventBody):
        """A fork's first own event, at `fork_at`: events before it are the parent's."""

        parent: U64
        fork_at: U64
        params: GenParams

    class MetaUpdated(Struct, _EventBody):
        """New title or archived flag; `version` counts the updates."""

        version: U64
        title: str | None
        archived: bool | None

    class Rebased(Struct, _EventBody):
        """A rebased branch's first own event, at the first edit's `from`."""

        parent: U64
        fork_at: U64
        params: GenParams
        edits: list[RebaseEdit]

    class ToolExpired(Struct, _EventBody):
        """A tool call closed without a result."""

        call_id: U64
        reason: str

    class Purged(Struct, _EventBody):
        """The session was purged (not kept in its event list)."""

        generation: U64
        descendants: PurgeMode

    class Rerooted(Struct, _EventBody):
        """The parent was purged: the inherited history, copied in."""

        purged_parent: U64
        prefix: list[tuple[U64, EventBody]]

    class QosSet(Struct, _EventBody):
        """The session's scheduling class."""

        class_: U8
        batch_invariant: bool

    class Block(Struct, _EventBody):
        """A structured block (diff, artifact, citation...) and the text it put on the input."""

        role: U32
        kind: U32
        payload: str
        span: list[U32]
        visibility_version: U32

    class PermissionRequest(Struct, _EventBody):
        """A question for the user; its event id is the request id."""

        call_id: U64
        text: str

    class PermissionResponse(Struct, _EventBody):
        """The user's answer to a permission request."""

        request_id: U64
        granted: bool

    class ToolCancelRequested(Struct, _EventBody):
        """The client asked a running tool call to stop."""

        call_id: U64

    class ToolOutcome(Struct, _EventBody):
        """A tool call ended without a result: 1 failed, 2 cancelled."""

        call_id: U64
        outcome: U8
        note: str

    class ToolReconciliation(Struct, _EventBody):
        """A result that arrived after its call had already ended."""

        call_id: U64
        note: str

    class ToolLease(Struct, _EventBody):
        """The deadline of a tool call's executor lease."""

        call_id: U64
        deadline_unix_ms: U64

    class Pinned(Struct, _EventBody):
        """Keep the session's prefix cached until the deadline (0 clears)."""

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
    """One line about a session, as `Sessions` lists it."""

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
    """A tool call's bookkeeping: its state (0 open .. 6 cancelled with a late effect)."""

    name: str
    arguments: str
    state: U8
    cancel_requested: bool
    lease_deadline_unix_ms: U64 | None
    late_effects: U32


class Tier(Enum):
    """Where a session's KV state lives."""

    class Resident(Struct, _Tier):
        """A generation is running."""

    class Parked(Struct, _Tier):
        """The KV state is parked on disk."""

        covered: U64
        encoding: U8

    class Cold(Struct, _Tier):
        """Nothing is held for it."""


class Inspection(Struct):
    """Everything the daemon knows about a session."""

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

    class Create(Struct, _Request):
        """A new session, optionally linked to a parent."""

        parent: U64 | None
        params: GenParams

    class Append(Struct, _Request):
        """Raw tokens (or text tokenized as is, markers included)."""

        session: U64
        text: str | None
        span: list[U32]

    class AppendMessage(Struct, _Request):
        """A message of role 0 system, 1 user or 2 assistant."""

        session: U64
        role: U32
        text: str

    class Generate(Struct, _Request):
        """Generate the next turn (or continue a cut one).

        `ignore_eos` (an extension, left off the wire when unset) bans end-of-generation
        tokens, so the generation runs to `max_tokens` unless a grammar ends it.
        """

        session: U64
        max_tokens: U32
        ignore_eos: Annotated[bool | None, TrailingOptional()] = None

    class Read(Struct, _Request):
        """The events from `cursor` on."""

        session: U64
        cursor: U64

    class AppendToolResult(Struct, _Request):
        """Answer an open tool call."""

        session: U64
        call_id: U64
        content: str

    class OpenToolCalls(Struct, _Request):
        """The session's unanswered tool calls."""

        session: U64

    class List(Struct, _Request):
        """The ids of live sessions."""

    class Cancel(Struct, _Request):
        """Stop the session's generation in flight."""

        session: U64

    class Subscribe(Struct, _Request):
        """The events from `cursor` on, then live ones, on this connection."""

        session: U64
        cursor: U64
        provisional: bool

    class Unsubscribe(Struct, _Request):
        """End a subscription."""

        sub: U64

    class Fork(Struct, _Request):
        """A new session holding the events before `at_event`."""

        session: U64
        at_event: U64
        params: GenParams | None

    class Tree(Struct, _Request):
        """Every unarchived session as (id, parent, fork_at)."""

    class Sessions(Struct, _Request):
        """A summary of every live session."""

        include_archived: bool

    class SetMeta(Struct, _Request):
        """Set the title or archived flag, if the version still matches."""

        session: U64
        expected_version: U64
        title: str | None
        archived: bool | None

    class Rebase(Struct, _Request):
        """A new branch with events dropped or replaced."""

        session: U64
        edits: list[RebaseEdit]
        params: GenParams | None

    class Purge(Struct, _Request):
        """Remove a session (and its descendants, or reroot them)."""

        session: U64
        expected_generation: U64
        mode: PurgeMode

    class SetQos(Struct, _Request):
        """The session's scheduling class: 0 interactive to 3 background."""

        session: U64
        class_: U8
        batch_invariant: bool

    class SetBackgroundRate(Struct, _Request):
        """Run agent and background lanes only every `divisor`-th step."""

        divisor: U32

    class Inspect(Struct, _Request):
        """Everything about a session."""

        session: U64

    class SetLogLevel(Struct, _Request):
        """Change logging, with a directive such as `superfluid=debug`."""

        directive: str

    class Metrics(Struct, _Request):
        """The Prometheus exposition."""

    class AppendBlock(Struct, _Request):
        """A structured block of kind 1 to 6."""

        session: U64
        role: U32
        kind: U32
        payload: str

    class RequestPermission(Struct, _Request):
        """Ask the user before going on; generation waits for the answer."""

        session: U64
        call_id: U64
        text: str

    class RespondPermission(Struct, _Request):
        """Answer a permission request."""

        session: U64
        request_id: U64
        granted: bool

    class RequestToolCancel(Struct, _Request):
        """Ask a running tool call to stop."""

        session: U64
        call_id: U64

    class AppendToolOutcome(Struct, _Request):
        """End a tool call without a result: 1 failed, 2 cancelled."""

        session: U64
        call_id: U64
        outcome: U8
        note: str

    class Ledger(Struct, _Request):
        """Every tool call of the session and its state."""

        session: U64

    class PutMedia(Struct, _Request):
        """Store a blob; answers its sha256."""

        bytes: Blob
        mime: str

    class AppendImage(Struct, _Request):
        """An image from the media store, between two texts."""

        session: U64
        role: U32
        blob: str
        pre_text: str
        post_text: str

    class GcMedia(Struct, _Request):
        """Remove blobs no session references."""

    class Complete(Struct, _Request):
        """Fill in the middle between `prefix` and `suffix` (0 PSM, 1 SPM)."""

        prefix: str
        suffix: str
        mode: U8
        max_tokens: U32

    class Trim(Struct, _Request):
        """A new session holding the events before `to_event`."""

        session: U64
        to_event: U64

    class Pin(Struct, _Request):
        """Keep the session's prefix cached for `ttl_ms` (0 clears)."""

        session: U64
        ttl_ms: U64

    class AppendSystem(Struct, _Request):
        """Open the session with a system turn that declares tools."""

        session: U64
        text: str | None
        tools: list[str]


class Response(Enum):
    """What the daemon answers."""

    class Created(Struct, _Response):
        """The new session's id."""

        session: U64

    class Delta(Struct, _Response):
        """An event a generation committed."""

        event: EventMsg

    class Cancelling(Struct, _Response):
        """The generation will stop at its next step."""

    class Committed(Struct, _Response):
        """The event the request committed."""

        event: EventMsg

    class Generated(Struct, _Response):
        """A generation's summary: its events, tokens, finish code and warm prefix."""

        events: list[EventMsg]
        tokens_generated: U32
        finish: U32
        warm_prefix: U64

    class Events(Struct, _Response):
        """Events of a session."""

        events: list[EventMsg]

    class Sessions(Struct, _Response):
        """Ids of live sessions."""

        ids: list[U64]

    class ToolCalls(Struct, _Response):
        """Open tool calls as (call id, name, arguments)."""

        calls: list[tuple[U64, str, str]]

    class Subscribed(Struct, _Response):
        """The new subscription's id."""

        sub: U64

    class SubEvent(Struct, _Response):
        """An event for a subscription."""

        sub: U64
        event: EventMsg

    class SubProvisional(Struct, _Response):
        """Text ahead of its commit, for a subscription."""

        sub: U64
        channel: U32
        text: str

    class SubEnded(Struct, _Response):
        """A subscription ended: unsubscribed, lagged, publisher closed or purged."""

        sub: U64
        reason: str

    class Unsubscribed(Struct, _Response):
        """The subscription is ended."""

    class Err(Struct, _Response):
        """The request was refused; nothing was written."""

        message: str

    class Tree(Struct, _Response):
        """Sessions as (id, parent, fork_at)."""

        nodes: list[tuple[U64, U64 | None, U64]]

    class SessionList(Struct, _Response):
        """Session summaries."""

        sessions: list[SessionSummary]

    class Meta(Struct, _Response):
        """The new metadata version."""

        version: U64

    class Purged(Struct, _Response):
        """The purged sessions, descendants first."""

        sessions: list[U64]

    class Ack(Struct, _Response):
        """Done."""

    class Inspection(Struct, _Response):
        """Everything about a session."""

        inspection: Inspection

    class Text(Struct, _Response):
        """Text, such as the metrics exposition."""

        text: str

    class Ledger(Struct, _Response):
        """Tool calls and their states."""

        entries: list[tuple[U64, LedgerEntry]]

    class Media(Struct, _Response):
        """The stored blob's sha256."""

        hash: str

    class Gc(Struct, _Response):
        """Blobs kept and removed."""

        kept: U64
        removed: U64

    class Completion(Struct, _Response):
        """A fill-in-the-middle answer; `cached` when it came from the recent results."""

        text: str
        tokens: list[U32]
        cached: bool
        expired: bool

    class Pinned(Struct, _Response):
        """The pin's deadline."""

        deadline_unix_ms: U64

    class Throttled(Struct, _Response):
        """Too many Complete requests: retry after this many milliseconds."""

        retry_after_ms: U64

    class Elsewhere(Struct, _Response):
        """Another daemon sharing the store serves the session: send its requests to `address`."""

        session: U64
        address: str
