"""What the decision's fast path remembers gives the same floats as computing afresh
(bench/prefix_decision.py; docs/routing.md, "Prefix index")."""

from __future__ import annotations

import dataclasses
import random

from fleet.costmodel import StepCostModel, seed_from_profile
from fleet.instance import InstanceSignals
from fleet.readings import Reading
from fleet.types import Decision, Features, InstanceState, PoolState


def test_step_cost_at_matches_the_model_as_it_learns():
    rng = random.Random(3)
    model = StepCostModel(seed_from_profile("h200-llama8b"))
    for step in range(400):
        now = step * 0.05
        at = model.at(now)
        for _ in range(3):  # asked again: remembered, the same floats
            for pool, width in (("spec", 4), ("base", 1)):
                batch = rng.randint(0, 70)
                tokens = rng.randint(0, 20_000)
                assert at.decode_step_ms(pool, batch, width) == model.decode_step_ms(pool, batch, width, now)
                assert at.prefill_ms(pool, tokens) == model.prefill_ms(pool, tokens, now)
                assert at.evidence(pool, batch) == model.evidence(pool, batch, now)
                assert at.evidence(pool, tokens, prefill=True) == model.evidence(pool, tokens, now, prefill=True)
        # Learning after the snapshot was taken reaches it (new buckets included).
        pool = rng.choice(("spec", "base"))
        model.observe(pool, rng.choice((1, 3, 9, 20, 33, 47, 90)), rng.uniform(5, 30), now=now)
        model.observe_prefill(pool, rng.choice((30, 500, 3000, 9000)), rng.uniform(20, 900), now=now)
        assert at.decode_step_ms("spec", 20, 4) == model.decode_step_ms("spec", 20, 4, now)
        assert at.prefill_ms("base", 3000) == model.prefill_ms("base", 3000, now)


def test_an_instance_state_is_its_signals_read_one_by_one():
    rng = random.Random(5)
    signals = InstanceSignals(url="u", pool="spec", max_running=48)
    for k in range(300):
        now = k * 0.1
        if k % 7 == 0:
            reading = Reading(at=now, running=rng.randint(0, 50), waiting=rng.randint(0, 4), max_running=48)
            signals.reading = dataclasses.replace(reading, waiting_tokens=rng.choice((None, 1200)))
            while signals.events and signals.events[0][0] < now:
                signals.events.popleft()
        if rng.random() < 0.6:
            tokens = rng.randint(0, 4000)
            signals.events.append((now, +1, tokens))
            signals.local_in_flight += 1
            signals.sent.add(now)
            signals.prompt_tokens_sent.add(now, tokens)
        if rng.random() < 0.4 and signals.local_in_flight:
            signals.events.append((now, -1, 0))
            signals.local_in_flight -= 1
        signals.polled = k % 50 != 49
        later = now + rng.uniform(0, 0.3)
        running, waiting = signals.adjusted()
        assert signals.state(later) == InstanceState(
            url="u",
            running=running,
            waiting=waiting,
            max_running=48,
            age_s=signals.age(later),
            waiting_tokens=signals.waiting_tokens(),
            prompt_tokens_per_s=signals.prompt_tokens_sent.per_s(later),
            dispatches_per_s=signals.sent.per_s(later),
            in_flight=signals.local_in_flight,
        )


def test_with_cached_is_replace():
    features = Features(
        prompt_tokens=900,
        max_tokens=64,
        stream=False,
        request_class="batch",
        ignore_eos=True,
        workload="json:-",
        stream_tokens=1200,
    )
    assert features.with_cached({"a": 256}) == dataclasses.replace(features, cached={"a": 256})
    # Every field is carried: a field added to Features must be added to with_cached too.
    assert [f.name for f in dataclasses.fields(Features)][-2:] == ["cached", "stream_tokens"]
    assert len(dataclasses.fields(Features)) == 8


def test_on_instance_is_replace():
    decision = Decision(pool="spec", reason="spec-sooner", scores={"t_spec_s": 0.5})
    assert decision.on_instance("http://a") == dataclasses.replace(decision, instance="http://a")
    # Every field is carried: a field added to Decision must be added to on_instance too.
    assert [f.name for f in dataclasses.fields(Decision)] == ["pool", "reason", "scores", "instance"]


def test_pool_state_least_loaded_is_the_first_smallest():
    def state(url: str, running: float, cap: int, healthy: bool = True) -> InstanceState:
        return InstanceState(url=url, running=running, waiting=0.0, max_running=cap, healthy=healthy)

    pool = PoolState("spec", (state("a", 10, 48), state("b", 5, 24), state("c", 5, 24), state("d", 0, 8, False)))
    assert pool.least_loaded() is pool.instances[1]  # 5/24 < 10/48 only by the tie-break on load
    assert [i.url for i in pool.healthy_instances] == ["a", "b", "c"]
    assert dataclasses.replace(pool, instances=pool.instances[3:]).least_loaded() is None


def test_a_batch_size_never_seen_has_no_evidence_though_its_prediction_borrows_a_ratio():
    model = StepCostModel(seed_from_profile("h200-llama8b"))
    for k in range(200):
        model.observe("base", 2, 2 * model.decode_step_ms("base", 2, 1, 0.0), now=k * 0.01)
    now = 2.0
    at = model.at(now)
    assert model.evidence("base", 2, now) > 10
    assert 0 < model.evidence("base", 3, now) < model.evidence("base", 2, now)  # within a doubling
    for far in (8, 256):  # two and seven doublings away: nothing seen there
        assert model.evidence("base", far, now) == at.evidence("base", far) == 0.0
        # ... yet the prediction there follows what batch 2 showed (twice the seed's step)
        assert model.decode_step_ms("base", far, 1, now) > 1.5 * StepCostModel(
            seed_from_profile("h200-llama8b")
        ).decode_step_ms("base", far, 1, now)
    assert model.evidence("spec", 2, now) == 0.0
