"""goodput with the cache credit (`Features.cached`): the instance inside a pool, the pool itself,
and load against the credit, on hand-built snapshots of two spec and two base instances."""

from dataclasses import replace

import pytest

from fleet.costmodel import StepCostModel, seed_from_profile
from fleet.types import Features, InstanceState, PoolState, Snapshot
from policies.goodput import Goodput, GoodputParams


@pytest.fixture
def cost():
    return StepCostModel(seed_from_profile("h200-llama8b"), num_draft_tokens=3)


def instance(url: str, load: float, cap: int) -> InstanceState:
    return InstanceState(url=url, running=min(load, cap), waiting=max(load - cap, 0), max_running=cap, age_s=0.05)


def fleet(cost, s0: float, s1: float, b0: float, b1: float) -> Snapshot:
    spec = PoolState("spec", (instance("s0", s0, 48), instance("s1", s1, 48)), speculative=True, num_draft_tokens=3)
    base = PoolState("base", (instance("b0", b0, 256), instance("b1", b1, 256)))
    return Snapshot(pools={"spec": replace(spec, alpha=0.6), "base": base}, cost=cost)


def test_the_instance_holding_the_prompt_is_chosen_and_its_prefill_credited(cost):
    snap = fleet(cost, 10, 10, 10, 10)
    prompt = Features(prompt_tokens=9000)
    cold = Goodput().decide(prompt, snap)
    warm = Goodput().decide(replace(prompt, cached={"s1": 8192}), snap)
    assert (cold.pool, warm.pool, warm.instance) == ("spec", "spec", "s1")
    assert warm.scores["cached_spec_tokens"] == 8192
    assert warm.scores["t_spec_s"] < cold.scores["t_spec_s"] - 0.15  # about 8,192 tokens of prefill less


def test_a_conversation_stays_on_its_pool_unless_switching_pays(cost):
    """Without the credit a 12,000-token prompt at a light load goes to spec; held on a base
    instance, it stays there (re-prefilling it on spec costs more than speculation saves); held
    for only a fraction, it goes to spec."""
    snap = fleet(cost, 10, 10, 10, 10)
    prompt = Features(prompt_tokens=12_000)
    assert Goodput().decide(prompt, snap).pool == "spec"
    stays = Goodput().decide(replace(prompt, cached={"b1": 11_999}), snap)
    assert (stays.pool, stays.instance) == ("base", "b1")
    assert Goodput().decide(replace(prompt, cached={"b1": 1024}), snap).pool == "spec"


def test_load_weighs_against_the_credit(cost):
    """An instance holding the prompt but full (its requests queue for a slot) loses it to an
    idle one: the wait for a slot costs more than the prefill saved."""
    prompt = Features(prompt_tokens=9000, cached={"s0": 8999})
    assert Goodput().decide(prompt, fleet(cost, 20, 5, 50, 50)).instance == "s0"
    full = Goodput().decide(prompt, fleet(cost, 60, 5, 50, 50))
    # Not named: the router's least loaded, s1.
    assert (full.pool, full.instance) == ("spec", None)


def test_without_the_credit_the_instance_is_left_to_the_router(cost):
    policy = Goodput(GoodputParams(cache_credit=False))
    snap = fleet(cost, 10, 10, 10, 10)
    plain = policy.decide(Features(prompt_tokens=12_000), snap)
    held = policy.decide(Features(prompt_tokens=12_000, cached={"b1": 11_999}), snap)
    assert plain == held and held.instance is None and "cached_base_tokens" not in held.scores


def test_equal_instances_without_credit_are_left_to_the_router(cost):
    """Nothing cached and equal loads: the router's rotation spreads them (no instance named)."""
    decision = Goodput().decide(Features(prompt_tokens=2000), fleet(cost, 10, 10, 10, 10))
    assert decision.instance is None
