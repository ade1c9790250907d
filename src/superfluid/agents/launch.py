"""`superfluid launch AGENT [-- ARGS]` and `superfluid stop`.

`launch` finds the daemon that answers at the address it is given, or starts one in the
background (its log under `$SUPERFLUID_HOME/launch/`, its pid in `launch.json` there) and
waits until it serves; checks that the model's window holds what the agent sends; and runs
the agent pointed at it, in the `agent` QoS class, with settings for that run alone. Its exit
status is the agent's. `stop` stops the daemon `launch` started, and no other.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from ..config import home
from .table import AGENTS, Agent, Target

START_TIMEOUT_S = 300.0  # a cold start loads the model; the first one on a machine may build nothing more
STOP_TIMEOUT_S = 30.0


class LaunchError(Exception):
    """Why an agent could not be launched, said so the user can act on it."""


@dataclass(frozen=True)
class Serving:
    """A daemon answering at `url`: the model it serves by default and that model's window."""

    url: str
    model: str
    window: int
    started: bool  # by this launch


def state_dir() -> Path:
    return home() / "launch"


def record_path() -> Path:
    return state_dir() / "launch.json"


def find(url: str, api_key: str | None, model: str | None) -> Serving | None:
    """The daemon at `url`, if one answers; LaunchError when it does but cannot serve `model`."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        reply = httpx.get(f"{url}/v1/models", headers=headers, timeout=5.0)
    except httpx.HTTPError:
        return None
    if reply.status_code == 401:
        raise LaunchError(f"the daemon at {url} wants an API key: pass --api-key or set SUPERFLUID_API_KEY")
    if reply.status_code != 200:
        raise LaunchError(f"{url} answers {reply.status_code} to /v1/models: is it a superfluid daemon?")
    served = reply.json().get("data", [])
    chosen = _model(served, model)
    if chosen is None:
        known = ", ".join(entry["id"] for entry in served)
        raise LaunchError(f"the daemon at {url} does not serve {model!r}; it serves {known}")
    return Serving(url, chosen["id"], int(chosen.get("meta", {}).get("n_ctx") or 0), started=False)


def _model(served: list[dict[str, Any]], wanted: str | None) -> dict[str, Any] | None:
    if wanted is None:
        return next((entry for entry in served if entry.get("default")), served[0] if served else None)
    stem = Path(wanted).name.removesuffix(".gguf")
    return next((entry for entry in served if entry["id"] in (wanted, stem)), None)


def start(address: str, serve_args: list[str], api_key: str | None) -> Serving:
    """Start `superfluid serve` in the background at `address` and wait until it serves."""
    folder = state_dir()
    folder.mkdir(parents=True, exist_ok=True)
    log_path = folder / "daemon.log"
    command = [sys.executable, "-m", "superfluid", "serve", "--no-tui", "--http", address, *serve_args]
    print(f"superfluid: starting a daemon at {address} (log: {log_path})", file=sys.stderr)
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, env=os.environ.copy()
        )
    record_path().write_text(json.dumps({"pid": process.pid, "address": address, "log": str(log_path)}))
    url = f"http://{address}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            record_path().unlink(missing_ok=True)
            raise LaunchError(f"the daemon exited with status {process.returncode}:\n{_tail(log_path)}")
        found = find(url, api_key, None)  # the model it was started with is its default
        if found is not None:
            return Serving(found.url, found.model, found.window, started=True)
        time.sleep(0.25)
    stop_recorded()
    raise LaunchError(f"the daemon did not answer at {url} within {START_TIMEOUT_S:.0f} s:\n{_tail(log_path)}")


def _tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("  " + line for line in text[-lines:])


def stop_recorded() -> str:
    """Stop the daemon `launch` started, if it runs; what was done, in words."""
    try:
        record = json.loads(record_path().read_text())
    except (OSError, ValueError):
        return "no daemon started by `superfluid launch` is running"
    pid = int(record["pid"])
    if not _is_our_daemon(pid):
        record_path().unlink(missing_ok=True)
        return "the daemon `superfluid launch` started is no longer running"
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline and _is_our_daemon(pid):
        time.sleep(0.1)
    if _is_our_daemon(pid):
        os.kill(pid, signal.SIGKILL)
    record_path().unlink(missing_ok=True)
    return f"stopped the daemon at {record['address']} (pid {pid})"


def _is_our_daemon(pid: int) -> bool:
    """Whether `pid` is alive and is `superfluid serve` (a pid reused by another program is left alone)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    zombie = stat.rpartition(")")[2].split()[0] == "Z"
    return not zombie and b"superfluid" in b" ".join(command) and b"serve" in command


def check_window(agent: Agent, daemon: Serving, args: list[str]) -> None:
    """LaunchError when the model's window is smaller than what the agent sends."""
    lean = any(flag in arg for arg in args for flag in agent.lean_flags)
    need = agent.lean_context if lean else agent.context
    if not need or daemon.window >= need:
        return
    window = _round_up(need)
    if daemon.started:
        how = [f"serve the model with a larger window: superfluid launch {agent.name} --max-context {window}"]
    else:
        how = [f"restart the daemon at {daemon.url} with --max-context {window} or more"]
    if agent.lean_hint and not lean:
        how.append(
            f"shorten the agent's prompt with its own flags: superfluid launch {agent.name} -- {agent.lean_hint}"
        )
    raise LaunchError(
        f"{agent.title} sends about {need:,} tokens on its first request, but {daemon.model}'s window here is "
        f"{daemon.window:,} tokens. Either\n" + "\n".join(f"  - {line}" for line in how)
    )


def _round_up(tokens: int) -> int:
    """The next power of two, as windows usually are."""
    size = 1024
    while size < tokens:
        size *= 2
    return size


def launch(
    name: str,
    agent_args: list[str],
    address: str,
    api_key: str | None,
    model: str | None,
    serve_args: list[str],
) -> int:
    """Run agent `name` against the daemon at `address` (started if none answers); its exit status."""
    agent = AGENTS.get(name)
    if agent is None:
        raise LaunchError(f"no agent {name!r}; known agents: {', '.join(AGENTS)}")
    executable = shutil.which(agent.command)
    if executable is None:
        raise LaunchError(
            f"{agent.title} is not installed ({agent.command!r} is not on PATH); install it: {agent.install}"
        )
    url = f"http://{address}"
    daemon = find(url, api_key, model)
    if daemon is None:
        daemon = start(address, serve_args, api_key)
    elif serve_args:
        print(
            f"superfluid: using the daemon already at {url}; {' '.join(serve_args)} is for a daemon launch starts",
            file=sys.stderr,
        )
    try:
        check_window(agent, daemon, agent_args)
    except LaunchError:
        if daemon.started:
            stop_recorded()
        raise
    target = Target(daemon.url, daemon.model, daemon.window, api_key or "superfluid", home() / "agents" / agent.name)
    setup = agent.setup(target)
    print(f"superfluid: {agent.title} on {daemon.model} at {daemon.url} ({agent.api})", file=sys.stderr)
    environment = {**os.environ, **setup.env}
    try:
        return subprocess.call([executable, *setup.args, *agent_args], env=environment)
    except KeyboardInterrupt:
        return 130
