"""What the HTTP fill-in-the-middle routes share: the model a FIM request runs on, its prompt
and its scheduling class.

OpenAI `/v1/completions` with `suffix`, llama.cpp's `/infill` and Ollama `/api/generate`
with `suffix` build their prompt with `fim.fim_prompt`, the function the socket's `Complete`
uses, so the same prefix and suffix make the same token ids on every route (llama.cpp's
`input_extra` files go before them, `fim.repo_context`). The prompt runs as a `ChatRequest`
of `prompt_tokens`, so it streams, stops and is logged like any completion. A request that
names no model runs on `--fim-model`'s, else the default. Completion requests (these, and
`/v1/completions` generally) default to the completion scheduling class.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from starlette.requests import Request

from ..core.daemon import Daemon
from ..core.fim import FimError, fim_prompt, repo_context
from ..core.runtime import Runtime
from ..protocol.schema import QOS_COMPLETION
from .chat import ChatError
from .chat_http import HttpPolicy, runtime_for, scheduling


def completion_scheduling(request: Request, policy: HttpPolicy) -> tuple[int, bool]:
    """`scheduling`, with the completion class where the request names none in its header (a
    `--key-policy` key still brings its own class; with `--no-http-qos-header` every request
    keeps `--http-default-qos`)."""
    if policy.qos_header:
        policy = dataclasses.replace(policy, default_qos=QOS_COMPLETION)
    return scheduling(request, policy)


async def fim_runtime_for(daemon: Daemon, name: str | None) -> Runtime:
    """The model a FIM request runs on: the one it names, else `--fim-model`'s, else the default;
    ChatError 404 for a name not served here."""
    return await runtime_for(daemon, name or daemon.models.config.fim_model)


def fim_tokens(
    runtime: Runtime,
    prefix: str,
    suffix: str,
    chunks: Sequence[tuple[str, str]] = (),
    reserve: int = 0,
    param: str | None = None,
) -> list[int]:
    """The FIM prompt (prefix-suffix-middle) of a request, after the repository context of `chunks`
    (`(filename, text)`), whose oldest tokens are dropped so that the prompt leaves `reserve` tokens
    of the window for the reply; ChatError 400 naming the FIM markers a model lacks."""
    try:
        core = fim_prompt(runtime.model, prefix, suffix)
        context = repo_context(runtime.model, chunks)
    except FimError as e:
        raise ChatError(f"{e}; model {runtime.id} cannot fill in the middle", param=param) from None
    room = max(runtime.window - len(core) - reserve, 0)
    return [*context[len(context) - min(room, len(context)) :], *core]
