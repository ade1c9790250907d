"""`superfluid run MODEL [PROMPT]`: one answer, streamed to stdout, for scripts and pipes.

The prompt is the words after MODEL, with standard input before them when it is not a
terminal (`git diff | superfluid run smollm2 "review this"`), as `ollama run` reads it. The
reply goes to stdout as it streams, reasoning to stderr. It talks to the daemon at `--http`,
starting one in the background when none answers (as `superfluid launch` does; `superfluid
stop` stops it), and loads MODEL there when that daemon does not serve it yet.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import IO, Any

import httpx

from ..agents.launch import LaunchError, find, start
from ..model.resolve import is_hub_id

LOAD_TIMEOUT_S = 600.0  # a model loaded on demand may be large


def compose(prompt: list[str], stdin: IO[str]) -> str:
    """The user's message: piped input first, then the words on the command line."""
    words = " ".join(prompt).strip()
    piped = "" if stdin.isatty() else stdin.read().strip()
    return "\n\n".join(part for part in (piped, words) if part)


def answer_once(
    model: str,
    message: str,
    address: str,
    api_key: str | None,
    system: str | None,
    options: dict[str, Any],
    out: IO[str],
    err: IO[str],
) -> int:
    """Stream one chat reply from the daemon at `address` (started if none answers); an exit status."""
    if not message:
        print("superfluid run: no prompt: give one after MODEL, or pipe it in", file=err)
        return 2
    url = f"http://{address}"
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        if find(url, api_key, None) is None:
            # a file or a hub id is served from the start; a name (`smollm2`) is one the daemon knows
            named = Path(model).expanduser().exists() or is_hub_id(model)
            start(address, ["--model", model] if named else [], api_key)
        name = _load(url, headers, model)
    except LaunchError as e:
        print(f"superfluid run: {e}", file=err)
        return 1
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": message}]
    body = {"model": name, "messages": messages, "stream": True, **options}
    ended = "\n"
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=None) as reply:
        if reply.status_code != 200:
            print(f"superfluid run: {_error(reply.read())}", file=err)
            return 1
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                print(f"\nsuperfluid run: {chunk['error'].get('message', chunk['error'])}", file=err)
                return 1
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta", {})
                if delta.get("reasoning_content"):
                    err.write(delta["reasoning_content"])
                    err.flush()
                if delta.get("content"):
                    out.write(delta["content"])
                    out.flush()
                    ended = "" if delta["content"].endswith("\n") else "\n"
    out.write(ended)
    return 0


def _load(url: str, headers: dict[str, str], model: str) -> str:
    """The id the daemon serves `model` under (a name it knows, a path or a Hugging Face id),
    loading it there first when it is not loaded."""
    reply = httpx.post(f"{url}/v1/models/load", json={"id": model}, headers=headers, timeout=LOAD_TIMEOUT_S)
    if reply.status_code != 200:
        raise LaunchError(f"the daemon at {url} cannot serve {model}: {_error(reply.content)}")
    return str(reply.json()["id"])


def _error(body: bytes) -> str:
    """The message of an OpenAI-shaped error body, or the body itself."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:500]


def main_run(args: Any) -> int:
    options: dict[str, Any] = {}
    if args.max_tokens is not None:
        options["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        options["temperature"] = args.temperature
    if args.seed is not None:
        options["seed"] = args.seed
    message = compose(args.prompt, sys.stdin)
    return answer_once(args.model, message, args.http, args.api_key, args.system, options, sys.stdout, sys.stderr)
