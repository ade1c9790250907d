"""The agents `superfluid launch` knows: one row each, so adding an agent is adding a row.

A row says how to find the agent, how to install it, which API it speaks, how much context
its first request needs, and how to point one run of it at a daemon: environment variables
and arguments for that run alone, and files under a directory of its own
(`$SUPERFLUID_HOME/agents/NAME`), never the user's own configuration.

The context figures are the first request's prompt, measured on SmolLM2's tokenizer with
the versions `make test` installs (Claude Code 2.1.197, Codex 0.171.0, aider 0.86.2): a
larger tokenizer counts fewer tokens for the same text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

QOS_HEADER = "x-superfluid-qos"
QOS = "agent"  # the class every launched agent's requests run in


@dataclass(frozen=True)
class Target:
    """The daemon an agent is pointed at."""

    url: str  # http://host:port, no trailing slash
    model: str  # the id the daemon serves the model under
    window: int  # the model's context window, in tokens
    api_key: str  # sent as the agent's key; any value where the daemon takes none
    home: Path  # this agent's own directory, for the files a run needs


@dataclass(frozen=True)
class Setup:
    """What one run of an agent is given."""

    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)  # before the user's own


@dataclass(frozen=True)
class Agent:
    """One agent `launch` can run."""

    name: str  # what `superfluid launch NAME` takes
    title: str
    command: str  # the executable looked up on PATH
    install: str  # how to install it
    api: str  # the API it speaks to the daemon
    context: int  # tokens its first request needs as it comes
    setup: Callable[[Target], Setup]
    # the agent's own flags that shorten its prompt, and the context it needs with them
    lean_flags: tuple[str, ...] = ()
    lean_context: int = 0
    lean_hint: str = ""


def _claude(t: Target) -> Setup:
    env = {
        "ANTHROPIC_BASE_URL": t.url,
        "ANTHROPIC_AUTH_TOKEN": t.api_key,
        "ANTHROPIC_CUSTOM_HEADERS": f"{QOS_HEADER}: {QOS}",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    # every model alias Claude Code may pick (the main one, the small fast one for titles) is ours
    for variable in ("MODEL", "SMALL_FAST_MODEL", "DEFAULT_OPUS_MODEL", "DEFAULT_SONNET_MODEL", "DEFAULT_HAIKU_MODEL"):
        env[f"ANTHROPIC_{variable}"] = t.model
    return Setup(env)


def _codex(t: Target) -> Setup:
    provider = {
        "name": "superfluid",
        "base_url": f"{t.url}/v1",
        "wire_api": "responses",
        "env_key": "SUPERFLUID_AGENT_KEY",
        "http_headers": {QOS_HEADER: QOS},
    }
    settings = {
        "model_provider": "superfluid",
        "model": t.model,
        "model_context_window": t.window,
        "model_providers.superfluid": provider,
        "web_search": "disabled",  # a search only OpenAI's servers run
    }
    args = [arg for key, value in settings.items() for arg in ("-c", f"{key}={_toml(value)}")]
    return Setup({"SUPERFLUID_AGENT_KEY": t.api_key}, args)


def _toml(value: object) -> str:
    """A TOML value for Codex's `-c key=value` (inline tables for dicts)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def _opencode(t: Target) -> Setup:
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "superfluid": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "superfluid",
                "options": {"baseURL": f"{t.url}/v1", "apiKey": t.api_key, "headers": {QOS_HEADER: QOS}},
                "models": {t.model: {"name": t.model, "limit": {"context": t.window, "output": t.window // 4}}},
            }
        },
        "model": f"superfluid/{t.model}",
    }
    path = _write(t.home / "opencode.json", json.dumps(config, indent=2))
    return Setup({"OPENCODE_CONFIG": str(path)})


def _aider(t: Target) -> Setup:
    name = f"openai/{t.model}"
    settings = f"- name: {json.dumps(name)}\n  extra_params:\n    extra_headers:\n      {QOS_HEADER}: {QOS}\n"
    metadata = {name: {"max_input_tokens": t.window, "max_output_tokens": t.window // 4, "litellm_provider": "openai"}}
    env = {
        "OPENAI_API_BASE": f"{t.url}/v1",
        "OPENAI_API_KEY": t.api_key,
        "AIDER_MODEL": name,
        "AIDER_MODEL_SETTINGS_FILE": str(_write(t.home / "model-settings.yml", settings)),
        "AIDER_MODEL_METADATA_FILE": str(_write(t.home / "model-metadata.json", json.dumps(metadata))),
        "AIDER_SHOW_MODEL_WARNINGS": "false",
        "AIDER_CHECK_UPDATE": "false",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # litellm would fetch its price list from the network
    }
    return Setup(env)


def _ollama(t: Target) -> Setup:
    return Setup({"OLLAMA_HOST": t.url})


def _llm(t: Target) -> Setup:
    # llm reads OpenAI-compatible models from its own directory: this run's is the agent's own
    models = f"- model_id: superfluid\n  model_name: {json.dumps(t.model)}\n  api_base: {json.dumps(t.url + '/v1')}\n"
    models += f"  api_key_name: superfluid\n  headers:\n    {QOS_HEADER}: {QOS}\n"
    _write(t.home / "extra-openai-models.yaml", models)
    _write(t.home / "keys.json", json.dumps({"superfluid": t.api_key}))
    _write(t.home / "default_model.txt", "superfluid")
    return Setup({"LLM_USER_PATH": str(t.home)})


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


AGENTS = {
    agent.name: agent
    for agent in (
        Agent(
            "claude",
            "Claude Code",
            "claude",
            "npm install -g @anthropic-ai/claude-code",
            "Anthropic /v1/messages",
            23_000,
            _claude,
            lean_flags=("--tools", "--system-prompt", "--bare"),
            lean_context=3_000,
            lean_hint="--tools Read,Bash (the default system prompt, two tools: about 2,800 tokens)",
        ),
        Agent(
            "codex",
            "Codex CLI",
            "codex",
            "npm install -g @openai/codex",
            "OpenAI Responses /v1/responses",
            9_200,
            _codex,
            lean_flags=("model_instructions_file",),
            lean_context=5_200,
            lean_hint="-c model_instructions_file=FILE (your own shorter instructions: about 5,100 tokens with its "
            "tools)",
        ),
        Agent(
            "opencode",
            "opencode",
            "opencode",
            "npm install -g opencode-ai",
            "OpenAI /v1/chat/completions",
            7_800,
            _opencode,
        ),
        Agent("aider", "aider", "aider", "pip install aider-chat", "OpenAI /v1/chat/completions", 2_000, _aider),
        Agent("ollama", "the Ollama CLI", "ollama", "see https://ollama.com/download", "Ollama /api", 0, _ollama),
        Agent("llm", "Simon Willison's llm", "llm", "pip install llm", "OpenAI /v1/chat/completions", 0, _llm),
    )
}
