"""`threshold`: speculate while the spec pool is quiet, with hysteresis so routing does not flap.

The load is that of the spec instance a request would join (running + waiting). In spec mode the
policy leaves for base once that load reaches `exit`; in base mode it returns once the load falls
below `enter` (enter < exit). Both thresholds scale with the observed acceptance: speculation pays
to a larger batch when more drafts are accepted, so they are multiplied by
(tau(alpha) - 1) / (tau(reference_alpha) - 1), clamped to [0.25, 2].
"""

from __future__ import annotations

from pydantic import Field

from fleet.acceptance import accept_length
from fleet.types import Decision, Features, PoolName, Snapshot
from policies.base import PolicyParams, one_pool_left
from policies.registry import register


class ThresholdParams(PolicyParams):
    """SPECROUTE_THRESHOLD_*: the two loads of the hysteresis."""

    enter: float = Field(24, gt=0, description="spec load below which traffic returns to spec.")
    exit: float = Field(40, gt=0, description="spec load at which traffic leaves for base.")

    def problems(self) -> list[str]:
        return (
            [f"{{enter}} ({self.enter:g}) must not exceed {{exit}} ({self.exit:g})"] if self.enter > self.exit else []
        )


@register(
    "threshold",
    params=ThresholdParams,
    decisions=(
        ("under-threshold", "spec"),
        ("over-threshold", "base"),
        ("stale", "base"),
        ("spec-down", "base"),
        ("base-down", "spec"),
        ("none-healthy", "base"),
        ("base-only", "base"),
        ("spec-only", "spec"),
    ),
)
class Threshold:
    name = "threshold"

    def __init__(
        self, params: ThresholdParams | None = None, *, reference_alpha: float = 0.6, scale_with_alpha: bool = True
    ):
        params = params or ThresholdParams()
        self.enter = float(params.enter)
        self.exit = float(params.exit)
        self.reference_alpha = reference_alpha
        self.scale_with_alpha = scale_with_alpha
        self._mode: PoolName = "spec"

    def thresholds(self, alpha: float | None, k: int, max_running: int) -> tuple[float, float]:
        scale = 1.0
        if self.scale_with_alpha and alpha is not None and k > 0:
            gain = accept_length(alpha, k) - 1
            ref = accept_length(self.reference_alpha, k) - 1
            scale = min(max(gain / ref, 0.25), 2.0) if ref > 0 else 1.0
        # Never plan to queue on the spec pool: exit at the latest when its cap is reached.
        exit_at = min(self.exit * scale, float(max_running))
        return min(self.enter * scale, exit_at), exit_at

    def decide(self, features: Features, snapshot: Snapshot) -> Decision:
        unavailable = one_pool_left(snapshot)
        if unavailable is not None:
            return unavailable
        spec = snapshot.pool("spec")
        assert spec is not None  # one_pool_left answered otherwise
        joined = spec.least_loaded()
        assert joined is not None
        enter, exit_at = self.thresholds(spec.alpha, spec.num_draft_tokens, joined.max_running)
        scores = {"spec_load": joined.load, "enter": enter, "exit": exit_at}
        if spec.stale:
            return Decision(pool="base", reason="stale", scores=scores)
        if self._mode == "spec" and joined.load >= exit_at:
            self._mode = "base"
        elif self._mode == "base" and joined.load < enter:
            self._mode = "spec"
        reason = "under-threshold" if self._mode == "spec" else "over-threshold"
        return Decision(pool=self._mode, reason=reason, scores=scores)
