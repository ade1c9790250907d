"""The `superfluid` command: `serve` runs the daemon; `session` and `media` talk to it; `top` watches daemons."""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

from .. import __version__
from ..config import DEFAULT_HTTP, ServeConfig, default_socket
from .serve_flags import (
    _positive,
    add_serve_arguments,
    apply_environment,
    context_window,
    http_address,
    refused_variables,
    serve_config,
)

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
        flags: list[str] = []
        for action in self._actions:
            flags += action.option_strings
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    flags += sub._flags()
        return flags


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="superfluid", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-V", "--version", action="version", version=f"superfluid {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    serve = commands.add_parser(
        "serve",
        # the flags are too many for a usage line: an error would scroll its one line of sense away
        usage="superfluid serve [MODEL] [flags]",
        help="run the daemon",
        description="Run the daemon: load MODEL, replay the sessions and serve them.",
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serve_arguments(serve)
    apply_environment(serve)

    _client_commands(commands)
    top = commands.add_parser(
        "top",
        help="watch running daemons: one row each, from their /metrics",
        description="Poll each daemon's /metrics once a second: whether it is up (or answers 401), its KV "
        "pool, decode tok/s, lanes busy and queue depth, and the total decode rate as a sparkline. q quits.",
        epilog="  superfluid top 127.0.0.1:8453\n  SUPERFLUID_API_KEY=... superfluid top gpu1:8453 gpu2:8453",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    top.add_argument("addresses", nargs="+", metavar="HOST:PORT", help="a daemon's HTTP listener (its --http)")
    top.add_argument(
        "--api-key",
        default=os.environ.get("SUPERFLUID_API_KEY"),
        metavar="KEY",
        help="sent as a Bearer token, for keyed daemons (default: $SUPERFLUID_API_KEY, which keeps it out of ps)",
    )
    _agent_commands(commands)
    _run_command(commands)
    _chat_command(commands)
    _catalog_commands(commands)
    _pull_command(commands)
    service = commands.add_parser(
        "service",
        usage="superfluid service unit|install [-- SERVE FLAGS]",
        help="run the daemon as a systemd user service",
        description="unit prints a systemd user unit that runs superfluid serve with the flags after --; install "
        "writes it to ~/.config/systemd/user/superfluid.service and says how to start it. The daemon tells systemd "
        "when it serves (Type=notify), stops cleanly on SIGTERM and is restarted after a crash.",
        epilog="examples:\n"
        "  superfluid service install -- ~/models/qwen3-8b-q4_k_m.gguf --max-context 16384\n"
        "  superfluid service unit -- --http 0.0.0.0:8453 --key-policy keys.json > superfluid.service",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    service.add_argument("action", choices=("unit", "install"), metavar="ACTION", help="unit or install")
    service.set_defaults(serve_args=[])  # what follows --, split off before parsing (see `main`)
    completion = commands.add_parser(
        "completion",
        help="print shell completion for bash, zsh or fish",
        description="Print a completion script for the commands and flags of superfluid.",
        epilog="install it once:\n"
        "  superfluid completion bash > ~/.local/share/bash-completion/completions/superfluid\n"
        '  superfluid completion zsh > "${fpath[1]}/_superfluid"\n'
        "  superfluid completion fish > ~/.config/fish/completions/superfluid.fish",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    completion.add_argument("shell", choices=("bash", "zsh", "fish"), metavar="SHELL", help="bash, zsh or fish")
    commands.add_parser("version", help="print the version")
    return parser


def _agent_commands(commands: Any) -> None:
    """`launch` runs a coding agent against a daemon; `stop` stops the daemon `launch` started."""
    from ..agents.table import AGENTS

    listing = "\n".join(f"  {a.name:<9} {a.title} ({a.api})" for a in AGENTS.values())
    launch = commands.add_parser(
        "launch",
        usage="superfluid launch AGENT [options] [-- ARGS for the agent]",
        help="run a coding agent (claude, codex, opencode, aider, ollama, llm) against superfluid",
        description="Run AGENT pointed at the daemon that answers at --http, starting one in the background when "
        "none does. The agent gets settings for this run only (environment variables, or files under "
        "$SUPERFLUID_HOME/agents/AGENT): your own configuration is left as it is. Its requests run in the agent "
        "QoS class. Arguments after -- go to the agent.",
        epilog=f"agents:\n{listing}\n\nexamples:\n"
        "  superfluid launch claude -- -p 'what does this repo do?' --tools Read,Bash\n"
        "  superfluid launch codex --model ~/models/qwen3-coder-30b.gguf --max-context 32768\n"
        "  superfluid stop",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    launch.add_argument("agent", metavar="AGENT", help=f"one of: {', '.join(AGENTS)}")
    _daemon_address(launch, "the daemon's key, given to the agent")
    launch.add_argument(
        "--model", default=None, metavar="MODEL", help="the model to serve and use (default: the daemon's)"
    )
    launch.add_argument(
        "--max-context",
        type=context_window,
        default=None,
        metavar="N",
        help="the window of a daemon launch starts (default: the model's, at most 8192)",
    )
    launch.set_defaults(agent_args=[])  # what follows --, split off before parsing (see `main`)
    commands.add_parser(
        "stop",
        help="stop the daemon `superfluid launch` started",
        description="Stop the daemon that `superfluid launch` started in the background (SIGTERM, as Ctrl-C would); "
        "a daemon started any other way is left alone.",
    )


def _run_command(commands: Any) -> None:
    """`run`: one answer from a model, for scripts."""
    run = commands.add_parser(
        "run",
        usage="superfluid run MODEL [PROMPT ...] [options]",
        help="answer one prompt and exit (reads standard input too)",
        description="Answer PROMPT with MODEL and exit: the reply streams to stdout, reasoning to stderr. Piped "
        "standard input comes before PROMPT in the message. It uses the daemon at --http, starting one in the "
        "background when none answers (superfluid stop stops it), and loads MODEL there when it is not loaded.",
        epilog="examples:\n"
        "  superfluid run smollm2 'Name three rivers.'\n"
        "  git diff | superfluid run smollm2 'Review this change.' --max-tokens 300\n"
        "  superfluid run ~/models/qwen3-8b-q4_k_m.gguf --system 'Answer in French.' 'Hello'",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("model", metavar="MODEL", help="a served model's name, a GGUF path or a Hugging Face id")
    run.add_argument("prompt", nargs="*", metavar="PROMPT", help="the message (words are joined by spaces)")
    run.add_argument("--system", default=None, metavar="TEXT", help="a system message before it")
    run.add_argument("--max-tokens", type=_positive, default=None, metavar="N", help="the longest reply")
    run.add_argument(
        "--temperature", type=float, default=None, metavar="T", help="0 for greedy (default: the daemon's)"
    )
    run.add_argument("--seed", type=int, default=None, metavar="N", help="the sampling seed")
    _daemon_address(run)


def _chat_command(commands: Any) -> None:
    """`chat`: a terminal chat on durable sessions."""
    chat = commands.add_parser(
        "chat",
        usage="superfluid chat [MODEL] [--session ID] [options]",
        help="chat in the terminal; sessions last, resume and branch",
        description="Chat with the daemon's model in the terminal. Each conversation is a session in the daemon's "
        "log: resume it by id (after a restart too), branch it with /fork, or with /edit N start a branch in which "
        "message N says something else; /help lists the commands. It talks to the daemon at --socket, starting one "
        "in the background when none answers (with MODEL, at --http; superfluid stop stops it).",
        epilog="examples:\n"
        "  superfluid chat\n"
        "  superfluid chat ~/models/qwen3-8b-q4_k_m.gguf --temperature 0.6\n"
        "  superfluid chat --session 12",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    chat.add_argument(
        "model", nargs="?", default=None, metavar="MODEL", help="the model to start a daemon with (default: its own)"
    )
    chat.add_argument("--session", type=int, default=None, metavar="ID", help="resume this session")
    chat.add_argument(
        "--max-tokens", type=_positive, default=1024, metavar="N", help="the longest reply (default: 1024)"
    )
    chat.add_argument(
        "--temperature", type=float, default=None, metavar="T", help="a new session's temperature (default: 0.7)"
    )
    chat.add_argument("--seed", type=int, default=None, metavar="N", help="a new session's sampling seed")
    chat.add_argument(
        "--socket", type=Path, default=None, metavar="PATH", help=f"the daemon's socket (default: {default_socket()})"
    )
    _daemon_address(chat)


def _daemon_address(parser: argparse.ArgumentParser, key: str = "the daemon's key") -> None:
    """--http and --api-key: the daemon a client command talks to."""
    parser.add_argument(
        "--http",
        default=os.environ.get("SUPERFLUID_HTTP", DEFAULT_HTTP),
        metavar="ADDR",
        help=f"the daemon's HTTP address (default: $SUPERFLUID_HTTP, else {DEFAULT_HTTP})",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("SUPERFLUID_API_KEY"),
        metavar="KEY",
        help=f"{key} (default: $SUPERFLUID_API_KEY)",
    )


def _catalog_commands(commands: Any) -> None:
    """`models` and `ps`: the models on this machine, and what a daemon has loaded."""
    models = commands.add_parser(
        "models",
        help="list the GGUF models on this machine",
        description="List the embedded model, the GGUF files in the Hugging Face cache and in each --dir: the name "
        "serve takes, size, quantisation, trained context, chat template family, and whether the daemon at "
        "--http has it loaded.",
    )
    models.add_argument("--dir", action="append", metavar="DIR", help="also look for .gguf files here; repeatable")
    _daemon_address(models)
    ps = commands.add_parser(
        "ps",
        help="what a running daemon has loaded",
        description="The models the daemon at --http has loaded: context window, kernels, worker process and its "
        "resident memory (for a daemon on this machine), and which is the default.",
    )
    _daemon_address(ps)


def _pull_command(commands: Any) -> None:
    """`pull`: download a model into the Hugging Face cache."""
    pull = commands.add_parser(
        "pull",
        help="download a GGUF model from Hugging Face (or a URL), with progress",
        description="Download MODEL into the Hugging Face cache (HF_HUB_CACHE), where serve, run and models find "
        "it: org/repo-GGUF:QUANT, org/repo-GGUF when the repository has one GGUF (with several, they are listed "
        "with their sizes), or a URL to a .gguf file (saved under $SUPERFLUID_HOME/models). A cut download "
        "resumes where it stopped; the file's size and sha256 are checked against what the hub states. "
        "HF_ENDPOINT names another hub, HF_TOKEN is sent for private and gated repositories.",
        epilog="examples:\n"
        "  superfluid pull bartowski/SmolLM2-360M-Instruct-GGUF:Q4_K_M\n"
        "  superfluid pull bartowski/SmolLM2-360M-Instruct-GGUF      # lists its quantisations\n"
        "  superfluid pull https://huggingface.co/bartowski/SmolLM2-360M-Instruct-GGUF/resolve/main/"
        "SmolLM2-360M-Instruct-Q8_0.gguf\n"
        "  superfluid serve bartowski/SmolLM2-360M-Instruct-GGUF:Q4_K_M",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pull.add_argument("model", metavar="MODEL", help="org/repo-GGUF[:QUANT] or a URL to a .gguf file")


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
            help="write a session's events to session-<id>.jsonl, or its spans to session-<id>.otlp.jsonl (mode 0600)",
            description="Write one JSON line per event (jsonl), or the session as OpenTelemetry spans (otlp-jsonl:"
            " one OTLP/JSON ExportTraceServiceRequest a line, as the collector's file exporter writes), and send"
            " the spans to an OTLP/HTTP collector with --endpoint. Texts, spans and arguments are left out (their"
            " sizes are kept) unless --include-content; included content has API keys and private keys redacted.",
        )
    )
    export.add_argument("id", type=int, help="session id")
    export.add_argument(
        "--format", choices=["jsonl", "otlp-jsonl"], default="jsonl", help="output format (default: jsonl)"
    )
    export.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="directory to write to, or - for stdout (default: ., or nothing with --endpoint)",
    )
    export.add_argument(
        "--endpoint",
        default=None,
        metavar="URL",
        help="send the spans to the OTLP/HTTP collector at URL (POST URL/v1/traces), with the headers"
        " OTEL_EXPORTER_OTLP_HEADERS names; needs --format otlp-jsonl",
    )
    export.add_argument("--include-content", action="store_true", help="keep texts, spans and arguments")

    media = commands.add_parser("media", help="the daemon's media store")
    media_verbs = media.add_subparsers(dest="verb", metavar="VERB", parser_class=Parser, required=True)
    put = with_socket(media_verbs.add_parser("put", help="store a file; prints its sha256 hash"))
    put.add_argument("file", type=Path)
    with_socket(media_verbs.add_parser("gc", help="remove blobs no session references; prints kept and removed"))


def _run_agent_command(args: argparse.Namespace) -> int:
    from ..agents.launch import LaunchError, launch, stop_recorded

    if args.command == "stop":
        print(f"superfluid: {stop_recorded()}", file=sys.stderr)
        return 0
    serve_args = [*(["--model", args.model] if args.model else [])]
    serve_args += ["--max-context", str(args.max_context)] if args.max_context else []
    try:
        return launch(args.agent, args.agent_args, args.http, args.api_key, args.model, serve_args)
    except LaunchError as e:
        print(f"superfluid launch: {e}", file=sys.stderr)
        return 1


def serve_settings(serve: argparse.ArgumentParser, args: argparse.Namespace) -> ServeConfig:
    """The `ServeConfig` of parsed `serve` arguments, once every check that needs no model has
    passed; otherwise exits 2 with what was wrong (`serve` is that subcommand's parser)."""
    from ..transports.access import load_policy
    from ..transports.addresses import parse_web_address, split_address
    from ..transports.socket import UNIX_PATH_MAX

    refused = refused_variables(args)
    if refused:
        # one line a variable: the usage says nothing about the environment
        for variable in refused:
            print(f"{serve.prog}: error: {variable}", file=sys.stderr)
        sys.exit(2)
    try:
        if args.web:
            parse_web_address(args.web, anywhere=args.store is not None)
        split_address(http_address(args))  # --http is checked as it is parsed; --host and --port here
        if not args.lease_renew < args.lease_expiry:
            raise ValueError(
                f"--lease-renew {args.lease_renew:g} must be below --lease-expiry {args.lease_expiry:g}: "
                "a lease is renewed before it can expire"
            )
        if "*" in args.cors_origins and (args.api_key or args.key_policy):
            raise ValueError(
                "--cors-origin * would let any web page send a key to this daemon; with --api-key or "
                "--key-policy, list the pages' origins instead"
            )
        # read once, and refused now, before any model loads
        keys = load_policy(args.key_policy, args.api_key) if args.key_policy is not None else []
    except ValueError as e:
        serve.error(str(e))
    config = serve_config(args)
    config.keys = keys
    # the socket opens after the models load, which may take minutes (or a download): its path is checked now
    if len(os.fsencode(config.socket)) >= UNIX_PATH_MAX:
        serve.error(
            f"the socket path {config.socket} is {len(os.fsencode(config.socket))} bytes, over the "
            f"{UNIX_PATH_MAX - 1} a unix socket allows; pass a shorter --socket"
        )
    return config


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found: argparse.ArgumentParser = commands.choices[name]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    # `launch AGENT ... -- ARGS`: what follows -- is the agent's, whatever it looks like
    passed: list[str] = []
    if argv[:1] in (["launch"], ["service"]) and "--" in argv:
        argv, passed = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    args = parser.parse_args(argv)
    if passed and args.command == "launch":
        args.agent_args = passed
    if passed and args.command == "service":
        args.serve_args = passed
    if args.command == "serve":
        from ..logsetup import LogPane, setup_logging
        from .serve import run

        config = serve_settings(_subparser(parser, "serve"), args)
        pane = LogPane() if config.tui else None
        if pane is not None and config.log_dir is None:
            config.log_dir = config.sessions / "logs"  # the pane scrolls away; the log stays on disk too
        setup_logging(config.log_filter, config.log_file, config.log_dir, pane)
        return run(config, pane)
    if args.command in ("session", "media"):
        from .commands import run as run_command

        return run_command(f"{args.command} {args.verb}", args)
    if args.command == "top":
        from ..views.top import Top

        Top(args.addresses, args.api_key).run()
        return 0
    if args.command in ("launch", "stop"):
        return _run_agent_command(args)
    if args.command == "run":
        from .prompt import main_run

        return main_run(args)
    if args.command == "chat":
        from .chat import main_chat

        return main_chat(args)
    if args.command == "service":
        from .service import main_service

        return main_service(args.action, args.serve_args)
    if args.command == "completion":
        from .completion import script

        print(script(args.shell, parser), end="")
        return 0
    if args.command == "pull":
        from .pull import main_pull

        return main_pull(args)
    if args.command in ("models", "ps"):
        from .catalog import main_catalog

        return main_catalog(args)
    if args.command == "version":
        print(f"superfluid {__version__}")
        return 0
    parser.print_help(sys.stderr)
    return 2
