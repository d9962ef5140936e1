"""goodput's parameters (SPECROUTE_GOODPUT_*), apart from the policy: a pydantic model cannot be
compiled by mypyc, and policies/goodput.py is (fleet/native.py)."""

from __future__ import annotations

from pydantic import Field

from policies.base import PolicyParams


class GoodputParams(PolicyParams):
    """SPECROUTE_GOODPUT_*: what the policy assumes before it has learned, and the SLO."""

    output_tokens: int = Field(
        256, ge=1, description="output tokens to plan for when a request does not run to max_tokens."
    )
    default_alpha: float = Field(
        0.5, ge=0, lt=1, description="acceptance assumed before the spec pool has reported any."
    )
    externality: float = Field(1.0, ge=0, description="weight of the slowdown a request causes the batch it joins.")
    slo_ttft_s: float = Field(
        0.0, ge=0, description="time-to-first-token target in seconds (0: none); see SLO-aware routing."
    )
    slo_tpot_ms: float = Field(0.0, ge=0, description="time-per-output-token target in milliseconds (0: none).")
    cache_credit: bool = Field(
        True,
        description="credit each instance's cached prompt prefix in its prefill and choose the instance by it.",
    )
