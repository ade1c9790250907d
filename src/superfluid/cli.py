"""The `superfluid` command: `serve` runs the daemon; `session` and `media` talk to it."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

from . import __version__
from .config import DEFAULT_HTTP, DEFAULT_MAX_BATCH, ServeConfig, default_sessions, default_socket
from .protocol.schema import qos_class

DESCRIPTION = """\
superfluid serves a local LLM whose conversations outlive crashes and restarts, fork
cheaply and share their prefixes. Sessions live in an fsynced log under --sessions;
clients reach them over the unix socket (--socket) or, with --web, from a browser.
"""

SERVE_EPILOG = """\
MODEL is a path to a .gguf file or a Hugging Face id such as
bartowski/SmolLM2-360M-Instruct-GGUF:Q4_K_M (looked up in the local Hugging Face
cache; downloaded only when missing and --offline is not given). Without MODEL the
embedded SmolLM2-135M-Instruct is served, so this works on a machine with no network:

  superfluid serve
  superfluid serve ~/models/qwen3-4b-q4_k_m.gguf --max-context 16384 --max-batch 4
"""


class Parser(argparse.ArgumentParser):
    """argparse without abbreviations, suggesting the closest flag for an unknown one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        unknown = re.search(r"unrecognized arguments: (\S+)", message)
        if unknown:
            close = difflib.get_close_matches(unknown.group(1).split("=")[0], self._flags(), n=1)
            if close:
                message += f" (did you mean {close[0]}?)"
        super().error(message)

    def _flags(self) -> list[str]:
        flags = []
        for action in self._actions:
            flags += action.option_strings
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    flags += sub._flags()
        return flags


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text}")
    return value


def _fim_tokens(text: str) -> tuple[int, int, int]:
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"give three token ids, prefix,suffix,middle (such as 1,3,2), not {text}")
    prefix, suffix, middle = (int(p) for p in parts)
    return prefix, suffix, middle


def _qos(text: str) -> int:
    try:
        return qos_class(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _context(text: str) -> int | None:
    if text == "auto":
        return None
    value = _positive(text)
    if value < 512:
        raise argparse.ArgumentTypeError(f"must be at least 512 tokens (or auto), not {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="superfluid", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-V", "--version", action="version", version=f"superfluid {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    serve = commands.add_parser(
        "serve",
        help="run the daemon",
        description="Run the daemon: load MODEL, replay the sessions and serve them.",
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument(
        "model", nargs="?", metavar="MODEL", help="a .gguf path or org/repo-GGUF:QUANT (default: embedded)"
    )
    serve.add_argument(
        "--model",
        dest="more_models",
        action="append",
        default=[],
        metavar="M",
        help="serve this model too (repeatable); the first named, MODEL or --model, is the default, which the "
        "session API uses; HTTP requests pick theirs by their model field",
    )
    serve.add_argument(
        "--idle-timeout",
        type=float,
        default=0.0,
        metavar="SEC",
        help="unload a model that served nothing for SEC seconds (never the default one); a request naming it "
        "loads it again (default: 0, never)",
    )
    serve.add_argument(
        "--sessions",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"directory of the session log; one daemon per directory (default: {default_sessions()}, "
        "under $SUPERFLUID_HOME)",
    )
    serve.add_argument(
        "--socket",
        type=Path,
        default=None,
        metavar="PATH",
        help=f"unix socket of the session API, mode 0600; a stale file is replaced (default: {default_socket()})",
    )
    serve.add_argument(
        "--max-context",
        type=_context,
        default=None,
        metavar="N",
        help="tokens one session may hold, prompt and reply together; 'auto' is the model's trained "
        "window up to 8192 (default: auto)",
    )
    serve.add_argument(
        "--max-batch",
        "--max-batch-size",
        dest="max_batch",
        type=_positive,
        default=DEFAULT_MAX_BATCH,
        metavar="N",
        help=f"generations decoded together in one batch (lanes) (default: {DEFAULT_MAX_BATCH})",
    )
    serve.add_argument(
        "--threads", type=_positive, default=None, metavar="N", help="CPU threads for llama.cpp (default: all cores)"
    )
    serve.add_argument(
        "--http",
        default=DEFAULT_HTTP,
        metavar="ADDR",
        help=f"address of the OpenAI, Anthropic and Ollama routes (default: {DEFAULT_HTTP})",
    )
    serve.add_argument("--no-http", action="store_true", help="serve the session API only (socket, and --web if given)")
    serve.add_argument(
        "--no-tui", action="store_true", help="no terminal monitor; superfluid has none yet, and logs to stderr"
    )
    serve.add_argument(
        "--http-default-qos",
        type=_qos,
        default="agent",
        metavar="CLASS",
        help="scheduling class of HTTP requests that name none in x-superfluid-qos: interactive, completion, "
        "agent or background (default: agent)",
    )
    serve.add_argument(
        "--no-http-qos-header",
        action="store_true",
        help="ignore x-superfluid-qos: every HTTP request runs in --http-default-qos (any client could claim "
        "interactive otherwise)",
    )
    serve.add_argument(
        "--http-allow-batch-invariant",
        action="store_true",
        help="grant x-superfluid-batch-invariant (a lane that runs alone: one client can then slow every other)",
    )
    serve.add_argument(
        "--web",
        metavar="127.0.0.1:PORT",
        help="also serve the session API as JSON over HTTP and WebSocket on this loopback address",
    )
    serve.add_argument(
        "--web-origin",
        dest="web_origins",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a browser page origin allowed to open /web/ws, such as http://localhost:5173; repeatable",
    )
    serve.add_argument(
        "--worker-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run llama.cpp in a worker process (superfluid-worker-llamacpp), so a crash there costs the "
        "generations in flight and not the daemon; --no-worker-process runs it inside the daemon, for "
        "debugging (default: a worker)",
    )
    serve.add_argument(
        "--host-cache-mb",
        type=int,
        default=None,
        metavar="MB",
        help="host memory for prefixes evicted from the KV slots; they come back without a prefill "
        "(default: a quarter of RAM, at most 2048; 0 turns it off)",
    )
    serve.add_argument("--offline", action="store_true", help="never download a model; use the local cache only")
    serve.add_argument(
        "--fim-tokens",
        type=_fim_tokens,
        metavar="PRE,SUF,MID",
        help="token ids of the fill-in-the-middle markers, for a GGUF whose metadata lacks them",
    )
    serve.add_argument(
        "--log-filter",
        default="info",
        metavar="DIRECTIVE",
        help="log levels, such as info or superfluid.scheduler=debug,info",
    )
    serve.add_argument("-v", "--verbose", action="store_true", help="debug logging (same as --log-filter debug)")

    _client_commands(commands)
    commands.add_parser("version", help="print the version")
    return parser


def _client_commands(commands: Any) -> None:
    """`session` and `media`: clients of a running daemon's socket."""

    def with_socket(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument(
            "--socket",
            type=Path,
            default=None,
            metavar="PATH",
            help=f"the daemon's socket (default: {default_socket()})",
        )
        return parser

    session = commands.add_parser("session", help="look at sessions of a running daemon")
    verbs = session.add_subparsers(dest="verb", metavar="VERB", parser_class=Parser, required=True)
    ls = with_socket(verbs.add_parser("ls", help="list sessions: id, parent, fork point, events, tokens, title"))
    ls.add_argument("--all", action="store_true", help="include archived sessions")
    with_socket(verbs.add_parser("tree", help="sessions as a tree of forks"))
    inspect = with_socket(verbs.add_parser("inspect", help="a session's summary and one line per event"))
    inspect.add_argument("id", type=int, help="session id")
    inspect.add_argument("--json", action="store_true", help="the whole Inspection as JSON")
    export = with_socket(
        verbs.add_parser(
            "export",
            help="write a session's events to session-<id>.jsonl (mode 0600)",
            description="Write one JSON line per event. Texts, spans and arguments are left out (their sizes are"
            " kept) unless --include-content; included content has API keys and private keys redacted.",
        )
    )
    export.add_argument("id", type=int, help="session id")
    export.add_argument("--format", choices=["jsonl"], required=True, help="output format")
    export.add_argument("--out", type=Path, default=Path("."), metavar="DIR", help="directory to write to (default: .)")
    export.add_argument("--include-content", action="store_true", help="keep texts, spans and arguments")

    media = commands.add_parser("media", help="the daemon's media store")
    media_verbs = media.add_subparsers(dest="verb", metavar="VERB", parser_class=Parser, required=True)
    put = with_socket(media_verbs.add_parser("put", help="store a file; prints its sha256 hash"))
    put.add_argument("file", type=Path)
    with_socket(media_verbs.add_parser("gc", help="remove blobs no session references; prints kept and removed"))


def serve_config(args: argparse.Namespace) -> ServeConfig:
    config = ServeConfig(
        models=([args.model] if args.model else []) + args.more_models,
        idle_timeout=max(0.0, args.idle_timeout),
        max_context=args.max_context,
        max_batch=args.max_batch,
        http=args.http,
        no_http=args.no_http,
        web=args.web,
        web_origins=args.web_origins,
        offline=args.offline,
        fim_tokens=args.fim_tokens,
        log_filter="debug" if args.verbose else args.log_filter,
        http_default_qos=args.http_default_qos,
        http_qos_header=not args.no_http_qos_header,
        http_allow_batch_invariant=args.http_allow_batch_invariant,
        worker_process=args.worker_process,
    )
    if args.sessions is not None:
        config.sessions = args.sessions.expanduser()
    if args.socket is not None:
        config.socket = args.socket.expanduser()
    if args.threads is not None:
        config.threads = args.threads
    if args.host_cache_mb is not None:
        config.host_cache_mb = max(0, args.host_cache_mb)
    return config


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        from .logsetup import parse_directive, setup_logging
        from .serve import run
        from .transports.listener import split_address
        from .transports.web import parse_web_address

        try:
            parse_directive(args.log_filter)
        except ValueError as e:
            parser.error(str(e))
        try:
            if args.web:
                parse_web_address(args.web)
            split_address(args.http)
        except ValueError as e:
            parser.error(str(e))
        config = serve_config(args)
        setup_logging(config.log_filter)
        return run(config)
    if args.command in ("session", "media"):
        from .commands import run as run_command

        return run_command(f"{args.command} {args.verb}", args)
    if args.command == "version":
        print(f"superfluid {__version__}")
        return 0
    parser.print_help(sys.stderr)
    return 2
