"""The separator count that bounds a body's values: exact outside strings, whatever the escapes
and wherever the body is cut into pieces (random JSON from a fixed seed)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from proxy import body

CHARS = list(',:"\\{}[] ab\n\u00e9')


def text(rng: random.Random) -> str:
    return "".join(rng.choice(CHARS) for _ in range(rng.randrange(12)))


def value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(5 if depth < 4 else 3)
    if kind == 0:
        return rng.choice([None, True, 12, -3.5])
    if kind in (1, 2):
        return text(rng)
    if kind == 3:
        return [value(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {text(rng): value(rng, depth + 1) for _ in range(rng.randrange(5))}


def separators(item: Any) -> int:
    if isinstance(item, list):
        return max(len(item) - 1, 0) + sum(separators(v) for v in item)
    if isinstance(item, dict):
        return max(len(item) - 1, 0) + len(item) + sum(separators(v) for v in item.values())
    return 0


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 64 * 1024])
def test_only_separators_outside_strings_count(monkeypatch: pytest.MonkeyPatch, piece: int) -> None:
    monkeypatch.setattr(body, "SCAN_BYTES", piece)
    rng = random.Random(piece)
    for _ in range(300):
        item = value(rng)
        raw = json.dumps(item, ensure_ascii=False).encode()
        assert body.separators_outside_strings(raw, 10**9) == separators(item), raw


def test_counting_stops_past_the_limit() -> None:
    raw = b"[" + b",".join([b"0"] * 1_000_000) + b"]"
    assert 100 < body.separators_outside_strings(raw, 100) < 1_000_000
