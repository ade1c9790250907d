"""`superfluid serve`: load the model, open the sessions, serve until told to stop."""

from __future__ import annotations

import asyncio
import gc
import importlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..config import ServeConfig
from ..core.daemon import Daemon
from ..core.runtime import Models
from ..engine.devices import describe
from ..engine.heap import map_large_blocks
from ..logsetup import LogPane
from ..metrics import Metrics
from ..store.leases import LeaseTiming, daemon_id
from ..store.postgres import PostgresLog, open_log, redacted
from ..store.sessions import SessionStore
from ..telemetry.otlp import OtlpSettings, Telemetry
from ..transports.addresses import reachable
from ..transports.socket import SocketServer

if TYPE_CHECKING:
    from ..transports.http import ApiServer

log = logging.getLogger("superfluid")

IDLE_CHECK_S = 5.0


# the HTTP listeners' modules (FastAPI, pydantic, uvicorn: about 0.4 s to import), and the OpenTelemetry
# SDK's with --otlp-endpoint, load on a thread while the first worker loads its weights. Started before the
# worker is spawned, they shared the GIL with the code that spawns it and made the spawn 0.3 s later: on the
# embedded model, READY came at 1.45 s that way and 1.12 s this way (medians of eight alternating starts)
HTTP_MODULES = ("superfluid.transports.http", "superfluid.transports.web", "superfluid.api.chat_http")


class HttpImports:
    """The HTTP listeners' modules, imported on a thread of their own once `start` is first called."""

    def __init__(self, more: tuple[str, ...] = ()) -> None:
        names = HTTP_MODULES + more
        self.thread = threading.Thread(target=self._load, args=(names,), name="superfluid-imports", daemon=True)

    @staticmethod
    def _load(names: tuple[str, ...]) -> None:
        for name in names:
            importlib.import_module(name)

    def start(self) -> None:
        if self.thread.ident is None:
            self.thread.start()

    def join(self) -> None:
        self.start()
        self.thread.join()


def notify_socket() -> str | None:
    """$NOTIFY_SOCKET, taken out of the environment: the workers, which start later, do not speak
    for the service, and must not inherit it."""
    return os.environ.pop("NOTIFY_SOCKET", None) or None


def notify(address: str | None, state: str) -> None:
    """Tell a supervisor what the daemon does (`READY=1` once every listener is up, `STOPPING=1`)
    by systemd's notify protocol: one datagram to `address`, an abstract socket when it starts
    with @. A unit of Type=notify starts what needs the daemon only once it serves; the tests wait
    for it the same way, whatever the version in the heading. A supervisor gone is logged, not fatal."""
    if not address:
        return
    target = "\0" + address[1:] if address.startswith("@") else address
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(1.0)
            sock.sendto(state.encode(), target)
    except OSError as e:
        log.warning("could not tell $NOTIFY_SOCKET %s %s: %s", address, state, e)


async def serve(config: ServeConfig, pane: LogPane | None = None) -> int:
    supervisor = notify_socket()
    # checked before anything loads: a bad $OTEL_EXPORTER_OTLP_PROTOCOL stops the start here
    otlp = OtlpSettings.resolve(config.otlp_endpoint, config.otlp_protocol, config.otlp_service_name)
    # The scheduler thread must get the GIL back quickly between two decodes; the default
    # 5 ms hand-over would let a busy transport thread stall the whole batch.
    sys.setswitchinterval(0.0005)
    map_large_blocks()  # a KV state the host tier lets go of goes back to the system
    imports = HttpImports(otlp.modules if otlp is not None else ())
    models = Models(config)
    models.on_spawn = imports.start  # or, without a worker process, when they are needed
    refs: list[str | None] = [*config.models] or [None]  # None: the embedded model
    for ref in refs:
        models.add(ref)
    timing = LeaseTiming(config.lease_renew, config.lease_expiry)
    # who holds a lease, until --web says where clients reach it: this machine's socket, which a
    # restart of this daemon shares, so that it takes its own sessions back at once
    address = config.advertise or f"unix:{socket.gethostname()}:{config.socket}"
    shared = open_log(config.store, address, timing, daemon_id(config.sessions)) if config.store else None
    store = SessionStore(config.sessions, shared)
    metrics = Metrics()
    daemon = Daemon(store, models, metrics=metrics)
    try:
        for model_id in list(models.known):  # every model named at start is loaded at start
            models.runtime(model_id)
    except BaseException:
        daemon.stop()
        store.close()
        raise
    imports.join()
    telemetry = Telemetry.start(otlp, metrics) if otlp is not None else None
    tracing = telemetry.tracing if telemetry is not None else None
    from ..api.chat_http import HttpPolicy
    from ..transports.forward import Forwarder
    from ..transports.http import ApiServer
    from ..transports.web import WebServer, mint_token

    default = daemon.runtime
    known = daemon.start()
    web_server = None
    token_path = config.sessions / "web-token"
    # daemons sharing a store share one token, so that a client sent to another one is let in
    shared_token = store.log.shared_token() if isinstance(store.log, PostgresLog) else None
    web_token = mint_token(token_path, shared_token)  # for --web, and the UI on a loopback --http
    # a request for a session another daemon serves is sent on to it
    forwarder = (
        Forwarder(daemon_id(config.sessions), web_token) if store.leases is not None and config.forward else None
    )
    if config.web:  # before the socket: a session leased from here on names this daemon's address
        web_server = WebServer(
            daemon, config.web, web_token, config.web_origins, shared_token is not None, forwarder, tracing
        )
        url = await web_server.start()
        if store.leases is not None and not config.advertise:
            store.leases.address = reachable(url)
    socket_server = SocketServer(daemon, config.socket, forwarder, tracing)
    await socket_server.start()
    api_server = None
    if not config.no_http:
        policy = HttpPolicy(
            config.http_default_qos,
            config.http_qos_header,
            config.http_allow_batch_invariant,
            config.nonstream_keepalive,
            config.shed_when_busy,
        )
        api_server = ApiServer(
            daemon,
            config.http,
            policy,
            config.api_key,
            config.keys,
            config.rate_limit,
            config.cors_origins,
            web_token,
            forwarder,
            tracing,
        )
        api_url = await api_server.start()
        if store.leases is not None:  # where the other daemons forward HTTP requests for this one's sessions
            store.leases.api = reachable(api_url)
            if web_server is None and api_server.web is not None and not config.advertise:
                store.leases.address = reachable(api_url)  # the session API is on this port too
    # every listener is up before the first line: whoever waits for it can connect at once
    heading = (
        f"superfluid {__version__}: serving {default.id} ({default.model.path}) on {default.kernels} kernels"
        f" with {config.max_batch} lanes"
        f" of {default.window} tokens; sessions {config.sessions} ({known} in the log); socket {config.socket}"
    )
    lines = [heading]
    on_gpu = describe(default.engine.device_report())
    if on_gpu is not None:  # a CPU build's heading says all there is
        lines.append(f"gpu: {on_gpu}")
    lines += [
        f"also serving {other.id} ({other.model.path}) on {other.kernels} kernels" for other in models.loaded()[1:]
    ]
    if web_server is not None:
        lines.append(f"web: {web_server.page_url(url)} (the token is also in {token_path})")
    if store.leases is not None:
        lines.append(
            f"store: {redacted(config.store or '')}, shared with other daemons; the sessions this one serves are "
            f"leased to it as {store.leases.address}, renewed every "
            f"{config.lease_renew:g} s, expiring {config.lease_expiry:g} s after"
        )
    if api_server is not None:
        lines.append(f"http: {api_url} (OpenAI /v1, Anthropic /v1/messages, Ollama /api)")
        page = api_server.page_url(api_url)
        if page is not None:
            lines.append(f"browser UI: {page}")
    _settle_heap()
    print("\n".join(lines), flush=True)
    notify(supervisor, "READY=1")
    if api_server is not None and not api_server.gate.keyed:
        if api_server.loopback:
            log.info("the HTTP API takes no key; it listens on this machine only")
        else:
            log.warning("the HTTP API listens on %s beyond this machine, with no credential", config.http)
    stop, drain = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, drain.set)
    idle = asyncio.create_task(_unload_idle(models, config.idle_timeout)) if config.idle_timeout else None
    monitor = _start_monitor(daemon, "\n".join(lines), pane, stop) if config.tui else None  # the same lines
    try:
        await _first(stop.wait(), drain.wait())
        if drain.is_set() and not stop.is_set():
            await _first(stop.wait(), _drain(daemon, api_server, config.drain_timeout))
    finally:
        if idle is not None:
            idle.cancel()
        if monitor is not None:
            await _stop_monitor(*monitor, pane)
        log.info("stopping")
        notify(supervisor, "STOPPING=1")
        daemon.bus.close()
        await asyncio.sleep(0.1)  # subscribers' tasks deliver their SubEnded before the sockets close
        if web_server is not None:
            await web_server.stop()
        if api_server is not None:
            await api_server.stop()
        await socket_server.stop()
        if forwarder is not None:
            await forwarder.close()
        daemon.stop()
        if telemetry is not None:  # after the daemon: the generations it ended have their lines and spans
            telemetry.stop()
        store.close()
    return 0


def _settle_heap() -> None:
    """Leave what start-up built (modules, the app, the models' vocabularies, the sessions read from the
    log) out of the garbage collector's full collections: it lives as long as the daemon, and scanning
    it held every thread, and so every stream: two streams of the embedded model stalled 36 and 40 ms
    in 25 s, and 3 ms once in 40 s with it frozen."""
    gc.collect()
    gc.freeze()


def _start_monitor(
    daemon: Daemon, heading: str, pane: LogPane | None, stop: asyncio.Event
) -> tuple[Any, asyncio.Task[Any]]:
    """The terminal monitor, running in this event loop; the daemon stops when the user quits it."""
    from ..views.monitor import Monitor  # Textual loads only when the monitor is shown

    async def read() -> str:
        return daemon.metrics.exposition()

    app = Monitor(read, heading, pane)
    task = asyncio.create_task(app.run_async())
    task.add_done_callback(lambda _: stop.set())
    return app, task


async def _stop_monitor(app: Any, task: asyncio.Task[Any], pane: LogPane | None) -> None:
    """Close the monitor (the terminal is given back) before the daemon's own stop; from then on
    the log goes to stderr again, and a monitor that failed says why."""
    if not task.done():
        app.exit()
    failure: BaseException | None = None
    try:
        await asyncio.wait_for(task, 5)
    except Exception as e:
        failure = e
    if pane is not None:
        pane.detach()
    if failure is not None:
        log.error("the terminal monitor failed: %s", failure, exc_info=failure)


async def _first(*waits: Coroutine[Any, Any, Any]) -> None:
    """Wait until one of `waits` is done; cancel the others."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


async def _drain(daemon: Daemon, api_server: ApiServer | None, timeout_s: float) -> None:
    """Refuse new HTTP requests and wait, up to `timeout_s`, for those running and every
    generation in flight to end (SIGUSR1)."""
    if api_server is not None:
        api_server.gate.draining = True
        api_server.gate.drain_retry_s = timeout_s

    def busy() -> str:
        """What still runs, in words; empty when nothing does. An HTTP chat is a request and a generation
        both: each is counted apart, never summed."""
        requests = api_server.gate.in_flight if api_server is not None else 0
        generations = len(daemon.running)
        return f"{generations} generations and {requests} HTTP requests" if generations or requests else ""

    log.info("draining: new HTTP requests get 503; waiting up to %.0f s for %s", timeout_s, busy() or "nothing")
    deadline = time.monotonic() + timeout_s
    while busy() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if busy():
        log.warning("drain timed out with %s still running; stopping them", busy())
    else:
        log.info("drained: nothing is running")


async def _unload_idle(models: Models, idle_s: float) -> None:
    """Unload the models (never the default) that served nothing for `idle_s` seconds."""
    while True:
        await asyncio.sleep(min(IDLE_CHECK_S, idle_s))
        await asyncio.to_thread(models.unload_idle, idle_s)


def run(config: ServeConfig, pane: LogPane | None = None) -> int:
    try:
        return asyncio.run(serve(config, pane))
    except KeyboardInterrupt:
        return 0
    except Exception as e:  # start-up failures: say what and exit 1
        if pane is not None and pane in logging.getLogger().handlers:
            pane.detach()  # no monitor will draw what was logged before the failure
        if log.isEnabledFor(logging.DEBUG):
            log.exception("serve failed")
        print(f"superfluid: {e}", file=sys.stderr)
        return 1
