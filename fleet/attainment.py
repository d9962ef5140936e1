"""How many of a pool's requests finish within the SLO targets, measured.

Each finished request whose time to first token (as the proxy saw it) and time per output token
(over its decode) are within the targets counts. Over the last `horizon_s` (over the time since
the pool's first finished request while that is shorter, and nothing before `min_window_s` of it)
the rate is their number per second and the share is their part of every request finished. The
state endpoint shows both per pool (docs/routing.md, "What is learned"): under overload the pool
that holds what the fleet cannot serve in time is the one whose share falls. Beside them, every
request that left the pool however it ended (`left`, `finished_rate`): flow control's fair share
of a wait divides by it.
"""

from __future__ import annotations

from collections import deque

ATTAINMENT_HORIZON_S = 60.0
"""Seconds a finished request counts."""
ATTAINMENT_MIN_WINDOW_S = 30.0
"""Seconds of finished requests before a rate or share is given (a shorter window is mostly noise)."""


class SloAttainment:
    """One pool's requests finished within the SLO targets: per second, and their share."""

    def __init__(
        self,
        ttft_s: float = 0.0,
        tpot_s: float = 0.0,
        horizon_s: float = ATTAINMENT_HORIZON_S,
        min_window_s: float = ATTAINMENT_MIN_WINDOW_S,
    ) -> None:
        self.ttft_s = ttft_s
        self.tpot_s = tpot_s
        """The targets (0: that one is not checked; both 0: nothing is measured)."""
        self.horizon_s = horizon_s
        self.min_window_s = min_window_s
        self._since: float | None = None
        self._met: deque[float] = deque()
        """Finish times of the requests that met the targets within the horizon, oldest first."""
        self._finished: deque[float] = deque()
        """Finish times of every request measured (its first token seen) within the horizon, oldest first."""
        self._left_since: float | None = None
        self.left_total = 0
        """Requests that ever left the pool (`left`): flow control's departures since a look."""
        self._left: deque[float] = deque()
        """When each request left its server within the horizon (answered, failed or its client
        gone), oldest first: `finished_rate`."""

    @property
    def enabled(self) -> bool:
        return self.ttft_s > 0 or self.tpot_s > 0

    def observe(self, now: float, ttft_s: float, tpot_s: float | None) -> None:
        """A request finished at `now` with its time to first token and per output token (None:
        not measurable, a single token's: not held against it)."""
        if not self.enabled:
            return
        if self._since is None:
            self._since = now
        if (self.ttft_s <= 0 or ttft_s <= self.ttft_s) and (
            self.tpot_s <= 0 or tpot_s is None or tpot_s <= self.tpot_s
        ):
            self._met.append(now)
        self._finished.append(now)
        self._expire(now)

    def rate(self, now: float) -> float | None:
        """Requests within the targets per second over the horizon; None before `min_window_s`."""
        window = self._window(now)
        if window is None:
            return None
        self._expire(now)
        return len(self._met) / window

    def left(self, now: float) -> None:
        """A request sent to the pool is over there, however it ended."""
        if not self.enabled:
            return
        if self._left_since is None:
            self._left_since = now
        self.left_total += 1
        self._left.append(now)
        self._expire(now)

    def finished_rate(self, now: float) -> float | None:
        """Requests that left the pool per second over the horizon, however they ended (flow
        control's fair share of a wait, by Little's law); None before `min_window_s` of them."""
        if self._left_since is None:
            return None
        window = min(now - self._left_since, self.horizon_s)
        if window < self.min_window_s:
            return None
        self._expire(now)
        return len(self._left) / window

    def share(self, now: float) -> float | None:
        """The part of the requests finished within the horizon that met the targets; None before
        `min_window_s`, or with none finished within it."""
        if self._window(now) is None:
            return None
        self._expire(now)
        return len(self._met) / len(self._finished) if self._finished else None

    def _window(self, now: float) -> float | None:
        if self._since is None:
            return None
        window = min(now - self._since, self.horizon_s)
        return window if window >= self.min_window_s else None

    def _expire(self, now: float) -> None:
        cutoff = now - self.horizon_s
        while self._met and self._met[0] <= cutoff:
            self._met.popleft()
        while self._finished and self._finished[0] <= cutoff:
            self._finished.popleft()
        while self._left and self._left[0] <= cutoff:
            self._left.popleft()
