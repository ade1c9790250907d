"""What copying a slot's KV costs, by the way it is done and by the tokens the source holds.

    .venv/bin/python bench/copies.py

A fork or a request that shares a cached prefix starts from a copy of another slot. llama.cpp
copies a whole stream (every cell of the window) at the next decode; the sequence state
(export, then import into the empty target) costs by the tokens held instead. For each source
length this prints both costs and whether the copies decode to the same logits, which is
where `SHORT_COPY_DIVISOR` in `superfluid.engine.llama` comes from.
"""

from __future__ import annotations

import argparse
import time

import llama_cpp as L
import numpy as np

from superfluid.engine.interface import ContextShape
from superfluid.engine.llama import LlamaContext, LlamaModel
from superfluid.model.resolve import embedded_model


def decode(context: LlamaContext, tokens: list[int], start: int, seq: int) -> np.ndarray:
    """Prefill `tokens` at `start` on `seq` in chunks; the last token's logits."""
    row = None
    for at in range(0, len(tokens), context.shape.batch):
        part = np.asarray(tokens[at : at + context.shape.batch], dtype=np.int32)
        want = np.zeros(len(part), dtype=np.int8)
        want[-1] = 1
        positions = np.arange(start + at, start + at + len(part), dtype=np.int32)
        row = context.decode(part, positions, np.full(len(part), seq, dtype=np.int32), want)[0].copy()
    assert row is not None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=4096, help="tokens per slot (default 4096)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = LlamaModel(embedded_model().path)
    context = LlamaContext(model, ContextShape(args.window, 3, 512, args.threads))
    memory = L.llama_get_memory(context._ctx)
    text = model.tokenize("The keeper lit the lamp as the storm came over the granite harbour. " * 200, True)
    print(f"window {args.window} tokens; milliseconds per copy, then one decode on it")
    print(f"{'source tokens':>13}  {'stream copy':>11}  {'state copy':>10}  same logits")
    for length in (32, 64, 128, 256, 512, 1024):
        tokens = text[:length]
        for seq in range(3):
            context.truncate(seq, 0)
        decode(context, tokens[:-1], 0, 0)
        started = time.perf_counter()
        L.llama_memory_seq_cp(memory, 0, 1, -1, -1)  # carried out by the decode below
        streamed = decode(context, tokens[-1:], length - 1, 1)
        stream_ms = (time.perf_counter() - started) * 1000
        started = time.perf_counter()
        context.restore(2, context.export(0))
        moved = decode(context, tokens[-1:], length - 1, 2)
        state_ms = (time.perf_counter() - started) * 1000
        print(f"{length:>13}  {stream_ms:>11.1f}  {state_ms:>10.1f}  {np.array_equal(streamed, moved)}")


if __name__ == "__main__":
    main()
