"""Where llama.cpp's arithmetic depends on how a token reached it.

    .venv/bin/python bench/exactness.py                   # every path, 4 prompts, 200 tokens each
    .venv/bin/python bench/exactness.py --tokens 64       # shorter
    .venv/bin/python bench/exactness.py --kernels fast    # with repacked weights and tiled kernels
    .venv/bin/python bench/exactness.py --library wheel   # llama-cpp-python's own library
    .venv/bin/python bench/exactness.py --model my.gguf   # another model (its weight types pick kernels)
    .venv/bin/python bench/exactness.py --context 600     # long prompts: attention's kernels change with length

A greedy run is computed once the way a lone lane computes it (the prompt prefilled in one
chunk, then one decode step per token), and its logits kept. Then the same tokens are fed
again along each path the scheduler can take (a bulk re-prefill after a restart, the last
prompt token decoded alone, small prefill chunks, seven other lanes in the batch, a KV copied
from another slot, a state exported to host memory and imported again, a prefill step
interrupted by an interactive arrival and run again) and every step's
logits are compared bit for bit with the reference, and so are those of the reply checked
five positions per step, as speculation checks a draft. For each path it prints the first
position whose logits differ in any bit, or that all of them are identical.

It runs on the library and kernels a worker runs by default: the fast build (`.venv/llama-fast`)
with `--kernels exact`. `--kernels fast` lets every weight type be repacked and run the tiled
K-quant kernels, as `serve --kernels fast` does; `--library wheel` probes llama-cpp-python's own
library, which `--no-worker-process` runs.

A path that differs breaks the promise that a cut, resumed, forked or crash-replayed greedy
run equals the uncut one. The library's build flags come first in the output (llama.cpp's
system info), since they decide which kernels run.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as L
import numpy as np

from superfluid.config import KERNELS
from superfluid.engine.build import (
    LIBRARY_ENV,
    TILED_ENV,
    fast_library,
    flash_attention_on,
    worker_environment,
)
from superfluid.engine.interface import ContextShape, StepInterrupted
from superfluid.engine.interrupt import Interrupt
from superfluid.engine.llama import LlamaContext, LlamaModel
from superfluid.model.resolve import embedded_model

PROMPTS = (
    "List the planets and describe each one at length.",
    "Write a long story about a lighthouse keeper and a storm.",
    "Explain in detail how a bicycle gear works.",
    "Describe a day in a busy city market.",
)
OTHERS = 7  # lanes sharing the batch in the "batched" path
NEIGHBOUR_ROOM = 16 * OTHERS  # their prompts' tokens, "Neighbour 3 writes about 21 boats." being about ten each
DRAFT = 5  # positions a draft check decodes in one step: the last accepted token and a draft of 4 (the default)
BATCH = 512


@dataclass
class Divergence:
    """The first position (counted from the end of the prompt) whose logits differ; None when none do."""

    path: str
    prompt: int
    first: int | None
    compared: int


class Probe:
    """One context with room for a lane, its copies and seven neighbours."""

    def __init__(self, model: LlamaModel, window: int, threads: int, flash_attention: bool = False) -> None:
        self.model = model
        self.interrupt = Interrupt()
        # room for the batched path's first step: a whole prompt and its neighbours' beside it
        shape = ContextShape(window, OTHERS + 3, max(BATCH, window + NEIGHBOUR_ROOM), threads, flash_attention)
        self.context = LlamaContext(model, shape, self.interrupt)

    def clear(self) -> None:
        for seq in range(self.context.shape.sequences):
            self.context.truncate(seq, 0)

    def feed(self, seq: int, tokens: list[int], start: int, chunk: int = BATCH) -> np.ndarray:
        """Prefill `tokens` at `start` in chunks of `chunk`; the logits of the last one."""
        last = None
        for at in range(0, len(tokens), chunk):
            part = tokens[at : at + chunk]
            want = np.zeros(len(part), dtype=np.int8)
            want[-1] = at + len(part) == len(tokens)
            rows = self.context.decode(
                np.asarray(part, dtype=np.int32),
                np.arange(start + at, start + at + len(part), dtype=np.int32),
                np.full(len(part), seq, dtype=np.int32),
                want,
            )
            if len(rows):
                last = rows[-1].copy()
        assert last is not None
        return last

    def step(self, seq: int, token: int, position: int) -> np.ndarray:
        one = np.ones(1, dtype=np.int32)
        return self.context.decode(one * token, one * position, one * seq, np.ones(1, dtype=np.int8))[0].copy()

    def decode_from(self, seq: int, tokens: list[int], start: int, first: np.ndarray) -> list[np.ndarray]:
        """Logits after each of `tokens` decoded one per step from `start`, `first` being the ones before."""
        out = [first]
        for i, token in enumerate(tokens[:-1]):
            out.append(self.step(seq, token, start + i))
        return out


def reference(probe: Probe, prompt: list[int], tokens: int) -> tuple[list[int], list[np.ndarray]]:
    """A lone greedy lane: the prompt in one chunk, then one step per token."""
    probe.clear()
    logits = [probe.feed(0, prompt, 0)]
    generated: list[int] = []
    while len(generated) < tokens:
        row = logits[-1].copy()
        row[probe.model.end_of_generation] = -np.inf  # a forced length: every prompt yields `tokens` steps
        generated.append(int(np.argmax(row)))
        if len(generated) < tokens:
            logits.append(probe.step(0, generated[-1], len(prompt) + len(generated) - 1))
    return generated, logits


def _first_difference(expected: list[np.ndarray], got: list[np.ndarray]) -> int | None:
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        if not np.array_equal(a.view(np.uint32), b.view(np.uint32)):
            return i
    return None


EnginePath = Callable[[Probe, list[int], list[int]], list[np.ndarray]]


def replayed(probe: Probe, prompt: list[int], out: list[int]) -> list[np.ndarray]:
    """After a restart: prompt and the first half of the reply prefilled in bulk, then decoded on."""
    probe.clear()
    cut = len(out) // 2
    head = prompt + out[:cut]
    return [*([None] * cut), *probe.decode_from(0, out[cut:], len(head), probe.feed(0, head, 0))]


def last_alone(probe: Probe, prompt: list[int], out: list[int]) -> list[np.ndarray]:
    """A warm start: all but the last prompt token in one chunk, the last one decoded alone."""
    probe.clear()
    probe.feed(0, prompt[:-1], 0)
    first = probe.step(0, prompt[-1], len(prompt) - 1)
    return probe.decode_from(0, out, len(prompt), first)


def small_chunks(probe: Probe, prompt: list[int], out: list[int]) -> list[np.ndarray]:
    """The prompt prefilled 7 tokens per step, as a busy scheduler slices it."""
    probe.clear()
    return probe.decode_from(0, out, len(prompt), probe.feed(0, prompt, 0, chunk=7))


def batched(probe: Probe, prompt: list[int], out: list[int]) -> list[np.ndarray]:
    """Seven other lanes decode in the same batches (and prefill beside the prompt)."""
    probe.clear()
    neighbours = [probe.model.tokenize(f"Neighbour {i} writes about {i * 7} boats.", False) for i in range(OTHERS)]
    context = probe.context
    lanes = [(0, prompt)] + [(1 + i, p) for i, p in enumerate(neighbours)]
    tokens = np.concatenate([np.asarray(p, dtype=np.int32) for _, p in lanes])
    positions = np.concatenate([np.arange(len(p), dtype=np.int32) for _, p in lanes])
    seqs = np.concatenate([np.full(len(p), s, dtype=np.int32) for s, p in lanes])
    want = np.zeros(len(tokens), dtype=np.int8)
    want[np.cumsum([len(p) for _, p in lanes]) - 1] = 1
    rows = context.decode(tokens, positions, seqs, want)
    result = [rows[0].copy()]
    last = [int(np.argmax(r)) for r in rows[1:]]
    lengths = [len(p) for _, p in lanes]
    for i, token in enumerate(out[:-1]):
        step_tokens = np.asarray([token, *last], dtype=np.int32)
        step_pos = np.asarray([lengths[0] + i] + [n + i for n in lengths[1:]], dtype=np.int32)
        rows = context.decode(
            step_tokens, step_pos, np.arange(OTHERS + 1, dtype=np.int32), np.ones(OTHERS + 1, np.int8)
        )
        result.append(rows[0].copy())
        last = [int(np.argmax(r)) for r in rows[1:]]
    return result


def drafted(probe: Probe, prompt: list[int], out: list[int]) -> list[np.ndarray]:
    """Speculation: the reply checked DRAFT tokens per step, each step's logits read at every position."""
    probe.clear()
    result = [probe.feed(0, prompt, 0)]
    for at in range(0, len(out) - 1, DRAFT):
        part = out[at : min(at + DRAFT, len(out) - 1)]
        rows = probe.context.decode(
            np.asarray(part, dtype=np.int32),
            np.arange(len(prompt) + at, len(prompt) + at + len(part), dtype=np.int32),
            np.zeros(len(part), dtype=np.int32),
            np.ones(len(part), dtype=np.int8),
        )
        result.extend(row.copy() for row in rows)
    return result


def copied(probe: Probe, prompt: list[int], out: list[int]) -> list[np.ndarray]:
    """A fork: the prompt's KV copied from another slot, the last prompt token decoded in the copy."""
    probe.clear()
    probe.feed(0, prompt, 0)
    probe.context.copy(0, 1, len(prompt) - 1)
    first = probe.step(1, prompt[-1], len(prompt) - 1)
    return probe.decode_from(1, out, len(prompt), first)


def imported(probe: Probe, prompt: list[int], out: list[int]) -> list[np.ndarray]:
    """The host-memory tier: the prompt's state exported, imported into another slot, then decoded on."""
    probe.clear()
    probe.feed(0, prompt[:-1], 0)
    probe.step(0, prompt[-1], len(prompt) - 1)  # the slot as a finished lone lane leaves it
    state = probe.context.export(0)
    probe.context.restore(2, state)
    probe.context.truncate(2, len(prompt) - 1)
    first = probe.step(2, prompt[-1], len(prompt) - 1)
    return probe.decode_from(2, out, len(prompt), first)


def interrupted(probe: Probe, prompt: list[int], out: list[int]) -> list[np.ndarray]:
    """An interactive arrival interrupts the prompt's second chunk, which then runs again."""
    probe.clear()
    half = len(prompt) // 2
    probe.feed(0, prompt[:half], 0)
    probe.interrupt.set()
    try:
        probe.feed(0, prompt[half:], half)
        raise AssertionError("the decode ran on with its interrupt set")
    except StepInterrupted:
        pass
    finally:
        probe.interrupt.clear()
    return probe.decode_from(0, out, len(prompt), probe.feed(0, prompt[half:], half))


PATHS: dict[str, EnginePath] = {
    "bulk re-prefill after a restart (prompt + half the reply)": replayed,
    "last prompt token decoded alone": last_alone,
    "prompt prefilled in 7-token chunks": small_chunks,
    "batched with 7 other lanes": batched,
    "a draft of 4 checked per step (speculation)": drafted,
    "KV copied from another slot": copied,
    "state exported and imported": imported,
    "a prefill step interrupted and run again": interrupted,
}


def system_info() -> str:
    return L.llama_print_system_info().decode()


def chat_prompt(model: LlamaModel, text: str, context: int = 0) -> list[int]:
    """`text` as a user turn, its text said again until the prompt is at least `context` tokens long."""
    body = text
    while True:
        tokens = model.tokenize(f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n", True)
        if len(tokens) >= context:
            return tokens
        body += "\n" + text


def probe_all(
    model: LlamaModel,
    prompts: list[str],
    tokens: int,
    threads: int,
    flash_attention: bool = False,
    context: int = 0,
) -> list[Divergence]:
    """Run every path on every prompt (each at least `context` tokens long); one `Divergence` each."""
    encoded = [chat_prompt(model, p, context) for p in prompts]
    window = max(len(p) for p in encoded) + tokens + 64
    probe = Probe(model, window, threads, flash_attention)
    found = []
    try:
        for index, prompt in enumerate(encoded):
            out, expected = reference(probe, prompt, tokens)
            for name, path in PATHS.items():
                got = path(probe, prompt, out)
                pairs = [(e, g) for e, g in zip(expected, got, strict=True) if g is not None]
                first = _first_difference([e for e, _ in pairs], [g for _, g in pairs])
                offset = len(expected) - len(pairs)
                found.append(Divergence(name, index, None if first is None else first + offset, len(pairs)))
    finally:
        probe.context.close()
    return found


def probe_environment(library: str, kernels: str) -> dict[str, str]:
    """This process's environment, with the library and kernel switches a worker gets for `kernels` on it."""
    where = None
    if library == "fast":
        where = fast_library()
        if where is None:
            sys.exit("the fast build is not installed: `make` builds it into .venv/llama-fast")
    environment = {name: value for name, value in os.environ.items() if name != LIBRARY_ENV}
    return {**environment, **worker_environment(where, exact=kernels == "exact")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=200, help="greedy tokens per prompt (default: 200)")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default: 2)")
    parser.add_argument(
        "--attention",
        choices=("flash", "plain"),
        help="flash or plain attention (default: as a worker runs it, flash on the fast build, plain on the wheel)",
    )
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many prompts (default: {len(PROMPTS)})")
    parser.add_argument(
        "--context",
        type=int,
        default=0,
        help="repeat each prompt to at least this many tokens: attention kernels change with the length (default: 0)",
    )
    parser.add_argument("--model", type=Path, help="a GGUF file (default: the embedded model)")
    parser.add_argument(
        "--library", choices=("fast", "wheel"), default="fast", help="the llama.cpp library (default: fast)"
    )
    parser.add_argument("--kernels", choices=KERNELS, default="exact", help="as serve's --kernels (default: exact)")
    parser.add_argument(
        "--switches",
        action="store_true",
        help="print the library and kernel switches the probe runs with (NAME=value ...) and exit, for a caller "
        "that runs it where it cannot re-execute itself with them (bench/arm64_exactness.sh, under an emulator)",
    )
    args = parser.parse_args()
    environment = probe_environment(args.library, args.kernels)
    switches = (LIBRARY_ENV, *worker_environment(None, exact=True))
    if args.switches:
        print(" ".join(f"{name}={environment[name]}" for name in switches if name in environment))
        return 0
    if any(os.environ.get(name) != environment.get(name) for name in switches):
        # the library is loaded when llama_cpp is imported, and its kernels read their switches once
        os.execve(sys.executable, [sys.executable, *sys.argv], environment)
    print(system_info())
    model = LlamaModel(args.model or embedded_model().path)  # exact or not as its environment says
    library = fast_library() if args.library == "fast" else None
    flash = args.attention == "flash" if args.attention else flash_attention_on(library)
    print(f"attention: {'flash' if flash else 'plain'}")
    print(f"repacked weights: {'on' if model.repacking else 'off'}")
    print(f"tiled K-quant kernels: {'on' if os.environ[TILED_ENV] != '0' else 'off'}")
    results = probe_all(model, list(PROMPTS[: args.prompts]), args.tokens, args.threads, flash, args.context)
    width = max(len(name) for name in PATHS)
    for name in PATHS:
        rows = [r for r in results if r.path == name]
        cells = ["same" if r.first is None else f"#{r.first}" for r in rows]
        print(f"{name.ljust(width)}  {'  '.join(c.rjust(5) for c in cells)}")
    print("(per prompt: the first reply position whose logits differ in any bit, or 'same')")
    return 0 if all(r.first is None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
