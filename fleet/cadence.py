"""How often the router reads its servers: shared by the proxy's pollers and the evaluation's
virtual router, so that what is evaluated reads the fleet as the served proxy does."""

from __future__ import annotations

POLL_INTERVAL_S = 0.1
"""The default load poll period (SPECROUTE_POLL_INTERVAL_MS)."""
COUNTERS_EVERY = 5
"""On a spec instance polled through /v1/loads, /metrics' counters and gauge are read every this
many polls (the poll that reads them is the first of each group: `reads_counters`)."""
GAUGE_INTERVAL_STEPS = 40
"""Decode iterations behind sglang:spec_accept_length (SGLang's --decode-log-interval default)."""


def reads_counters(poll: int) -> bool:
    """Whether poll number `poll` (1, 2, ... per instance) also reads the counters."""
    return poll % COUNTERS_EVERY == 1


def gauge_steps(running: float) -> float:
    """About how many request-verify steps the accept-length gauge covers at `running` requests."""
    return GAUGE_INTERVAL_STEPS * running
