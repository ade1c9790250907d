"""`superfluid-worker-llamacpp`: one model's llama.cpp context, served to the daemon over a channel.

The daemon starts it with the model's path, the context's shape and the file descriptor of
its end of a socket pair (`--gpu-layers` and its fellows come in its environment: `devices.py`). It
loads the model and answers READY with its device report (or FAILED with llama.cpp's reason, or
why its KV does not fit on its GPUs, and exits 1), then serves calls until the channel closes, which happens when the
daemon stops or dies. It sees token ids only: sessions, templates and tokenization stay in
the daemon, so a crash here costs the generations in flight and the KV in its slots, never
a committed event.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import struct
import sys
import time
from pathlib import Path

import numpy as np

from . import wire
from .grammar import GrammarError
from .interface import ContextShape, EngineError, KVFull, StepInterrupted
from .interrupt import Interrupt
from .llama import LlamaContext, LlamaModel
from .local import LocalEngine


def _serve(
    engine: LocalEngine, shared: wire.SharedRegion, channel: socket.socket, kind: int, payload: memoryview
) -> bytes:
    """One call; its reply payload."""
    if kind == wire.STEP:
        started = time.perf_counter()
        step = wire.decode_step(payload)
        # a run's tokens go to the daemon as they are drawn: a reader sees each one then, not at the run's end
        step.on_decode = lambda drawn: wire.send(channel, wire.DRAWN, wire.encode_tokens(drawn))
        drawn = engine.step(step)
        reply = wire.encode_drawn(step, drawn)
        # what the step cost here, and its first decode
        return reply + struct.pack("<dd", step.first_decode_s, time.perf_counter() - started)
    if kind == wire.COPY:
        engine.copy(*wire.read_ints(payload, 3))
        return wire.ints(int(engine.copy_pending))  # a short copy is done at once
    if kind == wire.TRUNCATE:
        engine.truncate(*wire.read_ints(payload, 2))
        return b""
    if kind == wire.EXPORT:  # into the shared region; the reply says how many bytes
        (seq,) = wire.read_ints(payload, 1)
        context = engine.context
        return wire.ints(context.export_into(seq, shared.view(context.export_size(seq))))
    if kind == wire.RESTORE:  # from the shared region: (seq, bytes)
        seq, size = wire.read_ints(payload, 2)
        engine.restore(seq, shared.view(size))
        return b""
    if kind == wire.OPEN_GRAMMAR:
        return wire.ints(engine.open_grammar(bytes(payload).decode("utf-8")))
    if kind == wire.CLOSE_GRAMMAR:
        engine.close_grammar(*wire.read_ints(payload, 1))
        return b""
    if kind == wire.EMBED:
        tokens = np.frombuffer(payload, dtype="<i4").tolist()
        return np.asarray(engine.embed(tokens), dtype="<f4").tobytes()
    if kind == wire.OPEN_SHAPING:
        return wire.ints(engine.open_shaping(*wire.decode_shaping(payload)))
    if kind == wire.CLOSE_SHAPING:
        engine.close_shaping(*wire.read_ints(payload, 1))
        return b""
    if kind == wire.OPEN_DRAFTER:
        return wire.ints(engine.open_drafter(np.frombuffer(payload, dtype="<i4").tolist()))
    if kind == wire.CLOSE_DRAFTER:
        engine.close_drafter(*wire.read_ints(payload, 1))
        return b""
    if kind == wire.DEVICES:
        return json.dumps(engine.device_report()).encode()
    raise EngineError(f"unknown call {kind}")


def serve(
    channel: socket.socket, shared: wire.SharedRegion, interrupt: Interrupt, model_path: Path, shape: ContextShape
) -> int:
    try:
        engine = LocalEngine(LlamaContext(LlamaModel(model_path), shape, interrupt))
    except EngineError as e:
        wire.send(channel, wire.FAILED, str(e).encode())
        return 1
    wire.send(channel, wire.READY, json.dumps(engine.device_report()).encode())
    while True:
        try:
            kind, payload = wire.receive(channel)
            wire.send(channel, *_answer(engine, shared, channel, kind, payload))
        except ConnectionError:
            return 0  # the daemon stopped, or died


def _answer(
    engine: LocalEngine, shared: wire.SharedRegion, channel: socket.socket, kind: int, payload: memoryview
) -> tuple[int, bytes]:
    """The reply frame to one request frame: OK with its payload, or why it failed."""
    try:
        return wire.OK, _serve(engine, shared, channel, kind, payload)
    except KVFull as e:
        return wire.KV_FULL, str(e).encode()
    except StepInterrupted as e:
        return wire.INTERRUPTED, str(e).encode()
    except (EngineError, GrammarError) as e:
        return wire.FAILED, str(e).encode()
    except Exception as e:  # a call that fails here ends the call, not the worker and its KV
        return wire.FAILED, f"{type(e).__name__}: {e}".encode()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="superfluid-worker-llamacpp",
        description="A llama.cpp worker of the superfluid daemon; the daemon starts it, people do not.",
    )
    parser.add_argument("--fd", type=int, required=True, help="the worker's end of the daemon's socket pair")
    parser.add_argument("--shared-fd", type=int, required=True, help="the memory file KV states travel in")
    parser.add_argument("--interrupt-fd", type=int, required=True, help="the memory file of the step interrupt")
    parser.add_argument("--model", type=Path, required=True, help="the GGUF file")
    parser.add_argument("--window", type=int, required=True, help="tokens per KV slot")
    parser.add_argument("--sequences", type=int, required=True, help="KV slots")
    parser.add_argument("--batch", type=int, required=True, help="tokens per decode")
    parser.add_argument("--threads", type=int, required=True, help="CPU threads")
    parser.add_argument("--flash-attention", action="store_true", help="attention by llama.cpp's flash kernels")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the daemon's to handle; it closes the channel
    channel = socket.socket(fileno=args.fd)
    shape = ContextShape(args.window, args.sequences, args.batch, args.threads, args.flash_attention)
    return serve(channel, wire.SharedRegion(args.shared_fd), Interrupt(args.interrupt_fd), args.model, shape)


if __name__ == "__main__":
    sys.exit(main())
