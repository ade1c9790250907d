"""`superfluid serve`: load the model, open the sessions, serve until told to stop."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from dataclasses import dataclass

from . import __version__
from .config import ServeConfig
from .daemon import Daemon
from .engine.build import exactness_problems
from .engine.llama import ContextShape, LlamaContext, LlamaModel
from .metrics import Metrics
from .model.resolve import resolve_model
from .model.template import CHATML, ChatTemplate
from .scheduler.scheduler import Scheduler
from .store.sessions import SessionStore
from .transports.chat_http import HttpPolicy
from .transports.http import ApiServer
from .transports.socket import SocketServer
from .transports.web import WebServer, mint_token

log = logging.getLogger("superfluid")

# KV slots beyond the lanes: they keep finished prefixes for forks and continuations.
SPARE_SLOTS = 4
BATCH_TOKENS = 512


@dataclass
class Loaded:
    """A model ready to serve: weights, template and the context that runs them."""

    model: LlamaModel
    template: ChatTemplate
    context: LlamaContext
    window: int
    name: str


def load(config: ServeConfig) -> Loaded:
    resolved = resolve_model(config.model, offline=config.offline)
    model = LlamaModel(resolved.path)
    if config.fim_tokens is not None:
        model.set_fim(*config.fim_tokens)
    source = model.chat_template or CHATML
    if model.chat_template is None:
        log.warning("%s carries no chat template; using ChatML", resolved.path.name)
    template = ChatTemplate(
        source,
        model.tokenize,
        bos_text=model.token_text(model.bos) if model.bos >= 0 else "",
        eos_text=model.token_text(model.eos) if model.eos >= 0 else "",
        bos_token=model.bos if model.add_bos and model.bos >= 0 else None,
    )
    trained = model.n_ctx_train or 8192
    window = config.max_context or min(trained, 8192)
    if window > trained:
        log.warning("--max-context %d is beyond the %d tokens %s was trained on", window, trained, resolved.name)
    shape = ContextShape(
        window=window,
        sequences=min(config.max_batch + SPARE_SLOTS, 256),
        batch=BATCH_TOKENS,
        threads=config.threads,
    )
    context = LlamaContext(model, shape)
    problems = exactness_problems()
    if problems:
        log.warning(
            "this llama.cpp build lets the batch change a token's logits (%s): cut, resumed and forked greedy "
            "runs may differ from uncut ones; `make clean serve` rebuilds it as the Makefile configures it",
            "; ".join(problems),
        )
    return Loaded(model, template, context, window, resolved.name)


async def serve(config: ServeConfig) -> int:
    # The scheduler thread must get the GIL back quickly between two decodes; the default
    # 5 ms hand-over would let a busy transport thread stall the whole batch.
    sys.setswitchinterval(0.0005)
    loaded = load(config)
    store = SessionStore(config.sessions)
    scheduler = Scheduler(
        loaded.context,
        lanes=config.max_batch,
        window=loaded.window,
        tick_ms=config.tick_ms,
        host_cache_bytes=config.host_cache_mb << 20,
    )
    daemon = Daemon(store, loaded.model, loaded.template, scheduler, window=loaded.window, metrics=Metrics())
    bumped = daemon.start()
    socket_server = SocketServer(daemon, config.socket)
    await socket_server.start()
    web_server = None
    if config.web:
        token_path = config.sessions / "web-token"
        web_server = WebServer(daemon, config.web, mint_token(token_path), config.web_origins)
        url = await web_server.start()
    api_server = None
    if not config.no_http:
        policy = HttpPolicy(config.http_default_qos, config.http_qos_header, config.http_allow_batch_invariant)
        api_server = ApiServer(daemon, config.http, loaded.name, policy)
        api_url = await api_server.start()
    # every listener is up before the first line: whoever waits for it can connect at once
    print(
        f"superfluid {__version__}: serving {loaded.name} ({loaded.model.path}) with {config.max_batch} lanes"
        f" of {loaded.window} tokens; sessions {config.sessions} ({bumped} resumed); socket {config.socket}",
        flush=True,
    )
    if web_server is not None:
        print(f"web: {url}/web/ (token in {token_path})", flush=True)
    if api_server is not None:
        print(f"http: {api_url} (OpenAI /v1, Anthropic /v1/messages, Ollama /api)", flush=True)
        if not api_server.loopback:
            log.warning("the HTTP API listens on %s beyond this machine, with no credential", config.http)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("stopping")
        daemon.bus.close()
        await asyncio.sleep(0.1)  # subscribers' tasks deliver their SubEnded before the sockets close
        if web_server is not None:
            await web_server.stop()
        if api_server is not None:
            await api_server.stop()
        await socket_server.stop()
        daemon.stop()
        store.close()
    return 0


def run(config: ServeConfig) -> int:
    try:
        return asyncio.run(serve(config))
    except KeyboardInterrupt:
        return 0
    except Exception as e:  # start-up failures: say what and exit 1
        if log.isEnabledFor(logging.DEBUG):
            log.exception("serve failed")
        print(f"superfluid: {e}", file=sys.stderr)
        return 1
