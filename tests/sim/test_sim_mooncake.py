"""The Mooncake trace reader: the shipped sample, arrivals with 512-token block prefixes, reuse."""

import pytest

from sim.mooncake import BLOCK_TOKENS, mooncake_arrivals, parse_mooncake, read_mooncake, reuse
from sim.virtual import Arrival


def test_the_shipped_sample_is_the_conversation_traces_first_3000_requests():
    rows = read_mooncake()
    assert len(rows) == 3000
    first = rows[0]
    assert (first.timestamp_ms, first.input_length, first.output_length) == (0, 6758, 500)
    assert first.hash_ids == tuple(range(14))
    assert rows[-1].timestamp_ms == 987000
    # Every prompt has one id per 512-token block, the last one partial.
    assert all(len(r.hash_ids) == -(-r.input_length // BLOCK_TOKENS) for r in rows)


def test_arrivals_carry_the_blocks_and_compress_time():
    rows = read_mooncake()[:50]
    arrivals = mooncake_arrivals(rows, scale=0.25)
    assert len(arrivals) == 50
    assert arrivals[0].time == 0.0
    assert arrivals[-1].time == pytest.approx((rows[-1].timestamp_ms - rows[0].timestamp_ms) / 1000 * 0.25)
    assert all(a.prefix == r.hash_ids and a.prefix_block_tokens == 512 for a, r in zip(arrivals, rows))
    assert [a.output_tokens for a in arrivals] == [max(r.output_length, 1) for r in rows]


def test_reuse_counts_leading_blocks_seen_before():
    a = Arrival(0.0, 1024 + 100, prefix=(1, 2, 3), prefix_block_tokens=512)
    b = Arrival(1.0, 1024 + 100, prefix=(1, 2, 4), prefix_block_tokens=512)
    c = Arrival(2.0, 1024, prefix=(9, 2, 4), prefix_block_tokens=512)  # block 2 seen, not as a prefix
    r = reuse([a, b, c])
    assert (r.blocks, r.blocks_seen) == (9, 4)
    assert r.prefix_tokens_seen == 1024  # b's first two blocks; c's first block is new
    assert r.token_share == pytest.approx(1024 / (2 * 1124 + 1024))
    # At most prompt - 1 tokens (the last one is always computed), full blocks only.
    assert reuse([a, Arrival(1.0, 1024, prefix=(1, 2), prefix_block_tokens=512)]).prefix_tokens_seen == 1023


def test_a_bad_line_is_named():
    with pytest.raises(ValueError, match="line 2"):
        parse_mooncake(['{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}', '{"timestamp": 1}'])
