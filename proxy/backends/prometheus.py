"""The Prometheus text format, as far as load gauges and counters need it."""

from __future__ import annotations

import math


def parse_prometheus(text: str, wanted: frozenset[str], means: frozenset[str] = frozenset()) -> dict[str, float]:
    """Sum of each wanted metric over its label sets (the text format, comments skipped); for
    those in `means`, a ratio such as an accept length, the mean (one series per data-parallel
    rank would otherwise add up the ranks' ratios)."""
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end <= 0:
            continue
        name = line[:name_end]
        if name not in wanted:
            continue
        rest = line[line.rfind("}") + 1 :] if line[name_end] == "{" else line[name_end:]
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        if math.isfinite(value):
            totals[name] = totals.get(name, 0.0) + value
            counts[name] = counts.get(name, 0) + 1
    for name in means:
        if name in totals:
            totals[name] /= counts[name]
    return totals
