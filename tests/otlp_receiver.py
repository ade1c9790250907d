"""A small OTLP receiver for the tests: what a collector would be sent, decoded with `opentelemetry-proto`.

`OtlpReceiver` takes OTLP/HTTP (protobuf bodies POSTed to /v1/traces and /v1/metrics, gzip or not) on a
loopback port; `GrpcReceiver` takes the same requests over gRPC. Both keep every span and every metric
they were sent, in order, for the test to read.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    """A span as it arrived, its ids as hex."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    service: str

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


@dataclass
class Received:
    """Everything a receiver was sent."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)  # the last of each name, as its protobuf `Metric`
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_traces(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(
                        ReceivedSpan(
                            span.name,
                            span.trace_id.hex(),
                            span.span_id.hex(),
                            span.parent_span_id.hex(),
                            span.start_time_unix_nano,
                            span.end_time_unix_nano,
                            {a.key: _value(a.value) for a in span.attributes},
                            resource.get("service.name", ""),
                        )
                    )
        with self.lock:
            self.spans += spans

    def add_metrics(self, request: metrics_service_pb2.ExportMetricsServiceRequest) -> None:
        with self.lock:
            for resource_metrics in request.resource_metrics:
                for scope_metrics in resource_metrics.scope_metrics:
                    for metric in scope_metrics.metrics:
                        self.metrics[metric.name] = metric

    def wait_for(self, found: Callable[[Received], Any], timeout: float = 20.0) -> Any:
        """What `found` returns once it is truthy; fails after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                result = found(self)
            if result:
                return result
            time.sleep(0.05)
        raise AssertionError(f"the receiver was not sent it within {timeout} s: {len(self.spans)} spans so far")

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [span for span in self.spans if span.trace_id == trace_id]


class OtlpReceiver(Received):
    """OTLP/HTTP with protobuf bodies on 127.0.0.1 (any free port): `endpoint` is what --otlp-endpoint takes."""

    def __init__(self) -> None:
        super().__init__()
        self.headers: list[dict[str, str]] = []  # each POST's, names in lower case
        received = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                received.headers.append({name.lower(): value for name, value in self.headers.items()})
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path == "/v1/traces":
                    received.add_traces(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                    reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                elif self.path == "/v1/metrics":
                    received.add_metrics(metrics_service_pb2.ExportMetricsServiceRequest.FromString(body))
                    reply = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class GrpcReceiver(Received):
    """OTLP over gRPC on 127.0.0.1 (any free port), without TLS: `endpoint` is what --otlp-endpoint takes."""

    def __init__(self) -> None:
        super().__init__()
        received = self

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                received.add_traces(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                received.add_metrics(request)
                return metrics_service_pb2.ExportMetricsServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), self._server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        self.endpoint = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self._server.stop(grace=None)
