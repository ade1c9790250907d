"""Status and tokenizer routes of the main listener, in llama-server's shapes.

- `POST /v1/tokenize` (also `/tokenize`): a text's token ids, with no chat scaffold; marker text
  such as `<|im_end|>` is its token, and `add_special` adds the BOS/EOS the vocabulary asks for.
  `POST /v1/detokenize` (also `/detokenize`) turns ids back into text.
- `GET /props`: a model's window, sampling defaults, chat template, devices, KV pool and capabilities.
- `GET /slots`: one aggregate entry, since every lane shares one llama.cpp context: lanes in
  use, KV tokens held, whether a scheduler tick is running, the engine's recent decode and
  prefill rates and the last time to first token. Saving and restoring slots is retired
  (501): the prefix cache keeps and reuses every session's KV by itself.

Each takes an optional `model` (in the body, or `?model=` on the GET routes); none names the default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from starlette.responses import JSONResponse, Response

from .. import __version__
from ..core.daemon import Daemon
from ..core.runtime import Runtime
from ..engine.llama import embedding_limit
from .chat import ChatError
from .chat_http import runtime_for
from .openai import Body, error, sampling


class TokenizeBody(Body):
    """The body of POST /v1/tokenize: the text as `content` (llama-server) or `input`."""

    model: str | None = None
    content: str | None = None
    input: str | None = None
    add_special: bool = False


class DetokenizeBody(Body):
    """The body of POST /v1/detokenize."""

    model: str | None = None
    tokens: list[int]


def capabilities(runtime: Runtime) -> list[str]:
    """What the model serves here."""
    served = ["completion", "chat", "tools", "grammar", "embeddings", "tokenize"]
    return [*served, "fim"] if min(runtime.model.fim.values()) >= 0 else served


def props(runtime: Runtime) -> dict[str, Any]:
    """GET /props for one loaded model."""
    defaults = sampling(runtime.sampling, None, None, None, None, None)
    scheduler = runtime.scheduler
    shape, cache = scheduler.engine.shape, scheduler.tiers.cache
    return {
        "model": runtime.id,
        "model_path": str(runtime.model.path),
        "default_generation_settings": {
            "n_ctx": runtime.window,
            "n_predict": runtime.max_tokens or -1,  # -1: a reply may fill the window
            "temperature": defaults.temperature,
            "top_k": defaults.top_k,
            "top_p": defaults.top_p,
            "min_p": defaults.min_p,
            "repeat_penalty": runtime.sampling.repeat_penalty or 1.0,
            "seed": None,  # unseeded requests draw a fresh seed each
        },
        "max_context": runtime.window,
        "n_embd": runtime.model.n_embd,
        "embedding_max_tokens": embedding_limit(runtime.model, runtime.window),
        "chat_template": runtime.template.source,
        "devices": scheduler.engine.device_report(),  # what llama.cpp sees, and where the layers are
        "kv_cache": {
            "slots": shape.sequences,
            "slot_tokens": shape.window,
            "pool_tokens": shape.pool_tokens,
            "tokens_used": scheduler.kv_tokens(),
            "idle_entries": len(cache),
            "host_cache_bytes": cache.host.bytes,
            "host_cache_budget_bytes": cache.host.budget,
        },
        "capabilities": capabilities(runtime),
        "total_slots": scheduler.max_lanes,
        "build_info": f"superfluid {__version__}",
    }


def slots(runtime: Runtime) -> list[dict[str, Any]]:
    """GET /slots: one entry for the whole context."""
    scheduler = runtime.scheduler
    stats = scheduler.stats
    queued = scheduler.queued()
    ttft = stats.last_ttft_seconds
    return [
        {
            "id": 0,
            "lanes": scheduler.max_lanes,
            "lanes_active": stats.lanes_active,
            "queued": queued,
            "n_ctx": runtime.window,
            "kv_tokens_used": scheduler.kv_tokens(),
            "kv_tokens_total": scheduler.engine.shape.pool_tokens,
            "tick_in_flight": stats.tick_in_flight,
            "decode_tokens_per_second": round(stats.decode_tokens_per_second, 2),
            "prefill_tokens_per_second": round(stats.prefill_tokens_per_second, 2),
            "last_ttft_seconds": None if ttft is None else round(ttft, 4),
            "is_processing": bool(stats.lanes_active or queued),
        }
    ]


def router(daemon: Daemon) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/tokenize")
    @api.post("/tokenize")
    async def tokenize(body: TokenizeBody) -> Response:
        text = body.content if body.content is not None else body.input
        if text is None:
            return error("tokenize needs the text as `content` (or `input`)", param="content")
        try:
            runtime = await runtime_for(daemon, body.model)
        except ChatError as e:
            return error(str(e), e.status, e.code)
        return JSONResponse({"tokens": runtime.model.tokenize(text, True, add_special=body.add_special)})

    @api.post("/v1/detokenize")
    @api.post("/detokenize")
    async def detokenize(body: DetokenizeBody) -> Response:
        try:
            runtime = await runtime_for(daemon, body.model)
        except ChatError as e:
            return error(str(e), e.status, e.code)
        n_vocab = runtime.model.n_vocab
        outside = [t for t in body.tokens if not 0 <= t < n_vocab]
        if outside:
            return error(f"token id {outside[0]} is outside the vocabulary (0..{n_vocab - 1})", param="tokens")
        return JSONResponse({"content": runtime.model.detokenize(body.tokens, special=True)})

    async def describe(model: str | None, view: Callable[[Runtime], Any]) -> Response:
        try:
            return JSONResponse(view(await runtime_for(daemon, model)))
        except ChatError as e:
            return error(str(e), e.status, e.code)

    @api.get("/props")
    async def get_props(model: str | None = None) -> Response:
        return await describe(model, props)

    @api.get("/slots")
    async def get_slots(model: str | None = None) -> Response:
        return await describe(model, slots)

    @api.post("/slots/{slot}")
    @api.post("/slots/{slot}/{action}")
    async def slot_action() -> Response:
        return error(
            "saving and restoring slots is retired: the prefix cache keeps every session's KV and reuses it "
            "by itself (pin a session with the session API to keep it warm)",
            501,
            "route_retired",
        )

    return api
