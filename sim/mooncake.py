"""The Mooncake traces (Kimi's service, FAST'25 release) as the twin's virtual-clock arrivals.

    rows = read_mooncake()                      # the shipped sample (sim/data, Apache-2.0)
    rows = read_mooncake("/path/to/mooncake-conversation.jsonl")
    arrivals = mooncake_arrivals(rows[:1500], scale=0.25)

One JSON object a line: `timestamp` (ms from the start), `input_length`, `output_length`
(tokens), `hash_ids`: remapped hashes of the prompt's 512-token blocks (the last one partial;
equal ids are the same prefix blocks). Attribution: Qin et al., "Mooncake: A KVCache-centric
Disaggregated Architecture for LLM Serving", FAST 2025; kvcache-ai/Mooncake, Apache-2.0.
"""

from __future__ import annotations

import io
import json
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

from sim.virtual import Arrival

BLOCK_TOKENS = 512
"""Tokens per `hash_ids` block in the Mooncake traces."""
SAMPLE = "mooncake-conversation-3000.jsonl"
"""The shipped sample: the conversation trace's first 3,000 requests, unchanged."""


@dataclass(frozen=True, slots=True)
class MooncakeRow:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def parse_mooncake(lines: Iterable[str]) -> tuple[MooncakeRow, ...]:
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            rows.append(
                MooncakeRow(
                    int(obj["timestamp"]),
                    int(obj["input_length"]),
                    int(obj["output_length"]),
                    tuple(int(h) for h in obj["hash_ids"]),
                )
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"line {n}: not a Mooncake trace record ({exc})") from None
    return tuple(rows)


@cache
def read_mooncake(path: str | None = None) -> tuple[MooncakeRow, ...]:
    """A Mooncake trace: the shipped sample (None) or a JSONL file by path."""
    if path is None:
        with (resources.files("sim") / "data" / SAMPLE).open("rb") as raw, io.TextIOWrapper(raw) as f:
            return parse_mooncake(f)
    with Path(path).open() as f:
        return parse_mooncake(f)


def mooncake_arrivals(rows: Sequence[MooncakeRow], scale: float = 1.0) -> list[Arrival]:
    """One arrival per row, times from the first row's (seconds) multiplied by `scale` (< 1
    compresses time: a higher rate), the prompt's blocks as `prefix` (512 tokens each). The
    natural output length is the trace's (at least one token); no `max_tokens`, as the routing
    evaluation sends its requests."""
    if not rows:
        return []
    t0 = rows[0].timestamp_ms
    return [
        Arrival(
            time=(r.timestamp_ms - t0) / 1000.0 * scale,
            prompt_tokens=max(r.input_length, 1),
            output_tokens=max(r.output_length, 1),
            prefix=r.hash_ids,
            prefix_block_tokens=BLOCK_TOKENS,
        )
        for r in rows
    ]


@dataclass(frozen=True)
class Reuse:
    """How much of a request stream's prompts was seen before (an unbounded cache's view)."""

    requests: int
    prompt_tokens: int
    blocks: int
    blocks_seen: int
    """Blocks whose id appeared in an earlier request, wherever in the prompt."""
    prefix_tokens_seen: int
    """Tokens of each prompt's longest leading run of blocks seen before (full blocks only, at
    most prompt - 1, as a prefix cache would serve them)."""

    @property
    def block_share(self) -> float:
        return self.blocks_seen / self.blocks if self.blocks else 0.0

    @property
    def token_share(self) -> float:
        """Prefix tokens seen before / all prompt tokens: the hit rate of one unbounded cache."""
        return self.prefix_tokens_seen / self.prompt_tokens if self.prompt_tokens else 0.0


def reuse(arrivals: Iterable[Arrival]) -> Reuse:
    """Prefix reuse of arrivals in the order given (those without `prefix` count as unseen)."""
    seen: set[Hashable] = set()
    requests = tokens = blocks = blocks_seen = prefix_seen = 0
    for a in arrivals:
        requests += 1
        tokens += a.prompt_tokens
        if a.prefix is None:
            continue
        full = min(len(a.prefix), a.prompt_tokens // a.prefix_block_tokens)
        leading = 0
        while leading < full and a.prefix[leading] in seen:
            leading += 1
        prefix_seen += min(leading * a.prefix_block_tokens, max(a.prompt_tokens - 1, 0))
        blocks += len(a.prefix)
        blocks_seen += sum(1 for b in a.prefix if b in seen)
        seen.update(a.prefix)
    return Reuse(requests, tokens, blocks, blocks_seen, prefix_seen)
