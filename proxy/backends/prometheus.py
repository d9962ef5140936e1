"""The Prometheus text format, as far as load gauges and counters need it."""

from __future__ import annotations

import math
from collections.abc import Iterator


def parse_prometheus(text: str, wanted: frozenset[str], means: frozenset[str] = frozenset()) -> dict[str, float]:
    """Sum of each wanted metric over its label sets (the text format, comments skipped); for
    those in `means`, a ratio such as an accept length, the mean (one series per data-parallel
    rank would otherwise add up the ranks' ratios)."""
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    for name, _, value in samples(text, wanted):
        totals[name] = totals.get(name, 0.0) + value
        counts[name] = counts.get(name, 0) + 1
    for name in means:
        if name in totals:
            totals[name] /= counts[name]
    return totals


def parse_prometheus_by(text: str, wanted: frozenset[str], label: str) -> dict[str, dict[str, float]]:
    """Each wanted metric summed over its label sets apart for each value of `label` (vLLM's
    `engine`, one per data-parallel engine); series without it under ""."""
    groups: dict[str, dict[str, float]] = {}
    for name, labels, value in samples(text, wanted):
        totals = groups.setdefault(label_value(labels, label), {})
        totals[name] = totals.get(name, 0.0) + value
    return groups


def samples(text: str, wanted: frozenset[str]) -> Iterator[tuple[str, str, float]]:
    """The wanted metrics' samples: name, label text (between the braces) and finite value."""
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end <= 0:
            continue
        name = line[:name_end]
        if name not in wanted:
            continue
        labelled = line[name_end] == "{"
        close = line.rfind("}")
        rest = line[close + 1 :] if labelled else line[name_end:]
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        if math.isfinite(value):
            yield name, line[name_end + 1 : close] if labelled else "", value


def label_value(labels: str, label: str) -> str:
    """One label's value in a sample's label text ("" when absent or unreadable), escapes kept
    as written: the pairs are read in turn, so a quoted value that looks like a pair is none."""
    at, n = 0, len(labels)
    while at < n:
        eq = labels.find("=", at)
        if eq < 0 or eq + 1 >= n or labels[eq + 1] != '"':
            return ""
        key = labels[at:eq].strip(" ,")
        end = eq + 2
        while end < n and labels[end] != '"':
            end += 2 if labels[end] == "\\" else 1
        if key == label:
            return labels[eq + 2 : end]
        at = end + 1
    return ""
