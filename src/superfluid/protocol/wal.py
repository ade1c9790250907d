"""The reference daemon's `wal.log` format, so its session logs can be read here.

A v2 log is the magic `BRTWAL02` then frames; a v1 log has no magic and no timestamps.
A frame is a u32-LE payload length, the u64-LE xxh3-64 of the payload, and the payload:
postcard of (session, event_id, epoch, [ts_unix_ms,] body). A torn last frame (short,
or failing its checksum with only zeros after it) ends the log; a bad frame followed by
data, or a payload that does not decode, means the log is corrupt.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from . import postcard
from .schema import EventBody, EventMsg
from .types import U64, Struct

MAGIC = b"BRTWAL02"
MAX_RECORD = 1 << 30
HEADER = 12


class WalCorrupt(ValueError):
    """The log is damaged somewhere other than its tail."""


class RecordV2(Struct):
    """A record of a v2 log."""

    session: U64
    event_id: U64
    epoch: U64
    ts_unix_ms: U64
    body: EventBody


class RecordV1(Struct):
    """A record of a v1 log: no commit time."""

    session: U64
    event_id: U64
    epoch: U64
    body: EventBody


@dataclass(frozen=True)
class WalRecord:
    """One record of a reference log: its session and event."""

    session: int
    event: EventMsg


def encode_record(session: int, event: EventMsg) -> bytes:
    """One v2 frame: length, checksum, payload."""
    record = RecordV2(session, event.event_id, event.epoch, event.ts_unix_ms, event.body)
    payload = postcard.encode(record)
    return len(payload).to_bytes(4, "little") + xxhash.xxh3_64_intdigest(payload).to_bytes(8, "little") + payload


def read_log(data: bytes) -> tuple[list[WalRecord], int]:
    """Every good record of a log file, and the length of its good part (the rest is a torn tail)."""
    if data.startswith(MAGIC) or (len(data) < len(MAGIC) and MAGIC.startswith(data)):
        version, pos = 2, min(len(data), len(MAGIC))
    else:
        version, pos = 1, 0
    records: list[WalRecord] = []
    while True:
        if pos + HEADER > len(data):
            return records, pos
        length = int.from_bytes(data[pos : pos + 4], "little")
        if length > MAX_RECORD:
            raise WalCorrupt(f"record at byte {pos} claims {length} bytes, beyond the 1 GiB limit")
        end = pos + HEADER + length
        if end > len(data):
            return records, pos
        payload = data[pos + HEADER : end]
        if xxhash.xxh3_64_intdigest(payload) != int.from_bytes(data[pos + 4 : pos + 12], "little"):
            if not data[end:].strip(b"\x00"):
                return records, pos
            raise WalCorrupt(f"record at byte {pos} fails its checksum and data follows it")
        records.append(_decode_payload(payload, version, pos))
        pos = end


def _decode_payload(payload: bytes, version: int, pos: int) -> WalRecord:
    try:
        record = postcard.decode(payload, RecordV2 if version == 2 else RecordV1)
    except postcard.DecodeError as e:
        raise WalCorrupt(f"record at byte {pos} does not decode: {e}") from None
    ts = record.ts_unix_ms if version == 2 else 0
    return WalRecord(record.session, EventMsg(record.event_id, record.epoch, ts, record.body))
