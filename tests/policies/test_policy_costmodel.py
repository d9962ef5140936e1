import pytest
from policy_snapshots import snapshot

from fleet.costmodel import AffineSeed, StepCostModel, seed_from_profile
from fleet.model import FleetModel
from fleet.readings import Reading, ResponseEvidence
from fleet.types import Features
from policies.goodput import Goodput


def test_seed_is_the_twin_profile():
    model = StepCostModel(seed_from_profile("h200-llama8b"), num_draft_tokens=3)
    # base = target(B, 1); spec = 3 * draft(B) + target(B, 4), both at L = 1024 (calibration CSV)
    assert model.decode_step_ms("base", 64, 1) == pytest.approx(7.5865, rel=1e-3)
    assert model.decode_step_ms("spec", 64, 4) == pytest.approx(3 * 0.3112 + 10.6011, rel=1e-3)
    assert model.prefill_ms("spec", 1000) > model.prefill_ms("base", 1000)  # draft extend


def test_learning_corrects_the_seed_where_observed():
    model = StepCostModel(AffineSeed(), num_draft_tokens=3)
    seed_spec_32 = model.decode_step_ms("spec", 32, 4)
    for _ in range(100):
        model.observe("spec", 32, 2.0 * seed_spec_32)
    assert model.decode_step_ms("spec", 32, 4) == pytest.approx(2 * seed_spec_32, rel=0.03)
    # the nearest learned bucket carries the correction outward; the other pool, unobserved,
    # keeps the seed (spec's correction says it is slower than seeded: it is not taken for so)
    assert model.correction("spec", 256) == pytest.approx(model.correction("spec", 32))
    assert model.correction("base", 32) == 1.0


def test_an_aged_pool_returns_no_further_than_the_other_pools_correction():
    """Both pools' steps are 2.6-3.4x the seed (the generic prior on a Kimi fleet). A pool
    observed and then left alone returns, as its observations age, to spec's correction when it
    was seen slower than that (it may have recovered: it is retried), and keeps what it showed
    when it was seen faster; never to the seed, which would make it look 3x faster than it is
    (docs/learning.md)."""
    for seen, aged in ((3.4, 3.0), (2.6, 2.6)):
        model = StepCostModel(AffineSeed(), num_draft_tokens=3, half_life_s=HALF_LIFE_S)
        for i in range(200):
            model.observe("base", 1, seen * model.seed_step_ms(1, 1), now=i * 0.01)
        for i in range(6000):
            model.observe("spec", 1, 3.0 * model.seed_step_ms(1, 4), now=i * 0.02)
        assert model.correction("base", 1, 2.0) == pytest.approx(seen, abs=0.05)  # its own, fresh
        assert model.correction("base", 1, 120.0) == pytest.approx(aged, abs=0.05)
        assert model.correction("spec", 1, 120.0) == pytest.approx(3.0, abs=0.05)
    # an unseen prefill takes the lower of the seed and what the other pool learned
    model.observe_prefill("spec", 1000, 2.0 * model.seed.prefill_ms(1000, True), now=120.0)
    assert model.prefill_correction("base", 1000, 120.0) == 1.0
    model.observe_prefill("spec", 100, 0.5 * model.seed.prefill_ms(100, True), now=120.0)
    assert model.prefill_correction("base", 100, 120.0) == pytest.approx(model.prefill_correction("spec", 100, 120.0))


def test_correction_interpolates_between_buckets_and_forgets():
    model = StepCostModel(AffineSeed(), num_draft_tokens=3, memory=20)
    for _ in range(50):
        model.observe("base", 8, model.seed_step_ms(8, 1) * 1.0)
        model.observe("base", 128, model.seed_step_ms(128, 1) * 2.0)
    middle = model.correction("base", 32)
    assert 1.2 < middle < 1.8
    for _ in range(60):  # the server got faster: a capped memory follows it
        model.observe("base", 128, model.seed_step_ms(128, 1) * 1.0)
    assert model.correction("base", 128) == pytest.approx(1.0, abs=0.05)


def test_bad_observations_are_ignored():
    model = StepCostModel()
    model.observe("base", 0, 5.0)
    model.observe("base", 4, float("nan"))
    model.observe("base", 4, -1.0)
    assert model.correction("base", 4) == 1.0


def test_unknown_profile_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown profile"):
        seed_from_profile("no-such-profile")


# -- learned corrections lose trust with age (a pool avoided on an inflated reading is retried) --

HALF_LIFE_S = 8.0


def inflated_spec(model, factor=3.0, n=300, until=10.0):
    """`n` observations at batch 1, `factor` x the seed, fed until `until` seconds."""
    seed = model.seed_step_ms(1, 4)
    for i in range(n):
        model.observe("spec", 1, factor * seed, now=until * (i + 1) / n)


def served_base(model, start, until):
    """Base observed at its seed once a second from `start` to `until`: the fleet is being
    served, so what spec learned ages (observed time runs)."""
    t = start
    while t <= until:
        model.observe("base", 1, model.seed_step_ms(1, 1), now=t)
        t += 1.0


def test_an_unobserved_bucket_returns_to_the_seed():
    model = StepCostModel(AffineSeed(), num_draft_tokens=3, half_life_s=HALF_LIFE_S)
    inflated_spec(model)
    assert model.at(10.0).decode_step_ms("spec", 1, 4) == pytest.approx(3 * model.seed_step_ms(1, 4), rel=0.02)
    corrections, served = [], 10.0
    for n in (1, 4, 8, 12):
        served_base(model, served, 10.0 + n * HALF_LIFE_S)
        served = 10.0 + n * HALF_LIFE_S + 1.0
        corrections.append(model.correction("spec", 1, 10.0 + n * HALF_LIFE_S))
    assert corrections == sorted(corrections, reverse=True)  # it only returns
    assert corrections[0] > 2.9  # one half-life: still trusted
    assert corrections[2] < 1.6  # 200 observations' worth at 3x, after 8 half-lives: 0.8 left
    assert corrections[3] == pytest.approx(1.0, abs=0.05)
    assert model.at(10.0 + 12 * HALF_LIFE_S).decode_step_ms("spec", 1, 4) == pytest.approx(
        model.seed_step_ms(1, 4), rel=0.05
    )
    # reading at a time does not move the learning: a later observation re-learns from there
    model.observe("spec", 1, 3 * model.seed_step_ms(1, 4), now=10.0 + 12 * HALF_LIFE_S)
    assert 1.5 < model.correction("spec", 1, 10.0 + 12 * HALF_LIFE_S) < 2.0  # 1 observation vs prior_weight 2


def test_a_lull_ages_what_was_learned_by_one_half_life_at_most():
    """No profile on a fleet 3x slower than the generic prior: a minute of traffic, then none
    for ten minutes. Nothing observed in the lull says the fleet changed, so the first request
    after it is predicted as the fleet was learned, not at the seed (docs/routing.md, "Step-cost
    model"); observed time runs again with the traffic."""
    model = StepCostModel(AffineSeed(), num_draft_tokens=3, half_life_s=HALF_LIFE_S)
    for i in range(60):
        model.observe("spec", 1, 3.0 * model.seed_step_ms(1, 4), now=float(i))
        model.observe("base", 8, 3.0 * model.seed_step_ms(8, 1), now=i + 0.5)
        model.observe_prefill("base", 1024, 3.0 * model.seed.prefill_ms(1024), now=i + 0.5)
    fed = {"spec": model.correction("spec", 1, 59.5), "base": model.correction("base", 8, 59.5)}
    assert fed["spec"] > 2.8 and fed["base"] > 2.8
    after = 59.5 + 600.0
    assert model.clock(after) - model.clock(59.5) == HALF_LIFE_S
    assert model.correction("spec", 1, after) > 2.7
    assert model.correction("base", 8, after) > 2.7
    # 11 observations' worth (one a second), halved once, against the seed's 2: 2.5 of 3
    assert model.prefill_correction("base", 1024, after) > 2.4
    assert model.evidence("base", 8, after) == pytest.approx(model.evidence("base", 8, 59.5) / 2, rel=0.01)
    # A reading stamped just before the observation that ended the lull (a poll processed late)
    # is in observed time just before it too, not ten minutes earlier.
    model.observe("base", 8, 3.0 * model.seed_step_ms(8, 1), now=after + 1.0)
    assert model.clock(after - 5.0) == model.clock(after) == model.clock(after + 1.0)
    assert model.clock(59.5 + 3.0) == model.clock(59.5) + 3.0
    # the traffic that resumes runs observed time again: spec, now avoided, ages as before
    served_base(model, after, after + 12 * HALF_LIFE_S)
    assert model.correction("spec", 1, after + 12 * HALF_LIFE_S) < 1.2 * model.correction("base", 1, after)


def test_a_bucket_being_fed_keeps_its_learned_value():
    model = StepCostModel(AffineSeed(), num_draft_tokens=3, half_life_s=HALF_LIFE_S)
    seed = model.seed_step_ms(32, 4)
    for i in range(600):  # one observation a second for ten minutes (75 half-lives)
        model.observe("spec", 32, 2.0 * seed, now=float(i))
        if i >= 30:  # learned within half a minute, and held: about 11 observations' worth vs 2
            assert model.at(i + 0.99).decode_step_ms("spec", 32, 4) > 1.8 * seed
    assert 1.8 < model.correction("spec", 32, 600.0) <= 2.0


def test_aging_without_a_clock_changes_nothing():
    """Calls without `now` stay at the latest time the model was told: no decay in between."""
    model = StepCostModel(AffineSeed(), num_draft_tokens=3, half_life_s=1.0)
    for _ in range(100):
        model.observe("base", 8, 2.0 * model.seed_step_ms(8, 1))
    assert model.correction("base", 8) == pytest.approx(2.0, abs=0.02)
    with pytest.raises(ValueError, match="half_life_s"):
        StepCostModel(half_life_s=0)


def test_goodput_returns_to_an_avoided_spec_pool_once_its_inflated_steps_age():
    """Spec's steps were observed 3x slow (CPU contention): goodput sends quiet requests to
    base, and spec gets no observations; some half-lives later it is tried again."""
    fleet = FleetModel(
        {"spec": 3, "base": 0},
        stale_after_s=1.0,
        seed=seed_from_profile("h200-llama8b"),
        costmodel_half_life_s=HALF_LIFE_S,
    )
    fleet.add_instance("http://spec", "spec", 48)
    fleet.add_instance("http://base", "base", 256)
    cost = fleet.cost
    for i in range(300):  # 200 observations' worth (the memory) at 3x on spec, at the seed on base
        now = i * 0.02
        fleet.on_response("http://spec", now, ResponseEvidence(step_ms=3 * cost.seed_step_ms(1, 4)))
        fleet.on_response("http://base", now, ResponseEvidence(step_ms=cost.seed_step_ms(1, 1)))
    policy = Goodput()
    request = Features(prompt_tokens=500)

    served = [6.0]

    def quiet(now):
        """The fleet idle at `now`, base having served a request a second until then (spec,
        avoided, ages as the fleet is observed; a lull would age nothing)."""
        while served[0] + 1.0 <= now:
            served[0] += 1.0
            fleet.on_response("http://base", served[0], ResponseEvidence(step_ms=cost.seed_step_ms(1, 1)))
        for url in ("http://spec", "http://base"):
            fleet.on_reading(url, Reading(at=now, running=0, waiting=0))
        return fleet.snapshot(now)

    assert policy.decide(request, quiet(6.0)).pool == "base"
    assert policy.decide(request, quiet(6.0 + 2 * HALF_LIFE_S)).pool == "base"
    decision = policy.decide(request, quiet(6.0 + 10 * HALF_LIFE_S))
    assert decision.pool == "spec", decision
    # the same model, read at an earlier moment, still predicts spec slow
    assert policy.decide(request, fleet.snapshot(6.0)).pool == "base"


def test_seed_steps_are_remembered_until_the_seed_changes():
    model = StepCostModel(AffineSeed())
    first = model.seed_step_ms(32, 4)
    assert model.seed_step_ms(32.2, 4) == first  # the same batch once rounded: remembered
    model.seed = AffineSeed(c0=AffineSeed().c0 + 5.0)
    assert model.seed_step_ms(32, 4) == pytest.approx(first + 5.0)


def test_an_aged_bucket_returns_toward_a_fresh_neighbour_before_the_seed():
    """Prefill 2.4x the seed everywhere (the generic prior on a Kimi fleet). One long prompt was
    seen 30 s ago; short ones keep coming. The long prompt's size, its own bucket aged, predicted
    at the seed (0.54x the truth) while its neighbour was fresh at 2.4x (a helper's probe)."""
    model = StepCostModel(AffineSeed(), num_draft_tokens=3, half_life_s=HALF_LIFE_S)
    truth = 2.4
    model.observe_prefill("spec", 3500, truth * model.seed.prefill_ms(3500, True), now=0.0)
    for i in range(40):
        model.observe_prefill("spec", 1600, truth * model.seed.prefill_ms(1600, True), now=20.0 + i * 0.25)
    assert model.prefill_correction("spec", 1600, 30.0) == pytest.approx(truth, rel=0.05)
    assert model.prefill_correction("spec", 4096, 30.0) == pytest.approx(truth, rel=0.15)
    # Nothing observed since: a lull ages what was learned by one half-life, no more, so the long
    # prompt is still predicted near the truth rather than at the seed (0.42x the truth).
    last = 20.0 + 39 * 0.25
    assert model.prefill_correction("spec", 4096, 600.0) == model.prefill_correction("spec", 4096, last + HALF_LIFE_S)
    assert model.prefill_correction("spec", 4096, 600.0) > 0.8 * truth


def test_an_aged_bucket_between_fresh_and_aged_ones_is_pulled_by_the_fresh_one_at_its_own_size():
    """A review: 3x the seed learned at batches 1-32, then only 16 and 32 fed for 120 s. At batch 8
    exactly (its bucket aged) the prediction heard only its lower neighbour (aged too): 8.0 ms,
    against 24.4 at batch 9 and the truth of ~24; the evidence at 8 showed 0 beside 25 at 9."""
    model = StepCostModel(AffineSeed(), num_draft_tokens=3, half_life_s=HALF_LIFE_S)
    now = 0.0
    for _ in range(200):
        now += 0.25
        for batch in (1, 2, 4, 8, 16, 32):
            model.observe("spec", batch, 3 * model.seed_step_ms(batch, 4), now=now)
    for _ in range(480):
        now += 0.25
        for batch in (16, 32):
            model.observe("spec", batch, 3 * model.seed_step_ms(batch, 4), now=now)
    at_8, at_9 = model.correction("spec", 8, now), model.correction("spec", 9, now)
    assert at_9 > 2.5
    assert at_8 == pytest.approx(at_9, rel=0.05)
    assert model.correction("spec", 7, now) > 0.8 * at_8  # and no cliff just below it either
    assert model.evidence("spec", 8, now) > 0.5 * model.evidence("spec", 9, now)


def test_prefill_evidence_is_asked_where_a_long_prompt_is_learned():
    """A prompt past a chunk is prefilled, and learned, chunk by chunk: its decision shows the
    evidence at its tokens per iteration, not at its whole length (three chunks showed 0)."""
    model = StepCostModel(seed_from_profile("h200-llama8b"))
    for i in range(20):
        model.observe_prefill("spec", 8192, 400.0, now=i * 0.1)
    cost = model.at(2.0)
    policy = Goodput()
    decision = policy.decide(Features(prompt_tokens=24_000, max_tokens=50), snapshot(1, 1, cost))
    assert policy.prefill_iteration(24_000) == 8000
    assert cost.evidence("spec", 24_000, prefill=True) == 0.0  # nothing learned near the whole length
    assert decision.scores["prefill_evidence_spec"] == cost.evidence("spec", 8000, prefill=True) > 0
    assert decision.scores["prefill_evidence_base"] == 0.0  # base learned nothing


def test_a_snapshot_predicts_as_the_model_across_lulls_and_late_observations():
    """A snapshot (`StepCostAt`, which remembers its answers and each bucket's trust) predicts what
    the model predicts at its moment, also when a lull lies between observations and when an
    observation stamped earlier than the latest one (a poll processed late) arrives after it."""
    import random

    rng = random.Random(7)
    model = StepCostModel(AffineSeed(), num_draft_tokens=3, half_life_s=HALF_LIFE_S)
    now = 0.0
    for _ in range(400):
        now += rng.choice((0.05, 0.5, 3.0, 30.0, 400.0))  # lulls among the gaps
        stamped = now - rng.choice((0.0, 0.0, 0.2, 2.0))  # some carry an earlier time
        if rng.random() < 0.5:
            model.observe(rng.choice(("spec", "base")), rng.choice((1, 4, 32, 200)), rng.uniform(5, 60), now=stamped)
        else:
            model.observe_prefill(
                rng.choice(("spec", "base")), rng.choice((64, 1000, 5000)), rng.uniform(5, 300), now=stamped
            )
        at = now + rng.choice((0.0, 1.0, 100.0))
        snapshot = model.at(at)
        for late in (False, True):
            if late:  # the model learns after the snapshot was taken: the snapshot follows it
                model.observe("base", 16, rng.uniform(5, 60), now=now - 1.0)
            for pool, width in (("spec", 4), ("base", 1)):
                for batch in (1, 7, 64):
                    assert snapshot.decode_step_ms(pool, batch, width) == model.decode_step_ms(pool, batch, width, at)
                    assert snapshot.evidence(pool, batch) == model.evidence(pool, batch, at)
                assert snapshot.prefill_ms(pool, 3000) == model.prefill_ms(pool, 3000, at)
