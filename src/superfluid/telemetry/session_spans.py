"""A session's history as OpenTelemetry spans, written as OTLP JSON lines or sent to a collector.

The log is the truth, so a session's trace is read from its committed events alone: a root span for
the session, a span per turn (a message, raw tokens, a block, a generation with its token counts and
finish reason) and a span per tool call, from the call to its result, each timed by the commit
timestamps of its events. Ids are derived from the store's id and the session id, so exporting a
session again gives the same trace and span ids.

Texts (prompts, replies, tool arguments and results) are left out unless the caller passes a
function to show them through (the command line passes one that redacts credentials).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import httpx
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from .. import __version__
from ..protocol.schema import (
    CHANNEL_REASONING,
    CHANNEL_TEXT,
    FINISH_ERROR,
    FINISH_NAMES,
    OUTCOME_FAILED,
    QOS_NAMES,
    ROLE_NAMES,
    TOKEN_BEARING,
    EventBody,
    EventMsg,
    Inspection,
)
from .otlp import check_endpoint

SCOPE = "superfluid.session_export"
TRACES_PATH = "/v1/traces"
# the fields of an OTLP span (and its links) that OTLP/JSON writes as hex rather than base64
_ID_FIELDS = ("traceId", "spanId", "parentSpanId")

# records that begin another turn: a generation still open before one of them was cut
_ENDS_A_GENERATION = (
    EventBody.Message,
    EventBody.Appended,
    EventBody.Block,
    EventBody.GenerationPrompt,
    EventBody.ToolResult,
    EventBody.EpochBump,
)

Show = Callable[[str], str]
Attribute = str | int | float | bool | list[str]


class SpanExportError(Exception):
    """Why spans could not be sent to a collector."""


def trace_id_of(store_id: bytes | None, session: int) -> bytes:
    """The trace id of a session of a store: the same on every export."""
    return hashlib.sha256(b"superfluid session\0" + (store_id or b"") + session.to_bytes(8, "big")).digest()[:16]


def _span_id(trace_id: bytes, tag: str) -> bytes:
    return hashlib.sha256(trace_id + tag.encode()).digest()[:8]


def _ns(ms: int) -> int:
    return ms * 1_000_000


def _value(value: Attribute) -> AnyValue:
    if isinstance(value, bool):  # before int: a bool is an int
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, list):
        return AnyValue(array_value=ArrayValue(values=[AnyValue(string_value=v) for v in value]))
    return AnyValue(string_value=value)


def _attributes(values: Mapping[str, Attribute | None]) -> list[KeyValue]:
    return [KeyValue(key=key, value=_value(value)) for key, value in values.items() if value is not None]


@dataclasses.dataclass
class _Generation:
    """A generation being read: its span and what its runs add up to."""

    span: Span
    input_tokens: int
    opener_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    runs: int = 0
    texts: dict[int, list[str]] = dataclasses.field(default_factory=dict)


class _SessionSpans:
    """Reads one session's events in order into spans."""

    def __init__(self, inspection: Inspection, show: Show | None) -> None:
        summary = inspection.summary
        self.show = show
        self.trace_id = trace_id_of(inspection.store_id, summary.id)
        events = inspection.events
        start, end = (events[0].ts_unix_ms, events[-1].ts_unix_ms) if events else (0, 0)
        params = inspection.params
        self.root = Span(
            trace_id=self.trace_id,
            span_id=_span_id(self.trace_id, "session"),
            name=f"session {summary.id}",
            kind=Span.SpanKind.SPAN_KIND_INTERNAL,
            start_time_unix_nano=_ns(start),
            end_time_unix_nano=_ns(end),
            attributes=_attributes(
                {
                    "gen_ai.conversation.id": str(summary.id),
                    "superfluid.session.id": summary.id,
                    "superfluid.session.parent": summary.parent,
                    "superfluid.session.fork_at": summary.fork_at,
                    "superfluid.session.events": summary.events,
                    "superfluid.session.tokens": summary.tokens,
                    "superfluid.session.title": self._shown(summary.title),
                    "superfluid.qos.class": QOS_NAMES.get(inspection.qos_class, str(inspection.qos_class)),
                    "gen_ai.request.temperature": params.temperature,
                    "gen_ai.request.top_p": params.top_p,
                    "gen_ai.request.top_k": params.top_k,
                    "gen_ai.request.seed": params.seed,
                }
            ),
        )
        self.spans = [self.root]
        self.generation: _Generation | None = None
        self.last_generation: Span | None = None
        self.calls: dict[int, Span] = {}  # every tool call by its id, answered or not
        self.open_calls: set[int] = set()
        self.permission_calls: dict[int, int] = {}  # permission request id -> its tool call
        self.fingerprint: int | None = None
        self.tokens = 0  # on the session's input so far
        for event in events:
            self._read(event)
        self._end_generation(None, FINISH_NAMES[0])
        for call_id in sorted(self.open_calls):  # calls still open when exported
            self.calls[call_id].end_time_unix_nano = _ns(end)
            self.calls[call_id].attributes.extend(_attributes({"superfluid.tool.state": "open"}))

    def _shown(self, text: str | None) -> str | None:
        return None if text is None or self.show is None else self.show(text)

    def _child(self, tag: str, name: str, ms: int, values: Mapping[str, Attribute | None]) -> Span:
        span = Span(
            trace_id=self.trace_id,
            span_id=_span_id(self.trace_id, tag),
            parent_span_id=self.root.span_id,
            name=name,
            kind=Span.SpanKind.SPAN_KIND_INTERNAL,
            start_time_unix_nano=_ns(ms),
            end_time_unix_nano=_ns(ms),
            attributes=_attributes(values),
        )
        self.spans.append(span)
        return span

    def _read(self, event: EventMsg) -> None:
        body, ms, eid = event.body, event.ts_unix_ms, event.event_id
        tokens = len(body.span) if isinstance(body, TOKEN_BEARING) else 0
        if isinstance(body, _ENDS_A_GENERATION):
            self._end_generation(None, FINISH_NAMES[0])
        if isinstance(body, EventBody.Generated):
            self._generated(event, body)
        elif isinstance(body, EventBody.GenerationPrompt):
            self.generation = self._start_generation(eid, ms, tokens)
        elif isinstance(body, EventBody.GenerationFingerprint):
            self.fingerprint = body.digest
        elif isinstance(body, EventBody.ToolUse):
            self._start_call(event, body)
        elif isinstance(body, EventBody.ToolParseFailure):
            failure = Span.Event(time_unix_nano=_ns(ms), name="tool call not understood")
            failure.attributes.extend(_attributes({"superfluid.raw": self._shown(body.raw)}))
            (self.generation.span if self.generation else self.root).events.append(failure)
        elif isinstance(body, EventBody.Message):
            role = ROLE_NAMES.get(body.role, str(body.role))
            self._turn(eid, f"message {role}", ms, tokens, {"superfluid.message.role": role}, body.text)
        elif isinstance(body, EventBody.Appended):
            self._turn(eid, "append", ms, tokens, {}, body.text)
        elif isinstance(body, EventBody.Block):
            self._turn(eid, "block", ms, tokens, {"superfluid.block.kind": body.kind}, body.payload)
        elif isinstance(body, EventBody.ToolResult):
            values = {"superfluid.tokens": tokens, "gen_ai.tool.call.result": self._shown(body.content)}
            self._end_call(body.call_id, ms, "succeeded", values)
        elif isinstance(body, EventBody.ToolOutcome):
            state = "failed" if body.outcome == OUTCOME_FAILED else "cancelled"
            self._end_call(body.call_id, ms, state, {"superfluid.tool.note": self._shown(body.note)})
        elif isinstance(body, EventBody.ToolExpired):
            self._end_call(body.call_id, ms, "expired", {"superfluid.tool.note": self._shown(body.reason)})
        elif isinstance(body, EventBody.PermissionRequest):
            self.permission_calls[eid] = body.call_id
            self._call_event(body.call_id, event)
        elif isinstance(body, EventBody.PermissionResponse):
            self._call_event(self.permission_calls.get(body.request_id, -1), event)
        elif isinstance(body, EventBody.ToolCancelRequested | EventBody.ToolLease | EventBody.ToolReconciliation):
            self._call_event(body.call_id, event)
        else:  # what happened to the session itself: created, forked, restarted, renamed, pinned...
            self.root.events.append(self._event(event))
        self.tokens += tokens

    def _event(self, event: EventMsg) -> Span.Event:
        """An event as a span event: its kind, id and numeric fields (never its texts)."""
        body = event.body
        values: dict[str, Attribute | None] = {"superfluid.event.id": event.event_id}
        for name, value in vars(body).items():
            if isinstance(value, int):
                values[f"superfluid.{name.rstrip('_')}"] = value
        return Span.Event(
            time_unix_nano=_ns(event.ts_unix_ms), name=type(body).__name__, attributes=_attributes(values)
        )

    def _turn(
        self, eid: int, name: str, ms: int, tokens: int, values: Mapping[str, Attribute | None], text: str | None
    ) -> None:
        shown = {
            "superfluid.event.id": eid,
            "superfluid.tokens": tokens,
            **values,
            "superfluid.text": self._shown(text),
        }
        self._child(f"event {eid}", name, ms, shown)

    def _start_generation(self, eid: int, ms: int, opener_tokens: int) -> _Generation:
        span = self._child(f"event {eid}", "generate", ms, {"superfluid.event.id": eid})
        return _Generation(span, self.tokens + opener_tokens, opener_tokens)

    def _generated(self, event: EventMsg, body: EventBody.Generated) -> None:
        """One run of a generation's tokens; the run with a finish code ends it."""
        ms = event.ts_unix_ms
        if self.generation is None:  # a continuation of a cut turn: it starts with its first run
            self.generation = self._start_generation(event.event_id, ms, 0)
        generation = self.generation
        generation.span.end_time_unix_nano = _ns(ms)
        if generation.runs == 0:
            generation.input_tokens = self.tokens
            generation.span.events.append(Span.Event(time_unix_nano=_ns(ms), name="first tokens committed"))
        generation.runs += 1
        generation.output_tokens += len(body.span)
        generation.reasoning_tokens += len(body.span) if body.channel == CHANNEL_REASONING else 0
        generation.texts.setdefault(body.channel, []).append(body.text)
        if body.finish:
            self._end_generation(body.finish, FINISH_NAMES.get(body.finish, str(body.finish)))

    def _end_generation(self, finish: int | None, reason: str) -> None:
        generation, self.generation = self.generation, None
        if generation is None:
            return
        self.last_generation = generation.span
        texts = {channel: "".join(parts) for channel, parts in generation.texts.items()}
        generation.span.attributes.extend(
            _attributes(
                {
                    "superfluid.tokens": generation.opener_tokens + generation.output_tokens,
                    "gen_ai.usage.input_tokens": generation.input_tokens,
                    "gen_ai.usage.output_tokens": generation.output_tokens,
                    "superfluid.usage.reasoning_tokens": generation.reasoning_tokens,
                    "gen_ai.response.finish_reasons": [reason],
                    "superfluid.commits": generation.runs,
                    "superfluid.fingerprint": None if self.fingerprint is None else f"{self.fingerprint:016x}",
                    "superfluid.reply": self._shown(texts.get(CHANNEL_TEXT)),
                    "superfluid.reasoning": self._shown(texts.get(CHANNEL_REASONING)),
                }
            )
        )
        if finish == FINISH_ERROR:
            generation.span.status.CopyFrom(Status(code=Status.StatusCode.STATUS_CODE_ERROR, message=reason))

    def _start_call(self, event: EventMsg, body: EventBody.ToolUse) -> None:
        call = self._child(
            f"event {event.event_id}",
            f"execute_tool {body.name}",
            event.ts_unix_ms,
            {
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": body.name,
                "gen_ai.tool.call.id": str(event.event_id),
                "gen_ai.tool.call.arguments": self._shown(body.arguments),
            },
        )
        # linked to the generation that asked for it rather than nested in it: the call outlives it
        asked_by = self.generation.span if self.generation else self.last_generation
        if asked_by is not None:
            call.links.append(Span.Link(trace_id=self.trace_id, span_id=asked_by.span_id))
        self.calls[event.event_id] = call
        self.open_calls.add(event.event_id)

    def _end_call(self, call_id: int, ms: int, state: str, values: Mapping[str, Attribute | None]) -> None:
        call = self.calls.get(call_id)
        if call is None:  # a call this history does not hold (copied in by a reroot): a call of no length
            call = self.calls[call_id] = self._child(
                f"event {call_id}", "execute_tool", ms, {"gen_ai.tool.call.id": str(call_id)}
            )
        self.open_calls.discard(call_id)
        call.end_time_unix_nano = _ns(ms)
        call.attributes.extend(_attributes({**values, "superfluid.tool.state": state}))
        if state in ("failed", "expired"):
            call.status.CopyFrom(Status(code=Status.StatusCode.STATUS_CODE_ERROR, message=f"tool call {state}"))

    def _call_event(self, call_id: int, event: EventMsg) -> None:
        call = self.calls.get(call_id)
        (call or self.root).events.append(self._event(event))


def session_trace(inspection: Inspection, show: Show | None = None) -> ExportTraceServiceRequest:
    """A session's history as one OTLP trace export; texts only through `show`."""
    spans = _SessionSpans(inspection, show).spans
    resource = Resource(
        attributes=_attributes(
            {
                "service.name": "superfluid",
                "service.version": __version__,
                "superfluid.store.id": None if inspection.store_id is None else inspection.store_id.hex(),
            }
        )
    )
    scope = InstrumentationScope(name=SCOPE, version=__version__)
    return ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(resource=resource, scope_spans=[ScopeSpans(scope=scope, spans=spans)])]
    )


def _spans_json(data: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every span of an export in its JSON form, and every link of each."""
    for resource_spans in data.get("resourceSpans", []):
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                yield span
                yield from span.get("links", [])


def to_json_line(request: ExportTraceServiceRequest) -> str:
    """One OTLP/JSON line: the protobuf JSON mapping with enums as integers and ids in hex, as the
    OTLP specification asks and the collector's file exporter writes."""
    data = json_format.MessageToDict(request, use_integers_for_enums=True)
    for span in _spans_json(data):
        for key in _ID_FIELDS:
            if key in span:
                span[key] = base64.b64decode(span[key]).hex()
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


def from_json_line(line: str) -> ExportTraceServiceRequest:
    """An export read back from one OTLP/JSON line (ids in hex)."""
    data = json.loads(line)
    for span in _spans_json(data):
        for key in _ID_FIELDS:
            if key in span:
                span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
    return json_format.ParseDict(data, ExportTraceServiceRequest())


def span_count(request: ExportTraceServiceRequest) -> int:
    return sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)


def traces_url(endpoint: str) -> str:
    """Where an OTLP/HTTP collector at `endpoint` takes traces: the base URL's /v1/traces, unless given."""
    try:
        base = check_endpoint(endpoint)
    except ValueError as e:
        raise SpanExportError(f"--endpoint: {e}") from None
    return base if base.endswith(TRACES_PATH) else base + TRACES_PATH


HEADERS_ENV = ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS")  # the first set one counts


def collector_headers() -> dict[str, str]:
    """The headers the standard variables ask every export to carry (`key=value,...`, values URL-encoded), as
    the SDK's exporters read them for the daemon: a collector that wants a key gets it from both."""
    from opentelemetry.util.re import parse_env_headers  # the API package the SDK's exporters parse with

    text = next((os.environ[name] for name in HEADERS_ENV if os.environ.get(name)), "")
    return dict(parse_env_headers(text, liberal=True))


def send(request: ExportTraceServiceRequest, endpoint: str, timeout: float = 10.0) -> str:
    """POST the export as protobuf to the collector at `endpoint` (OTLP/HTTP), with `collector_headers`;
    returns the URL it went to."""
    url = traces_url(endpoint)
    try:
        reply = httpx.post(
            url,
            content=request.SerializeToString(),
            headers=collector_headers() | {"content-type": "application/x-protobuf"},
            timeout=timeout,
        )
    except httpx.HTTPError as e:
        raise SpanExportError(f"cannot send spans to {url}: {e or type(e).__name__}") from None
    if not reply.is_success:
        raise SpanExportError(f"the collector at {url} answered {reply.status_code}: {reply.text[:200]}")
    if not reply.headers.get("content-type", "").startswith("application/x-protobuf"):
        return url  # OTLP answers in the request's encoding: anything else (no body, a proxy's page) says no more
    partial = ExportTraceServiceResponse.FromString(reply.content).partial_success
    if partial.rejected_spans:
        raise SpanExportError(
            f"the collector at {url} rejected {partial.rejected_spans} of {span_count(request)} spans:"
            f" {partial.error_message}"
        )
    return url
