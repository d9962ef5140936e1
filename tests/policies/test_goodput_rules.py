"""goodput's rules, one by one, on hand-built snapshots: each test names its rule and checks the
reason token the rule gives (or, for the rules that only amend the case, the token of the rule
that then decides). The order is checked against docs/routing.md and the module docstring."""

import ast
import re
from dataclasses import replace
from pathlib import Path

import pytest
from policy_snapshots import pool, snapshot

from fleet.costmodel import StepCostModel, seed_from_profile
from fleet.native import running_compiled
from fleet.types import Decision, Features, InstanceState, PoolState, Snapshot
from policies.goodput import Goodput, GoodputParams
from policies.threshold import Threshold

RULES = (
    "pool-down",
    "stale",
    "throughput",
    "slo-queue-allowance",
    "slo-one-pool",
    "slo-triage",
    "lost-together",
    "spec-backlog",
    "spare-spec",
    "spec-full",
    "slot-price",
    "sooner",
)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "routing.md"
SOURCE = Path(__file__).resolve().parents[2] / "policies" / "goodput.py"
SHORT = Features(prompt_tokens=64, max_tokens=256, ignore_eos=True)
LONG = Features(prompt_tokens=4000)
BATCH = Features(prompt_tokens=64, max_tokens=256, request_class="batch")
# Base prefills 30 prompts/s of 8,000 tokens: its decode is stretched past a 50 ms TPOT target,
# by the turnover of its batch too (`Goodput.prefill_share`).
PRESSED = dict(dispatches_per_s=30.0, prompt_tokens_per_s=240_000.0)


@pytest.fixture
def cost():
    return StepCostModel(seed_from_profile("h200-llama8b"), num_draft_tokens=3)


def slo_policy() -> Goodput:
    return Goodput(GoodputParams(slo_ttft_s=1.0, slo_tpot_ms=50.0))


def _with(snap, name, **changes):
    """The snapshot with the named pool's one instance changed."""
    from dataclasses import replace

    pools = dict(snap.pools)
    pools[name] = replace(pools[name], instances=(replace(pools[name].instances[0], **changes),))
    return replace(snap, pools=pools)


def test_decide_applies_the_rules_in_the_documented_order(cost):
    """decide calls the rules in RULES' order (its source, and when it runs from source, each
    rule replaced by a recorder); docs/routing.md and the module docstring list them in that
    order under the same names."""
    source = SOURCE.read_text()
    decide = next(
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef) and node.name == "decide" and node.args.args[0].arg == "self"
    )
    named = [
        n.attr.replace("_", "-")
        for n in sorted(
            (n for n in ast.walk(decide) if isinstance(n, ast.Attribute)), key=lambda n: (n.lineno, n.col_offset)
        )
        if isinstance(n.value, ast.Name) and n.value.id == "self"
    ]
    assert tuple(dict.fromkeys(r for r in named if r in RULES)) == RULES
    if not running_compiled("policies.goodput"):  # a compiled class's methods cannot be replaced
        policy, called = Goodput(), []

        def recorder(name, method):
            def rule(arg):
                called.append(name)
                return method(arg) if name == "sooner" else None

            return rule

        for name in RULES:
            attr = name.replace("-", "_")
            setattr(policy, attr, recorder(name, getattr(policy, attr)))
        policy.decide(SHORT, snapshot(0, 0, cost))
        assert tuple(called) == RULES
    section = DOCS.read_text().split("### `goodput`'s rules, in order", 1)[1].split("\n## ", 1)[0]
    assert tuple(re.findall(r"^ ?\d+\. `([a-z-]+)`", section, re.M)) == RULES
    docstring = ast.get_docstring(ast.parse(source)) or ""
    assert tuple(re.findall(r"^ ?\d+\. `([a-z-]+)`", docstring, re.M)) == RULES


def _reason(decision: Decision) -> tuple[str, str]:
    return decision.pool, decision.reason


def test_pool_down(cost):
    policy = Goodput()
    assert _reason(policy.decide(SHORT, snapshot(0, 0, cost, healthy=False))) == ("base", "spec-down")
    # A fleet of one pool: nothing is down (the single-pool demo read "base-down" on every request).
    no_spec = Snapshot(pools={"base": pool("base", 0, 256)}, cost=cost)
    assert _reason(policy.decide(SHORT, no_spec)) == ("base", "base-only")
    no_base = Snapshot(pools={"spec": pool("spec", 0)}, cost=cost)
    assert _reason(policy.decide(SHORT, no_base)) == ("spec", "spec-only")
    assert _reason(Threshold().decide(SHORT, no_base)) == ("spec", "spec-only")
    no_base_down = Snapshot(pools={"spec": pool("spec", 0, healthy=False)}, cost=cost)
    assert _reason(policy.decide(SHORT, no_base_down)) == ("base", "none-healthy")
    base_down = Snapshot(pools={"spec": pool("spec", 0), "base": pool("base", 0, 256, healthy=False)}, cost=cost)
    assert _reason(policy.decide(SHORT, base_down)) == ("spec", "base-down")
    both_down = Snapshot(pools={"spec": pool("spec", 0, healthy=False), "base": pool("base", 0, healthy=False)})
    assert _reason(policy.decide(SHORT, both_down)) == ("base", "none-healthy")
    # A guard needs no cost model, and comes before `stale`.
    stale_base_down = Snapshot(pools={"spec": pool("spec", 0, stale=True), "base": pool("base", 0, healthy=False)})
    assert _reason(policy.decide(SHORT, stale_base_down)) == ("spec", "base-down")


def test_stale(cost):
    policy = Goodput()
    assert _reason(policy.decide(SHORT, snapshot(0, 0, cost, stale=True))) == ("base", "stale")
    assert _reason(policy.decide(SHORT, snapshot(0, 0, None, stale=True))) == ("base", "stale")
    # Past the guards the rules need the cost model.
    with pytest.raises(ValueError, match="step-cost model"):
        policy.decide(SHORT, snapshot(0, 0, None))


def test_throughput(cost):
    policy = slo_policy()
    assert _reason(policy.decide(BATCH, snapshot(0, 0, cost))) == ("spec", "throughput-spec")
    assert _reason(policy.decide(BATCH, snapshot(47, 10, cost))) == ("base", "throughput-base")
    # Neither pool gains (both past their caps): the batch request skips the SLO rules and
    # `spec-full` and goes by the cost comparison, even onto spec's queue.
    both_full = policy.decide(BATCH, snapshot(60, 300, cost))
    assert both_full.scores["gain_spec_tok_s"] == 0.0 and both_full.scores["gain_base_tok_s"] == 0.0
    assert "slo_spec" not in both_full.scores and "slot_price_s" in both_full.scores
    assert _reason(both_full) == ("spec", "spec-sooner")


def test_slo_queue_allowance(cost):
    # Spec two past its cap but the slow end of the wait still meets the TTFT target, and so does
    # base: the request may queue on spec, skips `spec-full` and competes on cost there, slot
    # price included.
    snap = snapshot(50, 200, cost)
    decision = slo_policy().decide(SHORT, snap)
    assert decision.scores["slo_spec"] == 1.0 and decision.scores["slo_base"] == 1.0
    assert decision.scores["batch_spec"] == 48.0 and "slot_price_s" in decision.scores
    assert _reason(decision) == ("spec", "spec-sooner")
    # Without targets there is no allowance.
    assert _reason(Goodput().decide(SHORT, snap)) == ("base", "spec-full")
    # Base past its TPOT target: met on spec only, the request queues there (`slo-one-pool`).
    # The allowance used to skip `slo-one-pool` too, and the cost comparison, slot price
    # included, sent this request to base, where it misses its target.
    pressed = _with(snap, "base", **PRESSED)
    decision = slo_policy().decide(SHORT, pressed)
    assert decision.scores["slo_spec"] == 1.0 and decision.scores["slo_base"] == 0.0
    assert _reason(decision) == ("spec", "slo-spec")


def test_slo_one_pool(cost):
    # Spec below its cap but with 60,000 prompt tokens queued: a first token there misses 1 s.
    spec_backlogged = _with(snapshot(10, 10, cost), "spec", waiting=6.0, waiting_tokens=60_000.0)
    decision = slo_policy().decide(Features(prompt_tokens=2000), spec_backlogged)
    assert (decision.scores["slo_spec"], decision.scores["slo_base"]) == (0.0, 1.0)
    assert _reason(decision) == ("base", "slo-base")
    # Base's decode stretched past the TPOT target, spec one slot short of full.
    base_pressed = _with(snapshot(46, 200, cost), "base", **PRESSED)
    assert _reason(slo_policy().decide(SHORT, base_pressed)) == ("spec", "slo-spec")


def test_slo_triage(cost):
    # Lost on both: base past its TPOT target, spec's queue past the TTFT target; spec has room.
    snap = _with(snapshot(30, 60, cost), "base", **PRESSED)
    snap = _with(snap, "spec", waiting=6.0, waiting_tokens=60_000.0)
    decision = slo_policy().decide(Features(prompt_tokens=2000), snap)
    assert decision.scores["slo_lost"] == 1.0
    # Base's requests miss their target anyway: re-costed, the stall there is plain latency.
    assert decision.scores["cost_base_s"] < decision.scores["cost_spec_s"]
    assert _reason(decision) == ("base", "base-sooner")


def test_lost_together(cost):
    """A lost request joins the most loaded instance of a pool past its cap everywhere; with a
    free slot anywhere in the pool, or for a request that can still meet its targets, the
    cheapest instance as before."""

    def fleet(s0: float, s1: float, b0: float, b1: float) -> Snapshot:
        def instance(url: str, load: float, cap: int) -> InstanceState:
            return InstanceState(url, min(load, cap), max(load - cap, 0), cap, age_s=0.05)

        spec = PoolState("spec", (instance("s0", s0, 48), instance("s1", s1, 48)), True, 3, alpha=0.6)
        base = PoolState("base", (instance("b0", b0, 256), instance("b1", b1, 256)))
        return Snapshot(pools={"spec": spec, "base": base}, cost=cost)

    full = fleet(56, 60, 300, 280)
    decision = slo_policy().decide(LONG, full)
    assert decision.scores["slo_lost"] == 1.0
    assert decision.scores["lost_together_spec"] == decision.scores["lost_together_base"] == 1.0
    assert decision.instance == {"spec": "s1", "base": "b0"}[decision.pool]
    if not running_compiled("policies.goodput"):  # a compiled class's methods cannot be replaced
        # Without the rule's amendment the cheapest (least loaded) instance would have been named.
        plain = slo_policy()
        plain.lost_together = lambda c: None  # type: ignore[method-assign]
        assert plain.decide(LONG, full).instance != decision.instance
    # A free slot on one spec instance: spec's instance is the cheapest again.
    room = slo_policy().decide(LONG, fleet(40, 60, 300, 280))
    assert "lost_together_spec" not in room.scores and room.scores["lost_together_base"] == 1.0
    # A request that meets its targets somewhere is not lost: the rule does not apply.
    assert "lost_together_spec" not in Goodput().decide(SHORT, full).scores


def test_spec_backlog(cost):
    # Spec six past its cap, base below its cap with a burst's prompts waiting: lost on both.
    burst = _with(snapshot(54, 120, cost), "base", waiting=60.0, waiting_tokens=200_000.0, **PRESSED)
    decision = slo_policy().decide(LONG, burst)
    assert decision.scores["slo_lost"] == 1.0
    assert _reason(decision) == ("spec", "spec-backlog")
    # Past base's cap its queue is one for slots as well, which does not clear after a burst.
    base_full = _with(snapshot(54, 316, cost), "base", waiting_tokens=200_000.0, **PRESSED)
    assert _reason(slo_policy().decide(LONG, base_full)) == ("base", "spec-full")


def test_spare_spec(cost):
    """A lost request stays off a spec pool whose TPOT it would take past the target while base,
    past its cap, holds the overflow, even where spec is far cheaper; below base's cap, or lost
    by its first token alone, it goes where it is cheaper."""
    tight = Goodput(GoodputParams(slo_ttft_s=1.0, slo_tpot_ms=10.0))
    # Both pools prefill long prompts (base 8,000 tokens at 30 a second, spec 4,000 at 20):
    # base's decode far past 10 ms a token and 44 requests queued past its cap, spec's TPOT (30
    # running, below its cap) past the target.
    snap = _with(snapshot(30, 300, cost), "base", **PRESSED)
    snap = _with(snap, "spec", dispatches_per_s=20.0, prompt_tokens_per_s=80_000.0)
    decision = tight.decide(Features(prompt_tokens=1000), snap)
    assert decision.scores["slo_lost"] == 1.0 and decision.scores["tpot_spec_ms"] > 10.0
    assert decision.scores["cost_spec_s"] < decision.scores["cost_base_s"]
    assert _reason(decision) == ("base", "spare-spec")
    # The same pools with base below its cap: base holds no overflow, the cheaper pool wins.
    below = _with(
        _with(snapshot(30, 250, cost), "base", **PRESSED), "spec", dispatches_per_s=20.0, prompt_tokens_per_s=80_000.0
    )
    assert _reason(tight.decide(Features(prompt_tokens=1000), below)) == ("spec", "spec-sooner")
    # Base past its cap but spec's TPOT within a 50 ms target: a request lost by its first token
    # alone (a 60,000-token prompt misses 1 s on both pools) still goes where it is cheaper.
    quiet_spec = _with(snapshot(2, 300, cost), "base", **PRESSED)
    huge = slo_policy().decide(Features(prompt_tokens=60_000, max_tokens=256, ignore_eos=True), quiet_spec)
    assert huge.scores["slo_lost"] == 1.0 and huge.scores["tpot_spec_ms"] < 50.0
    assert _reason(huge) == ("spec", "spec-sooner")
    # Without a TPOT target there is no TPOT to spare.
    ttft_only = Goodput(GoodputParams(slo_ttft_s=1.0))
    decision = ttft_only.decide(Features(prompt_tokens=60_000, max_tokens=256, ignore_eos=True), snap)
    assert decision.scores["slo_lost"] == 1.0 and decision.reason != "spare-spec"
    # Two base instances: the one holding 39,000 of the prompt's 40,000 tokens is full, the other
    # has free slots, so base as a whole holds no overflow. The request is predicted on the full
    # one (its cached prefix makes it the cheapest), and the cost comparison decides.
    b0 = InstanceState("b0", 256, 1, 256, age_s=0.05, **PRESSED)
    b1 = InstanceState("b1", 200, 0, 256, age_s=0.05, **PRESSED)
    two = replace(snap, pools={**snap.pools, "base": replace(snap.pools["base"], instances=(b0, b1))})
    cached = tight.decide(Features(prompt_tokens=40_000, cached={"b0": 39_000}), two)
    assert cached.scores["slo_lost"] == 1.0 and cached.instance == "b0"
    assert _reason(cached) == ("base", "base-sooner")


def test_spec_full(cost):
    assert _reason(Goodput().decide(SHORT, snapshot(48, 250, cost))) == ("base", "spec-full")
    # With targets: the request lost on both pools, base's backlog short.
    short_backlog = _with(snapshot(54, 70, cost), "base", waiting=10.0, waiting_tokens=20_000.0, **PRESSED)
    decision = slo_policy().decide(LONG, short_backlog)
    assert decision.scores["slo_lost"] == 1.0
    assert _reason(decision) == ("base", "spec-full")


def test_slot_price(cost):
    # Spec has one free slot; recent prompts averaged 1,000 tokens; base runs 200 requests.
    snap = _with(snapshot(47, 200, cost), "base", dispatches_per_s=20.0, prompt_tokens_per_s=20_000.0)
    snap = _with(snap, "spec", dispatches_per_s=10.0, prompt_tokens_per_s=10_000.0)
    short = Goodput().decide(Features(prompt_tokens=200), snap)
    # Spec alone is cheaper for the short prompt; the price of its last slot sends it to base.
    assert short.scores["cost_spec_s"] < short.scores["cost_base_s"]
    assert short.scores["cost_spec_s"] + short.scores["slot_price_s"] > short.scores["cost_base_s"]
    assert _reason(short) == ("base", "base-sooner")
    assert _reason(Goodput().decide(LONG, snap)) == ("spec", "spec-sooner")


def test_sooner(cost):
    assert _reason(Goodput().decide(SHORT, snapshot(0, 0, cost))) == ("spec", "spec-sooner")
    # Spec's measured steps three times the profile's: base is sooner.
    slow = StepCostModel(seed_from_profile("h200-llama8b"), num_draft_tokens=3)
    for _ in range(200):
        for b in (8, 16):
            slow.observe("spec", b, 3 * slow.seed_step_ms(b, 4))
    decision = Goodput().decide(SHORT, snapshot(10, 10, slow))
    assert decision.scores["cost_spec_s"] > decision.scores["cost_base_s"]
    assert _reason(decision) == ("base", "base-sooner")
