"""Admission control's rules on hand-built snapshots, and its scale following what happened."""

from __future__ import annotations

from dataclasses import replace

import pytest
from policy_snapshots import snapshot

from fleet.costmodel import StepCostModel, seed_from_profile
from fleet.types import Decision, Features
from policies.admission import MIN_SCALE, SCALE_HALF_LIFE_S, TARGET_ATTAINMENT, Admission

COST = StepCostModel(seed_from_profile("h200-llama8b"), num_draft_tokens=3)
LATENCY = Features(prompt_tokens=1000, max_tokens=256)
BATCH = Features(prompt_tokens=1000, max_tokens=256, request_class="batch")
TO_BASE = Decision(pool="base", reason="test")


def test_a_quiet_fleet_admits_everything_and_no_limit_means_no_admission() -> None:
    quiet = snapshot(2, 10, COST)
    assert Admission(1.0, 0.05).admit(LATENCY, quiet, TO_BASE, now=0.0) is None
    assert Admission(1.0, 0.05).admit(BATCH, quiet, TO_BASE, now=0.0) is None
    assert not Admission(0.0, 0.0).enabled
    assert Admission(0.0, 0.0).admit(LATENCY, snapshot(48, 2000, COST), TO_BASE, now=0.0) is None


def test_a_prompt_whose_own_prefill_is_past_the_target_is_refused_only_for_what_is_ahead_of_it() -> None:
    """Held to the target, a long prompt was refused (429, retry in a second) on an idle fleet,
    on every retry: no wait would bring its first token in time. It is held to its own prefill."""
    long_prompt = Features(prompt_tokens=30_000, max_tokens=64)
    idle = snapshot(0, 0, COST)
    p = Admission(1.0).predict(long_prompt, idle, TO_BASE)
    assert p is not None and p.wait_s == 0 and p.own_prefill_s == pytest.approx(p.prefill_s)
    target = p.own_prefill_s / 2  # its own prefill alone takes twice the target
    admission = Admission(target)
    assert admission.admit(long_prompt, idle, TO_BASE, now=0.0) is None
    assert admission.admit(long_prompt, snapshot(0, 200, COST), TO_BASE, now=0.0) is None  # running, none queued
    queued = admission.admit(long_prompt, snapshot(0, 256 + 2, COST), TO_BASE, now=0.0)  # two prompts ahead
    assert queued is not None and queued.rule == "predicted-ttft"
    assert queued.ttft_limit_s == pytest.approx(p.own_prefill_s + target / 2)
    # A short prompt is held to the target itself; the limit grows continuously with the prefill
    # from half of it, and a request that may wait past the target does not move the scale.
    assert admission.ttft_limit_for(0.001) == target and admission.ttft_limit_for(0.001, 0.5) == target / 2
    below, above = admission.ttft_limit_for(target / 2 - 1e-6), admission.ttft_limit_for(target / 2 + 1e-6)
    assert below == pytest.approx(above, abs=1e-5)
    # Judged at the limit the request was held to at scale 1, which no scale admits past.
    assert admission.met(p.own_prefill_s + target / 2, 0.0, p.own_prefill_s)
    assert not admission.met(p.own_prefill_s + target / 2 + 0.01, 0.0, p.own_prefill_s)
    assert admission.met(target, 0.0, 0.001) and not admission.met(target + 0.01, 0.0, 0.001)


def test_a_deep_queue_refuses_with_a_retry_after_from_its_drain() -> None:
    flooded = snapshot(48, 256 + 600, COST)  # 600 waiting past base's cap
    refusal = Admission(1.0, 0.0).admit(LATENCY, flooded, TO_BASE, now=0.0)
    assert refusal is not None and refusal.rule == "predicted-ttft"
    assert refusal.predicted_ttft_s > 1.0 and refusal.retry_after_s >= 1
    deeper = Admission(1.0, 0.0).admit(LATENCY, snapshot(48, 256 + 2000, COST), TO_BASE, now=0.0)
    assert deeper is not None and deeper.retry_after_s > refusal.retry_after_s


def test_batch_requests_are_shed_before_latency_ones() -> None:
    admission = Admission(1.0, 0.0)
    # Find a queue where a latency request still gets in and a batch one does not.
    for waiting in range(0, 2000, 10):
        snap = snapshot(48, 256 + waiting, COST)
        latency, batch = (
            admission.admit(LATENCY, snap, TO_BASE, now=0.0),
            admission.admit(BATCH, snap, TO_BASE, now=0.0),
        )
        assert not (batch is None and latency is not None)  # never a batch in where a latency is out
        if latency is None and batch is not None:
            assert batch.rule == "shed-batch"
            break
    else:
        raise AssertionError("no queue depth sheds batch while admitting latency")


def test_a_request_that_would_stretch_the_running_streams_past_the_tpot_target_is_refused() -> None:
    busy = snapshot(48, 250, COST)  # base just under its cap: no slot wait, long decode steps
    p = Admission(100.0, 0.0).predict(LATENCY, busy, TO_BASE)
    assert p is not None and p.over_cap <= 0
    tight = max(p.tpot_s, p.others_tpot_s) * 0.9
    refusal = Admission(0.0, tight).admit(LATENCY, busy, TO_BASE, now=0.0)
    assert refusal is not None and refusal.rule == "predicted-tpot"
    assert Admission(0.0, tight * 1.5).admit(LATENCY, busy, TO_BASE, now=0.0) is None


def test_the_scale_settles_where_the_target_share_of_admitted_requests_meets_the_slo() -> None:
    admission = Admission(1.0, 0.05)
    for _ in range(200):
        admission.observe(False, now=0.0)
    assert admission.scale == MIN_SCALE  # never shut entirely
    admission = Admission(1.0, 0.05)
    for _ in range(100):
        admission.observe(True, now=0.0)
    assert admission.scale == 1.0  # never past the targets themselves
    # At exactly the target's miss rate the scale stands still; more misses shrink it.
    misses_per_100 = round(100 * (1 - TARGET_ATTAINMENT))
    admission.scale = 0.5
    for _ in range(10):
        for i in range(100):
            admission.observe(i >= misses_per_100, now=0.0)
    assert abs(admission.scale - 0.5) < 0.01
    for i in range(100):
        admission.observe(i >= 4 * misses_per_100, now=0.0)
    assert admission.scale < 0.3


def test_an_idle_fleet_is_not_refused_long_after_an_overload() -> None:
    """An overload drives the scale to its floor; afterwards few requests are admitted to say the
    fleet is quiet (batch ones never do), so what shrank it fades with time: an idle fleet was
    refused every request for minutes (a helper's probe: 388 of 390 on idle twins)."""
    quiet = snapshot(2, 10, COST)
    admission = Admission(1.0, 0.05)
    tpot = admission.admit(LATENCY, quiet, TO_BASE, now=0.0)
    assert tpot is None
    for i in range(200):  # the overload: every admitted request missed
        admission.observe(False, now=i * 0.1)
    assert admission.scale_now(19.9) == MIN_SCALE
    assert admission.admit(BATCH, quiet, TO_BASE, now=20.0) is not None  # shut at the floor
    # Quiet since: the shrink halves its logarithm every half-life, with nothing admitted.
    assert admission.scale_now(19.9 + SCALE_HALF_LIFE_S) == pytest.approx(MIN_SCALE**0.5)
    later = 20.0 + 4 * SCALE_HALF_LIFE_S
    assert admission.scale_now(later) > 0.85
    assert admission.admit(LATENCY, quiet, TO_BASE, now=later) is None
    assert admission.admit(BATCH, quiet, TO_BASE, now=later) is None
    # Evidence arriving as fast as under load is what holds the scale: a second's worth of
    # misses at 100 admitted a second moves it far more than a second of fading does.
    admission = Admission(1.0, 0.05)
    for i in range(100):
        admission.observe(i % 10 != 0, now=i * 0.01)
    assert admission.scale_now(1.0) < 0.75


def test_a_burst_below_the_cap_counts_at_its_rate() -> None:
    # 30 prompts/s of 1,000 tokens into a base running 100, below its cap: routing predicts a new
    # request's whole decode, where the batch's turnover bounds the stall, but the streams
    # decoding now sit through the burst at its rate, and admission judges by that.
    snap = snapshot(10, 100, COST)
    base = snap.pools["base"]
    burst = replace(base.instances[0], dispatches_per_s=30.0, prompt_tokens_per_s=30_000.0)
    snap = replace(snap, pools={**snap.pools, "base": replace(base, instances=(burst,))})
    p = Admission(0.0, 0.05).predict(LATENCY, snap, TO_BASE)
    assert p is not None
    over_a_decode = Admission(0.0, 0.05).predictor.predict(snap.pools["base"], burst, LATENCY, COST, 256)
    step = COST.decode_step_ms("base", 101, 1)
    assert p.tpot_s * 1000 == pytest.approx(step / (1 - 0.9), rel=1e-3)  # the rate, capped at 90 %
    assert over_a_decode.tpot_s < p.tpot_s / 2
    refusal = Admission(0.0, 0.05).admit(LATENCY, snap, TO_BASE, now=0.0)
    assert refusal is not None and refusal.rule == "predicted-tpot"
