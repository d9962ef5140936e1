"""How a pool's requests' time per output token came out against the router's prediction.

The policy predicts a request's TPOT from the learned step cost, the accept length and the
prefills it expects to sit through; what the request then gets also depends on what that model
leaves out or has wrong (a step learned from chunk gaps at another batch, the generic prior's
shape, each request's own acceptance against the pool's mean, the requests that join after it).
Each finished stream's TPOT over the TPOT predicted for it when it was sent is one sample; the
median of those finished in the last `horizon_s` is the pool's bias (1: the predictions are right),
taken in part while fewer than `min_samples` finished: 1 + (median - 1) x n / min_samples, so a
pool that finishes few streams a minute is corrected in proportion to its evidence, and one whose
correction cut its traffic returns gradually rather than all at once. Recent samples only: a
correction learned while the cost model was still far off (the first seconds with no profile) fades
once the model has learned, and one learned before the policy stopped sending there does not
outlive the horizon.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque

OUTCOME_HORIZON_S = 60.0
"""Seconds a finished request's sample counts."""
OUTCOME_MIN_SAMPLES = 30
"""Samples within the horizon before the bias is trusted in full (in proportion until then)."""
OUTCOME_MAX_SAMPLES = 2000
"""Samples kept at most (the latest): memory and the cost of keeping them in order stay bounded
however many requests a minute brings."""


class TpotOutcomes:
    """Actual over predicted TPOT of one pool's recently finished requests."""

    def __init__(
        self,
        horizon_s: float = OUTCOME_HORIZON_S,
        min_samples: int = OUTCOME_MIN_SAMPLES,
        max_samples: int = OUTCOME_MAX_SAMPLES,
    ) -> None:
        self.horizon_s = horizon_s
        self.min_samples = min_samples
        self.max_samples = max_samples
        self._recent: deque[tuple[float, float]] = deque()
        """(finished at, ratio), oldest first."""
        self._sorted: list[float] = []
        """The same ratios in order (the median is read per decision)."""

    def observe(self, now: float, actual_s: float, predicted_s: float) -> None:
        """A request finished at `now` with `actual_s` per output token, `predicted_s` predicted."""
        if not (actual_s > 0 and predicted_s > 0 and math.isfinite(actual_s) and math.isfinite(predicted_s)):
            return  # NaN would break the order the median is read from
        self._expire(now)
        if self._recent and len(self._recent) >= self.max_samples:
            self._drop_oldest()
        ratio = actual_s / predicted_s
        self._recent.append((now, ratio))
        insort(self._sorted, ratio)

    def samples(self, now: float) -> int:
        self._expire(now)
        return len(self._sorted)

    def bias(self, now: float) -> float:
        """The median ratio over the horizon, shrunk toward 1.0 by n / `min_samples` below it."""
        self._expire(now)
        n = len(self._sorted)
        if n == 0:
            return 1.0
        median = self._sorted[n // 2]
        if n >= self.min_samples:
            return median
        return 1.0 + (median - 1.0) * n / self.min_samples

    def _expire(self, now: float) -> None:
        cutoff = now - self.horizon_s
        while self._recent and self._recent[0][0] < cutoff:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, ratio = self._recent.popleft()
        del self._sorted[bisect_left(self._sorted, ratio)]
