"""Generated tokens, split into channel runs with their text.

The splitter turns each sampled token into a `Piece`: which channel it belongs to (0
text, 1 reasoning, 2 tool call) and the text it completes. Text is decoded
incrementally, so a character split across tokens appears once, whole. Marker tokens
(`<think>`, `</tool_call>`) stay in a run's span but not in its text; an opening marker
starts a run of its channel and the closing one ends it (`closes`).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass

from ..protocol.schema import CHANNEL_TEXT


@dataclass(frozen=True)
class MarkerPair:
    """Token ids that open and close a channel."""

    channel: int
    open: int
    close: int


@dataclass
class Piece:
    """One token's contribution to a run: its channel, id and completed text."""

    channel: int
    token: int
    text: str
    closes: bool = False


class ChannelSplitter:
    """Classifies a generation's tokens into channels, one token at a time."""

    def __init__(self, pieces: Sequence[bytes], markers: Sequence[MarkerPair] = (), channel: int = CHANNEL_TEXT):
        self._pieces = pieces
        self._opens = {m.open: m for m in markers}
        self._closes = {m.close: m for m in markers}
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.channel = channel

    def feed(self, token: int) -> Piece:
        marker = self._opens.get(token)
        if marker is not None and self.channel == CHANNEL_TEXT:
            self.channel = marker.channel
            return Piece(marker.channel, token, self._drain())
        marker = self._closes.get(token)
        if marker is not None and self.channel == marker.channel:
            piece = Piece(marker.channel, token, self._drain(), closes=True)
            self.channel = CHANNEL_TEXT
            return piece
        return Piece(self.channel, token, self._decoder.decode(self._pieces[token]))

    def _drain(self) -> str:
        return self._decoder.decode(b"", final=True)

    def flush(self) -> str:
        """Text held back waiting for the rest of a character, at the end of a generation."""
        return self._drain()
