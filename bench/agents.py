"""Coding agents: a Claude Code turn's first token, cold and warm, on superfluid and on llama-server.

Claude Code (the version `make test` installs into .venv/agents) runs headless (`claude -p`)
with its default system prompt and two tools (`--tools Read,Bash`: about 2,800 tokens on
SmolLM2's tokenizer; its 25 tools are 23,000, past the embedded model's window). A round
starts a server fresh, runs one turn with nothing cached (cold), then a turn with another
question and the same system prompt and tools (warm), and reads the time to first token
Claude Code itself reports (`ttft_ms` of its JSON result). Replies are capped at 32 tokens
(`CLAUDE_CODE_MAX_OUTPUT_TOKENS`), which the first token does not wait for. Both servers run
the same llama.cpp at 8 lanes of 8,192 tokens; llama-server speaks the Anthropic API itself
(`/v1/messages`), with `--jinja` for the tools. The systems take turns, three rounds each, and
each figure is the median of its rounds.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from peer import LlamaServer, Server, Superfluid

from superfluid.model.resolve import embedded_model

CLAUDE = Path(__file__).resolve().parents[1] / ".venv" / "agents" / "bin" / "claude"
LEAN = ["--tools", "Read,Bash", "--output-format", "json", "-p"]
QUESTIONS = ("What does a harbour master do?", "Name three rivers in Peru.")
ROUNDS = 3
WINDOW, LANES = 8192, 8

Row = tuple[str, float, str, bool, str]


def claude_turn(url: str, question: str, home: Path) -> dict:
    """One `claude -p` turn against `url`: its JSON result (ttft_ms, usage, ...)."""
    env = {
        **os.environ,
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_AUTH_TOKEN": "bench",
        "ANTHROPIC_MODEL": "SmolLM2-135M-Instruct",
        "ANTHROPIC_SMALL_FAST_MODEL": "SmolLM2-135M-Instruct",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "32",
    }
    done = subprocess.run(
        [str(CLAUDE), *LEAN, question], env=env, cwd=home, capture_output=True, text=True, timeout=900
    )
    result = json.loads(done.stdout)
    if result.get("is_error"):
        raise RuntimeError(f"Claude Code failed against {url}: {result.get('result')}")
    return result


def agent_figures(root: Path, peers: Path | None, quick: bool, threads: int) -> list[Row]:
    """(name, value, target, passed, detail) rows."""
    if not CLAUDE.exists():
        print("agents: Claude Code is not installed (make test installs it into .venv/agents); skipped", flush=True)
        return []
    systems: dict[str, Callable[[str], Server]] = {
        "superfluid": lambda tag: Superfluid(root / f"agents-sf-{tag}", WINDOW, LANES, "--threads", str(threads))
    }
    binary = peers / "fast" / "bin" / "llama-server" if peers else None
    if binary is not None and binary.exists():
        model = embedded_model().path
        systems["llama-server"] = lambda tag: LlamaServer(
            binary, model, root / f"agents-ls-{tag}", LANES, WINDOW, threads, "--jinja"
        )
    else:
        print("agents: llama-server not built (make bench builds it); its column is left out", flush=True)
    first: dict[tuple[str, str], list[float]] = {}
    for turn in range(1 if quick else ROUNDS):
        order = list(systems)[turn % len(systems) :] + list(systems)[: turn % len(systems)]
        for name in order:
            with systems[name](f"{turn}") as server, tempfile.TemporaryDirectory() as home:
                for kind, question in zip(("cold", "warm"), QUESTIONS, strict=True):
                    result = claude_turn(server.url, question, Path(home))
                    first.setdefault((name, kind), []).append(result["ttft_ms"] / 1000)
                    print(f"agents: {name} {kind}: {_line(result)}", flush=True)
    median = {key: float(np.median(values)) for key, values in first.items()}
    sf_cold, sf_warm = median[("superfluid", "cold")], median[("superfluid", "warm")]
    share = sf_warm / sf_cold
    rows: list[Row] = [
        (
            "agents: Claude Code warm/cold first token",
            share,
            "<= 0.2",
            share <= 0.2,
            f"cold {sf_cold:.2f} s, warm {sf_warm:.2f} s",
        )
    ]
    if "llama-server" in systems:
        for kind in ("cold", "warm"):
            ours, theirs = median[("superfluid", kind)], median[("llama-server", kind)]
            detail = f"superfluid {ours:.2f} s, llama-server {theirs:.2f} s"
            rows.append(
                (
                    f"agents: Claude Code {kind} first token sf/llama-server",
                    ours / theirs,
                    "<= 1.0",
                    ours <= theirs,
                    detail,
                )
            )
    return rows


def _line(result: dict) -> str:
    """A turn's first token and how much of its prompt came from the cache."""
    usage = result["usage"]
    read = usage.get("cache_read_input_tokens", 0)
    prompt = usage.get("input_tokens", 0) + read + usage.get("cache_creation_input_tokens", 0)
    return f"first token {result['ttft_ms'] / 1000:.2f} s, {read} of {prompt} prompt tokens read from the cache"
