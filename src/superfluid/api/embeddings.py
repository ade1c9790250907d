"""Embeddings: OpenAI's POST /v1/embeddings and Ollama's POST /api/embed.

An input's embedding is the served model run over its tokens and pooled by llama.cpp: the
model's own pooling, mean pooling for a chat model that names none. Text is tokenized as
llama.cpp's embedding tools do (the BOS/EOS the vocabulary adds, marker text as its token);
OpenAI inputs may also be token ids. OpenAI gets the vectors as they come, not normalized
(`encoding_format` "base64" is their little-endian float32 bytes); Ollama, as Ollama does,
gets them scaled to length 1. They are computed by the model's engine (its worker) on a
context of their own, one input per call and off the event loop, so generations keep
stepping between inputs and their KV is never touched.
"""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import APIRouter
from starlette.responses import JSONResponse, Response

from ..core.daemon import Daemon
from ..core.runtime import Runtime
from ..engine.interface import EngineError
from ..engine.llama import embedding_limit
from . import ollama
from .chat import ChatError
from .chat_http import runtime_for
from .openai import Body, error

Inputs = str | list[str] | list[int] | list[list[int]]
FORMATS = ("float", "base64")


class EmbeddingsBody(Body):
    """The body of POST /v1/embeddings."""

    model: str | None = None
    input: Inputs
    encoding_format: str = "float"
    dimensions: int | None = None


class EmbedBody(Body):
    """The body of Ollama's POST /api/embed."""

    model: str | None = None
    input: str | list[str] = ""
    truncate: bool = True
    dimensions: int | None = None


class InputError(ChatError):
    """An input that cannot be embedded (the request's `input` field is at fault)."""


@dataclass
class Embedded:
    """A request's embeddings, in input order, and what they cost."""

    runtime: Runtime
    vectors: list[np.ndarray]
    tokens: int
    load_seconds: float


def token_lists(runtime: Runtime, given: Inputs, *, truncate: bool = False) -> list[list[int]]:
    """Each input's token ids; InputError for an empty one, an id outside the vocabulary, or one longer than
    an embedding takes (cut to that instead with `truncate`)."""
    single = isinstance(given, str) or (bool(given) and isinstance(given[0], int))
    inputs: list[Any] = [given] if single else list(given)
    if not inputs:
        raise InputError("input is an empty list: give a string, a list of strings, or lists of token ids")
    model, limit = runtime.model, embedding_limit(runtime.model, runtime.window)
    out = []
    for i, item in enumerate(inputs):
        if not item:
            raise InputError(f"input {i} is empty: each input needs at least one character or token id")
        tokens = model.tokenize(item, True, add_special=True) if isinstance(item, str) else list(item)
        outside = [t for t in tokens if not 0 <= t < model.n_vocab]
        if outside:
            raise InputError(f"input {i} has token id {outside[0]}, outside the vocabulary (0..{model.n_vocab - 1})")
        if len(tokens) > limit:
            if not truncate:
                raise InputError(
                    f"input {i} has {len(tokens)} tokens, over the {limit} an embedding input may have with this "
                    f"model (its maximum context length is {runtime.window} tokens); shorten it or split it",
                    code="context_length_exceeded",
                )
            tokens = tokens[:limit]
        out.append(tokens)
    return out


async def embed(daemon: Daemon, model: str | None, given: Inputs, *, truncate: bool = False) -> Embedded:
    """The embeddings of a request's inputs; ChatError when the model or an input will not do."""
    started = time.monotonic()
    runtime = await runtime_for(daemon, model)
    loaded = time.monotonic() - started
    inputs = token_lists(runtime, given, truncate=truncate)
    try:
        # one call per input: the engine's channel is free for the scheduler's steps in between
        vectors = [await asyncio.to_thread(runtime.engine.embed, tokens) for tokens in inputs]
    except EngineError as e:
        raise ChatError(f"embedding failed: {e}", 500, "server_error") from None
    return Embedded(runtime, vectors, sum(len(tokens) for tokens in inputs), loaded)


def _encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def _unit(vector: np.ndarray) -> np.ndarray:
    norm = float(np.linalg.norm(vector))
    return vector / norm if norm > 0 else vector


def router(daemon: Daemon) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/embeddings")
    async def embeddings(body: EmbeddingsBody) -> Response:
        if body.dimensions is not None:
            return error(
                "dimensions is not supported: embeddings come at the model's own width (n_embd in GET /props)",
                code="unsupported_parameter",
                param="dimensions",
            )
        if body.encoding_format not in FORMATS:
            return error(
                f"encoding_format {body.encoding_format!r} is not one of {', '.join(FORMATS)}",
                param="encoding_format",
            )
        try:
            done = await embed(daemon, body.model, body.input)
        except ChatError as e:
            return error(str(e), e.status, e.code, "input" if isinstance(e, InputError) else None)
        data = [
            {"object": "embedding", "index": i, "embedding": _encoded(vector, body.encoding_format)}
            for i, vector in enumerate(done.vectors)
        ]
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "model": body.model or done.runtime.id,
                "usage": {"prompt_tokens": done.tokens, "total_tokens": done.tokens},
            }
        )

    @api.post("/api/embed")
    async def ollama_embed(body: EmbedBody) -> Response:
        started = time.monotonic()
        try:
            if not body.input:  # as in Ollama: nothing to embed loads the model
                await runtime_for(daemon, body.model)
                return JSONResponse({"model": body.model, "embeddings": []})
            done = await embed(daemon, body.model, body.input, truncate=body.truncate)
        except ChatError as e:
            return ollama.error(str(e), e.status)
        vectors = done.vectors
        if body.dimensions is not None:
            width = len(vectors[0])
            if not 0 < body.dimensions <= width:
                return ollama.error(f"dimensions must be 1 to {width}, this model's embedding width")
            vectors = [vector[: body.dimensions] for vector in vectors]
        return JSONResponse(
            {
                "model": body.model or done.runtime.id,
                "embeddings": [_unit(vector).tolist() for vector in vectors],
                "total_duration": int((time.monotonic() - started) * 1e9),
                "load_duration": int(done.load_seconds * 1e9),
                "prompt_eval_count": done.tokens,
            }
        )

    return api
