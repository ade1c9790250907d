"""Generated tokens, split into channel runs with their text.

The splitter watches the decoded text for the markers of the model's dialect
(`model.dialects`): by default `<think>`...`</think>` opens and closes the reasoning channel
(1), `<tool_call>`...`</tool_call>` the tool-call channel (2); everything else is text (0).
A marker of the text channel is markup that is dropped (Harmony's headers); a call marker
with no close runs to the end of the reply, and a `leading` one opens only before any text
(Llama 3's bare JSON call). Markers are matched on text, so they work whether the
vocabulary has them as one special token or spells them out in pieces. Tokens that might
be the start of a marker are held back until it is clear, and where one marker is the
start of a longer one the longer wins; a marker's tokens stay in its run's span, its text
never reaches a run's text. A call's text (what the dialect parses) keeps its markers.
Text is decoded incrementally, so a character split across tokens appears once, whole.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..protocol.schema import CHANNEL_REASONING, CHANNEL_TEXT, CHANNEL_TOOL_CALL


@dataclass(frozen=True)
class Markers:
    """The text that opens and closes one channel ("" closes at the end of the reply)."""

    channel: int
    open: str
    close: str
    leading: bool = False  # opens only before the reply's first text


THINK = Markers(CHANNEL_REASONING, "<think>", "</think>")
TOOL_CALL = Markers(CHANNEL_TOOL_CALL, "<tool_call>", "</tool_call>")


@dataclass
class Piece:
    """Tokens and the text they complete, in one channel; `closes` ends that channel's run."""

    channel: int
    tokens: list[int]
    text: str
    closes: bool = False
    call: str | None = None  # on the piece that closes a tool call: the call's whole text


@dataclass
class ChannelSplitter:
    """Classifies a generation's tokens into channels, one token at a time."""

    pieces: Sequence[bytes]
    markers: Sequence[Markers] = (THINK, TOOL_CALL)
    channel: int = CHANNEL_TEXT
    call_text: str = ""  # the open tool call's text so far, its markers included
    fresh: bool = True  # no text yet in this reply (a leading marker may open)
    _opened: Markers | None = None  # the marker that opened the current channel
    _held_tokens: list[int] = field(default_factory=list)
    _held_text: str = ""
    _replayed: int = 0  # leading characters of _held_text that were committed before (priming)

    def __post_init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def prime(self, tokens: Sequence[int], *, fresh: bool = True) -> None:
        """Replay an open turn's tokens, so a continuation starts in the channel it was left in;
        `fresh` when the turn has no text yet."""
        for token in tokens:
            self.feed(token)
        self._held_tokens = []
        self._replayed = len(self._held_text)
        self.fresh = fresh

    def feed(self, token: int) -> list[Piece]:
        self._held_tokens.append(token)
        self._held_text += self._decoder.decode(self.pieces[token])
        return self._scan()

    def flush(self) -> list[Piece]:
        """Everything held back, at the end of a generation."""
        self._held_text += self._decoder.decode(b"", final=True)
        out = [self._emit(self._held_tokens, self._held_text)] if self._held_tokens or self._held_text else []
        self._held_tokens, self._held_text, self._replayed = [], "", 0
        return [p for p in out if p.tokens or p.text]

    def _in_play(self) -> list[tuple[str, Markers, bool]]:
        """Marker texts that can occur now: (text, markers, opens)."""
        if self.channel == CHANNEL_TEXT:
            return [(m.open, m, True) for m in self.markers if self.fresh or not m.leading]
        opened = self._opened
        return [(opened.close, opened, False)] if opened is not None and opened.close else []

    def _next_marker(self) -> tuple[int, str, Markers, bool] | None:
        """The first whole marker in the held text; None also while a longer marker may still be
        forming where it starts."""
        in_play = self._in_play()
        hits = [(self._held_text.find(text), -len(text), text, m, opens) for text, m, opens in in_play if text]
        # a leading marker after text is no marker
        hits = [hit for hit in hits if hit[0] >= 0 and not (hit[3].leading and self._held_text[: hit[0]].strip())]
        if not hits:
            return None
        at, _, text, marker, opens = min(hits, key=lambda hit: hit[:2])
        rest = self._held_text[at:]
        if any(len(other) > len(rest) and other.startswith(rest) for other, _, _ in in_play):
            return None
        return at, text, marker, opens

    def _scan(self) -> list[Piece]:
        out: list[Piece] = []
        # where no marker's first character is held, none is whole or forming: the common token skips the
        # search, which the scheduler's thread would otherwise make once per token
        while any(text[:1] in self._held_text for text, _, _ in self._in_play()) and (found := self._next_marker()):
            at, text, marker, opens = found
            before = self._held_text[:at]
            after = self._held_text[at + len(text) :]
            if opens and marker.channel == CHANNEL_TEXT:  # markup to drop
                out.append(self._emit(self._held_tokens, before))
            elif opens:
                if before:
                    out.append(self._emit([], before))
                self.channel, self._opened = marker.channel, marker
                self.call_text = text if marker.channel == CHANNEL_TOOL_CALL else ""
                out.append(Piece(marker.channel, self._held_tokens, ""))
            else:
                piece = self._emit(self._held_tokens, before, closes=True)
                if marker.channel == CHANNEL_TOOL_CALL:
                    piece.call = self.call_text + text
                out.append(piece)
                self.channel, self._opened = CHANNEL_TEXT, None
            self._held_tokens, self._held_text = [], after
            self._replayed = max(0, self._replayed - at - len(text))
        if not any(_ends_with_prefix(self._held_text, text) for text, _, _ in self._in_play()):
            if self._held_tokens or self._held_text:
                out.append(self._emit(self._held_tokens, self._held_text))
            self._held_tokens, self._held_text, self._replayed = [], "", 0
        return [p for p in out if p.tokens or p.text or p.closes]

    def _emit(self, tokens: list[int], text: str, closes: bool = False) -> Piece:
        unseen = text[self._replayed :]  # text an earlier event already committed is not repeated
        self._replayed = max(0, self._replayed - len(text))
        if self.channel == CHANNEL_TOOL_CALL:
            self.call_text += text
        elif self.channel == CHANNEL_TEXT and text.strip():
            self.fresh = False
        return Piece(self.channel, tokens, unseen, closes)


def _ends_with_prefix(text: str, marker: str) -> bool:
    """Whether `text` ends with a proper prefix of `marker` (a marker may be starting)."""
    tail = text[max(0, len(text) - len(marker) + 1) :]
    # only a tail holding the marker's first character can end with a prefix of it
    return marker[:1] in tail and any(tail.endswith(marker[:n]) for n in range(1, len(marker)))
