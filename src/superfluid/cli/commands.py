"""`superfluid session ...` and `superfluid media ...`: small clients of the daemon's socket."""

from __future__ import annotations

import json
import os
import re
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..client import SocketClient
from ..protocol import jsoncodec
from ..protocol.schema import (
    FINISH_NAMES,
    QOS_NAMES,
    EventMsg,
    Inspection,
    Request,
    Response,
)


class CommandError(Exception):
    """What to tell the user when a command cannot do its job."""


def _call(client: SocketClient, request: Any, expect: type) -> Any:
    reply = client.call(request)
    if isinstance(reply, Response.Err):
        raise CommandError(reply.message)
    if not isinstance(reply, expect):
        raise CommandError(f"the daemon answered {type(reply).__name__}, not {expect.__name__}")
    return reply


def _connect(socket_path: Path | None) -> SocketClient:
    try:
        return SocketClient(socket_path)
    except ConnectionError as e:
        raise CommandError(str(e)) from None


def _ts(ms: int) -> str:
    if not ms:
        return "-"
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def session_ls(socket_path: Path | None, include_archived: bool) -> str:
    with _connect(socket_path) as client:
        sessions = _call(client, Request.Sessions(include_archived), Response.SessionList).sessions
    rows: list[tuple[str, ...]] = [("ID", "PARENT", "FORK_AT", "EVENTS", "TOKENS", "OPEN_CALLS", "TITLE")]
    for s in sessions:
        title = (s.title or "") + (" (archived)" if s.archived else "")
        parent = "-" if s.parent is None else str(s.parent)
        rows.append((str(s.id), parent, str(s.fork_at), str(s.events), str(s.tokens), str(s.open_tool_calls), title))
    return _table(rows) if sessions else "no sessions"


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def session_tree(socket_path: Path | None) -> str:
    with _connect(socket_path) as client:
        nodes = _call(client, Request.Tree(), Response.Tree).nodes
    children: dict[int | None, list[tuple[int, int]]] = {}
    known = {node[0] for node in nodes}
    for session, parent, fork_at in nodes:
        children.setdefault(parent if parent in known else None, []).append((session, fork_at))
    lines: list[str] = []

    def walk(parent: int | None, prefix: str) -> None:
        kids = children.get(parent, [])
        for i, (session, fork_at) in enumerate(kids):
            last = i == len(kids) - 1
            branch = "" if parent is None else ("└─ " if last else "├─ ")
            where = "" if parent is None else f"  (forked at event {fork_at})"
            lines.append(f"{prefix}{branch}{session}{where}")
            walk(session, prefix + ("" if parent is None else ("   " if last else "│  ")))

    walk(None, "")
    return "\n".join(lines) if lines else "no sessions"


def _summary_of(body: Any) -> str:
    """One line of an event's content, shortened."""
    name = type(body).__name__
    data = jsoncodec.to_json(body)
    fields = data.get(name, {}) if isinstance(data, dict) else {}
    parts = []
    for key, value in fields.items():
        if key == "span":
            parts.append(f"span={len(value)} tokens")
        elif isinstance(value, str):
            shown = value if len(value) <= 60 else value[:57] + "..."
            parts.append(f"{key}={json.dumps(shown, ensure_ascii=False)}")
        elif key == "params" and isinstance(value, dict):
            parts.append("params=" + ",".join(f"{k}={v}" for k, v in value.items()))
        elif key == "prefix":
            parts.append(f"prefix={len(value)} events")
        else:
            parts.append(f"{key}={json.dumps(value)}")
    return " ".join(parts)


def session_inspect(socket_path: Path | None, session: int, as_json: bool) -> str:
    with _connect(socket_path) as client:
        inspection: Inspection = _call(client, Request.Inspect(session), Response.Inspection).inspection
    if as_json:
        return json.dumps(jsoncodec.to_json(inspection), ensure_ascii=False, indent=2)
    s = inspection.summary
    tier = type(inspection.tier).__name__
    finish = FINISH_NAMES.get(inspection.last_finish, inspection.last_finish)
    lines = [
        f"session {s.id}  parent {'-' if s.parent is None else s.parent}  fork_at {s.fork_at}  "
        f"title {json.dumps(s.title) if s.title else '-'}  archived {str(s.archived).lower()}",
        f"epoch {inspection.epoch}  generation {s.generation}  meta_version {s.meta_version}  "
        f"qos {QOS_NAMES.get(inspection.qos_class, inspection.qos_class)}  "
        f"batch_invariant {str(inspection.batch_invariant).lower()}",
        f"tier {tier.lower()}  tokens {s.tokens}  events {s.events}  "
        f"last_finish {finish}  wal_v{inspection.wal_version}",
    ]
    if inspection.behavior_fingerprint is not None:
        lines.append(f"fingerprint {inspection.behavior_fingerprint:016x}")
    if inspection.store_id is not None:
        lines.append(f"store {inspection.store_id.hex()}")
    for call_id, name, arguments in inspection.open_tool_calls:
        lines.append(f"open call #{call_id} {name} {arguments}")
    for event in inspection.events:
        lines.append(
            f"#{event.event_id} e{event.epoch} {_ts(event.ts_unix_ms)} {type(event.body).__name__} "
            f"{_summary_of(event.body)}".rstrip()
        )
    return "\n".join(lines)


# Content-bearing fields an export drops unless --include-content.
CONTENT_FIELDS = ("text", "span", "content", "arguments", "raw", "payload", "note", "prefix", "reason", "title")
SECRETS = re.compile(
    r"(sk-[A-Za-z0-9_-]{16,}|ghp_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}|AKIA[0-9A-Z]{16}|"
    r"xox[abpr]-[A-Za-z0-9-]{10,}|-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?-----END [A-Z ]*PRIVATE KEY-----)"
)


def redact(text: str) -> str:
    """Replace credentials that look like API keys or private keys."""
    return SECRETS.sub("[redacted]", text)


def export_record(session: int, event: EventMsg, include_content: bool) -> dict[str, Any]:
    body = jsoncodec.to_json(event.body)
    kind, fields = (body, {}) if isinstance(body, str) else next(iter(body.items()))
    shown: dict[str, Any] = {}
    for key, value in fields.items():
        if key not in CONTENT_FIELDS or value is None:
            shown[key] = value
        elif include_content:
            shown[key] = redact(value) if isinstance(value, str) else value
        else:
            shown[f"{key}_len"] = len(value)
    return {
        "session": session,
        "event_id": event.event_id,
        "epoch": event.epoch,
        "ts_unix_ms": event.ts_unix_ms,
        "kind": kind,
        "fields": shown,
    }


def session_export(
    socket_path: Path | None, session: int, fmt: str, include_content: bool, out: str | None, endpoint: str | None
) -> list[str]:
    """Export a session as JSON lines of its events (`jsonl`) or as OpenTelemetry spans (`otlp-jsonl`), to a
    file `session-<id>.<format>` in `out` (mode 0600) or to stdout (`out` "-"), and the spans to an OTLP/HTTP
    collector at `endpoint`; with an endpoint and no `out`, nothing is written. Returns what to report."""
    if endpoint is not None and fmt != "otlp-jsonl":
        raise CommandError("--endpoint sends OpenTelemetry spans: add --format otlp-jsonl")
    with _connect(socket_path) as client:
        if fmt == "jsonl":
            events = _call(client, Request.Read(session, 0), Response.Events).events
            lines = [json.dumps(export_record(session, e, include_content), ensure_ascii=False) for e in events]
        else:
            inspection = _call(client, Request.Inspect(session), Response.Inspection).inspection
    report: list[str] = []
    if fmt == "otlp-jsonl":
        # imported only here: the exporter's packages are needed by nothing else the command line does
        from ..telemetry.session_spans import SpanExportError, send, session_trace, span_count, to_json_line

        trace = session_trace(inspection, redact if include_content else None)
        lines = [to_json_line(trace)]
        if endpoint is not None:
            try:
                report.append(f"sent {span_count(trace)} spans to {send(trace, endpoint)}")
            except SpanExportError as e:
                raise CommandError(str(e)) from None
    if out == "-":
        sys.stdout.writelines(line + "\n" for line in lines)
    elif out is not None or endpoint is None:
        folder = Path(out or ".")
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"session-{session}.{fmt.replace('-', '.')}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            os.fchmod(handle.fileno(), 0o600)
            handle.writelines(line + "\n" for line in lines)
        report.append(f"wrote {path}")
    return report


def media_put(socket_path: Path | None, file: Path) -> str:
    try:
        data = file.read_bytes()
    except OSError as e:
        raise CommandError(f"cannot read {file}: {e.strerror or e}") from None
    with _connect(socket_path) as client:
        return _call(client, Request.PutMedia(data, ""), Response.Media).hash


def media_gc(socket_path: Path | None) -> str:
    with _connect(socket_path) as client:
        gc = _call(client, Request.GcMedia(), Response.Gc)
    return f"kept {gc.kept}, removed {gc.removed}"


def run(command: str, args: Any) -> int:
    """Run one client command; prints its output, or its error to stderr (exit 1)."""
    try:
        if command == "session ls":
            print(session_ls(args.socket, args.all))
        elif command == "session tree":
            print(session_tree(args.socket))
        elif command == "session inspect":
            print(session_inspect(args.socket, args.id, args.json))
        elif command == "session export":
            report = session_export(args.socket, args.id, args.format, args.include_content, args.out, args.endpoint)
            for line in report:  # on stderr when the export itself goes to stdout
                print(line, file=sys.stderr if args.out == "-" else sys.stdout)
        elif command == "media put":
            print(media_put(args.socket, args.file))
        elif command == "media gc":
            print(media_gc(args.socket))
        return 0
    except CommandError as e:
        print(f"superfluid: {e}", file=sys.stderr)
        return 1
