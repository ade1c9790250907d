"""Flags and `SUPERFLUID_*` variables are refused as they are parsed, with what is accepted, and a
variable only matters to the command that uses it. Nothing here starts a daemon: `serve` runs up
to the `ServeConfig` it would start with."""

from __future__ import annotations

import argparse
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from superfluid.cli.main import build_parser, main
from superfluid.config import ServeConfig
from superfluid.transports.addresses import parse_web_address


def refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """What the parser says of `argv`, which it must refuse (exit 2)."""
    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args(list(argv))
    assert exit.value.code == 2
    return capsys.readouterr().err


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[ServeConfig]]:
    """`superfluid serve` with the daemon left out: the configs it would have run with."""
    configs: list[ServeConfig] = []

    def run(config: ServeConfig, pane: object = None) -> int:
        configs.append(config)
        return 0

    fake = types.ModuleType("superfluid.cli.serve")
    fake.run = run
    monkeypatch.setitem(sys.modules, "superfluid.cli.serve", fake)
    monkeypatch.setattr("superfluid.logsetup.setup_logging", lambda *args, **kwargs: None)
    monkeypatch.setenv("SUPERFLUID_HOME", str(tmp_path))  # a short socket path of its own
    yield configs


# --- variables: only `serve` reads them ------------------------------------------------------


def test_a_bad_serve_variable_leaves_other_commands_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SUPERFLUID_MAX_BATCH", "0")
    monkeypatch.setenv("SUPERFLUID_KERNELS", "bogus")
    assert main(["session", "ls", "--socket", str(tmp_path / "none.sock")]) == 1
    err = capsys.readouterr().err
    assert "cannot connect to the superfluid socket" in err and "usage" not in err
    assert main(["version"]) == 0
    assert build_parser().parse_args(["session", "export", "3"]).id == 3


def test_a_bad_serve_variable_is_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, started: list[ServeConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SUPERFLUID_MAX_BATCH", "0")
    with pytest.raises(SystemExit) as exit:
        main(["serve", "--no-tui"])
    assert exit.value.code == 2 and not started
    assert capsys.readouterr().err.splitlines() == [
        "superfluid serve: error: $SUPERFLUID_MAX_BATCH (--max-batch): expected an integer of at least 1, not '0'"
    ]


def test_every_bad_variable_is_named_and_a_switch_says_what_it_takes(
    monkeypatch: pytest.MonkeyPatch, started: list[ServeConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SUPERFLUID_KERNELS", "bogus")  # argparse checks choices only on the command line
    monkeypatch.setenv("SUPERFLUID_OFFLINE", "maybe")
    with pytest.raises(SystemExit):
        main(["serve", "--no-tui"])
    assert capsys.readouterr().err.splitlines() == [
        "superfluid serve: error: $SUPERFLUID_OFFLINE (--offline): expected 1 or 0 (also true or false, "
        "yes or no, on or off), not 'maybe'",
        "superfluid serve: error: $SUPERFLUID_KERNELS (--kernels): expected one of fast, exact, not 'bogus'",
    ]
    assert not started


def test_the_command_line_wins_over_a_bad_variable(monkeypatch: pytest.MonkeyPatch, started: list[ServeConfig]) -> None:
    monkeypatch.setenv("SUPERFLUID_MAX_BATCH", "0")
    monkeypatch.setenv("SUPERFLUID_MAX_TOKENS", "5")
    monkeypatch.setenv("SUPERFLUID_KERNELS", "exact")
    assert main(["serve", "--no-tui", "--max-batch", "2"]) == 0
    (config,) = started
    assert (config.max_batch, config.max_tokens, config.kernels) == (2, 5, "exact")


# --- ranges: every number is checked as it is parsed -----------------------------------------


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--park-budget-gb", "-1", "expected a number of at least 0 (0: unbounded), not '-1'"),
        ("--rate-limit", "-5", "expected an integer of at least 0 (0: off), not '-5'"),
        ("--api-key", "", "expected a key of at least one character, not an empty string"),
        ("--port", "70000", "expected an integer from 1 to 65535, not '70000'"),
        ("--port", "0", "expected an integer from 1 to 65535, not '0'"),
        ("--http", "127.0.0.1:70000", "expected HOST:PORT with a port from 0 to 65535"),
        ("--http", "8453", "expected HOST:PORT"),
        ("--web", "127.0.0.1:70000", "expected HOST:PORT with a port from 0 to 65535"),
        ("--idle-timeout", "-1", "expected a number of at least 0 (0: never), not '-1'"),
        ("--idle-timeout", "nan", "expected a number of at least 0 (0: never), not 'nan'"),
        ("--lease-renew", "0", "expected a number above 0, not '0'"),
        ("--lease-expiry", "-3", "expected a number above 0, not '-3'"),
        ("--nonstream-keepalive", "-1", "expected a number of at least 0 (0: off)"),
        ("--drain-timeout", "inf", "expected a number of at least 0 (0: no wait), not 'inf'"),
        ("--max-context", "100", "expected auto or an integer of at least 512 (tokens), not '100'"),
        ("--max-batch", "0", "expected an integer of at least 1, not '0'"),
        ("--max-tokens", "-1", "expected an integer of at least 1, not '-1'"),
        ("--threads", "two", "expected an integer of at least 1, not 'two'"),
        ("--temperature", "-0.5", "expected a number of at least 0 (0: greedy)"),
        ("--top-p", "1.5", "expected a number from 0 to 1, not '1.5'"),
        ("--min-p", "-0.1", "expected a number from 0 to 1, not '-0.1'"),
        ("--top-k", "-1", "expected an integer of at least 0 (0: every token), not '-1'"),
        ("--repeat-penalty", "0", "expected a number above 0, not '0'"),
        ("--spec-draft-tokens", "16", "expected an integer from 1 to 15, not '16'"),
        ("--spec-min-speedup", "0.9", "expected a number of at least 1, not '0.9'"),
        ("--host-cache-mb", "-1", "expected an integer of at least 0 (0: off), not '-1'"),
        ("--pin-budget-pct", "101", "expected an integer from 0 to 100, not '101'"),
        ("--class-lanes", "background=0", "expected an integer of at least 1, not '0'"),
        ("--fim-tokens", "1,2", "expected three token ids"),
        ("--log-filter", "loud", "expected LEVEL or TARGET=LEVEL, where LEVEL is one of trace, debug"),
    ],
)
def test_a_value_out_of_range_is_refused_with_what_is_accepted(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, says: str
) -> None:
    err = refusal(capsys, "serve", f"{flag}={value}")
    assert f"error: argument {flag}" in err and says in err, err


@pytest.mark.parametrize(
    ("flag", "value", "dest", "parsed"),
    [
        ("--park-budget-gb", "0", "park_budget_gb", 0.0),  # unbounded
        ("--rate-limit", "0", "rate_limit", 0),  # off
        ("--top-k", "0", "top_k", 0),  # every token
        ("--host-cache-mb", "0", "host_cache_mb", 0),  # off
        ("--pin-budget-pct", "0", "pin_budget_pct", 0),  # marks pin nothing
        ("--idle-timeout", "0", "idle_timeout", 0.0),  # never
        ("--drain-timeout", "0", "drain_timeout", 0.0),
        ("--temperature", "0", "temperature", 0.0),  # greedy
        ("--port", "65535", "port", 65535),
        ("--http", "[::1]:0", "http", "[::1]:0"),  # any free port
        ("--max-context", "auto", "max_context", None),
        ("--max-context", "512", "max_context", 512),
        ("--spec-draft-tokens", "1", "spec_draft_tokens", 1),
        ("--repeat-penalty", "1", "repeat_penalty", 1.0),
    ],
)
def test_the_documented_bounds_are_accepted(flag: str, value: str, dest: str, parsed: object) -> None:
    assert getattr(build_parser().parse_args(["serve", f"{flag}={value}"]), dest) == parsed


def serve_parser() -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = commands.choices["serve"]
    return parser


def test_no_flag_that_parses_its_value_takes_a_negative_or_a_nan() -> None:
    """A guard for flags to come: a `type=` other than a path or a name must refuse -1 and nan."""
    checked = []
    for action in serve_parser()._actions:
        if not action.option_strings or action.type in (None, str, Path) or action.dest == "api_key":
            continue  # texts and paths: "-1" is a key like any other
        for bad in ("-1", "nan"):
            with pytest.raises(argparse.ArgumentError):
                serve_parser()._get_values(action, [bad])
        checked.append(action.option_strings[0])
    assert {"--port", "--park-budget-gb", "--rate-limit", "--top-k", "--host-cache-mb"} <= set(checked)


def test_launch_refuses_a_window_serve_would(capsys: pytest.CaptureFixture[str]) -> None:
    assert "at least 512" in refusal(capsys, "launch", "claude", "--max-context", "100")
    assert build_parser().parse_args(["launch", "claude", "--max-context", "auto"]).max_context is None


# --- session export ---------------------------------------------------------------------------


def test_export_takes_jsonl_without_being_told(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args(["session", "export", "1"]).format == "jsonl"
    assert build_parser().parse_args(["session", "export", "1", "--format", "jsonl"]).format == "jsonl"
    assert "invalid choice: 'csv'" in refusal(capsys, "session", "export", "1", "--format", "csv")


# --- checks after parsing: still before anything loads ---------------------------------------


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--web", "10.0.0.1:8460"], "the browser transport listens on loopback only"),
        (["--lease-renew", "20"], "--lease-renew 20 must be below --lease-expiry 10"),
        (["--socket", "/tmp/" + "s" * 120], "a unix socket allows; pass a shorter --socket"),
        (["--cors-origin", "*", "--api-key", "k"], "--cors-origin * would let any web page send a key"),
        (["--cors-origin", "ftp://x"], "expected an origin such as https://app.example.com"),
        (["--cors-origin", "https://app.example.com/chat"], "expected an origin such as"),
    ],
)
def test_what_depends_on_other_flags_is_refused_before_the_daemon_starts(
    started: list[ServeConfig], capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["serve", "--no-tui", *argv])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and not started and says in err, err
    assert err.startswith("usage: superfluid serve [MODEL] [flags]\n"), "a usage line, not a page of it"


@pytest.mark.parametrize(
    ("address", "says"),
    [
        ("127.0.0.1:70000", "expected a port from 0 to 65535 after the host"),
        ("localhost:http", "expected a port from 0 to 65535 after the host"),
        ("10.0.0.1:8460", "listens on loopback only"),
    ],
)
def test_a_web_address_is_refused_for_what_is_wrong_with_it(address: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_web_address(address)
    assert parse_web_address("[::1]:8460") == ("::1", 8460)
