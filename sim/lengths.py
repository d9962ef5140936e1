"""Natural output lengths: how many tokens a twin request generates before its "EOS".

Spellings (the `--output-len` option):
- `azure-conv` (default) / `azure-code`: drawn from the GeneratedTokens column of the Azure LLM
  inference trace 2023 (sim/data, CC-BY 4.0);
- `fixed:N`: always N tokens;
- `exp:MEAN`: exponential with the given mean (at least 1 token);
- `uniform:LO,HI`: uniform integers in [LO, HI].
"""

from __future__ import annotations

import csv
import io
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources

TRACES = {"azure-conv": "azure-llm-2023-conv.csv", "azure-code": "azure-llm-2023-code.csv"}


@dataclass(frozen=True)
class TraceRow:
    timestamp: str
    context_tokens: int
    generated_tokens: int


@cache
def read_trace(name: str) -> tuple[TraceRow, ...]:
    """One of the shipped Azure traces, by name (azure-conv, azure-code)."""
    try:
        filename = TRACES[name]
    except KeyError:
        raise ValueError(f"unknown trace {name!r}; choose one of {', '.join(TRACES)}") from None
    # Binary, wrapped here: Traversable.open promises no newline= (not every resource reader takes it).
    with (resources.files("sim") / "data" / filename).open("rb") as raw, io.TextIOWrapper(raw, newline="") as f:
        return tuple(
            TraceRow(r["TIMESTAMP"], int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)
        )


@dataclass(frozen=True)
class OutputLengths:
    spelling: str
    _values: tuple[int, ...] = ()
    _exp_mean: float = 0.0
    _uniform: tuple[int, int] = (0, 0)

    def draw(self, rng: random.Random) -> int:
        if self._values:
            return self._values[int(rng.random() * len(self._values))]
        if self._exp_mean:
            return max(1, round(rng.expovariate(1.0 / self._exp_mean)))
        return rng.randint(*self._uniform)

    @property
    def mean(self) -> float:
        if self._values:
            return sum(self._values) / len(self._values)
        if self._exp_mean:
            return self._exp_mean
        return sum(self._uniform) / 2


def parse_output_lengths(spelling: str) -> OutputLengths:
    kind, _, arg = spelling.partition(":")
    try:
        if spelling in TRACES:
            values: Sequence[int] = [max(1, r.generated_tokens) for r in read_trace(spelling)]
            return OutputLengths(spelling, tuple(values))
        if kind == "fixed" and int(arg) >= 1:
            return OutputLengths(spelling, (int(arg),))
        if kind == "exp" and float(arg) > 0:
            return OutputLengths(spelling, _exp_mean=float(arg))
        if kind == "uniform":
            lo, hi = (int(x) for x in arg.split(","))
            if 1 <= lo <= hi:
                return OutputLengths(spelling, _uniform=(lo, hi))
    except ValueError:
        pass
    raise ValueError(
        f"bad output length distribution {spelling!r}: use azure-conv, azure-code, fixed:N, exp:MEAN or uniform:LO,HI"
    )
