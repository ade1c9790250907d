"""Traces over OTLP: one per request, its spans made from the times the scheduler and the committer stamped.

Each HTTP request (a W3C `traceparent` header makes it part of the caller's trace) and each socket or
WebSocket generation has a root span. When the request's access line is written, its children are made
from its generations' `JobTimes`:

- `admission`: from arrival to the job's submission (the key, the body, the template, the session's first commit);
- `queue`: waiting for a lane;
- `prefill`, with a `prefill.chunk` child for each scheduler step that prefilled some of the prompt;
- `decode`: from the first token to the last, with token counts and speculation's drafted and accepted tokens;
- `commit`: from the generation's end to its last record durable;
- `forward`: the hop to the daemon that owns the session, whose own spans join this trace (`traceparent` is sent).

Nothing is made on the scheduler thread, which only reads the clock a few times a job. Ended spans go to
`SpanQueue`, which an export thread empties: when it is full, or an export fails, spans are dropped and counted
in `superfluid_otlp_spans_dropped_total`; the thread that ends a span never waits for the collector.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .. import __version__
from ..metrics import Metrics
from ..protocol.schema import QOS_NAMES
from .access_log import AccessRecord, Hop, Served, decode_rate
from .otlp import ExportOutcomes, OtlpSettings

if TYPE_CHECKING:
    from starlette.types import Scope

STOP_WAIT_S = 1.0  # at stop, how long the last export may take before the daemon goes on without it


class SpanQueue(SpanProcessor):
    """Ended spans, waiting for the export thread; a span that finds the queue full is dropped and counted."""

    def __init__(
        self, exporter: SpanExporter, settings: OtlpSettings, outcomes: ExportOutcomes, metrics: Metrics
    ) -> None:
        self.exporter = exporter
        self.max_queue, self.batch, self.delay_s = settings.max_queue, settings.batch, settings.delay_s
        self.outcomes = outcomes
        self.dropped = metrics.otlp_spans_dropped
        self._spans: collections.deque[ReadableSpan] = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="superfluid-otlp-spans", daemon=True)
        self._thread.start()

    def on_end(self, span: ReadableSpan) -> None:
        if len(self._spans) >= self.max_queue:
            self.dropped.inc()
            return
        self._spans.append(span)
        if len(self._spans) >= self.batch:
            self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.delay_s)
            self._wake.clear()
            self._export()
            if self._stopping:  # after one more export: what was queued when the daemon stopped goes too
                return

    def _export(self) -> None:
        while self._spans:
            batch = [self._spans.popleft() for _ in range(min(self.batch, len(self._spans)))]
            try:
                ok, why = self.exporter.export(batch) is SpanExportResult.SUCCESS, ""
            except Exception as e:  # an exporter that raises rather than answer FAILURE
                ok, why = False, str(e)
            self.outcomes.record(ok, why)
            if not ok:
                self.dropped.inc(len(batch))

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(STOP_WAIT_S)
        self.exporter.shutdown()


class Tracing:
    """The daemon's tracer: root spans for requests, and the queue that sends them."""

    def __init__(
        self,
        exporter: SpanExporter,
        resource: Resource,
        settings: OtlpSettings,
        outcomes: ExportOutcomes,
        metrics: Metrics,
    ) -> None:
        self.queue = SpanQueue(exporter, settings, outcomes, metrics)
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(self.queue)
        self.tracer = self.provider.get_tracer("superfluid", __version__)
        self.propagator = TraceContextTextMapPropagator()

    def begin_http(self, scope: Scope, start_ns: int) -> RequestTrace:
        """The root span of an HTTP request, a child of the caller's span when it sent `traceparent`."""
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope.get("headers", [])}
        method = scope["method"]
        return self.begin(
            f"{method} {scope['path']}",
            start_ns,
            headers,
            {"http.request.method": method, "url.path": scope["path"]},
        )

    def begin(
        self,
        name: str,
        start_ns: int,
        carrier: Mapping[str, str] | None = None,
        attributes: dict[str, Any] | None = None,
    ) -> RequestTrace:
        """A root span from `start_ns`, in the trace `carrier`'s `traceparent` names, if any."""
        parent = self.propagator.extract(carrier) if carrier else None
        span = self.tracer.start_span(name, parent, SpanKind.SERVER, attributes, start_time=start_ns)
        return RequestTrace(self, span)

    def stop(self) -> None:
        self.provider.shutdown()


class RequestTrace:
    """A request's root span, ended with its children when its access line is written."""

    def __init__(self, tracing: Tracing, span: Span) -> None:
        self.tracing = tracing
        self.span = span

    @property
    def trace_id(self) -> str:
        return format(self.span.get_span_context().trace_id, "032x")

    def hop(self, owner: str) -> Hop:
        """A `forward` span, live while the owner answers; its `traceparent` goes there with the request."""
        span = self.tracing.tracer.start_span(
            "forward",
            set_span_in_context(self.span),
            SpanKind.CLIENT,
            {"superfluid.forwarded_to": owner},
        )
        headers: dict[str, str] = {}
        self.tracing.propagator.inject(headers, set_span_in_context(span))
        return Hop(headers, span.end)

    def end(self, record: AccessRecord, fields: dict[str, Any]) -> None:
        """Make the children from the record's generations, then end the root span when the request ended."""
        inside = set_span_in_context(self.span)
        for index, served in enumerate(record.served):
            self._generation(inside, record.started if index == 0 else 0, served, record.finish(served))
        span = self.span
        if record.transport == "http":
            span.update_name(f"{record.method} {record.route}")
            span.set_attribute("http.route", record.route)
            if record.status is not None:
                span.set_attribute("http.response.status_code", record.status)
                if record.status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
        for name, value in fields.items():
            if value is not None and name != "trace_id":
                span.set_attribute(f"superfluid.{name}", value)
        span.end(record.ended)

    def _generation(self, inside: Context, arrived: int, served: Served, finish: str | None) -> None:
        """The spans of one generation, which ended with `finish`; `arrived` (0: none) starts its admission span."""
        job, times = served.run.job, served.run.job.times
        if times is None or not times.submitted:
            return
        if arrived:
            self._span("admission", inside, arrived, times.submitted, {})
        self._span(
            "queue", inside, times.submitted, times.admitted or times.finished, {"superfluid.qos": QOS_NAMES[job.qos]}
        )
        if times.admitted:
            prefill = self._span(
                "prefill",
                inside,
                times.admitted,
                times.first_token or times.finished,
                {"superfluid.prompt_tokens": served.prompt_tokens, "superfluid.cached_tokens": job.warm_prefix},
            )
            chunk_parent = set_span_in_context(prefill)
            for start, end, tokens in times.chunks or ():
                self._span("prefill.chunk", chunk_parent, start, end, {"superfluid.tokens": tokens})
        if times.first_token:
            decode = {
                "superfluid.completion_tokens": job.generated,
                "superfluid.spec.proposed": job.spec_proposed,
                "superfluid.spec.accepted": job.spec_accepted,
                "superfluid.finish": finish or "",
            }
            rate = decode_rate(job.generated, times)
            if rate is not None:
                decode["superfluid.decode_tok_s"] = rate
            self._span("decode", inside, times.first_token, times.finished, decode)
        if times.committed >= times.finished:
            self._span("commit", inside, times.finished, times.committed, {"superfluid.commits": times.commits})

    def _span(self, name: str, parent: Context, start: int, end: int, attributes: dict[str, Any]) -> Span:
        span = self.tracing.tracer.start_span(name, parent, SpanKind.INTERNAL, attributes, start_time=start)
        span.end(max(start, end))
        return span
