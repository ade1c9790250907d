"""How much work a step takes on: the rates steps measure, and the prefill and decode runs sized from them.

A step's prefill is sized from the measured cost of a prefilled token to last about
`STEP_URGENT_S` while interactive or completion work runs (and a second after), so it
never waits long for the step in flight, and `STEP_BATCH_S` or more otherwise: a long step
pays less often for the lanes decoding beside its prompt, and an interactive arrival
interrupts it (`engine.interrupt`) rather than wait for it. An engine whose steps cannot be
interrupted gets `STEP_TARGET_S`. A step that only decodes makes a run of decodes in one
engine call when nobody waits.
"""

from __future__ import annotations

import time

from .stats import SchedulerStats

# A step's work: what an interactive arrival may have to wait for. Prefill chunks of 16-32
# tokens run 10-15% slower than chunks of 64-256 (the weights are read once a step), so steps
# are not made shorter than an arrival needs.
STEP_TARGET_S = 0.2
STEP_URGENT_S = 0.12  # the same while interactive or completion work runs
# Short steps cost batch work its prefill rate: in the daemon on 2 cores, the embedded model
# prefilled eight agents' prompts at about 6 ms a token in the 17-24-token chunks of 0.12 s steps
# and 5 ms in the 40-token chunks of 0.2 s steps. So short steps last only while such work runs,
# and this long after (a tool call's quick answer). A later arrival interrupts the long step in
# flight: it loses that step's work, not its own time. Eight agents with a chat behind them
# (bench/run.py --quick's agents) had their first tokens at p50 7.3 s with 1 s here against
# 7.4-7.6 s with 5 s and finished in 19 s against 20-21 s; the chat's first token took 0.08 s.
URGENT_GRACE_S = 1.0
# An interruptible step of batch work. The lanes decoding beside its prompt chunk run in a llama.cpp
# micro-batch of their own, one more pass over the weights: on the 0.7B bench model a 192-token step
# took 1.69 s alone, 1.78 with one lane decoding and 1.86 with seven, while the chunk's length costs
# nothing (llama-batched-bench prefills that model at 102-107 tok/s in chunks of 96 to 512 tokens).
# So such a step lasts at least `STEP_BATCH_S` and long enough for `BATCH_CHUNK` tokens, up to
# `STEP_BATCH_MAX_S`: the embedded model prefills ~400 tokens a second beside eight decoding lanes,
# the 0.7B one ~100. The 0.7B model's quick agents (bench/run.py) had their first tokens at p50 32.4 and 28.5 s
# against 32.0 and 32.7 with 1 s steps, and finished in 73.6 and 70.9 s against 75.5 and 75.9. A
# request in the agent class (HTTP's default) does not interrupt it: a chat sent without the QoS
# header behind eight agents waits for it, then for a short step of its own, and is to see its first
# token in 2 s.
STEP_BATCH_S = 1.0
BATCH_CHUNK = 192
STEP_BATCH_MAX_S = 2.0
MIN_PREFILL = 16
# a step that only decodes lets each lane draw a run of tokens in one engine call (the channel
# and this loop are paid once), as long as nobody waits for admission, up to this long (and no
# longer than a tick, whose end commits). Each token of a run is shown as it is drawn
# (`Step.on_decode`); a run ends when any of its lanes ends, and after the decode in flight when a
# job arrives or is cancelled (`Interrupt.cut`), so neither a reader nor an arrival waits for it.
# On a two-core AMD EPYC whose decodes took 8-10 ms, a lone stream's daemon took 0.80 ms of CPU a
# token with runs of one decode (at 15 ms), 0.51-0.59 with runs of five (at 50 ms): on two cores
# that CPU is taken from the decode (the worker's send of each run's token lends its core to the
# daemon thread it wakes). In two A/B probes of 12 and 14 paired 256-token replies, runs of five
# decoded a lone stream 1.14 and 1.10 times as fast, and their chunks' gap p99 was 1.37 and 1.31
# times as long (31.7 against 17.9 ms, 23.9 against 19.5): a run's next decode already holds the
# cores when the daemon wakes to show a token. Two streams: the same rate and gaps either way
RUN_S = 0.05
MAX_RUN = 8


def _smoothed(average: float, sample: float) -> float:
    """A moving average that follows the last few dozen samples; the first sample starts it."""
    return sample if average == 0.0 else 0.9 * average + 0.1 * sample


class Pace:
    """The rates one scheduler's steps measure, and what they make of the next step."""

    def __init__(self) -> None:
        self.token_cost = 0.005  # seconds per prefilled token, measured on prefill-heavy steps
        # seconds per decode of the last steps that only decoded, without drafts and with them allowed
        self.decode_step_s = {False: 0.0, True: 0.0}
        self.urgent_until = 0.0  # monotonic time until which steps stay short

    def urgent(self) -> None:
        """Interactive or completion work arrived or runs: steps stay short until a while after."""
        self.urgent_until = time.monotonic() + URGENT_GRACE_S

    def step_s(self, interruptible: bool) -> float:
        """How long the next step's prefill may take, on an engine whose steps are `interruptible` or not."""
        if time.monotonic() < self.urgent_until:
            return STEP_URGENT_S
        if not interruptible:
            return STEP_TARGET_S
        return min(STEP_BATCH_MAX_S, max(STEP_BATCH_S, BATCH_CHUNK * self.token_cost))

    @staticmethod
    def is_batch(step_s: float) -> bool:
        """Whether a step of `step_s` is one of batch work: as long as `step_s` made it for an interruptible
        engine with no interactive work about (the urgent and target steps are shorter)."""
        return step_s >= STEP_BATCH_S

    def tokens_in(self, step_s: float) -> int:
        """Prompt tokens a step of `step_s` prefills."""
        return int(step_s / self.token_cost)

    def prefill_budget(self, inputs: int, batch: int, step_s: float) -> int:
        """Prompt tokens a step of `step_s` that already carries `inputs` tokens may prefill, in a batch of
        `batch`."""
        return min(max(MIN_PREFILL, self.tokens_in(step_s) - inputs), batch - inputs)

    def prefilled(self, tokens: int, lanes: int, first_decode_s: float) -> None:
        """A step that prefilled `tokens` over `lanes` lanes took `first_decode_s` for its own batch."""
        if tokens >= MIN_PREFILL + lanes:
            # attention makes a token dearer as its lane grows: follow the cost closely (a step that only
            # decodes runs on after its batch, and drafts are no prompt)
            self.token_cost = 0.5 * self.token_cost + 0.5 * first_decode_s / tokens

    def run_length(self, drafting: bool, tick_s: float) -> int:
        """How many decodes a step that only decodes may make in one engine call (each lane draws a token a
        decode, more where its drafts stand); `drafting` says whether its lanes may draft, which makes a
        decode dearer. The first such step runs one, to measure."""
        step_s = self.decode_step_s[drafting]
        if not step_s:
            return 1
        return max(1, min(MAX_RUN, int(min(RUN_S, tick_s) / step_s)))

    def measure(
        self, stats: SchedulerStats, prefilled: int, drawn: int, took: float, decodes: int, drafting: bool
    ) -> None:
        """The engine's rates as /slots shows them: a step that prefills counts for prefill (its cost is
        mostly the prompt's), one that only decodes for decode (over the `decodes` calls it made, with
        drafts allowed or not)."""
        if prefilled:
            stats.prefill_tokens_per_second = _smoothed(stats.prefill_tokens_per_second, prefilled / took)
        else:
            stats.decode_tokens_per_second = _smoothed(stats.decode_tokens_per_second, drawn / took)
        if decodes:
            self.decode_step_s[drafting] = _smoothed(self.decode_step_s[drafting], took / decodes)
