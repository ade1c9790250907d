"""The models routes: which models this daemon knows, and loading, unloading and forgetting them.

`GET /v1/models` lists every known model with `loaded` and its context window;
`POST /v1/models/load` loads one (a known id, or a path or hub id with `runtime`);
`POST /v1/models/unload` stops its worker and frees its memory (in-flight generations end
with an error; a daemon's only model cannot be unloaded, while any other model named on the
command line or loaded since may be); `DELETE /v1/models/{id}` forgets
it. A request naming an unloaded model loads it again on demand.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from starlette.responses import JSONResponse, Response

from ..config import RUNTIMES
from ..core.daemon import Daemon
from ..core.runtime import ModelError
from .openai import Body, error


class LoadBody(Body):
    """The body of POST /v1/models/load: a known `model` id, or an `id` path or hub reference."""

    model: str | None = None
    id: str | None = None
    runtime: str | None = None


class UnloadBody(Body):
    """The body of POST /v1/models/unload."""

    model: str | None = None
    id: str | None = None


def router(daemon: Daemon) -> APIRouter:
    api = APIRouter()
    models = daemon.models

    def entry(model_id: str) -> dict[str, Any]:
        runtime = models.known[model_id].runtime
        return {
            "id": model_id,
            "object": "model",
            "created": int(models.known[model_id].path.stat().st_mtime),
            "owned_by": "superfluid",
            "loaded": runtime is not None,
            "default": model_id == models.default_id,
            "meta": {"n_ctx": runtime.window if runtime else models.config.max_context or None},
            "runtime": {
                "id": "llamacpp",
                "worker_pid": runtime.worker_pid if runtime else None,
                "kernels": runtime.kernels if runtime else None,
                "attention": ("flash" if runtime.flash_attention else "plain") if runtime else None,
            },
        }

    def known(name: str | None) -> str | Response:
        model_id = models.find(name)
        if model_id is None:
            return error(
                f"model {name!r} is not known here; known models: {', '.join(models.known)}", 404, "model_not_found"
            )
        return model_id

    @api.get("/v1/models")
    async def listing() -> dict[str, Any]:
        return {"object": "list", "data": [entry(model_id) for model_id in list(models.known)]}

    @api.get("/v1/models/{model:path}")
    async def one(model: str) -> Response:
        model_id = known(model)
        return model_id if isinstance(model_id, Response) else JSONResponse(entry(model_id))

    @api.post("/v1/models/load")
    async def load(body: LoadBody) -> Response:
        if body.runtime is not None and body.runtime.lower() not in RUNTIMES:
            return error(
                f"runtime {body.runtime!r} is not built in; this build has llamacpp", 400, "unsupported_runtime"
            )
        started = time.monotonic()
        model_id = models.find(body.model or body.id)
        new = model_id is None
        try:
            if model_id is None:
                model_id = await asyncio.to_thread(models.add, body.id or body.model)
            runtime = await asyncio.to_thread(models.runtime, model_id)
        except ModelError as e:
            if new and model_id is not None:
                models.forget(model_id)  # a model that does not load is not known either
            return error(str(e), e.status, "model_load_failed")
        return JSONResponse({**entry(runtime.id), "load_seconds": round(time.monotonic() - started, 3)})

    async def change(
        name: str | None, action: Callable[[str], None], answer: Callable[[str], dict[str, Any]]
    ) -> Response:
        """Unload or forget the named model off the event loop; its entry, or why not."""
        model_id = known(name)
        if isinstance(model_id, Response):
            return model_id
        try:
            await asyncio.to_thread(action, model_id)
        except ModelError as e:
            return error(str(e), e.status, "invalid_request_error")
        return JSONResponse(answer(model_id))

    @api.post("/v1/models/unload")
    async def unload(body: UnloadBody) -> Response:
        return await change(body.model or body.id, models.unload, entry)

    @api.delete("/v1/models/{model:path}")
    async def forget(model: str) -> Response:
        return await change(model, models.forget, lambda model_id: {"id": model_id, "object": "model", "deleted": True})

    return api
