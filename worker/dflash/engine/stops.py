"""Stop strings, checked incrementally: each committed token decodes only a short window.

Incremental detokenisation as in transformers' TextStreamer and vLLM: the text of the
newest tokens is the decode of a few tokens of context plus the new ones, minus the decode
of that context alone, and it is held back while it ends in an incomplete UTF-8 sequence
(U+FFFD). Only the last `max(len(stop)) - 1` characters of earlier text are kept, which is
all a stop string straddling the boundary can need. So a generation costs O(new tokens)
decoding instead of a decode of the whole output per step.
"""

from __future__ import annotations

CONTEXT_TOKENS = 5  # tokens of left context per decode: enough for merges and leading spaces


class StopStrings:
    def __init__(self, decode, stops: list[str]):
        self.decode = decode  # ids -> text, as the engine decodes its output
        self.stops = list(stops)
        self.keep = max(len(s) for s in self.stops) - 1
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] is the decode context, already turned into text
        self.read = 0
        self.tail = ""  # the last `keep` characters of the text so far
        self.hit_at: int | None = None  # tokens up to and including the one that completed a stop

    def feed(self, token: int) -> bool:
        """Add one committed token; True when a stop string has just been completed."""
        self.ids.append(token)
        before = self.decode(self.ids[self.prefix : self.read])
        after = self.decode(self.ids[self.prefix :])
        if len(after) <= len(before):
            return False  # nothing printable yet (a special token)
        new = after[len(before) :]
        if new.endswith("\ufffd"):
            # A partial character: the text before it is final (a stop may already be in it),
            # but the window moves on only once the character is complete.
            done = new.rstrip("\ufffd")
            if done and any(s in self.tail + done for s in self.stops):
                self.hit_at = len(self.ids)
                return True
            return False
        self.prefix, self.read = max(len(self.ids) - CONTEXT_TOKENS, 0), len(self.ids)
        window = self.tail + new
        self.tail = window[-self.keep :] if self.keep else ""
        if any(s in window for s in self.stops):
            self.hit_at = len(self.ids)
            return True
        return False

    def cut(self, text: str) -> str:
        """The final text, ending before the first stop string in it."""
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return text[: min(hits)] if hits else text
