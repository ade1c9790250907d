"""The OpenAI chat-completion extras agents send, checked and turned into what a `ChatRequest` carries.

- `n` (1-128) choices, each its own generation; with a seed, choice i samples with seed + i,
  so choices differ under sampling and each equals a one-choice request with that seed.
- `logprobs` / `top_logprobs` (0-20), `logit_bias`, `presence_penalty`, `frequency_penalty`
  and llama.cpp's `repeat_penalty` (alias `repetition_penalty`) become the job's `Shaping`.
- `chat_template_kwargs`, and the top-level `enable_thinking` and `reasoning_effort` that the
  kwargs override, become the chat template's variables.
- `stream_options.include_usage` sends a stream's usage in a last chunk of its own with no
  choices; without it the usage rides on the chunk that carries the finish reason.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from pydantic import BaseModel, ConfigDict

from ..config import SamplingDefaults
from ..engine.sampling import MASK64
from ..engine.shaping import MAX_TOP_LOGPROBS, Shaping
from ..protocol.schema import GenParams
from .chat import ChatError, ChatRequest
from .logprobs import TokenLogprob

MAX_CHOICES = 128


class ShapedBody(BaseModel):
    """The fields that shape sampling: bias and penalties (both OpenAI endpoints)."""

    model_config = ConfigDict(extra="allow")

    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_penalty: float | None = None
    repetition_penalty: float | None = None

    def shaping(self, defaults: SamplingDefaults, logprobs: int = -1) -> Shaping:
        """The request's `Shaping`, its repeat penalty else the model's default (`--repeat-penalty`
        or the GGUF's); ChatError naming the field that is out of range."""
        bias = []
        for key, value in (self.logit_bias or {}).items():
            if not key.strip().isdigit():
                raise ChatError(f"logit_bias keys are token ids, not {key!r}", param="logit_bias")
            if not (math.isfinite(value) and -100.0 <= value <= 100.0):
                raise ChatError(f"logit_bias values run from -100 to 100, not {value}", param="logit_bias")
            bias.append((int(key), float(value)))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ChatError(f"{name} must be a finite number, not {value}", param=name)
        repeat = next(
            (r for r in (self.repeat_penalty, self.repetition_penalty, defaults.repeat_penalty) if r is not None), None
        )
        if repeat is not None and not (math.isfinite(repeat) and repeat > 0):
            raise ChatError(f"repeat_penalty must be a number above 0 (1 is off), not {repeat}", param="repeat_penalty")
        return Shaping(
            tuple(sorted(bias)),
            self.presence_penalty or 0.0,
            self.frequency_penalty or 0.0,
            1.0 if repeat is None else repeat,
            logprobs,
        )


class ChatExtras(ShapedBody):
    """The extras of POST /v1/chat/completions beyond sampling, tools and formats."""

    n: int = 1
    logprobs: bool | None = None
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None
    reasoning_effort: str | None = None
    stream_options: dict[str, Any] | None = None

    def choices(self, stream: bool) -> int:
        """How many choices to generate; ChatError for a count out of range or several on a stream."""
        if not 1 <= self.n <= MAX_CHOICES:
            raise ChatError(f"n must be from 1 to {MAX_CHOICES}, not {self.n}", param="n")
        if stream and self.n != 1:
            raise ChatError(
                "a streamed reply has one choice: send n=1, or stream=false for several",
                code="unsupported_parameter",
                param="n",
            )
        return self.n

    def logprob_count(self) -> int:
        """-1 for no log probabilities, else how many alternatives each token lists."""
        top = self.top_logprobs
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ChatError(f"top_logprobs must be from 0 to {MAX_TOP_LOGPROBS}, not {top}", param="top_logprobs")
        if top and not self.logprobs:
            raise ChatError("top_logprobs needs logprobs: true", param="top_logprobs")
        return (top or 0) if self.logprobs else -1

    def template_vars(self) -> dict[str, Any]:
        """The chat template's variables: chat_template_kwargs over the top-level switches (an effort the
        template does not know is snapped to its nearest: `ChatTemplate.request_variables`)."""
        variables: dict[str, Any] = {}
        if self.enable_thinking is not None:
            variables["enable_thinking"] = self.enable_thinking
        if self.reasoning_effort is not None:
            variables["reasoning_effort"] = self.reasoning_effort
        return {**variables, **(self.chat_template_kwargs or {})}


def choice_requests(request: ChatRequest, n: int) -> list[ChatRequest]:
    """One request per choice: choice i draws with the request's seed + i."""
    p = request.params
    return [
        dataclasses.replace(request, params=GenParams(p.temperature, p.top_p, p.min_p, p.top_k, (p.seed + i) & MASK64))
        for i in range(n)
    ]


def logprobs_json(entries: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> dict[str, Any]:
    """A choice's (or a chunk's) `logprobs` object."""
    return {"content": [entry.openai() for entry in entries], "refusal": None}
