"""The fleet model's prefix credit: what it credits each instance with, how dispatches, servers'
reports and health change it, and the named sessions (fleet/model.py, fleet/sessions.py)."""

import pytest

from fleet.blocks import PromptBlocks, chain_ids
from fleet.features import count_prompt_tokens
from fleet.model import NO_MATCH, FleetModel
from fleet.readings import Reading, ResponseEvidence
from fleet.sessions import SessionTable

BLOCK = 512
CONVERSATION = chain_ids(range(8))  # 8 blocks: 4,096 tokens
NEXT_TURN = chain_ids(range(10))  # extends it by two blocks
OTHER = chain_ids((99, 1, 2))


def fleet() -> FleetModel:
    model = FleetModel(prefix_block_tokens=BLOCK)
    for url, pool in (("s0", "spec"), ("s1", "spec"), ("b0", "base")):
        model.add_instance(url, pool, 48)
    return model


def test_a_dispatched_prompt_is_credited_to_its_instance_below_the_prompt_length():
    model = fleet()
    assert model.cached(CONVERSATION, 4096, 0.0) is NO_MATCH
    model.on_dispatch("s0", 0.0, 4096, blocks=CONVERSATION)
    match = model.cached(NEXT_TURN, 5200, 1.0)
    assert match.credit == {"s0": 8 * BLOCK} and match.matched == {"s0": 8 * BLOCK}
    # The same prompt again: everything but its last token.
    assert model.cached(CONVERSATION, 4096, 1.0).credit == {"s0": 4095}
    assert model.cached(OTHER, 1536, 1.0) is NO_MATCH


def test_a_dispatch_counts_only_its_uncached_tokens_as_load():
    model = fleet()
    model.on_reading("s0", Reading(at=0.0, running=1, waiting=1, waiting_tokens=0.0))
    model.on_dispatch("s0", 0.1, 4096, blocks=CONVERSATION)
    match = model.cached(NEXT_TURN, 5200, 0.2)
    sent = model.on_dispatch("s0", 0.2, 5200, blocks=NEXT_TURN, match=match)
    assert sent.cached_tokens == 4096 and sent.matched_tokens == 4096
    assert model.instances["s0"].waiting_tokens() == 4096 + (5200 - 4096)


def test_reports_of_fewer_cached_tokens_lower_the_credit_and_unreachable_forgets():
    model = fleet()
    model.on_dispatch("s0", 0.0, 4096, blocks=CONVERSATION)
    for t in range(1, 6):
        match = model.cached(NEXT_TURN, 5200, float(t))
        sent = model.on_dispatch("s0", float(t), 5200, blocks=NEXT_TURN, match=match)
        # The server says it held nothing (it restarted, or evicted it).
        evidence = ResponseEvidence(tokens=10, dispatch=sent, prompt_tokens=5200, cached_tokens=0)
        model.on_response("s0", float(t) + 0.5, evidence)
        model.on_complete("s0", float(t) + 0.5)
    match = model.cached(NEXT_TURN, 5200, 6.0)
    assert match.matched["s0"] == 10 * BLOCK  # the index still claims all its blocks
    assert match.credit["s0"] < 0.3 * 10 * BLOCK  # but credits a fraction: 0.75^5 of them
    stats = model.instances["s0"].cache
    assert (stats.responses, stats.cached_tokens, stats.hit_rate()) == (5, 0, 0.0)
    model.set_health("s0", False)
    model.set_health("s0", True)
    assert model.cached(NEXT_TURN, 5200, 7.0) is NO_MATCH


@pytest.mark.parametrize("reported_before", [True, False])
def test_sglangs_null_count_is_a_miss_only_from_a_server_seen_to_report(reported_before: bool):
    # SGLang leaves out a zero cached count (prompt_tokens_details: null), as a server without its
    # cache report does for every answer: a miss is only told apart once the server reported a hit.
    model = fleet()
    if reported_before:
        sent = model.on_dispatch("s0", 0.0, 2048, blocks=OTHER)
        model.on_response("s0", 0.5, ResponseEvidence(tokens=5, dispatch=sent, prompt_tokens=2048, cached_tokens=512))
        model.on_complete("s0", 0.5)
    model.on_dispatch("s0", 1.0, 4096, blocks=CONVERSATION)
    for t in range(2, 7):
        match = model.cached(NEXT_TURN, 5200, float(t))
        sent = model.on_dispatch("s0", float(t), 5200, blocks=NEXT_TURN, match=match)
        evidence = ResponseEvidence(tokens=10, dispatch=sent, prompt_tokens=5200, cached_details_null=True)
        model.on_response("s0", float(t) + 0.5, evidence)
        model.on_complete("s0", float(t) + 0.5)
    credit = model.cached(NEXT_TURN, 5200, 7.0).credit["s0"]
    stats = model.instances["s0"].cache
    if reported_before:
        assert credit < 0.3 * 10 * BLOCK and (stats.responses, stats.cached_tokens) == (6, 512)
    else:
        assert credit == 10 * BLOCK and stats.responses == 0  # nothing known: the index's own claim


def test_a_named_session_credits_its_last_instance_with_its_last_prompt():
    model = fleet()
    short = chain_ids(())  # a prompt under one block: the index cannot see it
    model.on_dispatch("s1", 0.0, 300, blocks=short, session="conv-1")
    match = model.cached(short, 420, 1.0, session="conv-1")
    assert match.credit == {"s1": 300}
    assert model.cached(short, 200, 1.0, session="conv-1").credit == {"s1": 199}
    assert model.cached(short, 420, 1.0, session="conv-2") is NO_MATCH
    model.set_health("s1", False)
    assert model.cached(short, 420, 2.0, session="conv-1") is NO_MATCH


def test_the_session_table_is_bounded_and_expires():
    table = SessionTable(max_sessions=2, ttl_s=10.0)
    table.put("a", "s0", 100, 0.0)
    table.put("b", "s0", 100, 1.0)
    table.put("c", "s1", 100, 2.0)
    assert len(table) == 2 and table.get("a", 2.0) is None
    assert table.get("b", 11.5) is None  # older than the TTL
    entry = table.get("c", 11.5)
    assert entry is not None and entry.instance == "s1"
    table.forget_instance("s1")
    assert table.get("c", 11.5) is None
    with pytest.raises(ValueError):
        SessionTable(ttl_s=0)


def test_a_refused_request_returns_its_session_past_other_unanswered_ones():
    table = SessionTable()
    table.put("s", "x", 100, 0.0)  # answered long ago
    table.settle("s", "x", 0.0)
    table.put("s", "y", 200, 1.0)
    table.put("s", "y", 210, 1.1)  # sent again before the first answer
    table.restore("s", "y", 1.0)
    assert table.get("s", 1.2).at == 1.1  # the later request still points there
    table.restore("s", "y", 1.1)
    assert (table.get("s", 1.3).instance, table.get("s", 1.3).at) == ("x", 0.0)
    # One answered: a refusal of the other returns the session no further than it.
    table.put("s", "y", 300, 2.0)
    table.put("s", "y", 310, 2.1)
    table.settle("s", "y", 2.0)
    table.restore("s", "y", 2.1)
    assert (table.get("s", 2.2).instance, table.get("s", 2.2).at) == ("y", 2.0)
    # Named first by refused requests: nowhere again, whatever the order.
    table.put("t", "y", 10, 3.0)
    table.put("t", "z", 10, 3.1)
    table.restore("t", "z", 3.1)
    table.restore("t", "y", 3.0)
    assert table.get("t", 3.2) is None
    # A server whose cache is gone is no session's place to return to on a refusal.
    table.put("v", "x", 100, 5.0)
    table.settle("v", "x", 5.0)
    table.put("v", "y", 200, 5.1)
    table.forget_instance("x")
    table.restore("v", "y", 5.1)
    assert table.get("v", 5.2) is None
    table.put("w", "x", 100, 6.0)
    table.forget_instance("x")
    assert table.get("w", 6.1) is None
    # Requests never answered chain no further than MAX_UNANSWERED entries.
    from fleet.sessions import MAX_UNANSWERED

    for i in range(5 * MAX_UNANSWERED):
        table.put("u", "y", i, 4.0 + i)
    depth, entry = 0, table.get("u", 100.0)
    while entry is not None:
        depth, entry = depth + 1, entry.previous
    assert depth == MAX_UNANSWERED + 1


def test_prefill_is_learned_from_the_uncached_tokens():
    """An idle instance's first token after a cache hit took the prefill of the uncached part: the
    cost model learns that, not the whole prompt's time."""
    model = fleet()
    model.on_reading("s0", Reading(at=0.0, running=0, waiting=0, waiting_tokens=0.0))
    model.on_dispatch("s0", 0.0, 4096, blocks=CONVERSATION)
    model.on_complete("s0", 1.0)
    model.on_reading("s0", Reading(at=1.5, running=0, waiting=0, waiting_tokens=0.0))
    before = model.cost.prefill_ms("spec", 1104)
    match = model.cached(NEXT_TURN, 5200, 2.0)
    sent = model.on_dispatch("s0", 2.0, 5200, blocks=NEXT_TURN, match=match)
    slow_ms = 4 * before  # the uncached 1,104 tokens took four times the seed's guess
    evidence = ResponseEvidence(tokens=5, ttft_s=slow_ms / 1000, dispatch=sent, prompt_tokens=5200, cached_tokens=4096)
    model.on_response("s0", 3.0, evidence)
    assert model.cost.prefill_ms("spec", 1104) > 1.5 * before


def test_a_session_name_covering_another_conversation_is_not_credited_past_the_index():
    """A name such as `user` may cover several conversations: a prompt whose blocks show it does
    not extend the session's last one (the index holds none of them past a shared system
    prompt) gets the index's credit only, not the last prompt's length."""
    model = fleet()
    system = (7, 8)  # a shared system prompt of two blocks
    first = chain_ids((*system, 1, 2, 3, 4))
    model.on_dispatch("s0", 0.0, 3 * BLOCK * 2, blocks=first, session="user-1")
    other = chain_ids((*system, 50, 51))
    match = model.cached(other, 4 * BLOCK + 100, 1.0, session="user-1")
    assert match.credit == {"s0": 2 * BLOCK}
    follow = chain_ids((*system, 1, 2, 3, 4, 5))
    assert model.cached(follow, 7 * BLOCK, 1.0, session="user-1").credit == {"s0": 6 * BLOCK}
    # A shorter one is checked by its blocks too: sharing the system prompt only, it is another.
    assert model.cached(chain_ids((*system, 9)), 3 * BLOCK, 1.0, session="user-1").credit == {"s0": 2 * BLOCK}


def test_tool_definitions_count_in_the_prompt_they_are_hashed_in():
    # Large tools and different user messages share only the tools' blocks: the credit is about
    # the tools' share of the prompt, not the whole prompt (the estimate once left tools out).
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "description": "x" * 500, "parameters": {}}}
        for i in range(40)
    ]
    first = {"tools": tools, "messages": [{"role": "user", "content": "hello a " * 300}]}
    other = {"tools": tools, "messages": [{"role": "user", "content": "other b " * 300}]}
    model = FleetModel()
    model.add_instance("a", "spec", 48)
    model.on_dispatch("a", 0.0, count_prompt_tokens(first), blocks=PromptBlocks.of(first))
    prompt_tokens = count_prompt_tokens(other)
    tools_tokens = count_prompt_tokens({"tools": tools, "messages": []})
    assert tools_tokens > 5000 and prompt_tokens > tools_tokens + 500
    credit = model.cached(PromptBlocks.of(other), prompt_tokens, 1.0).credit["a"]
    assert tools_tokens - 256 <= credit <= tools_tokens


def test_a_non_ascii_prompt_is_credited_in_the_estimates_unit():
    # Three UTF-8 bytes a character: the blocks count bytes, the estimate characters. A shared
    # system prompt, a third of the prompt, is credited as about a third of its estimate.
    system = {"role": "system", "content": "系" * 10000}
    first = {"messages": [system, {"role": "user", "content": "甲" * 20000}]}
    other = {"messages": [system, {"role": "user", "content": "乙" * 20000}]}
    model = FleetModel()
    model.add_instance("a", "spec", 48)
    model.on_dispatch("a", 0.0, count_prompt_tokens(first), blocks=PromptBlocks.of(first))
    prompt_tokens = count_prompt_tokens(other)
    system_tokens = count_prompt_tokens({"messages": [system]})
    match = model.cached(PromptBlocks.of(other), prompt_tokens, 1.0)
    assert system_tokens - 256 <= match.credit["a"] <= system_tokens
    assert match.matched["a"] == match.credit["a"]  # the raw claim in the same unit
    # Given the stream's length (the proxy's worker sends hashes as a tuple), the same credit.
    hashes = PromptBlocks.of(other)
    same = model.cached(hashes[:], prompt_tokens, 1.0, stream_tokens=hashes.stream_tokens)
    assert same.credit == match.credit
    # Its next turn, ASCII or not, is credited with the whole last prompt, less a block at most.
    turn = {"messages": [*first["messages"], {"role": "assistant", "content": "好"}, {"role": "user", "content": "再"}]}
    credit = model.cached(PromptBlocks.of(turn), count_prompt_tokens(turn), 1.0).credit["a"]
    assert count_prompt_tokens(first) - 256 <= credit <= count_prompt_tokens(first)


def test_a_restart_seen_as_prefill_counters_going_back_forgets_the_instance():
    # Both polls reached it (no lost poll marked it down): only its counters tell it restarted.
    model = fleet()
    session = "conv"
    counters = {"prefill_tokens_total": 1e6, "prefill_busy_us_total": 1e7}
    model.on_answered(model.on_dispatch("s0", 0.5, 4096, blocks=CONVERSATION, session=session))
    model.on_reading("s0", Reading(at=1.0, running=0, waiting=0, **counters))  # the first: nothing forgotten
    assert model.cached(NEXT_TURN, 5200, 2.0, session).credit == {"s0": 8 * BLOCK}
    model.on_reading("s0", Reading(at=2.0, running=0, waiting=0, **counters))  # did not move: kept
    model.on_reading("s0", Reading(at=2.5, running=0, waiting=0, prefill_tokens_total=2e6, prefill_busy_us_total=2e7))
    assert model.cached(NEXT_TURN, 5200, 3.0, session).credit == {"s0": 8 * BLOCK}
    assert model.prefix.blocks("s1") == 0
    model.on_dispatch("s1", 3.0, 4096, blocks=CONVERSATION)
    model.on_reading("s0", Reading(at=4.0, running=0, waiting=0, prefill_tokens_total=10, prefill_busy_us_total=100))
    match = model.cached(NEXT_TURN, 5200, 5.0, session)
    assert "s0" not in match.credit and model.prefix.blocks("s0") == 0
    assert model.sessions.get(session, 5.0) is None
    assert match.credit == {"s1": 8 * BLOCK}  # another instance's entries stay


def test_a_request_not_streamed_keeps_its_claims_once_out_long_enough_to_be_prefilled():
    """A review's finding: a non-streamed answer comes whole, after its decode, so a client
    that left (or timed out) during a long generation had its claims withdrawn though the
    server had long prefilled the prompt and holds it. A stream shows its prefill by its first
    token; one that left before it plants nothing."""
    model = fleet()
    prefill_s = model.cost.at(0.0).prefill_ms("spec", 4096) / 1000
    early = model.on_dispatch("s0", 0.0, 4096, blocks=CONVERSATION)
    model.on_unanswered(early, 0.5 * prefill_s, streamed=False)
    assert model.prefix.blocks("s0") == 0  # left before it could have been prefilled
    late = model.on_dispatch("s0", 1.0, 4096, blocks=CONVERSATION)
    model.on_unanswered(late, 1.0 + 2 * prefill_s, streamed=False)
    assert model.prefix.blocks("s0") == 8  # out long enough: its claims stand
    stream = model.on_dispatch("s1", 2.0, 4096, blocks=CONVERSATION)
    model.on_unanswered(stream, 60.0)  # a stream without a first token, however long
    assert model.prefix.blocks("s1") == 0


def test_a_turn_carrying_a_large_tool_call_keeps_its_cached_prefixs_credit():
    """A review's finding: the blocks hash an assistant's tool calls (their arguments), the
    estimate left them out, and the credit was scaled by the whole prompt's ratio of the two:
    an agent's turn after it wrote a file was credited 2,762 of its 8,012 cached tokens."""
    model = fleet()
    first = {"messages": [{"role": "user", "content": "x" * 32_000}]}
    tokens = count_prompt_tokens(first)
    model.on_dispatch("s0", 0.0, tokens, blocks=PromptBlocks.of(first, BLOCK), session="agent")
    call = {"id": "call_1", "type": "function", "function": {"name": "write", "arguments": "y" * 60_000}}
    turn = {
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
        ]
    }
    blocks = PromptBlocks.of(turn, BLOCK)
    assert blocks.stream_tokens <= count_prompt_tokens(turn) + 8  # the estimate counts what is hashed
    match = model.cached(blocks, count_prompt_tokens(turn), 1.0, session="agent")
    assert match.credit["s0"] >= 0.95 * tokens  # the first turn, all but framing (2,762 before)


def counters(at: float, tokens: float) -> Reading:
    return Reading(at=at, running=0, waiting=0, prefill_tokens_total=tokens, prefill_busy_us_total=tokens * 10)


def test_a_server_back_from_an_outage_is_forgotten_once_not_again_at_its_first_reading():
    """A review's finding: the outage forgot it, but the counters kept their reading from
    before; the first reading after it was back read as a restart and wiped what it had cached
    in between."""
    model = fleet()
    model.on_answered(model.on_dispatch("s0", 0.5, 1536, blocks=OTHER))  # cached before it restarted
    model.on_reading("s0", counters(1.0, 1e6))
    model.set_health("s0", False)  # polls lost: it may be restarting
    model.set_health("s0", True)
    model.on_answered(model.on_dispatch("s0", 2.0, 4096, blocks=CONVERSATION))  # served since
    model.on_reading("s0", counters(3.0, 10))
    assert model.prefix.blocks("s0") == 8 and model.cached(OTHER, 1536, 3.0) is NO_MATCH


def test_an_outage_without_a_restart_keeps_what_a_server_with_counters_cached():
    """A failed connection, or a few polls lost while it was busy, is no restart: its prefill
    counters, read before and after, say so (they went on), and its cache is credited still. A
    server whose counters are not read is forgotten at once (nothing would tell a restart)."""
    model = fleet()
    for url in ("s0", "s1"):
        model.on_answered(model.on_dispatch(url, 0.5, 4096, blocks=CONVERSATION, session=f"chat-{url}"))
    model.on_reading("s0", counters(1.0, 1e6))
    for url in ("s0", "s1"):
        model.set_health(url, False)
        model.set_health(url, True)
    assert model.cached(CONVERSATION, 4096, 2.0, session="chat-s1").credit.get("s1") is None
    model.on_reading("s0", counters(2.5, 1e6 + 4096))
    assert model.cached(NEXT_TURN, 5200, 3.0).credit == {"s0": 8 * BLOCK}
    assert model.cached(CONVERSATION, 4096, 3.0, session="chat-s0").credit == {"s0": 4095}
    # Down again, and back restarted: its counters start again, and what it held is forgotten.
    model.set_health("s0", False)
    model.on_reading("s0", counters(4.0, 20))
    model.set_health("s0", True)
    assert model.cached(NEXT_TURN, 5200, 4.5) is NO_MATCH
    assert model.cached(CONVERSATION, 4096, 4.5, session="chat-s0") is NO_MATCH


def test_an_outage_forgets_a_young_server_and_one_back_without_its_counters():
    """A review's cases: a server that had counted few prefill tokens (a fresh one: 0) could,
    restarted, count as many again before its next reading, so its restart would go unseen;
    and a server back without its counters (another kind behind the URL) tells nothing."""
    model = fleet()
    model.on_answered(model.on_dispatch("s0", 0.5, 4096, blocks=CONVERSATION))
    model.on_reading("s0", counters(0.2, 0))  # read before it prefilled anything
    model.set_health("s0", False)
    model.set_health("s0", True)
    assert model.cached(NEXT_TURN, 5200, 1.0) is NO_MATCH
    model.on_answered(model.on_dispatch("s1", 1.0, 4096, blocks=CONVERSATION))
    model.on_reading("s1", counters(1.5, 2e6))
    model.set_health("s1", False)
    model.set_health("s1", True)
    model.on_reading("s1", Reading(at=2.0, running=0, waiting=0))  # no counters
    assert model.cached(NEXT_TURN, 5200, 2.5) is NO_MATCH
    # Back with one counter of the two (a review's case): nothing tells a restart either.
    model.on_answered(model.on_dispatch("b0", 3.0, 4096, blocks=CONVERSATION))
    model.on_reading("b0", counters(3.5, 2e6))
    model.set_health("b0", False)
    model.set_health("b0", True)
    model.on_reading("b0", Reading(at=4.0, running=0, waiting=0, prefill_tokens_total=10))
    assert model.cached(NEXT_TURN, 5200, 4.5) is NO_MATCH
