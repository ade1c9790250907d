"""Where the daemon's traces and metrics go over OTLP, and starting and stopping their export.

`--otlp-endpoint URL` (else `$OTEL_EXPORTER_OTLP_ENDPOINT`) turns the export on; `--otlp-protocol`
(else `$OTEL_EXPORTER_OTLP_PROTOCOL`, else http/protobuf) sends it as HTTP/protobuf, to URL/v1/traces and
URL/v1/metrics, or over gRPC to URL; `--otlp-service-name` (else `$OTEL_SERVICE_NAME`, else superfluid)
names the service. The span queue follows the standard `OTEL_BSP_MAX_QUEUE_SIZE`,
`OTEL_BSP_MAX_EXPORT_BATCH_SIZE` and `OTEL_BSP_SCHEDULE_DELAY`, the metrics' period
`OTEL_METRIC_EXPORT_INTERVAL` (milliseconds both), and the exporters read `OTEL_EXPORTER_OTLP_HEADERS`,
`_TIMEOUT`, `_COMPRESSION` and `_CERTIFICATE` themselves. The OpenTelemetry SDK is imported by `Telemetry.start`
only: a daemon without an endpoint never loads it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..metrics import Metrics
    from .otlp_metrics import MetricsExport
    from .tracing import Tracing

log = logging.getLogger("superfluid.telemetry")

PROTOCOLS = ("http/protobuf", "grpc")
DEFAULT_PROTOCOL = "http/protobuf"
DEFAULT_SERVICE_NAME = "superfluid"


def check_endpoint(url: str) -> str:
    """An OTLP endpoint as `--otlp-endpoint` takes it: http:// or https://, a host, maybe a port and a path."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("http", "https") or not rest.split("/", 1)[0]:
        raise ValueError(f"expected an http:// or https:// URL such as http://127.0.0.1:4318, not {url!r}")
    return url.rstrip("/")


def _whole(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) == 0:
        raise ValueError(f"${name} must be a whole number above 0, not {raw!r}")
    return int(raw)


@dataclass(frozen=True)
class OtlpSettings:
    """Where and how the export goes."""

    endpoint: str
    protocol: str = DEFAULT_PROTOCOL
    service_name: str = DEFAULT_SERVICE_NAME
    max_queue: int = 2048  # spans waiting for export; past it they are dropped, and counted
    batch: int = 512  # spans in one export
    delay_s: float = 5.0  # between two exports of spans
    metrics_interval_s: float = 60.0

    @property
    def modules(self) -> tuple[str, ...]:
        """What `Telemetry.start` imports, for a thread to load while the models do."""
        kind = "grpc" if self.protocol == "grpc" else "http"
        exporters = f"opentelemetry.exporter.otlp.proto.{kind}"
        return (
            "superfluid.telemetry.tracing",
            "superfluid.telemetry.otlp_metrics",
            f"{exporters}.trace_exporter",
            f"{exporters}.metric_exporter",
        )

    @classmethod
    def resolve(
        cls,
        endpoint: str | None,
        protocol: str | None,
        service_name: str | None,
        environ: Mapping[str, str] | None = None,
    ) -> OtlpSettings | None:
        """The flags' settings, else the standard variables'; None when no endpoint is set. ValueError says
        which value is wrong (a variable's is checked only here)."""
        environ = os.environ if environ is None else environ
        endpoint = endpoint or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip() or None
        if endpoint is None:
            return None
        protocol = protocol or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "").strip() or DEFAULT_PROTOCOL
        if protocol not in PROTOCOLS:
            raise ValueError(f"the OTLP protocol must be one of {', '.join(PROTOCOLS)}, not {protocol!r}")
        try:
            endpoint = check_endpoint(endpoint)
        except ValueError as e:
            raise ValueError(f"the OTLP endpoint: {e}") from None
        return cls(
            endpoint,
            protocol,
            (service_name or "").strip() or environ.get("OTEL_SERVICE_NAME", "").strip() or DEFAULT_SERVICE_NAME,
            _whole(environ, "OTEL_BSP_MAX_QUEUE_SIZE", 2048),
            _whole(environ, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512),
            _whole(environ, "OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000,
            _whole(environ, "OTEL_METRIC_EXPORT_INTERVAL", 60000) / 1000,
        )


class ExportOutcomes:
    """One signal's exports: failures counted in `superfluid_otlp_export_failures_total{signal}`, and logged
    when the export starts failing and when it works again, not at every try."""

    def __init__(self, signal: str, endpoint: str, metrics: Metrics) -> None:
        self.signal = signal
        self.endpoint = endpoint
        self.failures = metrics.otlp_export_failures.labels(signal=signal)
        self._failing = False

    def record(self, ok: bool, why: str = "") -> None:
        if ok and self._failing:
            log.info("OTLP %s reach %s again", self.signal, self.endpoint)
        elif not ok:
            self.failures.inc()
            if not self._failing:
                log.warning(
                    "OTLP %s could not be sent to %s%s; the daemon goes on, counting what is lost in "
                    "superfluid_otlp_export_failures_total",
                    self.signal,
                    self.endpoint,
                    f" ({why})" if why else "",
                )
        self._failing = not ok


def _exporters(settings: OtlpSettings) -> tuple[Any, Any]:
    """The span and metric exporters of the settings' protocol (only that protocol's package is imported)."""
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetrics
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpans

        insecure = settings.endpoint.startswith("http://")
        return GrpcSpans(endpoint=settings.endpoint, insecure=insecure), GrpcMetrics(
            endpoint=settings.endpoint, insecure=insecure
        )
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=f"{settings.endpoint}/v1/traces"), OTLPMetricExporter(
        endpoint=f"{settings.endpoint}/v1/metrics"
    )


class Telemetry:
    """The daemon's trace and metric export: started before the models load, stopped after the daemon."""

    def __init__(self, tracing: Tracing, metrics_export: MetricsExport) -> None:
        self.tracing = tracing
        self.metrics_export = metrics_export

    @classmethod
    def start(cls, settings: OtlpSettings, metrics: Metrics) -> Telemetry:
        from opentelemetry.sdk.resources import Resource

        from .. import __version__
        from .otlp_metrics import MetricsExport
        from .tracing import Tracing

        quiet = logging.getLogger("opentelemetry.exporter")
        if quiet.level == logging.NOTSET:  # its retries warn every second while a collector is away; ours say it once
            quiet.setLevel(logging.CRITICAL)
        resource = Resource.create({"service.name": settings.service_name, "service.version": __version__})
        spans, metric_exporter = _exporters(settings)
        tracing = Tracing(spans, resource, settings, ExportOutcomes("traces", settings.endpoint, metrics), metrics)
        export = MetricsExport(
            metrics.registry,
            metric_exporter,
            resource,
            settings.metrics_interval_s,
            ExportOutcomes("metrics", settings.endpoint, metrics),
        )
        export.start()
        log.info(
            "sending traces and metrics over OTLP (%s) to %s as service %s",
            settings.protocol,
            settings.endpoint,
            settings.service_name,
        )
        return cls(tracing, export)

    def stop(self) -> None:
        """Send what is queued, waiting a little at most (a collector out of reach does not hold the stop)."""
        self.tracing.stop()
        self.metrics_export.stop()
