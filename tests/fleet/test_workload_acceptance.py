"""Acceptance per workload key: shrinkage toward the pool, bounded memory, decay, and routing."""

import pytest

from fleet.acceptance import WorkloadAcceptance, accept_length, alpha_from_accept_length
from fleet.costmodel import seed_from_profile
from fleet.features import workload_key
from fleet.model import FleetModel
from fleet.readings import Reading, ResponseEvidence
from fleet.types import Features
from policies import registry

SPEC, BASE = "http://spec", "http://base"


def evidence(alpha: float, workload: str | None, steps: int = 100) -> ResponseEvidence:
    """One finished spec stream of `steps` verify steps at acceptance `alpha` (plus the prefill's token)."""
    return ResponseEvidence(tokens=round(steps * accept_length(alpha, 3)) + 1, verify_steps=steps, workload=workload)


def mixed_fleet(spec_running: float, base_running: float) -> tuple[FleetModel, float]:
    """A fleet whose spec pool served code (alpha 0.8) and chat (alpha 0.45) for a second."""
    fleet = FleetModel({"spec": 3, "base": 0}, seed=seed_from_profile("h200-llama8b"))
    fleet.add_instance(SPEC, "spec", 48)
    fleet.add_instance(BASE, "base", 256)
    now = 0.0
    for _ in range(10):
        now += 0.1
        for key, alpha in (("code", 0.8), ("chat", 0.45)):
            fleet.on_response(SPEC, now, evidence(alpha, key))
            fleet.on_complete(SPEC, now)
    fleet.on_reading(SPEC, Reading(at=now, running=spec_running, waiting=0))
    fleet.on_reading(BASE, Reading(at=now, running=base_running, waiting=0))
    return fleet, now


def test_a_high_acceptance_workload_stays_on_spec_where_a_low_one_goes_to_base():
    fleet, now = mixed_fleet(spec_running=24, base_running=0)
    policy = registry.create("goodput", {})
    code = fleet.snapshot(now, "code")
    chat = fleet.snapshot(now, "chat")
    pooled = fleet.snapshot(now)
    assert code.pools["spec"].alpha == pytest.approx(0.8, abs=0.05)
    assert chat.pools["spec"].alpha == pytest.approx(0.45, abs=0.05)
    assert chat.pools["spec"].alpha < pooled.pools["spec"].alpha < code.pools["spec"].alpha
    assert policy.decide(Features(prompt_tokens=500, workload="code"), code).pool == "spec"
    assert policy.decide(Features(prompt_tokens=500, workload="chat"), chat).pool == "base"
    # On a quiet fleet both go to spec: the key moves the crossover, it does not pin a pool.
    quiet, now = mixed_fleet(spec_running=0, base_running=0)
    assert policy.decide(Features(prompt_tokens=500, workload="chat"), quiet.snapshot(now, "chat")).pool == "spec"


def test_without_a_key_or_with_an_unknown_one_the_snapshot_is_the_pools():
    fleet, now = mixed_fleet(spec_running=4, base_running=0)
    pooled = fleet.snapshot(now)
    assert fleet.snapshot(now, None).pools == pooled.pools
    assert fleet.snapshot(now, "never-seen").pools["spec"].alpha == pooled.pools["spec"].alpha
    # A fleet fed the same evidence without keys estimates the pool exactly alike.
    plain = FleetModel({"spec": 3, "base": 0}, seed=seed_from_profile("h200-llama8b"))
    plain.add_instance(SPEC, "spec", 48)
    plain.add_instance(BASE, "base", 256)
    t = 0.0
    for _ in range(10):
        t += 0.1
        for alpha in (0.8, 0.45):
            plain.on_response(SPEC, t, evidence(alpha, None))
            plain.on_complete(SPEC, t)
    assert plain.acceptance().accept_length() == fleet.acceptance().accept_length()
    assert len(plain.workload_acceptance()) == 0


def test_a_key_with_little_evidence_is_shrunk_toward_the_pool():
    table = WorkloadAcceptance(3, half_life_s=1.5, prior_steps=200)
    pool_tau = accept_length(0.5, 3)
    own_tau = accept_length(0.9, 3)
    table.observe_request("code", 0.0, round(50 * own_tau) + 1, 50)
    one = table.accept_length("code", 0.0, pool_tau)
    assert one is not None and pool_tau < one < own_tau
    assert one == pytest.approx((50 * own_tau + 200 * pool_tau) / 250, rel=1e-3)
    for _ in range(40):
        table.observe_request("code", 0.0, round(50 * own_tau) + 1, 50)
    many = table.alpha("code", 0.0, pool_tau)  # 2050 steps against 200: 91 % its own
    assert many is not None and many == pytest.approx(0.9, abs=0.04)
    # Stale evidence halves every half-life: ten of them later the key is the pool's again.
    later = table.alpha("code", 15.0, pool_tau)
    assert later == pytest.approx(alpha_from_accept_length(pool_tau, 3), abs=0.01)
    # Without a pool-wide estimate the key's own is used; an unknown key gets the pool's.
    assert table.accept_length("code", 0.0, None) == pytest.approx(own_tau, rel=0.01)
    assert table.accept_length("other", 0.0, pool_tau) == pool_tau
    assert table.accept_length("other", 0.0, None) is None


def test_memory_is_bounded_least_recently_used_first():
    table = WorkloadAcceptance(3, max_keys=3)
    for i, key in enumerate(("a", "b", "c")):
        table.observe_request(key, float(i), 250, 100)
    table.observe_request("a", 3.0, 250, 100)  # a is used again: b is now the oldest
    table.observe_request("d", 4.0, 250, 100)
    assert len(table) == 3
    assert {row["key"] for row in table.top(4.0, 10, None)} == {"a", "c", "d"}
    top = table.top(4.0, 1, 2.0)
    assert len(top) == 1 and top[0]["key"] in ("a", "d") and top[0]["evidence_steps"] > 0
    assert FleetModel(workload_keys=0).workload_acceptance() is not None
    off = WorkloadAcceptance(3, max_keys=0)
    off.observe_request("a", 0.0, 250, 100)
    assert len(off) == 0


def test_a_derived_key_says_what_the_request_asks_for_and_hashes_its_system_prompt():
    system = "You are a careful Python programmer."
    chat = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]}
    key = workload_key(chat)
    assert key is not None and key.startswith("text:") and len(key) == len("text:") + 8
    assert system not in key and "Python" not in key
    assert workload_key({**chat, "messages": [{"role": "user", "content": "other words"}, *chat["messages"]]}) == key
    assert workload_key({**chat, "response_format": {"type": "json_object"}}) == "json:" + key[5:]
    assert workload_key({**chat, "tools": [{"type": "function"}]}) == "tools:" + key[5:]
    # Plain text without a system prompt has no key: the pool-wide estimate, as before.
    assert workload_key({"messages": [{"role": "user", "content": "hi"}]}) is None
    assert workload_key({"prompt": "def f():"}) is None
    assert workload_key({"prompt": "{", "response_format": {"type": "json_schema"}}) == "json:-"
    other = {"messages": [{"role": "developer", "content": [{"type": "text", "text": "Answer in French."}]}]}
    assert workload_key(other) not in (key, None)


def test_a_derived_key_is_keyed_so_a_guessed_prompt_cannot_be_confirmed():
    chat = {"messages": [{"role": "system", "content": "You are a helpful assistant."}]}
    unkeyed, one, two = workload_key(chat), workload_key(chat, b"k" * 16), workload_key(chat, b"j" * 16)
    assert len({unkeyed, one, two}) == 3
    assert workload_key(chat, b"k" * 16) == one  # stable for the process's key
