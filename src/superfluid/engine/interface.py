"""The engine as the scheduler drives it: the `Engine` protocol, the `Step` it runs, and its errors.

A `Step` is one llama_decode: token ids, positions and sequence ids, and for each lane
whose last token it carries, a `Draw` saying how to pick the next token (sampling
parameters, the stream position its random draw is keyed by, whether end-of-generation is
banned, the handles of its grammar, its `Shaping` and its drafter, and how many decodes and
tokens it may take: a lane whose run is longer than one decodes its drawn token at once, in
a batch of the lanes still running, and draws again, so a few tokens cost one call; the
step's `on_decode` sees the tokens drawn so far after each decode but the last, so a reader
is shown each token as it is drawn, not at the end of its run).

Two engines implement it: `LocalEngine` (`local.py`) runs llama.cpp in this process, and
`WorkerEngine` (`worker_client.py`) drives a worker process over its channel, so the
scheduler never knows which one it drives. The fake engine of `tests/test_scheduler.py`
implements it too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypedDict

import numpy as np

from ..protocol.schema import GenParams
from .drafting import Arm
from .interrupt import Interrupt
from .shaping import LogprobRow, Shaping


class EngineError(RuntimeError):
    """llama.cpp refused an operation."""


class KVFull(EngineError):
    """The KV pool has no room for the batch."""


@dataclass(frozen=True)
class ContextShape:
    """How a context is sized: tokens per sequence slot, slots, batch size, threads."""

    window: int
    sequences: int
    batch: int
    threads: int
    flash_attention: bool = False  # on where build.flash_attention_on says

    @property
    def pool_tokens(self) -> int:
        return self.window * self.sequences


class DeviceFigures(TypedDict):
    """One device llama.cpp sees (`devices.Device`): its memory in bytes."""

    name: str
    description: str
    kind: str
    free: int
    total: int
    used: int


class DeviceReport(TypedDict):
    """What llama.cpp sees and where a model's layers are: every device, the GPUs its layers are on (none: all in
    host memory), and how many of its layers, the output layer counted, are there."""

    devices: list[DeviceFigures]
    gpus: list[str]
    gpu_layers: int
    layers: int


class StepInterrupted(EngineError):
    """The step stopped early because its engine's `interrupt` was set: nothing of it is in the KV."""


class WorkerGone(EngineError):
    """The process that ran the engine died; the text says how (its exit status or signal)."""


@dataclass(frozen=True)
class Draw:
    """How to pick one lane's next tokens."""

    params: GenParams
    position: int  # the stream position of the token drawn: its random draw is keyed by it
    ignore_eos: bool = False
    grammar: int = 0  # an `open_grammar` handle; 0 for none
    shaping: int = 0  # an `open_shaping` handle; 0 for none
    run: int = 1  # decodes it may take part in during this call (a time budget); an end of generation stops it
    limit: int = 1  # tokens it may draw in this call (its max_tokens and the window): drafts never pass it
    drafter: int = 0  # an `open_drafter` handle; 0 for none. The drafter sees every input of the lane
    draft: int = 0  # the longest draft each decode may carry; 0 for none
    adaptive: bool = True  # drafts as long as pays (`drafting.plan`), else always the longest there is


@dataclass
class Step:
    """One decode: a row of logits is wanted where `want` is 1, one `Draw` per such row, in order.

    The engine fills `logprobs` (by draw index) for the draws whose shaping asks for them (a
    draw that asks for them runs one token), `spec` (by draw index: tokens drafted and those
    that stood) for the draws that drafted, `decodes`, the llama_decode calls it made, and
    `first_decode_s`, the time of the decode of the step's own batch (what the runs after it
    take is not in it).

    A step that `probe`s is a trial of drafting (`--speculate auto`): of its decodes where drafts
    are planned, one in `PLAIN_EVERY` goes without them, and `drafted` and `plain` sum up the
    two arms, so the gate compares drafts with none where the engine would draft.

    Where a step runs on after a decode, `on_decode` (if set) is called with every draw's tokens so
    far; it may show them, but what the step returns is what stands.
    """

    tokens: np.ndarray
    positions: np.ndarray
    seqs: np.ndarray
    want: np.ndarray
    draws: list[Draw]
    logprobs: dict[int, LogprobRow] = field(default_factory=dict)
    spec: dict[int, tuple[int, int]] = field(default_factory=dict)
    probe: bool = False
    decodes: int = 0
    first_decode_s: float = 0.0
    drafted: Arm = field(default_factory=Arm)
    plain: Arm = field(default_factory=Arm)
    on_decode: Callable[[list[list[int]]], None] | None = None


class Engine(Protocol):
    """What the scheduler needs of llama.cpp: steps, KV slots and grammars.

    Any call may raise `KVFull` (no room for a step or a restore), `EngineError`, or
    `WorkerGone` when the engine runs in a worker that died; `restart` then starts another.
    """

    shape: ContextShape
    end_of_generation: np.ndarray  # by token id: True for the tokens that end a turn

    @property
    def interrupt(self) -> Interrupt | None:
        """Set from any thread, it stops the step in flight (`StepInterrupted`), or the next one if none is; the
        scheduler clears it. None where a step cannot be stopped."""
        ...

    @property
    def copy_pending(self) -> bool: ...

    def step(self, step: Step) -> list[list[int]]:
        """The tokens each draw drew, in order: one, or up to its `limit` over up to `run` decodes."""
        ...

    def copy(self, source: int, target: int, length: int) -> None: ...

    def truncate(self, seq: int, length: int) -> None: ...

    def export(self, seq: int) -> bytes: ...

    def restore(self, seq: int, data: bytes) -> None: ...

    def open_grammar(self, gbnf: str) -> int: ...

    def close_grammar(self, handle: int) -> None: ...

    def embed(self, tokens: list[int]) -> np.ndarray:
        """The pooled embedding of one input (n_embd float32s), from a context of its own: the lanes'
        KV is untouched. It may be called from another thread than the steps'."""
        ...

    def open_shaping(self, shaping: Shaping, recent: list[int]) -> int: ...

    def close_shaping(self, handle: int) -> None: ...

    def open_drafter(self, stream: list[int]) -> int:
        """A drafter for one lane whose KV holds `stream`; it follows the lane's inputs from there."""
        ...

    def close_drafter(self, handle: int) -> None: ...

    def device_report(self) -> DeviceReport:
        """The devices llama.cpp sees with their memory now, and where the model's layers are."""
        ...

    def restart(self) -> None: ...

    def abandon_restart(self) -> None: ...

    def close(self) -> None: ...
