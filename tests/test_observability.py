"""The access log and the OpenTelemetry export: a line per request with its fields and never its text; a
trace per request whose spans nest and add up to the request's time, joined to a caller's `traceparent` and
carried over a forward hop; the metrics of /metrics over OTLP (HTTP and gRPC); and a collector out of
reach costing the decode nothing, its losses counted."""

from __future__ import annotations

import asyncio
import json
import secrets
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from conftest import HttpDaemon, chat_body, forced, free_port, new_session, say
from otlp_receiver import GrpcReceiver, OtlpReceiver, ReceivedSpan

from superfluid.metrics import Metrics
from superfluid.telemetry.access_log import AccessRecord, following
from superfluid.telemetry.otlp import OtlpSettings, Telemetry

MARKER = "zebra quartz lantern"  # words every prompt here carries, and no log may
KEY = "observability-secret"
CHAT = "/v1/chat/completions"
PHASES = {"admission", "queue", "prefill", "decode", "commit"}
DECODED = 32  # tokens of each decode-rate measurement
ONE_THREAD = ("--threads", "1")
NO_PARK = "--no-park"  # parking nothing, a daemon writes no KV state to disk between the requests a test times


def access_lines(proc: HttpDaemon) -> list[dict[str, Any]]:
    """The access lines of a daemon's JSON log (`--log-dir <root>/logs`), oldest first."""
    lines = [
        json.loads(line) for path in (proc.root / "logs").glob("*.jsonl") for line in path.read_text().splitlines()
    ]
    return [line for line in lines if line["target"] == "superfluid.access"]


def wait_for(found: Callable[[], Any], timeout: float = 15.0) -> Any:
    """What `found` returns once it is truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = found()
        if result:
            return result
        time.sleep(0.05)
    raise AssertionError(f"not found within {timeout} s")


def line_of(proc: HttpDaemon, **fields: Any) -> dict[str, Any]:
    """The last access line whose fields have these values, once it is written."""
    return wait_for(
        lambda: next((line for line in reversed(access_lines(proc)) if fields.items() <= line.items()), None)
    )


def traceparent() -> tuple[str, str, str]:
    """A caller's W3C `traceparent`, and its trace and span ids."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def phases(receiver: OtlpReceiver, trace_id: str) -> list[ReceivedSpan]:
    """A trace's spans, once its root (ended last) and every phase of its generation have arrived."""

    def whole(received: Any) -> list[ReceivedSpan] | None:
        spans = received.trace(trace_id)
        ids = {span.span_id for span in spans}
        rooted = any(span.parent_id not in ids for span in spans)
        return spans if rooted and {span.name for span in spans} >= PHASES else None

    return receiver.wait_for(whole)


def content(line: str) -> str:
    """The text an OpenAI stream's line carries (none for the role's chunk, the end, or a blank line)."""
    if not line.startswith("data: {"):
        return ""
    return json.loads(line[len("data: ") :])["choices"][0]["delta"].get("content") or ""


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    received = OtlpReceiver()
    yield received
    received.close()


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver) -> Iterator[HttpDaemon]:
    """A daemon that sends its traces and metrics to `receiver` often, with a debug log in JSON lines too."""
    root = tmp_path_factory.mktemp("traced")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        env.setenv("OTEL_METRIC_EXPORT_INTERVAL", "300")
        proc = HttpDaemon(
            root, "--otlp-endpoint", receiver.endpoint, "--log-dir", str(root / "logs"), "-v", NO_PARK, max_context=1024
        ).start()
    yield proc
    proc.stop()


@pytest.mark.e2e
def test_a_streamed_chat_is_one_trace_whose_spans_nest_and_add_up(traced: HttpDaemon, receiver: OtlpReceiver) -> None:
    seen = {span.trace_id for span in receiver.spans}
    started = time.monotonic()
    with httpx.stream(
        "POST", f"{traced.url}{CHAT}", json=chat_body(f"{MARKER}, twice.", 16, True), timeout=60
    ) as reply:
        assert reply.status_code == 200
        for _ in reply.iter_lines():
            pass
    wall = time.monotonic() - started
    root = receiver.wait_for(
        lambda r: next((s for s in r.spans if s.name == f"POST {CHAT}" and s.trace_id not in seen), None)
    )
    spans = phases(receiver, root.trace_id)
    assert root.parent_id == "" and root.service == "superfluid"
    assert root.attributes["http.response.status_code"] == 200 and root.attributes["http.route"] == CHAT
    by_id = {span.span_id: span for span in spans}
    for span in spans:
        if span is not root:
            parent = by_id[span.parent_id]  # every span's parent is in the trace
            assert parent.start_ns <= span.start_ns <= span.end_ns <= parent.end_ns, (span, parent)
    children = [span for span in spans if span.parent_id == root.span_id]
    assert sorted(span.name for span in children) == sorted(PHASES)
    # the phases tile the request as the daemon saw it, which the client's wall time holds: what lies
    # between is the connection and the last bytes on the wire (a few ms, more on a loaded machine)
    assert root.seconds <= wall
    assert abs(sum(span.seconds for span in children) - root.seconds) <= 0.1 * root.seconds, (children, root)
    assert root.seconds >= 0.7 * wall, (root, wall)
    named = {span.name: span for span in children}
    prefill = named["prefill"].attributes
    chunks = [span for span in spans if span.name == "prefill.chunk"]
    assert chunks and all(chunk.parent_id == named["prefill"].span_id for chunk in chunks)
    assert sum(c.attributes["superfluid.tokens"] for c in chunks) == (
        prefill["superfluid.prompt_tokens"] - prefill["superfluid.cached_tokens"]
    )
    decode = named["decode"].attributes
    assert decode["superfluid.completion_tokens"] == 16 and decode["superfluid.finish"] == "length"
    assert {"superfluid.spec.proposed", "superfluid.spec.accepted"} <= set(decode)

    line = line_of(traced, trace_id=root.trace_id)
    assert line["level"] == "info"
    assert {k: line[k] for k in ("transport", "method", "route", "status", "key", "qos", "finish")} == {
        "transport": "http",
        "method": "POST",
        "route": CHAT,
        "status": 200,
        "key": None,
        "qos": "agent",
        "finish": "length",
    }
    assert line["model"] == "SmolLM2-135M-Instruct" and isinstance(line["session"], int)
    assert line["prompt_tokens"] == prefill["superfluid.prompt_tokens"] and line["completion_tokens"] == 16
    assert line["cached_tokens"] == prefill["superfluid.cached_tokens"]
    assert line["queued_ms"] >= 0 and 0 < line["ttft_ms"] < line["duration_ms"] and line["decode_tok_s"] > 0
    assert line["forwarded_to"] is None and "disconnected" not in line
    assert line["message"].startswith(f"POST {CHAT} 200 model=SmolLM2-135M-Instruct qos=agent")


@pytest.mark.e2e
def test_a_callers_traceparent_is_the_parent_of_a_non_streamed_chat(traced: HttpDaemon, receiver: OtlpReceiver) -> None:
    header, trace_id, caller = traceparent()
    reply = httpx.post(
        f"{traced.url}{CHAT}", json=chat_body(f"{MARKER}.", 8, False), headers={"traceparent": header}, timeout=60
    )
    assert reply.status_code == 200
    spans = phases(receiver, trace_id)
    (root,) = [span for span in spans if span.parent_id == caller]
    assert root.name == f"POST {CHAT}"
    line = line_of(traced, trace_id=trace_id)
    assert line["status"] == 200 and line["completion_tokens"] == 8 and line["finish"] == "length"
    assert line["prompt_tokens"] == reply.json()["usage"]["prompt_tokens"]


@pytest.mark.e2e
def test_a_client_that_hangs_up_has_a_cancelled_line(traced: HttpDaemon) -> None:
    header, trace_id, _ = traceparent()
    body = chat_body(f"{MARKER}, at length.", 600, True)
    with httpx.stream("POST", f"{traced.url}{CHAT}", json=body, headers={"traceparent": header}, timeout=60) as reply:
        for line in reply.iter_lines():
            if content(line):
                break  # the first text: hang up
    line = line_of(traced, trace_id=trace_id)
    assert line["status"] == 200 and line["disconnected"] is True
    assert line["finish"] == "cancelled" and line["completion_tokens"] < 600


@pytest.mark.e2e
def test_a_reply_cut_at_a_stop_string_has_a_stop_line_and_span(traced: HttpDaemon, receiver: OtlpReceiver) -> None:
    body = chat_body(f"{MARKER}, in a few words.", 24, False)
    whole = httpx.post(f"{traced.url}{CHAT}", json=body, timeout=60).json()["choices"][0]["message"]["content"]
    stop = whole[len(whole) // 2 :][:4]  # the same request gives the same text: this cuts the second reply
    assert stop.strip(), f"a reply of forced length has text to cut: {whole!r}"
    header, trace_id, _ = traceparent()
    reply = httpx.post(
        f"{traced.url}{CHAT}", json=body | {"stop": [stop]}, headers={"traceparent": header}, timeout=60
    ).json()["choices"][0]
    assert reply["finish_reason"] == "stop" and len(reply["message"]["content"]) < len(whole)
    assert line_of(traced, trace_id=trace_id)["finish"] == "stop", "the generation the API cancelled stopped"
    (decode,) = [span for span in phases(receiver, trace_id) if span.name == "decode"]
    assert decode.attributes["superfluid.finish"] == "stop"


@pytest.mark.e2e
def test_a_socket_generation_has_its_line_and_trace(traced: HttpDaemon, receiver: OtlpReceiver) -> None:
    with traced.client() as client:
        session = new_session(client)
        say(client, session, f"{MARKER}: go on.")
        forced(client, session, 6)
    line = line_of(traced, transport="socket", session=session)
    assert line["verb"] == "Generate" and line["result"] == "ok" and line["finish"] == "length"
    assert line["completion_tokens"] == 6 and line["key"] is None and "status" not in line
    assert line["message"].startswith("socket Generate ok ")
    spans = phases(receiver, line["trace_id"])
    assert [span.name for span in spans if not span.parent_id] == ["Generate"]


@pytest.mark.e2e
def test_the_metrics_of_metrics_arrive_over_otlp(traced: HttpDaemon, receiver: OtlpReceiver) -> None:
    def sent(name: str) -> Any:
        return receiver.wait_for(lambda r: r.metrics.get(name))

    assert httpx.post(f"{traced.url}{CHAT}", json=chat_body(f"{MARKER}.", 2, False), timeout=60).status_code == 200
    wait_for(lambda: sent("superfluid_ttft_seconds").histogram.data_points[0].count >= 1)
    generations = sent("superfluid_generations").sum
    assert generations.is_monotonic and len(generations.data_points) == 1
    (lanes,) = sent("superfluid_lanes_total").gauge.data_points
    assert lanes.as_double == 4 and {a.key: a.value.string_value for a in lanes.attributes} == {
        "model": "SmolLM2-135M-Instruct"
    }
    (ttft,) = sent("superfluid_ttft_seconds").histogram.data_points
    assert generations.data_points[0].as_double >= ttft.count >= 1 and sum(ttft.bucket_counts) == ttft.count
    assert len(ttft.bucket_counts) == len(ttft.explicit_bounds) + 1
    assert sent("superfluid_otlp_spans_dropped").sum.data_points[0].as_double == 0


@pytest.mark.e2e
def test_no_prompt_word_reaches_a_log_or_a_span(traced: HttpDaemon, receiver: OtlpReceiver) -> None:
    written = traced.log.read_text() + "".join(p.read_text() for p in (traced.root / "logs").glob("*.jsonl"))
    assert len(access_lines(traced)) >= 4 and '"level": "debug"' in written
    spans = json.dumps([span.attributes for span in receiver.spans])
    for word in MARKER.split():
        assert word not in written and word not in spans


@pytest.fixture(scope="module")
def dead_and_off(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HttpDaemon, HttpDaemon]]:
    """Two daemons started together: one exporting to a port nothing listens on (a queue of 4 spans, so it
    overflows), one with no export, behind --api-key and --rate-limit. One llama.cpp thread each, so that
    they decode side by side on two cores without their threads spinning against each other."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "4")
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        env.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
        env.setenv("OTEL_METRIC_EXPORT_INTERVAL", "200")
        dead = HttpDaemon(
            tmp_path_factory.mktemp("dead"),
            "--otlp-endpoint",
            f"http://127.0.0.1:{free_port()}",
            NO_PARK,
            *ONE_THREAD,
            max_context=1024,
        )
        off_root = tmp_path_factory.mktemp("off")
        off = HttpDaemon(
            off_root,
            "--api-key",
            KEY,
            "--rate-limit",
            "40",
            "--log-dir",
            str(off_root / "logs"),
            NO_PARK,
            *ONE_THREAD,
            max_context=1024,
        )
        starting = threading.Thread(target=dead.start)
        starting.start()
        off.start()
        starting.join()
    assert dead.alive(), dead.log.read_text()
    yield dead, off
    dead.stop()
    off.stop()


def decode_rate(proc: HttpDaemon) -> float:
    """A forced-length stream's decode rate as its client sees it: tokens a second from its first text on."""
    arrivals = []
    body = chat_body(f"{MARKER}: count.", DECODED, True)
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{proc.url}{CHAT}", json=body, headers=headers, timeout=120) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if content(line):
                arrivals.append(time.monotonic())
    return (DECODED - 1) / (arrivals[-1] - arrivals[0])


@pytest.mark.e2e
def test_a_collector_out_of_reach_costs_the_decode_nothing_and_drops_are_counted(
    dead_and_off: tuple[HttpDaemon, HttpDaemon],
) -> None:
    dead, off = dead_and_off
    ratios = []
    with ThreadPoolExecutor(2) as pool:
        for _ in range(5):  # side by side: whatever else the machine runs slows both alike
            with_export, without = pool.submit(decode_rate, dead), pool.submit(decode_rate, off)
            ratios.append(with_export.result() / without.result())
    assert statistics.median(ratios) >= 0.8, ratios
    assert dead.metric("superfluid_otlp_spans_dropped_total") > 0
    wait_for(lambda: dead.metric('superfluid_otlp_export_failures_total{signal="traces"}') > 0)
    wait_for(lambda: dead.metric('superfluid_otlp_export_failures_total{signal="metrics"}') > 0)
    assert "could not be sent to" in dead.log.read_text()


@pytest.mark.e2e
def test_refused_requests_have_their_lines(dead_and_off: tuple[HttpDaemon, HttpDaemon]) -> None:
    _, off = dead_and_off
    assert httpx.post(f"{off.url}{CHAT}", json=chat_body(f"{MARKER}.", 4, False), timeout=60).status_code == 401
    refused = line_of(off, status=401)
    assert refused["route"] == CHAT and refused["key"] is None and refused["model"] is None
    assert "trace_id" not in refused  # no export: no trace
    statuses = []
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2")) as other:  # a client IP of its own
        while 429 not in statuses and len(statuses) < 60:  # 40 a minute, all at once first
            statuses.append(other.get(f"{off.url}/v1/models", headers={"authorization": f"Bearer {KEY}"}).status_code)
    assert statuses[0] == 200 and statuses[-1] == 429
    limited = line_of(off, status=429)
    assert limited["method"] == "GET" and limited["route"] == "/v1/models"
    assert limited["key"] == "api-key", "a valid key that is refused is named"
    assert line_of(off, status=200, route="/v1/models")["key"] == "api-key"


def test_grpc_export_sends_spans_and_histograms() -> None:
    """In this process: the gRPC exporter, and a histogram's buckets as Prometheus counts them."""
    receiver = GrpcReceiver()
    metrics = Metrics()
    metrics.ttft_seconds.observe(0.3)
    settings = OtlpSettings(receiver.endpoint, "grpc", "sf-grpc-test", delay_s=0.05, metrics_interval_s=0.1)
    telemetry = Telemetry.start(settings, metrics)
    try:
        record = AccessRecord("socket", "Generate")
        record.trace = telemetry.tracing.begin("Generate", record.started)
        with following(record):
            pass
        (root,) = receiver.wait_for(lambda r: r.spans)
        assert (
            root.name == "Generate"
            and root.service == "sf-grpc-test"
            and root.attributes["superfluid.verb"] == "Generate"
        )
        (ttft,) = receiver.wait_for(lambda r: r.metrics.get("superfluid_ttft_seconds")).histogram.data_points
        assert list(ttft.explicit_bounds) == [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40]
        assert ttft.count == 1 and ttft.sum == pytest.approx(0.3) and ttft.bucket_counts[6] == 1
        assert not ttft.HasField("min")
    finally:
        telemetry.stop()
        receiver.close()


def test_a_forwarded_request_carries_its_trace_to_the_owner() -> None:
    """In this process: the hop to the owner is a `forward` span, and the owner is sent its `traceparent`."""
    from starlette.requests import Request

    from superfluid.transports.forward import Forwarder

    seen: list[str] = []

    class Owner(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            seen.append(self.headers["traceparent"])
            self.send_response(200)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, format: str, *args: Any) -> None:
            pass

    owner = ThreadingHTTPServer(("127.0.0.1", 0), Owner)
    threading.Thread(target=owner.serve_forever, daemon=True).start()
    receiver = OtlpReceiver()
    telemetry = Telemetry.start(OtlpSettings(receiver.endpoint, delay_s=0.05), Metrics())
    header, trace_id, caller = traceparent()
    address = f"http://127.0.0.1:{owner.server_address[1]}"

    async def forward() -> AccessRecord:
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/responses",
            "query_string": b"",
            "headers": [(b"content-type", b"application/json"), (b"traceparent", header.encode())],
        }
        record = AccessRecord("http", "POST", "/v1/responses")
        record.trace = telemetry.tracing.begin_http(scope, record.started)
        forwarder = Forwarder("this-daemon")
        with following(record):
            response = await forwarder.send(Request(scope), b"{}", address)
            async for _ in response.body_iterator:
                pass
            record.status = response.status_code
        await forwarder.close()
        return record

    try:
        record = asyncio.run(forward())
        assert record.forwarded_to == address
        spans = receiver.wait_for(lambda r: len(r.trace(trace_id)) == 2 and r.trace(trace_id))
        root, hop = sorted(spans, key=lambda span: span.name != "POST /v1/responses")
        assert root.parent_id == caller and hop.name == "forward" and hop.parent_id == root.span_id
        assert hop.attributes["superfluid.forwarded_to"] == address
        assert seen == [f"00-{trace_id}-{hop.span_id}-01"]  # the owner's spans join the caller's trace under the hop
    finally:
        telemetry.stop()
        receiver.close()
        owner.shutdown()
        owner.server_close()


def test_settings_come_from_the_flags_else_the_standard_variables() -> None:
    assert OtlpSettings.resolve(None, None, None, {}) is None
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/", "OTEL_SERVICE_NAME": "svc"}
    assert OtlpSettings.resolve(None, None, None, environ) == OtlpSettings("http://collector:4318", service_name="svc")
    flags = OtlpSettings.resolve("https://other:4317", "grpc", "mine", {**environ, "OTEL_EXPORTER_OTLP_PROTOCOL": "x"})
    assert flags == OtlpSettings("https://other:4317", "grpc", "mine")
    with pytest.raises(ValueError, match="must be one of http/protobuf, grpc, not 'http/json'"):
        OtlpSettings.resolve(None, None, None, {**environ, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    with pytest.raises(ValueError, match=r"\$OTEL_BSP_MAX_QUEUE_SIZE must be a whole number above 0, not 'lots'"):
        OtlpSettings.resolve(None, None, None, {**environ, "OTEL_BSP_MAX_QUEUE_SIZE": "lots"})
