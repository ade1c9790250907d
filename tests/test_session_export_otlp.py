"""`superfluid session export --format otlp-jsonl`: a session's history as OpenTelemetry spans, in a file,
on stdout and sent to an OTLP/HTTP collector, read back with opentelemetry-proto."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import CITY_FUNCTION, WebDaemon, forced, free_port, new_session, say, web_stream
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from otlp_receiver import OtlpReceiver, Received

from superfluid.cli.main import main
from superfluid.protocol.schema import (
    FINISH_GRAMMAR,
    OUTCOME_FAILED,
    TOKEN_BEARING,
    EventBody,
    EventMsg,
    GenParams,
    Inspection,
    Request,
    Response,
    SessionSummary,
    Tier,
)
from superfluid.telemetry.session_spans import from_json_line, session_trace, to_json_line, trace_id_of

WEATHER = {"type": "function", "function": CITY_FUNCTION}
PROMPT = "Tell me about marmalade; my key is sk-abcdefghijklmnopqrstuvwx."
RESULT = "sunny and mild"
FORCED = 6
# where a span keeps text, which only --include-content writes
CONTENT_KEYS = {
    "superfluid.text",
    "superfluid.reply",
    "superfluid.reasoning",
    "superfluid.raw",
    "superfluid.session.title",
    "superfluid.tool.note",
    "gen_ai.tool.call.arguments",
    "gen_ai.tool.call.result",
}


@pytest.fixture
def collector() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def session(daemon: WebDaemon) -> int:
    """A titled session with tools: a user turn and a forced generation, then a turn that calls a tool
    (forced by the tool's grammar) and the call's result."""
    with daemon.client() as c:
        session = new_session(c)
        assert isinstance(
            c.call(Request.AppendSystem(session, "Use the tools.", [json.dumps(WEATHER)])), Response.Committed
        )
        say(c, session, PROMPT)
        forced(c, session, FORCED)
        c.call(Request.SetMeta(session, 0, "weather chat", None))
        say(c, session, "What is the weather in Oslo?")
    frames = web_stream(daemon, {"session": session, "max_tokens": 64, "tool": WEATHER})
    assert frames[-1]["done"]["finish"] == 3, frames[-1]
    [call] = [f["committed"]["event_id"] for f in frames if "ToolUse" in f.get("committed", {}).get("body", {})]
    time.sleep(0.05)  # the tool takes a while
    with daemon.client() as c:
        assert isinstance(c.call(Request.AppendToolResult(session, call, RESULT)), Response.Committed)
    return session


def inspect(daemon: WebDaemon, session: int) -> Inspection:
    with daemon.client() as c:
        reply = c.call(Request.Inspect(session))
    assert isinstance(reply, Response.Inspection), reply
    return reply.inspection


def export(daemon: WebDaemon, session: int, *args: str) -> None:
    """`session export --format otlp-jsonl` in this process (its argument parser and command)."""
    assert (
        main(["session", "export", str(session), "--format", "otlp-jsonl", "--socket", str(daemon.socket), *args]) == 0
    )


def spans_of(request: ExportTraceServiceRequest) -> list[Span]:
    [resource_spans] = request.resource_spans
    [scope_spans] = resource_spans.scope_spans
    return list(scope_spans.spans)


def attributes(span: Span) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for pair in span.attributes:
        kind = pair.value.WhichOneof("value")
        value = getattr(pair.value, kind)
        found[pair.key] = [v.string_value for v in value.values] if kind == "array_value" else value
    return found


@pytest.fixture(scope="module")
def exported(daemon: WebDaemon, session: int, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session exported by the `superfluid` command to a file."""
    out = tmp_path_factory.mktemp("export")
    command = [sys.executable, "-m", "superfluid", "session", "export", str(session), "--format", "otlp-jsonl"]
    done = subprocess.run(
        [*command, "--out", str(out), "--socket", str(daemon.socket)], capture_output=True, text=True, timeout=60
    )
    path = out / f"session-{session}.otlp.jsonl"
    assert done.returncode == 0 and done.stdout.strip() == f"wrote {path}", done.stderr
    return path


@pytest.mark.e2e
def test_a_session_exports_as_one_trace_of_its_turns(daemon: WebDaemon, session: int, exported: Path) -> None:
    assert exported.stat().st_mode & 0o777 == 0o600
    [line] = exported.read_text().splitlines()
    request = from_json_line(line)
    assert to_json_line(request) == line  # parse and serialize give the same line
    trace_id = trace_id_of(inspect(daemon, session).store_id, session)
    assert f'"traceId":"{trace_id.hex()}"' in line  # OTLP/JSON writes ids in hex

    root, *children = spans_of(request)
    assert {s.trace_id for s in [root, *children]} == {trace_id}
    assert not root.parent_span_id and all(s.parent_span_id == root.span_id for s in children)
    assert len({s.span_id for s in [root, *children]}) == 1 + len(children)
    assert [s.name for s in children] == [
        "message system",
        "message user",
        "generate",
        "message user",
        "generate",
        "execute_tool get_weather",
    ]
    starts = [s.start_time_unix_nano for s in children]
    assert starts == sorted(starts) and all(root.start_time_unix_nano <= t <= root.end_time_unix_nano for t in starts)

    # no text without --include-content
    assert not CONTENT_KEYS & {key for s in [root, *children] for key in attributes(s)}
    for words in ("marmalade", "Oslo", RESULT, "weather chat", "Use the tools"):
        assert words not in line

    export(daemon, session, "--out", str(exported.parent))  # again: the same ids, the same bytes
    assert exported.read_text() == line + "\n"


@pytest.mark.e2e
def test_token_counts_and_tool_calls_are_the_sessions(daemon: WebDaemon, session: int, exported: Path) -> None:
    inspection = inspect(daemon, session)
    events = inspection.events
    root, *children = spans_of(from_json_line(exported.read_text()))
    assert attributes(root)["superfluid.session.tokens"] == inspection.summary.tokens
    assert sum(attributes(s)["superfluid.tokens"] for s in children) == inspection.summary.tokens
    first, second = (attributes(s) for s in children if s.name == "generate")
    first_run = next(i for i, e in enumerate(events) if isinstance(e.body, EventBody.Generated))
    prompt = sum(len(e.body.span) for e in events[:first_run] if isinstance(e.body, TOKEN_BEARING))
    assert (first["gen_ai.usage.input_tokens"], first["gen_ai.usage.output_tokens"]) == (prompt, FORCED)
    assert first["gen_ai.response.finish_reasons"] == ["length"]
    generated = sum(len(e.body.span) for e in events if isinstance(e.body, EventBody.Generated))
    assert second["gen_ai.usage.output_tokens"] == generated - FORCED
    assert second["gen_ai.response.finish_reasons"] == ["grammar"]

    # the tool call lasts from its ToolUse to its result, and links to the generation that made it
    call = children[-1]
    use = next(e for e in events if isinstance(e.body, EventBody.ToolUse))
    result = next(e for e in events if isinstance(e.body, EventBody.ToolResult))
    assert (call.start_time_unix_nano, call.end_time_unix_nano) == (use.ts_unix_ms * 10**6, result.ts_unix_ms * 10**6)
    assert call.end_time_unix_nano > call.start_time_unix_nano
    assert attributes(call)["superfluid.tool.state"] == "succeeded"
    assert attributes(call)["gen_ai.tool.call.id"] == str(use.event_id)
    assert [link.span_id for link in call.links] == [children[4].span_id]


@pytest.mark.e2e
def test_content_goes_to_stdout_redacted(daemon: WebDaemon, session: int, capsys: pytest.CaptureFixture[str]) -> None:
    export(daemon, session, "--out", "-", "--include-content")
    out, err = capsys.readouterr()
    [line] = out.splitlines()
    assert err == ""
    root, *children = spans_of(from_json_line(line))
    texts = [attributes(s).get("superfluid.text") for s in children if s.name == "message user"]
    assert "marmalade" in texts[0] and "[redacted]" in texts[0] and "sk-abc" not in line
    call = attributes(children[-1])
    assert call["gen_ai.tool.call.result"] == RESULT and json.loads(call["gen_ai.tool.call.arguments"])["city"]
    assert attributes(root)["superfluid.session.title"] == "weather chat"


@pytest.mark.e2e
def test_spans_go_to_a_collector(
    daemon: WebDaemon,
    session: int,
    exported: Path,
    collector: OtlpReceiver,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%20t0k,x-tenant=acme")
    export(daemon, session, "--endpoint", collector.endpoint)
    assert {"authorization": "Bearer t0k", "x-tenant": "acme"}.items() <= collector.headers[-1].items()
    sent = Received()
    sent.add_traces(from_json_line(exported.read_text()))
    assert capsys.readouterr().out == f"sent {len(sent.spans)} spans to {collector.endpoint}/v1/traces\n"
    assert collector.spans == sent.spans
    assert not list(tmp_path.iterdir())  # sent, not written: --out was not given


@pytest.mark.e2e
def test_an_unreachable_collector_is_a_clear_error(
    daemon: WebDaemon, session: int, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    args = ["session", "export", str(session), "--socket", str(daemon.socket), "--endpoint", url]
    assert main([*args, "--format", "otlp-jsonl"]) == 1
    assert capsys.readouterr().err.startswith(f"superfluid: cannot send spans to {url}/v1/traces: ")
    assert main(args) == 1
    assert capsys.readouterr().err == "superfluid: --endpoint sends OpenTelemetry spans: add --format otlp-jsonl\n"
    assert main([*args[:-1], "127.0.0.1:4318", "--format", "otlp-jsonl"]) == 1
    assert capsys.readouterr().err.startswith("superfluid: --endpoint: expected an http:// or https:// URL")


def inspection_of(bodies: list[Any]) -> Inspection:
    """A session of these records, one a second, as `Inspect` would answer for it."""
    events = [EventMsg(i, 1, 1_000 * (i + 1), body) for i, body in enumerate(bodies)]
    tokens = sum(len(body.span) for body in bodies if isinstance(body, TOKEN_BEARING))
    summary = SessionSummary(7, None, 0, "plans", False, 1, 0, len(events), tokens, 1)
    params = GenParams(0.0, 1.0, 0.0, 0, 0)
    return Inspection(summary, params, 1, 0, 2, False, 0, None, [], Tier.Cold(), [], events, 2, b"s" * 16)


def test_failed_and_open_calls_and_a_cut_generation() -> None:
    """Paths no quick run on the model takes: a failed call, a call still open with a permission asked,
    a generation cut by a restart and one continued without an opener."""
    params = GenParams(0.0, 1.0, 0.0, 0, 0)
    bodies = [
        EventBody.Created(None, params),
        EventBody.Message(1, "book it", [1, 2]),
        EventBody.GenerationPrompt([3]),
        EventBody.Generated([4, 5], "", 2, 0),
        EventBody.ToolUse("book", "{}"),  # 4
        EventBody.ToolUse("pay", "{}"),  # 5
        EventBody.Generated([], "", 0, FINISH_GRAMMAR),
        EventBody.ToolOutcome(4, OUTCOME_FAILED, "network down"),
        EventBody.PermissionRequest(5, "pay 10 EUR?"),  # 8
        EventBody.PermissionResponse(8, True),
        EventBody.MetaUpdated(1, "plans", None),
        EventBody.GenerationPrompt([6]),
        EventBody.Generated([7], "so", 0, 0),
        EventBody.EpochBump(),  # the daemon restarted: that generation was cut
        EventBody.Generated([8, 9], " far", 0, 0),  # 14: a continuation, still running
    ]
    root, *children = spans_of(session_trace(inspection_of(bodies)))
    names = ["message user", "generate", "execute_tool book", "execute_tool pay", "generate", "generate"]
    assert [s.name for s in children] == names
    assert [e.name for e in root.events] == ["Created", "MetaUpdated", "EpochBump"]
    tokens = sum(attributes(s).get("superfluid.tokens", 0) for s in children)  # a call with no result has none
    assert tokens == attributes(root)["superfluid.session.tokens"]
    failed, open_call = children[2], children[3]
    assert (
        attributes(failed)["superfluid.tool.state"] == "failed"
        and failed.status.code == failed.status.STATUS_CODE_ERROR
    )
    assert failed.end_time_unix_nano == 8 * 10**9 and "superfluid.tool.note" not in attributes(failed)
    assert attributes(open_call)["superfluid.tool.state"] == "open"
    assert open_call.end_time_unix_nano == root.end_time_unix_nano == 15 * 10**9
    assert [e.name for e in open_call.events] == ["PermissionRequest", "PermissionResponse"]
    assert [link.span_id for link in open_call.links] == [children[1].span_id]
    cut, continued = (attributes(s) for s in children[4:])
    assert cut["gen_ai.response.finish_reasons"] == continued["gen_ai.response.finish_reasons"] == ["none"]
    assert (cut["gen_ai.usage.input_tokens"], cut["gen_ai.usage.output_tokens"]) == (6, 1)
    assert children[5].start_time_unix_nano == 15 * 10**9 and continued["gen_ai.usage.output_tokens"] == 2
