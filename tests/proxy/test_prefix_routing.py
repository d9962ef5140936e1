"""The request path's prefix-cache inputs, without servers: the session a request names (header,
prompt_cache_key, user; only a hash kept), its prompt blocks from the body reader (lazy on the
loop, a tuple from the worker), the usage's cached tokens from a response's tail, and the
router honouring the instance a decision names (and falling back when it cannot)."""

from __future__ import annotations

import asyncio
import pickle
import time

import orjson
import pytest

from fleet.blocks import PromptBlocks, block_hashes
from fleet.features import responses_as_chat
from fleet.model import PrefixMatch
from fleet.readings import Reading
from fleet.types import Decision, Features, Snapshot
from proxy import body as request_body
from proxy.routing import (
    SESSION_HEADER,
    Router,
    RoutingInputError,
    read_session,
    session_key,
    session_of,
)
from proxy.scan import summarise
from proxy.settings import load_settings
from proxy.state import DecisionLog, dispatched

SPEC = ["http://127.0.0.1:9", "http://127.0.0.1:10"]
BASE = ["http://127.0.0.1:11", "http://127.0.0.1:12"]


# -- sessions ---------------------------------------------------------------------------------


def test_the_header_names_the_session_before_prompt_cache_key_and_user():
    body = {"prompt_cache_key": "conv-7", "user": "alice"}
    assert session_of(body, "from-header") == session_key("from-header")
    assert session_of(body) == session_key("conv-7")
    assert session_of({"user": "alice"}) == session_key("alice")
    assert session_of({"prompt_cache_key": "", "user": "alice"}) == session_key("alice")
    assert session_of({"prompt_cache_key": 12, "user": ["alice"]}) is None  # not strings: no session
    assert session_of({}) is None


def test_only_a_hash_of_the_session_name_is_kept():
    key = session_key("alice@example.com")
    assert "alice" not in key and len(key) == 32 and int(key, 16) >= 0
    assert key == session_key("alice@example.com") != session_key("alice@example.org")


@pytest.mark.parametrize("value", ["", "   ", "has space", "x" * 65, "caf\u00e9", "tab\there"])
def test_a_bad_session_header_is_refused_without_echoing_it(value):
    with pytest.raises(RoutingInputError) as refused:
        read_session({SESSION_HEADER: value})
    assert refused.value.header == SESSION_HEADER
    message = str(refused.value)
    assert SESSION_HEADER in message and "printable ASCII" in message
    if value.strip():
        assert value.strip() not in message


def test_a_good_session_header_is_read_stripped():
    assert read_session({SESSION_HEADER: "  conv-42  "}) == "conv-42"
    assert read_session({SESSION_HEADER: "x" * 64}) == "x" * 64
    assert read_session({}) is None


# -- the body reader --------------------------------------------------------------------------


def chat(text: str, **extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}], **extra}


def test_a_small_body_is_hashed_lazily_and_names_its_session():
    payload = chat("a" * 5000, prompt_cache_key="conv-1", user="alice")
    given = request_body.Given(block_tokens=256, max_blocks=3)
    parsed = request_body.read(orjson.dumps(payload), 10_000, 100_000, given)
    assert isinstance(parsed.blocks, PromptBlocks) and parsed.blocks.computed == 0
    assert tuple(parsed.blocks) == block_hashes(payload, 256, 3)
    assert len(parsed.blocks) == 3  # bounded: 5 whole blocks in the prompt
    assert parsed.session == session_key("conv-1")
    named = request_body.read(orjson.dumps(payload), 10_000, 100_000, request_body.Given(session="hdr"))
    assert named.session == session_key("hdr")


def test_a_large_body_is_hashed_in_full_in_the_worker():
    payload = chat("b" * 400_000, user="bob")
    raw = orjson.dumps(payload)
    given = request_body.Given(block_tokens=256, max_blocks=50)
    result = request_body.read_in_worker(raw, 10_000, 100_000, given)
    # Plain values only: the worker and the proxy may run the decision path one compiled and
    # one from source (fleet/native.py), whose classes do not unpickle as each other.
    assert b"fleet" not in pickle.dumps(result)
    small, features, blocks, session, forward = result
    assert "messages" not in small  # the prompt stays in the worker
    assert forward is None  # nothing to drop: the proxy forwards the body it has
    assert blocks == block_hashes(payload, 256, 50) and isinstance(blocks, tuple)
    assert len(blocks) == 50
    assert session == session_key("bob")
    assert Features(*features) == request_body.read(raw, 10_000, 100_000, given).features


def test_the_body_reader_uses_the_worker_past_its_threshold():
    async def scenario() -> tuple[dict, request_body.Parsed]:
        reader = request_body.BodyReader(10_000, 100_000)
        try:
            payload = chat("c" * 300_000, prompt_cache_key="k")
            return payload, await reader.parse(orjson.dumps(payload), request_body.Given(max_blocks=10))
        finally:
            await reader.close()

    payload, parsed = asyncio.run(scenario())
    assert parsed.blocks == block_hashes(payload, 256, 10)
    assert parsed.session == session_key("k") and parsed.features.prompt_tokens > 70_000


# -- the usage's cached tokens ------------------------------------------------------------------


def test_cached_tokens_are_read_from_a_json_body_and_a_stream_tail():
    body = (
        b'{"id":"x","choices":[{"finish_reason":"stop"}],"usage":{"prompt_tokens":1200,'
        b'"completion_tokens":8,"prompt_tokens_details":{"cached_tokens":1024}}}'
    )
    assert summarise(body).cached_tokens == 1024 and summarise(body).prompt_tokens == 1200
    tail = (
        b'data: {"choices":[{"delta":{},"finish_reason":"length"}]}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":900,"completion_tokens":4,'
        b'"prompt_tokens_details": {"cached_tokens": 768},"reasoning_tokens":0}}\n\ndata: [DONE]\n\n'
    )
    assert summarise(tail).cached_tokens == 768
    # Not reported (SGLang without --enable-cache-report), or only elsewhere: None.
    null = summarise(b'{"usage":{"prompt_tokens":9,"prompt_tokens_details":null}}')
    assert null.cached_tokens is None and null.cached_details_null  # SGLang's miss (or no report)
    assert not summarise(body).cached_details_null and not summarise(b'{"usage":{}}').cached_details_null
    assert summarise(b'{"meta_info":{"cached_tokens":5},"usage":{"prompt_tokens":9}}').cached_tokens is None
    # SGLang's completions stream ends with a usage chunk dumped with exclude_none: a miss has no
    # prompt_tokens_details at all, which reads as the null one does (a miss where the server is
    # seen to report, fleet.model.reported_cached).
    completions = b'data: {"choices":[],"usage":{"prompt_tokens":9,"total_tokens":11,"completion_tokens":2}}\n\n'
    assert summarise(completions).cached_details_null and summarise(completions).cached_tokens is None
    # A completion's text that spells the field is escaped JSON: never taken for it.
    text = b'{"choices":[{"text":"\\"prompt_tokens_details\\":{\\"cached_tokens\\":77}"}]}'
    assert summarise(text).cached_tokens is None


# -- the router ---------------------------------------------------------------------------------


@pytest.fixture
def router() -> Router:
    """A router over four unreachable URLs (nothing is polled: it never starts)."""
    settings = load_settings(spec_urls=",".join(SPEC), base_urls=",".join(BASE), request_log=False)
    return Router.from_settings(settings)


def load(router: Router, url: str, running: float) -> None:
    router.fleet.on_reading(url, Reading(at=time.monotonic(), running=running, waiting=0.0, max_running=4))


def instance(router: Router, url: str):
    return next(i for i in router.instances() if i.url == url)


def test_pick_honours_the_decision_s_instance_over_the_least_loaded(router):
    load(router, SPEC[0], 0)
    load(router, SPEC[1], 3)
    assert router.pick("spec").url == SPEC[0]
    assert router.pick("spec", prefer=SPEC[1]).url == SPEC[1]
    assert router.next_instance("spec", [], False, SPEC[1]).url == SPEC[1]


def test_pick_falls_back_when_the_named_instance_cannot_take_it(router):
    load(router, SPEC[0], 0)
    load(router, SPEC[1], 3)
    tried = [instance(router, SPEC[1])]
    # Already tried (a failover): the least loaded of the rest.
    assert router.next_instance("spec", tried, False, SPEC[1]).url == SPEC[0]
    # Both tried: the other pool (the name is of the first pool's instance, so not there).
    both = [instance(router, url) for url in SPEC]
    assert router.next_instance("spec", both, False, SPEC[1]).pool == "base"
    assert router.next_instance("spec", both, True, SPEC[1]) is None  # pinned
    # Unreachable, or ejected by outlier detection: the least loaded.
    router.fleet.set_health(SPEC[1], False)
    assert router.pick("spec", prefer=SPEC[1]).url == SPEC[0]
    router.fleet.set_health(SPEC[1], True)
    for _ in range(router.settings.outlier_consecutive_failures):
        router.outliers.failed(instance(router, SPEC[1]), "connect")
    assert router.outliers.ejected(SPEC[1])
    assert router.pick("spec", prefer=SPEC[1]).url == SPEC[0]
    # A name from another pool is ignored.
    assert router.pick("base", prefer=SPEC[0]).pool == "base"


def test_a_pinned_pool_gets_its_most_credited_instance_with_a_free_slot(router):
    load(router, SPEC[0], 0)
    load(router, SPEC[1], 1)
    features = Features(prompt_tokens=3000, cached={SPEC[1]: 2048, SPEC[0]: 512, BASE[0]: 2900})
    decision = router.choose(features, "spec")
    assert (decision.pool, decision.reason, decision.instance) == ("spec", "override", SPEC[1])
    load(router, SPEC[1], 4)  # full: the credit does not pay for a queue
    assert router.choose(features, "spec").instance == SPEC[0]
    assert router.choose(Features(prompt_tokens=3000), "spec").instance is None


def test_the_decision_log_shows_the_credit_and_where_the_request_went(router):
    load(router, SPEC[0], 0)
    load(router, SPEC[1], 0)
    features = Features(prompt_tokens=3000, cached={SPEC[1]: 2048})
    decision, entry = router.decide(features, "spec")
    assert decision.instance == SPEC[1]
    assert entry["cached"] == {SPEC[1]: 2048} and entry["chosen"] == SPEC[1] and entry["instance"] is None
    match = PrefixMatch({SPEC[1]: 2048}, {SPEC[1]: 2048})
    attempt = router.dispatch(instance(router, SPEC[1]), 3000, match=match)
    dispatched(entry, SPEC[1], attempt.sent.cached_tokens)
    attempt.finished()
    state = router.state()
    assert state["decisions"][-1]["instance"] == SPEC[1] and state["decisions"][-1]["cached_tokens"] == 2048
    assert state["prefix"]["block_tokens"] == 256 and "sessions" in state["prefix"]


def test_a_dispatch_enters_the_index_and_the_session_and_a_refusal_undoes_its_uncached_tokens(router):
    load(router, SPEC[0], 0)
    blocks = PromptBlocks.of(chat("d" * 8192), 256)
    features = Features(prompt_tokens=2100)
    assert router.cached(blocks, features, None).credit == {}
    first = router.dispatch(instance(router, SPEC[0]), 2100, blocks=blocks, session="s1")
    first.first_byte()  # answered: its claims stand
    first.finished()
    assert router.cached(blocks, features, None).credit == {SPEC[0]: 2048}  # 8 whole blocks of 256
    match = router.cached(blocks, features, "s1")
    assert match.credit == {SPEC[0]: 2099}  # the session's last prompt, all but its last token
    assert router.cached(blocks, features, "other").credit == {SPEC[0]: 2048}
    signals = router.fleet.instances[SPEC[0]]
    load(router, SPEC[0], 0)  # a fresh reading: the events since are this dispatch's
    second = router.dispatch(instance(router, SPEC[0]), 2100, blocks=blocks, match=match, session="s1")
    assert second.sent.cached_tokens == 2099
    assert list(signals.events)[-1][2] == 1  # its uncached tokens
    second.refused()
    # Undone exactly: the dispatch's event is removed, nothing is counted as completed.
    assert not signals.events
    state = router.state()
    held = state["pools"]["spec"]["instances"][0]["prefix"]
    assert held["blocks"] == 8 and held["trust"] == 1.0
    assert state["prefix"]["entries"] == 8 and state["prefix"]["sessions"] == 1


def test_an_attempt_s_claims_stand_once_answered_and_go_when_refused(router):
    # Claims settle at the response's first byte, not at its end: a same-prompt request refused
    # meanwhile takes nothing back. A 401/403 on the proxy's credentials never ran the
    # request: its claims go as a 4xx refusal's do, though it counts as the server's failure.
    blocks = PromptBlocks.of(chat("e" * 8192), 256)
    streaming = router.dispatch(instance(router, SPEC[0]), 2100, blocks=blocks, session="s")
    streaming.first_byte()
    burst = router.dispatch(instance(router, SPEC[0]), 2100, blocks=blocks, session="s")
    burst.refused()
    assert router.fleet.prefix.blocks(SPEC[0]) == 8
    assert router.fleet.sessions.get("s", time.monotonic()).instance == SPEC[0]
    streaming.finished()
    denied = router.dispatch(instance(router, SPEC[1]), 2100, blocks=blocks, session="t")
    denied.failed("upstream_auth", refused=True)
    assert router.fleet.prefix.blocks(SPEC[1]) == 0
    assert router.fleet.sessions.get("t", time.monotonic()) is None
    assert instance(router, SPEC[1]).failed_total == 1


def test_an_attempt_ended_before_its_first_byte_leaves_no_claims(router):
    # A client that leaves (or a request that fails) before the first byte of its response
    # plants nothing: its blocks and session move are withdrawn as a refusal's are, though it
    # counts as complete. One that got its first token keeps them.
    left = PromptBlocks.of(chat("f" * 8192), 256)
    signals = router.fleet.instances[SPEC[0]]
    gone = router.dispatch(instance(router, SPEC[0]), 2100, blocks=left, session="p")
    assert router.fleet.prefix.blocks(SPEC[0]) == 8
    gone.finished()  # the client left while it waited (the relay's `finally`)
    assert router.fleet.prefix.blocks(SPEC[0]) == 0
    assert router.fleet.sessions.get("p", time.monotonic()) is None
    assert signals.local_in_flight == 0 and signals.sent.weighted > 0  # over, not undone
    failed = router.dispatch(instance(router, SPEC[0]), 2100, blocks=left, session="p")
    failed.failed("upstream_reset")
    assert router.fleet.prefix.blocks(SPEC[0]) == 0
    # An earlier answered turn of the session is where it returns to, and its blocks stay.
    kept = router.dispatch(instance(router, SPEC[1]), 2100, blocks=left, session="p")
    kept.first_byte()
    kept.finished()
    again = router.dispatch(instance(router, SPEC[0]), 2100, blocks=left, session="p")
    again.finished()
    assert router.fleet.sessions.get("p", time.monotonic()).instance == SPEC[1]
    assert (router.fleet.prefix.blocks(SPEC[0]), router.fleet.prefix.blocks(SPEC[1])) == (0, 8)
    # A block two requests claim stays while the other is still waiting.
    a = router.dispatch(instance(router, SPEC[0]), 2100, blocks=left)
    b = router.dispatch(instance(router, SPEC[0]), 2100, blocks=left)
    a.finished()
    assert router.fleet.prefix.blocks(SPEC[0]) == 8
    b.first_byte()
    b.finished()
    assert router.fleet.prefix.blocks(SPEC[0]) == 8


def test_a_huge_prompt_is_hashed_only_as_far_as_an_instance_can_hold(router):
    router.fleet.on_reading(SPEC[0], Reading(at=time.monotonic(), running=0, waiting=0, cache_tokens=256 * 40))
    assert router.prefix_blocks() == router.fleet.prefix.max_blocks  # the others have no cap yet
    for url in SPEC[1:] + BASE:
        router.fleet.on_reading(url, Reading(at=time.monotonic(), running=0, waiting=0, cache_tokens=256 * 30))
    assert router.prefix_blocks() == 40


def test_a_decision_keeps_its_instance_through_the_log():
    log = DecisionLog(4)
    explained = log.explain(Features(prompt_tokens=10), Decision("spec", "x", instance="u"), Snapshot(pools={}))
    assert explained.instance == "u" and log.recent[-1]["chosen"] == "u"


def test_the_index_and_session_bounds_are_settings():
    settings = load_settings(
        spec_urls=",".join(SPEC),
        base_urls=",".join(BASE),
        request_log=False,
        prefix_max_blocks=5000,
        max_sessions=0,
        session_ttl_s=30,
    )
    fleet = Router.from_settings(settings).fleet
    assert fleet.prefix.max_blocks == 5000
    assert (fleet.sessions.max_sessions, fleet.sessions.ttl_s) == (0, 30.0)
    blocks = block_hashes({"messages": [{"role": "user", "content": "x" * 2048}]})
    fleet.on_dispatch(SPEC[0], 0.0, 600, blocks=blocks, session="s")
    assert len(fleet.sessions) == 0  # 0 sessions: names are ignored, the index still learns
    assert fleet.prefix.blocks(SPEC[0]) == len(blocks) > 0


def test_a_refused_request_leaves_no_cache_memory_behind():
    """A turn the server refuses (a 4xx: it never ran) does not credit that server with its
    prompt, nor move its session there (a probe: after one refused turn, the next was credited
    the whole 821-token prompt on the server that refused it)."""
    fleet = Router.from_settings(load_settings(spec_urls=",".join(SPEC), base_urls=",".join(BASE))).fleet
    first = block_hashes(chat("x" * 8192))
    longer = block_hashes(chat("x" * 8192 + "y" * 8192))
    assert len(longer) > len(first) > 2
    fleet.on_dispatch(SPEC[0], 0.0, 600, blocks=first, session="s")
    fleet.on_dispatch(BASE[0], 1.0, 300, blocks=first[:2])  # base-0 holds the first two blocks
    refused = fleet.on_dispatch(BASE[0], 2.0, 1200, blocks=longer, session="s")
    assert fleet.prefix.blocks(BASE[0]) == len(longer) and fleet.sessions.get("s", 2.0).instance == BASE[0]
    fleet.on_refused(refused, 2.1)
    assert fleet.prefix.blocks(BASE[0]) == 2  # what it held before stays
    assert fleet.sessions.get("s", 2.1).instance == SPEC[0]
    assert fleet.cached(longer, 4000, 2.2, "s").credit.get(BASE[0], 0) <= 2 * fleet.prefix.block_tokens
    # A session named first by a refused request points nowhere again.
    fleet.on_refused(fleet.on_dispatch(BASE[1], 3.0, 10, session="new"), 3.1)
    assert fleet.sessions.get("new", 3.1) is None
    # Two turns of one session with one prompt, both sent before the first refusal came (a 429
    # burst, a client's parallel requests): both refused, neither leaves its blocks or its move.
    settled = fleet.on_dispatch(SPEC[1], 4.0, 600, blocks=first, session="p")
    fleet.on_complete(SPEC[1], 4.5, settled)
    burst = [fleet.on_dispatch(BASE[1], 5.0 + i / 10, 1200, blocks=longer, session="p") for i in range(2)]
    for sent in burst:
        fleet.on_refused(sent, 5.5)
    assert fleet.prefix.blocks(BASE[1]) == 0
    assert fleet.sessions.get("p", 5.5).instance == SPEC[1]
    # One of them answered: the server holds the prompt and the session stays there.
    kept = [fleet.on_dispatch(BASE[1], 6.0 + i / 10, 1200, blocks=longer, session="p") for i in range(2)]
    fleet.on_complete(BASE[1], 6.5, kept[1])
    fleet.on_refused(kept[0], 6.6)
    assert fleet.prefix.blocks(BASE[1]) == len(longer)
    assert fleet.sessions.get("p", 6.6).instance == BASE[1]


def test_a_non_ascii_prompt_is_credited_in_the_estimates_unit_after_the_worker(router):
    # The worker sends the hashes as a tuple: the stream's length crosses with the features,
    # so the router credits a shared system prompt (a third of a 3-byte-a-character prompt)
    # as a third of the estimate, as it does for blocks hashed on the loop.
    system = {"role": "system", "content": "系" * 10000}
    first = {"messages": [system, {"role": "user", "content": "甲" * 20000}]}
    other = {"messages": [system, {"role": "user", "content": "乙" * 20000}]}
    given = request_body.Given(max_blocks=1000)
    sent = request_body.read(orjson.dumps(first), 10_000, 100_000, given)
    router.fleet.on_dispatch(SPEC[0], time.monotonic(), sent.features.prompt_tokens, blocks=sent.blocks)
    small, values, hashes, session, _ = request_body.read_in_worker(orjson.dumps(other), 10_000, 100_000, given)
    features = Features(*values)
    assert features.stream_tokens == PromptBlocks.of(other).stream_tokens > 3 * features.prompt_tokens - 100
    credit = router.cached(hashes, features).credit[SPEC[0]]
    assert 2500 - 256 <= credit <= 2500  # the system prompt's 10,000 characters


def test_a_responses_follow_up_has_no_blocks_to_claim_or_credit(router):
    # Its new input is not where its prompt begins (the stored conversation is): hashed as if
    # it were, it would be credited with, and insert, a prefix no server holds.
    follow_up = {"previous_response_id": "resp_1", "input": "tool output " * 400}
    fresh = {"input": "tool output " * 400}
    given = request_body.Given(responses=True)
    earlier = request_body.read(orjson.dumps(fresh), 10_000, 100_000, given)
    assert len(earlier.blocks) > 0
    router.fleet.on_dispatch(SPEC[0], time.monotonic(), earlier.features.prompt_tokens, blocks=earlier.blocks)
    parsed = request_body.read(orjson.dumps(follow_up), 10_000, 100_000, given)
    assert len(parsed.blocks) == 0 and parsed.features.prompt_tokens > 0
    assert router.cached(parsed.blocks, parsed.features).credit == {}
    small, values, hashes, session, _ = request_body.read_in_worker(orjson.dumps(follow_up), 10_000, 100_000, given)
    assert hashes == ()
    # The chat view alone says so too (it carries the id), for any reader of it.
    assert len(PromptBlocks.of(responses_as_chat(follow_up))) == 0
    assert len(PromptBlocks.of(responses_as_chat(fresh))) > 0
