"""Flow control's rules (policies/flow.py) on hand-built snapshots."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from policy_snapshots import snapshot

from fleet.costmodel import StepCostModel, seed_from_profile
from fleet.types import Features, Snapshot
from policies.flow import MAX_SCAN, ROOM_SHARE, FlowControl, fair_wait_s
from policies.goodput import Goodput
from policies.goodput_params import GoodputParams

COST = StepCostModel(seed_from_profile("h200-llama8b"), num_draft_tokens=3)
LATENCY = Features(prompt_tokens=1000, max_tokens=256)
BATCH = Features(prompt_tokens=1000, max_tokens=256, request_class="batch")
SLO = GoodputParams(slo_ttft_s=1.0, slo_tpot_ms=50)


def flow(max_hold_s: float = 60.0) -> FlowControl:
    return FlowControl(Goodput(SLO), max_hold_s)


def test_only_a_latency_request_lost_on_both_pools_is_held() -> None:
    quiet, flooded = snapshot(2, 10, COST), snapshot(48 + 400, 256 + 2000, COST)
    one_lost = snapshot(48 + 400, 10, COST)  # spec's queue is long, base is quiet
    assert not flow().holds(LATENCY, quiet)
    assert not flow().holds(LATENCY, one_lost)
    assert flow().holds(LATENCY, flooded)
    assert not flow().holds(BATCH, flooded)  # batch work has no targets to miss


def test_room_is_a_first_token_well_inside_the_target_and_the_bound_ends_any_wait() -> None:
    f = flow(max_hold_s=30.0)
    assert f.room(LATENCY, snapshot(2, 10, COST))
    assert not f.room(LATENCY, snapshot(48 + 400, 256 + 2000, COST))
    # A queue whose prefill takes the first token past ROOM_SHARE of the target, though within
    # it: a fresh request there would meet its target, a held one is not let in ahead of it.
    for waiting in range(0, 400):
        snap = snapshot(48 + 400, 256 + waiting, COST)
        p = f.predict(LATENCY, snap, "base")
        idle = f.predict(LATENCY, snap, "base", idle=True)
        assert p is not None and idle is not None
        ttft = p.ttft_s + p.wait_spread_s
        if idle.ttft_s + ROOM_SHARE * (SLO.slo_ttft_s - idle.ttft_s) < ttft <= SLO.slo_ttft_s:
            assert Goodput(SLO).meets_slo(p) or p.tpot_s * 1000 > SLO.slo_tpot_ms
            assert not f.room(LATENCY, snap)
            break
    else:
        raise AssertionError("no queue puts the first token between the room share and the target")
    assert not f.expired(29.9) and f.expired(30.0)


def test_a_request_lost_by_its_own_size_is_never_held() -> None:
    """A probe's finding: a prompt whose prefill alone passes the TTFT target was held to the
    bound on an idle fleet, then served (or refused) as it would have been at once."""
    huge = Features(prompt_tokens=200_000, max_tokens=256)
    f = flow()
    idle = f.predict(huge, snapshot(0, 0, COST), "base", idle=True)
    assert idle is not None and idle.ttft_s > SLO.slo_ttft_s
    assert not f.holds(huge, snapshot(48 + 400, 256 + 2000, COST))
    assert f.holds(LATENCY, snapshot(48 + 400, 256 + 2000, COST))


def test_a_request_lost_only_at_the_predictions_margin_is_not_held_on_a_fleet_meeting_its_targets() -> None:
    """Held on the spread alone (its mean in time), a request that would have been served in
    time waits and is lost by the holding (a probe's burst below capacity: 97 % met without
    flow control, 87.5 % with it). With no attainment measured yet, nothing says the overload
    is real."""
    f, g = flow(), Goodput(SLO)
    for spec_waiting, base_waiting in itertools.product(range(0, 100), range(0, 400, 4)):
        snap = snapshot(48 + spec_waiting, 256 + base_waiting, COST)
        on = [f.predict(LATENCY, snap, pool) for pool in ("spec", "base")]
        assert all(p is not None for p in on)
        if all(not g.meets_slo(p) for p in on if p) and any(f.meets_on_average(p) for p in on if p):
            assert not f.holds(LATENCY, snap)
            break
    else:
        raise AssertionError("no fleet where the request misses only at the margin")


def test_flow_control_needs_a_target() -> None:
    with pytest.raises(ValueError, match="SLO targets"):
        FlowControl(Goodput(GoodputParams()), 60.0)


def test_a_request_lost_only_at_the_margin_is_held_while_a_pool_is_measured_missing_its_targets() -> None:
    f, g = flow(), Goodput(SLO)
    for spec_waiting, base_waiting in itertools.product(range(0, 100), range(0, 400, 4)):
        snap = snapshot(48 + spec_waiting, 256 + base_waiting, COST)
        on = [f.predict(LATENCY, snap, pool) for pool in ("spec", "base")]
        if all(p is not None and not g.meets_slo(p) for p in on) and any(p and f.meets_on_average(p) for p in on):
            break
    else:
        raise AssertionError("no fleet where the request misses only at the margin")
    assert not f.holds(LATENCY, snap)
    meeting = replace(snap, pools={k: replace(v, slo_share=0.97) for k, v in snap.pools.items()})
    assert not f.holds(LATENCY, meeting)
    missing = replace(snap, pools={**snap.pools, "base": replace(snap.pools["base"], slo_share=0.5)})
    assert f.holds(LATENCY, missing)


def measured(snap: Snapshot, spec_per_s: float | None, base_per_s: float | None) -> Snapshot:
    """`snap` with each pool's requests finished per second as the fleet model measures them,
    and every request on its instances this router's own (`in_flight`)."""
    rates = {"spec": spec_per_s, "base": base_per_s}
    return replace(
        snap,
        pools={
            k: replace(
                v,
                finished_per_s=rates[k],
                instances=tuple(replace(i, in_flight=int(i.running + i.waiting)) for i in v.instances),
            )
            for k, v in snap.pools.items()
        },
    )


def test_the_fair_wait_is_the_fleets_mean_time_in_system_held_requests_included() -> None:
    snap = snapshot(48 + 20, 200, COST)  # 68 on spec (48 running, 20 queued), 200 on base
    assert fair_wait_s(measured(snap, 2.0, 6.0), held=32) == pytest.approx((68 + 200 + 32) / 8.0)
    assert fair_wait_s(snap, held=32) is None  # not measured (no targets, or under half a minute)
    # A pool not measured yet (nothing of it finished) still counts what runs on it.
    assert fair_wait_s(measured(snap, 2.0, None), held=32) == pytest.approx(300 / 2.0)
    assert fair_wait_s(measured(snap, 0.0, 0.0), held=32) is None  # nothing finishes: no share to give
    # This router's own requests and departures, not the servers' figures (a review's finding:
    # with two proxies in front of the same servers, each one's share came out twice too long).
    # An ejected instance's requests count (they end there); so does every engine of a
    # data-parallel server (its figures are one engine's, its in-flight count the server's).
    base = measured(snap, 2.0, 6.0).pools["base"]
    (one,) = base.instances
    others = replace(one, running=400, waiting=100)  # another proxy's load beside ours
    dp = replace(one, running=50, replicas=4)
    ejected = replace(one, url="http://b2", healthy=False, ejected=True)
    for instances, in_base in (((others,), 200), ((dp,), 200), ((one, ejected), 400)):
        fleet = measured(snap, 2.0, 6.0)
        fleet = replace(fleet, pools={**fleet.pools, "base": replace(base, instances=instances)})
        assert fair_wait_s(fleet, held=0) == pytest.approx((68 + in_base) / 8.0)


def test_held_requests_past_their_fair_share_are_judged_first_oldest_first_then_the_newest() -> None:
    """`release-due`: without it the newest always goes first, and in a closed loop (a client
    sends again only once answered) the oldest wait out the bound: the tail."""
    f = flow(max_hold_s=120.0)
    snap = measured(snapshot(48, 200, COST), 2.0, 6.0)  # 248 in the fleet
    waits = [90.0, 70.0, 50.0, 10.0, 1.0]  # oldest first; fair share (248 + 5) / 8 = 31.6 s
    order = f.judging_order(waits, snap)
    assert order == [
        (0, "release-due"),
        (1, "release-due"),
        (2, "release-due"),
        (4, "release-room"),
        (3, "release-room"),
    ]
    # Before the rate is measured, only the newest-first rule.
    assert f.judging_order(waits, snapshot(48, 200, COST)) == [(i, "release-room") for i in (4, 3, 2, 1, 0)]
    # At most MAX_SCAN of each kind are judged per look.
    many = [200.0 - i for i in range(100)]
    order = f.judging_order(many, snap)
    assert [i for i, rule in order if rule == "release-due"] == list(range(MAX_SCAN))
    assert [i for i, rule in order if rule == "release-room"] == list(range(99, 99 - MAX_SCAN, -1))


def test_the_due_allowance_is_one_for_each_request_that_left_up_to_one_looks_worth() -> None:
    from policies.flow import due_allowance

    busy = snapshot(48, 200, COST)
    busy = replace(
        busy,
        pools={
            name: replace(pool, instances=tuple(replace(i, in_flight=3) for i in pool.instances))
            for name, pool in busy.pools.items()
        },
    )
    assert due_allowance(0, 3, busy) == 3
    assert due_allowance(2, 3, busy) == 3  # a look's worth, not a pile
    assert due_allowance(1, 0, busy) == 1 and due_allowance(0, 0, busy) == 0
    assert due_allowance(0, 0, snapshot(48, 200, COST)) == 1  # none of ours in the fleet: one goes
