"""Sessions a client named: where each one's last request went, and how long its prompt was.

A client may name its conversation (the proxy reads `x-specroute-session`, else the OpenAI
`prompt_cache_key`, else `user`: proxy/routing.py). Naming one asserts that its requests extend
each other, so the instance that served the last one holds that prompt in its prefix cache
(until it evicts it): `FleetModel.cached` credits it with up to the last prompt's tokens, as the
prefix index credits what it matched. The index recognises most conversations by their prefix
anyway; a name also covers what the index cannot see (a prompt shorter than one block, an entry
the index evicted first) and keeps a conversation together while its turns are short.

Bounded: at most `max_sessions` (least recently used go first), each forgotten `ttl_s` after its
last request. Keys are whatever the caller gives (the proxy hashes client strings first). Pure:
every call takes `now`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_MAX_SESSIONS = 10_000
DEFAULT_SESSION_TTL_S = 600.0
MAX_UNANSWERED = 16
"""Most unanswered requests of one session a refusal can step back over."""


@dataclass(slots=True)
class SessionEntry:
    instance: str
    prompt_tokens: int
    at: float
    previous: SessionEntry | None = None
    """Where the session pointed before, kept while this request is unanswered (a refusal
    returns the session there); None once it is answered, or when it pointed nowhere."""


class SessionTable:
    """session key -> the instance its last request went to (see the module's docstring)."""

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS, ttl_s: float = DEFAULT_SESSION_TTL_S):
        if max_sessions < 0 or ttl_s <= 0:
            raise ValueError("max_sessions must be >= 0 and ttl_s positive")
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, SessionEntry] = OrderedDict()

    def get(self, key: str, now: float) -> SessionEntry | None:
        """The session's last request, unless it is older than the TTL (then it is dropped)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if now - entry.at > self.ttl_s:
            del self._entries[key]
            return None
        return entry

    def put(self, key: str, instance: str, prompt_tokens: int, now: float) -> None:
        """The session's latest request went to `instance` with `prompt_tokens`."""
        if self.max_sessions == 0:
            return
        entry = self._entries[key] = SessionEntry(instance, prompt_tokens, now, self.get(key, now))
        # Unanswered requests of one session chain their entries; a caller that never settles
        # them (or a client with hundreds in flight) must not grow the chain without bound.
        for _ in range(MAX_UNANSWERED):
            if entry.previous is None:
                break
            entry = entry.previous
        else:
            entry.previous = None
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_sessions:
            self._entries.popitem(last=False)
        # Expired entries at the old end go too, so an idle table shrinks as it is used.
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if now - oldest.at <= self.ttl_s:
                break
            self._entries.popitem(last=False)

    def settle(self, key: str, instance: str, at: float) -> None:
        """The session's request sent to `instance` at `at` was answered: the session held there
        then, so a later refusal returns it no further back."""
        entry = self._entries.get(key)
        while entry is not None:
            if entry.instance == instance and entry.at == at:
                entry.previous = None
                return
            entry = entry.previous

    def restore(self, key: str, instance: str, at: float) -> None:
        """The session's request sent to `instance` at `at` was refused: it never pointed there.
        The session points where it did before (nowhere, if that request named it first), and
        a later request that moved it on returns, if refused too, past this one."""
        entry = self._entries.get(key)
        after: SessionEntry | None = None
        while entry is not None:
            if entry.instance == instance and entry.at == at:
                if after is not None:
                    after.previous = entry.previous
                elif entry.previous is None:
                    del self._entries[key]
                else:
                    self._entries[key] = entry.previous
                return
            after, entry = entry, entry.previous

    def forget_instance(self, instance: str) -> None:
        """The instance's cache is gone: its sessions no longer hold a prefix there, nor return
        there when a later request of theirs is refused."""
        for key in list(self._entries):
            entry = self._entries[key]
            if entry.instance == instance:
                del self._entries[key]
                continue
            while entry.previous is not None:
                if entry.previous.instance == instance:
                    entry.previous = entry.previous.previous
                else:
                    entry = entry.previous

    def __len__(self) -> int:
        return len(self._entries)
