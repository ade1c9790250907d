"""A fake llama.cpp for scheduler and KV-tier tests: slots that hold token lists, checked at every decode.

`FakeEngine` is the real `LocalEngine` step loop (runs, drafts, grammars' absence) over a
`FakeLlama`, whose logits pick a pure function of a slot's whole content: any KV that is
copied, exported, imported or truncated wrongly shows as a different token or a failed check.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import numpy as np

from superfluid.engine.interface import ContextShape, Step, StepInterrupted
from superfluid.engine.interrupt import Interrupt
from superfluid.engine.local import LocalEngine

VOCAB = 64


def next_of(held: list[int]) -> int:
    """The default model: a token that depends on every token before it and on their count."""
    return 1 + (sum(held) * 31 + len(held)) % (VOCAB - 1)


class FakeLlama:
    """A llama.cpp context whose slots hold token lists, checked at every decode: each row's logits pick
    a pure function of its slot's whole content (`rule`)."""

    def __init__(
        self,
        sequences: int,
        window: int,
        batch: int,
        delay: float,
        rule: object,
        position_delay: float,
        interrupt: Interrupt | None = None,
    ) -> None:
        self.rule = rule
        self.interrupt = interrupt
        self.shape = ContextShape(window, sequences, batch, 1)
        # token 0 ends a turn; the rules never pick it
        self.model = SimpleNamespace(end_of_generation=np.eye(1, VOCAB, 0, dtype=bool)[0])
        self.slots: dict[int, list[int]] = {s: [] for s in range(sequences)}
        self.delay, self.position_delay = delay, position_delay
        self.orders: list[list[int]] = []  # the slot of each token of each decode, in the batch's order
        self.ended: list[float] = []  # when each decode ended (monotonic)
        self.truncate_delay = 0.0
        self.copying: set[int] = set()  # as in llama.cpp, a copy's data moves at the next decode

    @property
    def copy_pending(self) -> bool:
        return bool(self.copying)

    @property
    def batches(self) -> list[set[int]]:
        """The slots of each decode."""
        return [set(order) for order in self.orders]

    def decode(self, tokens: np.ndarray, positions: np.ndarray, seqs: np.ndarray, want: np.ndarray) -> np.ndarray:
        self.copying.clear()
        self._compute(self.delay + self.position_delay * len(tokens))
        self.orders.append([int(s) for s in seqs])
        self.ended.append(time.monotonic())
        rows = []
        for token, position, seq, wanted in zip(tokens, positions, seqs, want, strict=True):
            held = self.slots[int(seq)]
            assert position == len(held), f"slot {seq} holds {len(held)} positions, decode wrote at {position}"
            held.append(int(token))
            if wanted:
                rows.append(np.eye(1, VOCAB, self.rule(held), dtype=np.float32)[0])  # type: ignore[operator]
        return np.array(rows, dtype=np.float32).reshape(len(rows), VOCAB)

    def _compute(self, seconds: float) -> None:
        """A decode's time; as llama.cpp does, it stops early, having written nothing, when the interrupt is set."""
        deadline = time.monotonic() + seconds
        while True:
            if self.interrupt is not None and self.interrupt.is_set():
                raise StepInterrupted("the step was interrupted")
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.002))

    def copy(self, source: int, target: int, length: int) -> None:
        self.slots[target] = list(self.slots[source][:length])
        self.copying.update((source, target))

    def truncate(self, seq: int, length: int) -> None:
        time.sleep(self.truncate_delay)
        del self.slots[seq][length:]

    def export(self, seq: int) -> bytes:
        assert seq not in self.copying, f"slot {seq} exported before its copy ran"
        return json.dumps(self.slots[seq]).encode()

    def restore(self, seq: int, data: bytes) -> None:
        assert seq not in self.copying, f"slot {seq} overwritten before its copy ran"
        assert not self.slots[seq], "a restore goes into an empty slot"
        self.slots[seq] = json.loads(data)

    def close(self) -> None:
        pass


class FakeEngine(LocalEngine):
    """The engine's own step loop (runs, drafts and all) over a `FakeLlama`; it counts its calls.

    `delay` is a decode's fixed cost, `position_delay` what each position of its batch adds; an
    `interruptible` one's steps stop when its `interrupt` is set."""

    def __init__(
        self,
        sequences: int,
        window: int = 256,
        batch: int = 512,
        delay: float = 0.0,
        model: object = next_of,
        position_delay: float = 0.0,
        interruptible: bool = False,
    ) -> None:
        interrupt = Interrupt() if interruptible else None
        llama = FakeLlama(sequences, window, batch, delay, model, position_delay, interrupt)
        super().__init__(llama)  # type: ignore[arg-type]
        self.llama: FakeLlama = self.context  # type: ignore[assignment]
        self.calls = 0

    def step(self, step: Step) -> list[list[int]]:
        self.calls += 1
        return super().step(step)

    def restart(self) -> None:
        pass

    def abandon_restart(self) -> None:
        pass
