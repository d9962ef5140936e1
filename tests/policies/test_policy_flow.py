"""Flow control's rules (policies/flow.py) on hand-built snapshots."""

from __future__ import annotations

import pytest
from policy_snapshots import snapshot

from fleet.costmodel import StepCostModel, seed_from_profile
from fleet.types import Features
from policies.flow import ROOM_SHARE, FlowControl
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
    assert f.room(LATENCY, snapshot(2, 10, COST), "base")
    assert not f.room(LATENCY, snapshot(48 + 400, 256 + 2000, COST), "base")
    # A queue whose prefill takes the first token past ROOM_SHARE of the target, though within
    # it: a fresh request there would meet its target, a held one is not let in ahead of it.
    g = Goodput(SLO)
    for waiting in range(0, 400):
        snap = snapshot(2, 256 + waiting, COST)
        p = f.predict(LATENCY, snap, "base")
        assert p is not None
        ttft = p.ttft_s + p.wait_spread_s
        if ROOM_SHARE * SLO.slo_ttft_s < ttft <= SLO.slo_ttft_s and g.meets_slo(p):
            assert not f.room(LATENCY, snap, "base")
            break
    else:
        raise AssertionError("no queue puts the first token between the room share and the target")
    assert not f.expired(29.9) and f.expired(30.0)


def test_flow_control_needs_a_target() -> None:
    with pytest.raises(ValueError, match="SLO targets"):
        FlowControl(Goodput(GoodputParams()), 60.0)
