"""The twin's output text: one word per token from a small fixed vocabulary, stop strings honoured.

Words are drawn from a per-request random stream, so a run with the same seed and the same
request order produces the same text. Every word after the first carries a leading space, so a
completion reads as plain words and stop strings can span tokens.
"""

from __future__ import annotations

import random

VOCABULARY = (
    "the",
    "a",
    "model",
    "token",
    "draft",
    "verify",
    "batch",
    "stream",
    "server",
    "request",
    "fast",
    "slow",
    "speculative",
    "decoding",
    "accepts",
    "rejects",
    "and",
    "or",
    "of",
    "to",
    "in",
    "on",
    "with",
    "for",
    "each",
    "step",
    "runs",
    "waits",
    "queue",
    "cache",
    "context",
    "prompt",
    "answer",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "router",
    "pool",
    "base",
    "spec",
    "load",
    "latency",
    "throughput",
    "goodput",
    "is",
    "was",
    "will",
    "can",
    "not",
    "more",
    "less",
    "than",
    "then",
    "so",
    "it",
    "this",
    "GPU",
    "kernel",
    "graph",
    "tensor",
)


class TextStream:
    """Generates the text of one completion and finds the first stop string in it.

    Only the text not yet taken is kept. Text that could still turn out to be the start of a
    stop string is held back until the next tokens decide it, so a client never sees part of a
    stop string; hence a stop string can never begin inside text already taken.
    """

    __slots__ = ("_rng", "_stop", "_hold", "_pending", "_started", "stopped", "matched_stop")

    def __init__(self, seed: int, stop: tuple[str, ...] = ()):
        self._rng = random.Random(seed)
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""
        self._started = False
        self.stopped = False
        self.matched_stop: str | None = None

    def extend(self, n_tokens: int) -> int:
        """Append up to n tokens; returns how many were used (fewer when a stop string ends it)."""
        choice = self._rng.choice
        for used in range(1, n_tokens + 1):
            before = len(self._pending)
            word = choice(VOCABULARY)
            self._pending += (" " + word) if self._started else word
            self._started = True
            # A new match must end in this word, so it starts at most `hold` characters earlier.
            if self._stop and self._find_stop(max(0, before - self._hold)):
                return used
        return n_tokens

    def _find_stop(self, start: int) -> bool:
        best = -1
        for s in self._stop:
            i = self._pending.find(s, start)
            if i >= 0 and (best < 0 or i < best):
                best, self.matched_stop = i, s
        if best < 0:
            return False
        self._pending = self._pending[:best]
        self.stopped = True
        return True

    def take(self, final: bool) -> str:
        """The text not yet taken; the tail that may begin a stop string waits unless final."""
        end = len(self._pending)
        if not final and self._stop and not self.stopped:
            end = self._safe_end()
        piece, self._pending = self._pending[:end], self._pending[end:]
        return piece

    def _safe_end(self) -> int:
        text = self._pending
        for cut in range(max(0, len(text) - self._hold), len(text)):
            tail = text[cut:]
            if any(s.startswith(tail) for s in self._stop):
                return cut
        return len(text)
