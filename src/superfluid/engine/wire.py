"""The daemon-to-worker channel: length-prefixed frames over a unix socket pair.

A frame is a `u32` little-endian length, then a one-byte kind, then its payload. Each call
is one request frame answered by one reply frame, in order. A step travels as a small
header and numpy arrays (the batch's token ids, positions, sequence ids and logit flags,
then one packed record per draw) and comes back as the drawn token ids, so a tick's traffic
is a few hundred bytes whatever the vocabulary. KV exports travel as raw bytes, and so do
an embedding's token ids and the vector it comes back as.
"""

from __future__ import annotations

import socket
import struct

import numpy as np

from ..protocol.schema import GenParams
from .local import Draw, Step

# request kinds (daemon -> worker)
STEP, COPY, TRUNCATE, EXPORT, RESTORE, OPEN_GRAMMAR, CLOSE_GRAMMAR = range(1, 8)
# an input's token ids (i32s) in, its pooled embedding (f32s) back; numbered apart from the
# kinds above so that new step kinds can follow them
EMBED = 32
# reply kinds (worker -> daemon)
OK, KV_FULL, FAILED, READY = 100, 101, 102, 103

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
    ]
)
_HEAD = struct.Struct("<II")  # tokens in the batch, draws
_LENGTH = struct.Struct("<I")


class ChannelClosed(ConnectionError):
    """The other end of the channel is gone."""


def send(sock: socket.socket, kind: int, payload: bytes = b"") -> None:
    sock.sendall(_LENGTH.pack(len(payload) + 1) + bytes((kind,)) + payload)


def receive(sock: socket.socket) -> tuple[int, memoryview]:
    """The next frame's kind and payload; ChannelClosed when the other end has gone."""
    (length,) = _LENGTH.unpack(_read(sock, _LENGTH.size))
    frame = _read(sock, length)
    return frame[0], memoryview(frame)[1:]


def _read(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        read = sock.recv_into(view[got:], n - got)
        if read == 0:
            raise ChannelClosed("the channel closed")
        got += read
    return bytes(buf)


def encode_step(step: Step) -> bytes:
    draws = np.zeros(len(step.draws), dtype=DRAW)
    for i, d in enumerate(step.draws):
        p = d.params
        draws[i] = (p.temperature, p.top_p, p.min_p, p.top_k, p.seed, d.position, d.ignore_eos, d.grammar)
    return b"".join(
        (
            _HEAD.pack(len(step.tokens), len(step.draws)),
            np.ascontiguousarray(step.tokens, dtype="<i4").tobytes(),
            np.ascontiguousarray(step.positions, dtype="<i4").tobytes(),
            np.ascontiguousarray(step.seqs, dtype="<i4").tobytes(),
            np.ascontiguousarray(step.want, dtype="i1").tobytes(),
            draws.tobytes(),
        )
    )


def decode_step(payload: memoryview) -> Step:
    n, m = _HEAD.unpack_from(payload)
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
        )
        for r in records
    ]
    return Step(arrays[0], arrays[1], arrays[2], arrays[3], draws)


def ints(*values: int) -> bytes:
    """Small integer arguments (slots, lengths, handles) as little-endian i64s."""
    return struct.pack(f"<{len(values)}q", *values)


def read_ints(payload: memoryview, count: int) -> tuple[int, ...]:
    return struct.unpack_from(f"<{count}q", payload)
