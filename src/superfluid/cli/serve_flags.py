"""The flags of `superfluid serve`, their `SUPERFLUID_*` environment fallbacks, and the
`ServeConfig` they make.

Every flag with a value or a switch can also come from the environment: `--max-batch`
from `SUPERFLUID_MAX_BATCH`, `--no-http` from `SUPERFLUID_NO_HTTP=1`, a repeatable flag
such as `--model` from a comma-separated list. The command line wins over the
environment. Flags of the reference daemon that no longer do anything are accepted with
a one-line notice, so scripts written for it keep working.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import (
    DEFAULT_HTTP,
    DEFAULT_MAX_BATCH,
    KERNELS,
    RUNTIMES,
    SamplingDefaults,
    ServeConfig,
    default_sessions,
    default_socket,
)
from ..engine.placement import parse_gpu_layers, parse_gpus, parse_tensor_split
from ..logsetup import parse_directive
from ..model.dialects import DIALECTS, NAMES
from ..protocol.schema import QOS_ALIASES, qos_class
from ..telemetry.otlp import DEFAULT_PROTOCOL, DEFAULT_SERVICE_NAME, PROTOCOLS, check_endpoint
from ..transports.addresses import split_address
from ..transports.cors import check_origin

SPECULATE = ("off", "auto", "prompt-lookup")
DEFAULT_PORT = 8453

# retired reference flags: name -> whether it takes a value ("?" an optional one)
RETIRED: dict[str, bool | str] = {
    "--paged-kv": False,
    "--prefix-cache": False,
    "--continuous-batching": "?",
    "--prefix-cache-file": True,
    "--prefix-cache-save-interval": True,
    "--files-dir": True,
    "--media-dir": True,
    "--metallib": True,
    "--prefill-chunk": True,
    "--gpu-wait-timeout-ms": True,
    "--decode-replay": False,
    "--paged-weights": False,
    "--no-paged-weights-retry": False,
    "--no-baked-decode": False,
}


def _integer(low: int, high: int | None = None, zero: str = "") -> Callable[[str], int]:
    """A `type=` for an integer from `low` (up to `high`); `zero` says what 0 means where it is allowed."""
    accepted = f"an integer from {low} to {high}" if high is not None else f"an integer of at least {low}"
    if zero:
        accepted += f" ({zero})"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {accepted}, not {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {accepted}, not {text!r}")
        return value

    return parse


def _number(low: float, high: float | None = None, *, above: bool = False, zero: str = "") -> Callable[[str], float]:
    """A `type=` for a finite number from `low` (above it, with `above`) up to `high`; `zero` says what
    0 means where it is allowed. nan and inf are refused: no flag has a use for them."""
    if high is not None:
        accepted = f"a number from {low:g} to {high:g}"
    else:
        accepted = f"a number above {low:g}" if above else f"a number of at least {low:g}"
    if zero:
        accepted += f" ({zero})"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {accepted}, not {text!r}") from None
        if not math.isfinite(value) or value < low or (above and value == low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {accepted}, not {text!r}")
        return value

    return parse


_positive = _integer(1)


def _parsed(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """A `type=` of a parser that raises ValueError with its reason."""

    def checked(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    checked.__name__ = parse.__name__  # argparse names the type in its message
    return checked


def _fim_tokens(text: str) -> tuple[int, int, int]:
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(
            f"expected three token ids, prefix,suffix,middle (such as 1,3,2), not {text!r}"
        )
    prefix, suffix, middle = (int(p) for p in parts)
    return prefix, suffix, middle


def _qos(text: str) -> int:
    try:
        return qos_class(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def context_window(text: str) -> int | None:
    """`--max-context`: `auto` (None: the model's window) or at least 512 tokens."""
    if text == "auto":
        return None
    if not text.strip().isdigit() or int(text) < 512:
        raise argparse.ArgumentTypeError(f"expected auto or an integer of at least 512 (tokens), not {text!r}")
    return int(text)


def _address(text: str) -> str:
    """`--http`: HOST:PORT, or [V6]:PORT, with a port up to 65535 (0: any free port)."""
    try:
        split_address(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT with a port from 0 to 65535, such as 127.0.0.1:8453, not {text!r}"
        ) from None
    return text


def _web_address(text: str) -> str:
    """`--web`: its port here; whether its host is loopback depends on --store, checked after parsing."""
    _, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT with a port from 0 to 65535, such as 127.0.0.1:8460, not {text!r}"
        )
    return text


def _cors_origin(text: str) -> str:
    try:
        return check_origin(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _api_key(text: str) -> str:
    """`--api-key`: an empty one would turn keys on with none that matches, and lock every client out."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a key of at least one character, not an empty string")
    return text


def _directive(text: str) -> str:
    """`--log-filter`: checked here, so a bad one is refused before anything loads."""
    try:
        parse_directive(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _runtime(text: str) -> str:
    """`ID` or `MODEL=ID`, with an optional `@INSTALL`; this build has llama.cpp only."""
    runtime = text.rpartition("=")[2].partition("@")[0].strip().lower()
    if runtime not in RUNTIMES:
        raise argparse.ArgumentTypeError(
            f"runtime {runtime!r} is not built in; this build has llamacpp (also spelled llama.cpp, llama-cpp) and auto"
        )
    return RUNTIMES[runtime]


def _speculate(text: str) -> str:
    if text not in SPECULATE:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a strategy llama.cpp models can use; choose one of {', '.join(SPECULATE)}"
        )
    return text


def _store_url(text: str) -> str:
    if not text.startswith(("postgresql://", "postgres://")):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a store this build knows: give postgresql://USER@HOST/DB (or leave --store out for "
            "the SQLite log under --sessions)"
        )
    return text


_draft_tokens = _integer(1, 15)


def _otlp_endpoint(text: str) -> str:
    try:
        return check_endpoint(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _class_lanes(text: str) -> dict[int, int]:
    """`class=N,...`: the most lanes each named class may hold at once."""
    caps = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, count = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected class=N pairs such as background=2,agent=6, not {item!r}")
        caps[_qos(name.strip())] = _positive(count.strip())
    return caps


class Repeatable(argparse._AppendAction):
    """A repeatable flag: given on the command line, it replaces the list the environment set."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: str | None = None) -> None:
        given = f"_{self.dest}_given"
        if not getattr(namespace, given, False):
            setattr(namespace, self.dest, [])
            setattr(namespace, given, True)
        super().__call__(parser, namespace, values, option)


class Retired(argparse.Action):
    """A flag of the reference daemon that does nothing here: noted, then ignored."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: str | None = None) -> None:
        print(f"superfluid: {option} is retired and does nothing; it is ignored", file=sys.stderr)


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    """Every `serve` flag, in groups as `--help` shows them."""
    serve.add_argument(
        "model", nargs="?", metavar="MODEL", help="a .gguf path or org/repo-GGUF:QUANT (default: embedded)"
    )
    model = serve.add_argument_group("model")
    model.add_argument(
        "--model",
        dest="more_models",
        action=Repeatable,
        default=[],
        metavar="M",
        help="serve this model too (repeatable); the first named, MODEL or --model, is the default, which the "
        "session API uses; HTTP requests pick theirs by their model field",
    )
    model.add_argument(
        "--runtime",
        type=_runtime,
        default="auto",
        metavar="ID",
        help="the runtime, as ID or MODEL=ID: llamacpp (also llama.cpp, llama-cpp) or auto; this build has "
        "llama.cpp only (default: auto)",
    )
    model.add_argument("--offline", action="store_true", help="never download a model; use the local cache only")
    model.add_argument(
        "--idle-timeout",
        type=_number(0, zero="0: never"),
        default=0.0,
        metavar="SEC",
        help="unload a model that served nothing for SEC seconds (never the default one); a request naming it "
        "loads it again (default: 0, never)",
    )
    model.add_argument(
        "--fim-tokens",
        type=_fim_tokens,
        metavar="PRE,SUF,MID",
        help="token ids of the fill-in-the-middle markers, for a GGUF whose metadata lacks them",
    )
    model.add_argument(
        "--fim-model",
        default=None,
        metavar="NAME",
        help="the served model (MODEL or a --model, named as a request's model field names it) that "
        "fill-in-the-middle runs on: the socket's Complete, and /v1/completions with suffix, /infill and "
        "/api/generate with suffix when they name no model; chat stays on the default (default: the default model)",
    )

    model.add_argument(
        "--chat-template",
        type=Path,
        default=None,
        metavar="FILE",
        help="render chats with this Jinja template instead of the one in the GGUF (every model served); "
        "its tool-call dialect is recognised from it like a GGUF's",
    )
    model.add_argument(
        "--tool-call-parser",
        choices=NAMES,
        default=None,
        metavar="NAME",
        help="the tool-call and reasoning dialect, when recognising it from the chat template is wrong: "
        + ", ".join(f"{d.name} ({d.families})" for d in DIALECTS)
        + " (default: recognised from the template)",
    )

    server = serve.add_argument_group("listeners")
    server.add_argument(
        "--http",
        type=_address,
        default=None,
        metavar="ADDR",
        help=f"address of the OpenAI, Anthropic and Ollama routes; wins over --host and --port "
        f"(default: {DEFAULT_HTTP})",
    )
    server.add_argument("--host", default=None, metavar="ADDR", help="host of --http (default: 127.0.0.1)")
    server.add_argument(
        "--port", type=_integer(1, 65535), default=None, metavar="N", help=f"port of --http (default: {DEFAULT_PORT})"
    )
    server.add_argument(
        "--no-http", action="store_true", help="serve the session API only (socket, and --web if given)"
    )
    server.add_argument(
        "--sessions",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"directory of the session log; one daemon per directory (default: {default_sessions()}, "
        "under $SUPERFLUID_HOME)",
    )
    server.add_argument(
        "--store",
        type=_store_url,
        default=None,
        metavar="URL",
        help="keep the session log in PostgreSQL (postgresql://USER@HOST/DB) instead of SQLite under --sessions, "
        "so that several daemons share it (default: SQLite)",
    )
    server.add_argument(
        "--advertise",
        default=None,
        metavar="URL",
        help="with --store: the address clients reach this daemon's --web at, told to a client that asks "
        "another daemon for a session this one serves (default: the --web address)",
    )
    server.add_argument(
        "--no-forward",
        action="store_true",
        help="with --store: answer a request for a session another daemon serves with 409 and that daemon's "
        "address, instead of sending it on to that daemon and streaming its answer back",
    )
    server.add_argument(
        "--lease-renew",
        type=_number(0, above=True),
        default=2.0,
        metavar="SEC",
        help="with --store: how often this daemon renews the leases of the sessions it serves (default: 2)",
    )
    server.add_argument(
        "--lease-expiry",
        type=_number(0, above=True),
        default=10.0,
        metavar="SEC",
        help="with --store: how long a lease lasts unrenewed before another daemon may take its sessions (default: 10)",
    )
    server.add_argument(
        "--socket",
        type=Path,
        default=None,
        metavar="PATH",
        help=f"unix socket of the session API, mode 0600; a stale file is replaced (default: {default_socket()})",
    )
    server.add_argument(
        "--web",
        type=_web_address,
        metavar="127.0.0.1:PORT",
        help="also serve the session API as JSON over HTTP and WebSocket on this loopback address",
    )
    server.add_argument(
        "--web-origin",
        dest="web_origins",
        action=Repeatable,
        default=[],
        metavar="ORIGIN",
        help="a browser page origin allowed to open /web/ws, such as http://localhost:5173; repeatable",
    )
    server.add_argument(
        "--cors-origin",
        dest="cors_origins",
        action=Repeatable,
        type=_cors_origin,
        default=[],
        metavar="ORIGIN",
        help="a web page origin allowed to call the HTTP API from a browser, such as https://chat.example.com, "
        "answered with CORS headers; * allows any (refused with --api-key or --key-policy); repeatable "
        "(default: none; pages on this machine are served without CORS headers)",
    )
    server.add_argument(
        "--nonstream-keepalive",
        type=_number(0, zero="0: off"),
        default=0.0,
        metavar="SEC",
        help="answer a non-streaming request's status and headers at once and write a space into its body "
        "every SEC seconds until the reply, so proxies with idle timeouts keep the connection (default: 0, off)",
    )
    server.add_argument(
        "--drain-timeout",
        type=_number(0, zero="0: no wait"),
        default=60.0,
        metavar="SEC",
        help="on SIGUSR1, refuse new requests (503) and wait this long for those running, then exit 0 (default: 60)",
    )

    security = serve.add_argument_group("keys and limits")
    security.add_argument(
        "--api-key",
        type=_api_key,
        default=None,
        metavar="KEY",
        help="require this key (Authorization: Bearer KEY or X-Api-Key: KEY) on every HTTP route but /health "
        "and the browser UI's /web/* (which take the web token)",
    )
    security.add_argument(
        "--key-policy",
        type=Path,
        default=None,
        metavar="FILE.json",
        help='keys with their own class, limits and rights: {"keys": [{"name", "key" or "key_env", "class", '
        '"max_class", "rate_limit_rpm", "max_concurrent", "admin", "batch_invariant"}]}; turns keys on',
    )
    security.add_argument(
        "--rate-limit",
        type=_integer(0, zero="0: off"),
        default=0,
        metavar="RPM",
        help="requests per minute one client IP may make (/health and /metrics are exempt) (default: 0, off)",
    )

    generation = serve.add_argument_group("generation")
    generation.add_argument(
        "--max-context",
        type=context_window,
        default=None,
        metavar="N",
        help="tokens one session may hold, prompt and reply together; 'auto' is the model's trained "
        "window up to 8192 (default: auto)",
    )
    generation.add_argument(
        "--max-batch",
        "--max-batch-size",
        dest="max_batch",
        type=_positive,
        default=DEFAULT_MAX_BATCH,
        metavar="N",
        help=f"generations decoded together in one batch (lanes) (default: {DEFAULT_MAX_BATCH})",
    )
    generation.add_argument(
        "--max-tokens",
        type=_positive,
        default=None,
        metavar="N",
        help="tokens an HTTP request generates when it names no limit (default: fill the context)",
    )
    generation.add_argument(
        "--temperature",
        type=_number(0, zero="0: greedy"),
        default=None,
        metavar="T",
        help="default temperature (default: the model's, else 1)",
    )
    generation.add_argument(
        "--top-p", type=_number(0, 1), default=None, metavar="P", help="default top-p (default: the model's, else 1)"
    )
    generation.add_argument(
        "--top-k",
        type=_integer(0, zero="0: every token"),
        default=None,
        metavar="K",
        help="default top-k; 0 keeps every token (default: the model's, else 40)",
    )
    generation.add_argument(
        "--min-p", type=_number(0, 1), default=None, metavar="P", help="default min-p (default: the model's, else 0)"
    )
    generation.add_argument(
        "--repeat-penalty",
        type=_number(0, above=True),
        default=None,
        metavar="R",
        help="default repeat penalty, 1 is none (default: the model's, else 1)",
    )
    generation.add_argument(
        "--speculate",
        type=_speculate,
        default="auto",
        metavar="MODE",
        help="speculative decoding by prompt lookup: drafts of a lane's next tokens from its own stream, verified "
        "in the lane's next decode; prompt-lookup always drafts, auto drafts while measured decode is at least "
        "--spec-min-speedup faster, off never (default: auto)",
    )
    generation.add_argument(
        "--spec-draft-tokens",
        type=_draft_tokens,
        default=None,
        metavar="N",
        help="the most tokens one draft holds, 1 to 15 (default: 15 with --spec-adaptive, which picks each "
        "draft's length below it; 4 without)",
    )
    generation.add_argument(
        "--spec-adaptive",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="make each draft as long as pays, from the measured odds that its tokens stand and the measured "
        "time of a decode by its size, and none where none pays; off, every draft is as long as it may be "
        "(default: on)",
    )
    generation.add_argument(
        "--spec-min-speedup",
        type=_number(1),
        default=1.08,
        metavar="X",
        help="under --speculate auto, the decode speed-up drafts must show to be kept (default: 1.08)",
    )
    generation.add_argument(
        "--threads", type=_positive, default=None, metavar="N", help="CPU threads for llama.cpp (default: all cores)"
    )
    generation.add_argument(
        "--host-cache-mb",
        type=_integer(0, zero="0: off"),
        default=None,
        metavar="MB",
        help="host memory for prefixes evicted from the KV slots; they come back without a prefill "
        "(default: a quarter of RAM, at most 2048; 0 turns it off)",
    )
    generation.add_argument(
        "--park",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep idle and evicted KV states on disk under <sessions>/park, so a session comes back warm "
        "after a restart or an eviction (default: on where that is a local disk with 2 GiB free, within "
        "half of the free space)",
    )
    generation.add_argument(
        "--park-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="park KV states in DIR instead of <sessions>/park (implies --park): a directory the daemons on one "
        "--store share (NFS between machines), so a session taken over from a killed daemon resumes warm",
    )
    generation.add_argument(
        "--park-budget-gb",
        type=_number(0, zero="0: unbounded"),
        default=20.0,
        metavar="GB",
        help="disk for parked KV states, least recently used dropped first (default: 20; 0 = unbounded)",
    )
    generation.add_argument(
        "--pin-budget-pct",
        type=_integer(0, 100),
        default=50,
        metavar="PCT",
        help="the most of the KV pool that prompt-cache marks (Anthropic cache_control) may keep pinned; "
        "the least recently marked prefix is released first (default: 50; 0 = marks pin nothing)",
    )

    scheduling = serve.add_argument_group("scheduling")
    classes = ", ".join(sorted(QOS_ALIASES))
    scheduling.add_argument(
        "--http-default-qos",
        type=_qos,
        default="agent",
        metavar="CLASS",
        help="scheduling class of HTTP requests that name none in x-superfluid-qos: interactive, completion, "
        "agent or background (default: agent)",
    )
    scheduling.add_argument(
        "--no-http-qos-header",
        action="store_true",
        help="ignore x-superfluid-qos: every HTTP request runs in --http-default-qos (any client could claim "
        "interactive otherwise)",
    )
    scheduling.add_argument(
        "--http-allow-batch-invariant",
        action="store_true",
        help="grant x-superfluid-batch-invariant (a lane that runs alone: one client can then slow every other)",
    )
    scheduling.add_argument(
        "--shed-when-busy",
        type=int,
        choices=(429, 503),
        default=None,
        metavar="STATUS",
        help="answer a new request that carries no session (a chat completion, completion, message, Ollama chat "
        "or generate) with STATUS, 429 or 503, and Retry-After when every lane is busy, instead of queueing it, "
        "so a load balancer or the client tries another daemon (HAProxy retries 503 itself) (default: queue it)",
    )
    scheduling.add_argument(
        "--class-lanes",
        type=_class_lanes,
        default={},
        metavar="CLASS=N,...",
        help=f"the most lanes a class may hold at once, such as background=2; classes: {classes} (default: no caps)",
    )
    scheduling.add_argument(
        "--worker-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run llama.cpp in a worker process (superfluid-worker-llamacpp), so a crash there costs the "
        "generations in flight and not the daemon; --no-worker-process runs it inside the daemon, for "
        "debugging (default: a worker)",
    )
    scheduling.add_argument(
        "--kernels",
        choices=KERNELS,
        default=None,
        help="exact: a token's logits do not depend on what shares its batch, so continuations, forks, "
        "replays and speculation equal the uncut run bit for bit; fast: also llama.cpp's repacked-weight and "
        "tiled K-quant kernels, which prefill IQ1_S and IQ1_M models faster and give that up (other models run "
        "kernels as fast either way). Explicit exact is refused "
        "where llama-cpp-python was not compiled for it (default: exact where the library allows it, else fast)",
    )
    scheduling.add_argument(
        "--gpu-layers",
        type=_parsed(parse_gpu_layers),
        default=None,
        metavar="N|all",
        help="the model's layers to put on the GPU, the output layer counted first (all, or a number); "
        "refused at start on a llama.cpp built for the CPU only, which `make serve GPU=cuda` replaces "
        "(default: all on a GPU build, 0 on a CPU one)",
    )
    scheduling.add_argument(
        "--gpu",
        type=_parsed(parse_gpus),
        default=(),
        metavar="ID[,ID]",
        help="the GPUs to use, by index among those llama.cpp sees; one keeps the whole model there, "
        "several split its layers (default: every GPU)",
    )
    scheduling.add_argument(
        "--tensor-split",
        type=_parsed(parse_tensor_split),
        default=(),
        metavar="F,F,...",
        help="the share of the layers each GPU takes, one number a GPU, such as 3,1 "
        "(default: by their memory, as llama.cpp splits)",
    )

    logging = serve.add_argument_group("logging")
    logging.add_argument(
        "--log-filter",
        type=_directive,
        default="info",
        metavar="DIRECTIVE",
        help="log levels, such as info or superfluid.scheduler=debug,info",
    )
    logging.add_argument("-v", "--verbose", action="store_true", help="debug logging (same as --log-filter debug)")
    logging.add_argument(
        "--log-file", type=Path, default=None, metavar="PATH", help="append the log here, not to stderr"
    )
    logging.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="also write the log as JSON lines to DIR/superfluid.N.jsonl, 64 MiB a file, 8 kept, mode 0600; "
        "no prompt or reply text is ever logged",
    )
    logging.add_argument(
        "--otlp-endpoint",
        type=_otlp_endpoint,
        default=None,
        metavar="URL",
        help="send a trace of every request and the metrics of /metrics to this OpenTelemetry collector, such as "
        "http://127.0.0.1:4318 (default: $OTEL_EXPORTER_OTLP_ENDPOINT, else none)",
    )
    logging.add_argument(
        "--otlp-protocol",
        choices=PROTOCOLS,
        default=None,
        help=f"how --otlp-endpoint is spoken to: {' or '.join(PROTOCOLS)} "
        f"(default: $OTEL_EXPORTER_OTLP_PROTOCOL, else {DEFAULT_PROTOCOL})",
    )
    logging.add_argument(
        "--otlp-service-name",
        default=None,
        metavar="NAME",
        help=f"the service.name of the traces and metrics (default: $OTEL_SERVICE_NAME, else {DEFAULT_SERVICE_NAME})",
    )
    logging.add_argument(
        "--tui",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a live full-screen monitor of lanes, KV tiers, rates and the log (default: on when stdout is a "
        "terminal); its log pane replaces stderr, and without --log-dir the log also goes to <sessions>/logs",
    )

    for flag, value in RETIRED.items():
        nargs = {False: 0, True: None, "?": "?"}[value]
        serve.add_argument(flag, action=Retired, nargs=nargs, help=argparse.SUPPRESS)


def environment_name(action: argparse.Action) -> str | None:
    """`SUPERFLUID_MAX_BATCH` for --max-batch; None for flags the environment does not set."""
    longs = [o for o in action.option_strings if o.startswith("--")]
    if not longs or isinstance(action, (Retired, argparse._HelpAction, argparse._VersionAction)):
        return None
    return "SUPERFLUID_" + longs[0][2:].upper().replace("-", "_")


def _truth(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected 1 or 0 (also true or false, yes or no, on or off), not {text!r}")


class RefusedVariable:
    """The default of a flag whose `SUPERFLUID_*` variable does not parse. It is an error only
    where it is used: by `serve`, and only when the command line does not give the flag."""

    def __init__(self, name: str, flag: str, problem: str) -> None:
        self.name, self.flag, self.problem = name, flag, problem

    def __str__(self) -> str:
        return f"${self.name} ({self.flag}): {self.problem}"


def apply_environment(serve: argparse.ArgumentParser, environ: dict[str, str] | None = None) -> None:
    """Defaults from `SUPERFLUID_*` variables, and each flag's variable named in its help.

    A variable that does not parse becomes a `RefusedVariable` default rather than an error
    here: this runs whatever the command is, and `superfluid session ls` has no use for
    `$SUPERFLUID_MAX_BATCH`. `refused_variables` finds those that `serve` would use."""
    environ = dict(os.environ) if environ is None else environ
    for action in serve._actions:
        name = environment_name(action)
        if name is None:
            continue
        if action.help and action.help is not argparse.SUPPRESS:
            action.help += f" [${name}]"
        raw = environ.get(name)
        if raw is None:
            continue
        try:
            action.default = _from_environment(action, raw)
        except (ValueError, argparse.ArgumentTypeError) as e:
            action.default = RefusedVariable(name, action.option_strings[0], str(e))


def refused_variables(args: argparse.Namespace) -> list[RefusedVariable]:
    """The variables that did not parse, of the flags the command line left to them."""
    return [value for value in vars(args).values() if isinstance(value, RefusedVariable)]


def _from_environment(action: argparse.Action, raw: str) -> Any:
    if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
        return _truth(raw)
    convert: Callable[[str], Any] = action.type if callable(action.type) else str

    def one(text: str) -> Any:
        value = convert(text)
        # argparse checks choices only on what the command line gives, so a variable is checked here
        if action.choices is not None and value not in action.choices:
            raise ValueError(f"expected one of {', '.join(map(str, action.choices))}, not {text!r}")
        return value

    if isinstance(action, argparse._AppendAction):
        return [one(item.strip()) for item in raw.split(",") if item.strip()]
    return one(raw)


def http_address(args: argparse.Namespace) -> str:
    """--http, else --host and --port, else the default."""
    if args.http:
        return args.http
    host = args.host or DEFAULT_HTTP.rpartition(":")[0]
    return f"[{host}]:{args.port or DEFAULT_PORT}" if ":" in host else f"{host}:{args.port or DEFAULT_PORT}"


def serve_config(args: argparse.Namespace) -> ServeConfig:
    config = ServeConfig(
        models=([args.model] if args.model else []) + args.more_models,
        idle_timeout=args.idle_timeout,
        max_context=args.max_context,
        max_batch=args.max_batch,
        http=http_address(args),
        no_http=args.no_http,
        web=args.web,
        web_origins=args.web_origins,
        cors_origins=args.cors_origins,
        offline=args.offline,
        fim_tokens=args.fim_tokens,
        fim_model=args.fim_model,
        chat_template=args.chat_template.expanduser() if args.chat_template else None,
        tool_call_parser=args.tool_call_parser,
        log_filter="debug" if args.verbose else args.log_filter,
        http_default_qos=args.http_default_qos,
        http_qos_header=not args.no_http_qos_header,
        http_allow_batch_invariant=args.http_allow_batch_invariant,
        worker_process=args.worker_process,
        kernels=args.kernels,
        gpu_layers=args.gpu_layers,
        gpus=args.gpu,
        tensor_split=args.tensor_split,
        park=True if args.park_dir is not None and args.park is None else args.park,
        park_dir=args.park_dir,
        park_budget_gb=args.park_budget_gb,
        max_tokens=args.max_tokens,
        pin_budget_pct=args.pin_budget_pct,
        sampling=SamplingDefaults(args.temperature, args.top_p, args.top_k, args.min_p, args.repeat_penalty),
        class_lanes=args.class_lanes,
        nonstream_keepalive=args.nonstream_keepalive,
        shed_when_busy=args.shed_when_busy,
        api_key=args.api_key,
        rate_limit=args.rate_limit,
        drain_timeout=args.drain_timeout,
        log_file=args.log_file,
        log_dir=args.log_dir,
        otlp_endpoint=args.otlp_endpoint,
        otlp_protocol=args.otlp_protocol,
        otlp_service_name=args.otlp_service_name,
        tui=sys.stdout.isatty() if args.tui is None else args.tui,
        store=args.store,
        advertise=args.advertise,
        forward=not args.no_forward,
        lease_renew=args.lease_renew,
        lease_expiry=args.lease_expiry,
        speculate=args.speculate,
        spec_draft_tokens=args.spec_draft_tokens or (15 if args.spec_adaptive else 4),
        spec_adaptive=args.spec_adaptive,
        spec_min_speedup=args.spec_min_speedup,
    )
    if args.sessions is not None:
        config.sessions = args.sessions.expanduser()
    if args.socket is not None:
        config.socket = args.socket.expanduser()
    if args.threads is not None:
        config.threads = args.threads
    if args.host_cache_mb is not None:
        config.host_cache_mb = args.host_cache_mb
    return config
