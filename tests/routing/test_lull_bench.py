"""bench.lull's cell: a lull without a profile no longer takes what the router learned with it.

kimi-moe, the router seeded with the generic prior (3x too fast there): a minute at half the
fleet's capacity, three minutes of nothing, then a burst at 90 %. Aging by the wall clock, every
correction was back at the seed when the burst came, and the burst was checked against a fleet
3x faster than it is; aging by observed time, the lull counts one half-life and the burst meets
its targets more often: over seeds 0-4, 9.51 against 8.78 requests/s within the SLO on average
(seed 0 a tie; 9.42 against 8.70 before the servers' prefill counters were read with the
iterations their prompts' gaps imply).
"""

from __future__ import annotations

from bench import lull

SEEDS = (0, 1, 2, 3, 4)


def test_a_burst_after_a_lull_is_served_on_what_was_learned_before_it() -> None:
    observed, wall = (lull.execute(lull.Job("kimi-moe a=0.64", 0.9, aging), seeds=SEEDS) for aging in lull.AGING)
    assert observed["summary"]["requests"] == wall["summary"]["requests"] > 50  # the same burst
    assert observed["summary"]["slo_goodput_rps"] > 1.05 * wall["summary"]["slo_goodput_rps"]
    section = lull.report([observed, wall], 1.0, seeds=SEEDS)
    assert "| kimi-moe a=0.64 | 90% |" in section
