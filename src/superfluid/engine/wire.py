"""The daemon-to-worker channel: length-prefixed frames over a unix socket pair.

A frame is a `u32` little-endian length, then a one-byte kind, then its payload. Each call
is one request frame answered by one reply frame, in order; a step whose run goes on after a
decode sends a DRAWN frame (every draw's tokens so far) before its reply. A step travels as a
small header and numpy arrays (the batch's token ids, positions, sequence ids and logit flags,
then one packed record per draw) and comes back as how many tokens each draw drew, their
ids, what each draw drafted and kept, how many decodes the call made and, for a step that
probes drafting, its two arms, so a tick's traffic
is a few hundred bytes whatever the vocabulary. Only draws whose shaping asks for log
probabilities add a fixed-size record each to the reply. A job's shaping (bias, penalties,
how many log probabilities) travels once, when it is opened, and so does the stream a
drafter starts from. An embedding's token ids and
the vector it comes back as travel as raw bytes. KV states (tens of megabytes) do not cross
the socket: both sides map one memory file (`SharedRegion`), llama.cpp writes an export
straight into it and reads an import straight from it, and the frames carry their sizes.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct

import numpy as np

from ..protocol.schema import GenParams
from .drafting import Arm
from .interface import Draw, Step
from .shaping import MAX_TOP_LOGPROBS, LogprobRow, Shaping

# request kinds (daemon -> worker)
# (COPY answers 1 when the copy waits for the next step, 0 when it is done)
STEP, COPY, TRUNCATE, EXPORT, RESTORE, OPEN_GRAMMAR, CLOSE_GRAMMAR = range(1, 8)
# numbered apart from the kinds above, so that new step kinds can follow them
EMBED = 32  # an input's token ids (i32s) in, its pooled embedding (f32s) back
OPEN_SHAPING, CLOSE_SHAPING = 33, 34  # a job's sampling extras, opened once and closed at its end
OPEN_DRAFTER, CLOSE_DRAFTER = 35, 36  # a job's prompt lookup: its stream (i32s) in, a handle back
DEVICES = 37  # the model's device report (`LlamaModel.device_report`) back, as JSON; READY carries it too
# reply kinds (worker -> daemon)
OK, KV_FULL, FAILED, READY, INTERRUPTED = 100, 101, 102, 103, 104  # INTERRUPTED: `interface.StepInterrupted`
# a step's tokens drawn so far, sent after each decode of a run that goes on, before its reply
DRAWN = 105

DRAW = np.dtype(
    [
        ("temperature", "<f4"),
        ("top_p", "<f4"),
        ("min_p", "<f4"),
        ("top_k", "<u4"),
        ("seed", "<u8"),
        ("position", "<u4"),
        ("ignore_eos", "u1"),
        ("grammar", "<u4"),
        ("shaping", "<u4"),
        ("run", "<u4"),
        ("limit", "<u4"),
        ("drafter", "<u4"),
        ("draft", "<u4"),
        ("adaptive", "u1"),
    ]
)
LOGPROBS = np.dtype(
    [
        ("draw", "<u4"),
        ("logprob", "<f4"),
        ("count", "<u4"),
        ("ids", "<i4", (MAX_TOP_LOGPROBS,)),
        ("values", "<f4", (MAX_TOP_LOGPROBS,)),
    ]
)
_HEAD = struct.Struct("<IIB")  # tokens in the batch, draws, whether the step probes
_ARM = struct.Struct("<IId")  # decodes, tokens, seconds
_SHAPING = struct.Struct("<fffiII")  # presence, frequency, repeat, logprobs, biased tokens, recent tokens
_LENGTH = struct.Struct("<I")
_DECODES = struct.Struct("<I")  # a step reply's llama_decode calls


class ChannelClosed(ConnectionError):
    """The other end of the channel is gone."""


class SharedRegion:
    """A memory file both ends of a channel map, for KV states: it grows (by whichever side needs
    more room) in steps of `GROWTH` bytes, and each side maps what the file holds when it needs it.
    Pages are taken only as they are written; after a transfer, those beyond the first `GROWTH`
    bytes are given back (`release`), so a long state does not hold memory once it has crossed."""

    GROWTH = 64 << 20

    def __init__(self, fd: int | None = None) -> None:
        self.fd = os.memfd_create("superfluid-kv") if fd is None else fd
        self._map: mmap.mmap | None = None

    def view(self, size: int) -> memoryview:
        """The first `size` bytes, writable; the file grows first when it is shorter. OSError when
        the memory cannot be had."""
        if os.fstat(self.fd).st_size < size:
            os.ftruncate(self.fd, -(-size // self.GROWTH) * self.GROWTH)
        if self._map is None or len(self._map) < size:
            if self._map is not None:
                self._map.close()
            self._map = mmap.mmap(self.fd, os.fstat(self.fd).st_size)
        return memoryview(self._map)[:size]

    def release(self) -> None:
        """Give back the pages beyond the first `GROWTH` bytes (the file keeps its size)."""
        if self._map is not None and len(self._map) > self.GROWTH:
            self._map.madvise(mmap.MADV_REMOVE, self.GROWTH, len(self._map) - self.GROWTH)

    def close(self) -> None:
        """Unmap it and close the file: its pages are freed once the other side has done the same."""
        if self._map is not None:
            self._map.close()
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def send(sock: socket.socket, kind: int, payload: bytes = b"") -> None:
    sock.sendall(_LENGTH.pack(len(payload) + 1) + bytes((kind,)) + payload)


def receive(sock: socket.socket) -> tuple[int, memoryview]:
    """The next frame's kind and payload; ChannelClosed when the other end has gone."""
    (length,) = _LENGTH.unpack(_read(sock, _LENGTH.size))
    frame = _read(sock, length)
    return frame[0], memoryview(frame)[1:]


def _read(sock: socket.socket, n: int) -> bytes:
    parts: list[bytes] = []
    while n:  # one recv in the common case: a frame is sent whole
        part = sock.recv(n)
        if not part:
            raise ChannelClosed("the channel closed")
        parts.append(part)
        n -= len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def encode_step(step: Step) -> bytes:
    draws = np.zeros(len(step.draws), dtype=DRAW)
    for i, d in enumerate(step.draws):
        p = d.params
        draws[i] = (
            p.temperature,
            p.top_p,
            p.min_p,
            p.top_k,
            p.seed,
            d.position,
            d.ignore_eos,
            d.grammar,
            d.shaping,
            d.run,
            d.limit,
            d.drafter,
            d.draft,
            d.adaptive,
        )
    return b"".join(
        (
            _HEAD.pack(len(step.tokens), len(step.draws), step.probe),
            np.ascontiguousarray(step.tokens, dtype="<i4").tobytes(),
            np.ascontiguousarray(step.positions, dtype="<i4").tobytes(),
            np.ascontiguousarray(step.seqs, dtype="<i4").tobytes(),
            np.ascontiguousarray(step.want, dtype="i1").tobytes(),
            draws.tobytes(),
        )
    )


def decode_step(payload: memoryview) -> Step:
    n, m, probe = _HEAD.unpack_from(payload)
    at = _HEAD.size
    arrays = []
    for dtype, size in (("<i4", 4), ("<i4", 4), ("<i4", 4), ("i1", 1)):
        arrays.append(np.frombuffer(payload, dtype=dtype, count=n, offset=at))
        at += n * size
    records = np.frombuffer(payload, dtype=DRAW, count=m, offset=at)
    draws = [
        Draw(
            GenParams(float(r["temperature"]), float(r["top_p"]), float(r["min_p"]), int(r["top_k"]), int(r["seed"])),
            int(r["position"]),
            bool(r["ignore_eos"]),
            int(r["grammar"]),
            int(r["shaping"]),
            int(r["run"]),
            int(r["limit"]),
            int(r["drafter"]),
            int(r["draft"]),
            bool(r["adaptive"]),
        )
        for r in records
    ]
    return Step(arrays[0], arrays[1], arrays[2], arrays[3], draws, probe=bool(probe))


def encode_tokens(drawn: list[list[int]]) -> bytes:
    """How many tokens each draw drew, then their ids: a DRAWN frame, and part of a step's reply."""
    ids = [token for tokens in drawn for token in tokens]
    # struct, not numpy: a frame goes each decode, and the daemon's side is paid on a core the decode wants
    return struct.pack(f"<{len(drawn)}I{len(ids)}i", *map(len, drawn), *ids)


def decode_tokens(payload: memoryview, draws: int, at: int = 0) -> tuple[list[list[int]], int]:
    """The tokens `encode_tokens` wrote for `draws` draws from offset `at`, and the offset after them."""
    counts = struct.unpack_from(f"<{draws}I", payload, at)
    at += 4 * draws
    total = sum(counts)
    ids = struct.unpack_from(f"<{total}i", payload, at)
    drawn, start = [], 0
    for count in counts:
        drawn.append(list(ids[start : start + count]))
        start += count
    return drawn, at + 4 * total


def encode_drawn(step: Step, drawn: list[list[int]]) -> bytes:
    """A step's reply: the decodes it made, its trial's two arms, how many tokens each draw drew, their
    ids, each draw's drafted and kept tokens, then a record per draw that asked for log probabilities."""
    spec = [0] * (2 * len(drawn))
    for draw, (drafted, kept) in step.spec.items():
        spec[draw], spec[len(drawn) + draw] = drafted, kept
    arms = b"".join(_ARM.pack(arm.decodes, arm.tokens, arm.seconds) for arm in (step.drafted, step.plain))
    head = _DECODES.pack(step.decodes) + arms + encode_tokens(drawn) + struct.pack(f"<{len(spec)}I", *spec)
    if not step.logprobs:
        return head
    rows = np.zeros(len(step.logprobs), dtype=LOGPROBS)
    for i, (draw, row) in enumerate(sorted(step.logprobs.items())):
        rows[i]["draw"], rows[i]["logprob"], rows[i]["count"] = draw, row.logprob, len(row.top)
        for j, (token, value) in enumerate(row.top):
            rows[i]["ids"][j], rows[i]["values"][j] = token, value
    return head + rows.tobytes()


def decode_drawn(payload: memoryview, step: Step) -> list[list[int]]:
    """The tokens each draw drew; the step's `decodes`, trial arms, `spec` and `logprobs` are filled in."""
    draws = len(step.draws)
    (step.decodes,) = _DECODES.unpack_from(payload)
    at = _DECODES.size
    step.drafted = Arm(*_ARM.unpack_from(payload, at))
    step.plain = Arm(*_ARM.unpack_from(payload, at + _ARM.size))
    drawn, at = decode_tokens(payload, draws, at + 2 * _ARM.size)
    spec = struct.unpack_from(f"<{2 * draws}I", payload, at)  # each draw's drafted tokens, then those kept
    at += 8 * draws
    step.spec = {i: (spec[i], spec[draws + i]) for i in range(draws) if spec[i]}
    step.logprobs = {}
    if len(payload) == at:
        return drawn
    for r in np.frombuffer(payload, dtype=LOGPROBS, offset=at):
        step.logprobs[int(r["draw"])] = LogprobRow(
            drawn[r["draw"]][0],
            float(r["logprob"]),
            tuple((int(t), float(v)) for t, v in zip(r["ids"][: r["count"]], r["values"][: r["count"]], strict=True)),
        )
    return drawn


def encode_shaping(shaping: Shaping, recent: list[int]) -> bytes:
    bias = shaping.logit_bias
    return b"".join(
        (
            _SHAPING.pack(
                shaping.presence_penalty,
                shaping.frequency_penalty,
                shaping.repeat_penalty,
                shaping.logprobs,
                len(bias),
                len(recent),
            ),
            np.asarray([t for t, _ in bias], dtype="<i4").tobytes(),
            np.asarray([b for _, b in bias], dtype="<f4").tobytes(),
            np.asarray(recent, dtype="<i4").tobytes(),
        )
    )


def decode_shaping(payload: memoryview) -> tuple[Shaping, list[int]]:
    presence, frequency, repeat, logprobs, biased, recent = _SHAPING.unpack_from(payload)
    at = _SHAPING.size
    ids = np.frombuffer(payload, dtype="<i4", count=biased, offset=at)
    values = np.frombuffer(payload, dtype="<f4", count=biased, offset=at + 4 * biased)
    tail = np.frombuffer(payload, dtype="<i4", count=recent, offset=at + 8 * biased)
    bias = tuple((int(t), float(v)) for t, v in zip(ids, values, strict=True))
    return Shaping(bias, presence, frequency, repeat, logprobs), tail.tolist()


def ints(*values: int) -> bytes:
    """Small integer arguments (slots, lengths, handles) as little-endian i64s."""
    return struct.pack(f"<{len(values)}q", *values)


def read_ints(payload: memoryview, count: int) -> tuple[int, ...]:
    return struct.unpack_from(f"<{count}q", payload)
