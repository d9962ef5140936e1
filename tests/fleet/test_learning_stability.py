"""Learning never makes routing unstable: the fleet model is driven with a server whose decode
step doubles mid-run and back, and one whose prefill suddenly slows and recovers; goodput follows
each change within the time docs/routing.md gives ("What is learned") and returns after it."""

from __future__ import annotations

from collections.abc import Callable

from fleet.costmodel import seed_from_profile
from fleet.model import FleetModel
from fleet.readings import Reading, ResponseEvidence
from fleet.types import Decision, Features
from policies.goodput import Goodput

SPEC, BASE = "http://spec", "http://base"
TICK_S = 0.05  # 20 finished responses per second on each pool
PREFILL_FOLLOW_S = 25.0  # docs/routing.md: a 4x prefill, 2 idle-instance samples a second (0.5 s, 18.5 s)
FOLLOW_S = 5.0  # docs/routing.md: a doubled step or a 4x prefill is followed within 5 s at this rate
BUSY = 12.0  # requests running on each pool in the decode tests
IDLE_TICK_S = 0.5  # the prefill test: one request at a time on an idle fleet, 2 a second


def fleet_model() -> FleetModel:
    fleet = FleetModel({"spec": 3, "base": 0}, seed=seed_from_profile("h200-llama8b"))
    fleet.add_instance(SPEC, "spec", 48)
    fleet.add_instance(BASE, "base", 256)
    return fleet


def drive(
    fleet: FleetModel,
    start: float,
    end: float,
    step_factor: Callable[[str], float],
    prefill_factor: Callable[[str], float],
    request: Features,
    policy: Goodput,
    running: float = 12.0,
    tick_s: float = TICK_S,
) -> list[tuple[float, Decision]]:
    """Tick the virtual clock from `start` to `end`: each tick a reading of a steady load, one
    finished response per pool (its step gap and, as a stream that found a free slot, its time to
    first token at the given factors of the seed), and one decision for `request`."""
    decisions = []
    now = start
    cost = fleet.cost
    while now < end:
        for url, pool in ((SPEC, "spec"), (BASE, "base")):
            fleet.on_reading(url, Reading(at=now, running=running, waiting=0, accept_length=2.8, accept_steps=400))
            width = cost.tokens_per_seq(pool)
            sent = fleet.on_dispatch(url, now, request.prompt_tokens)
            step = cost.seed_step_ms(running + 1, width) * step_factor(pool)
            prefill = cost.seed.prefill_ms(request.prompt_tokens, pool == "spec") * prefill_factor(pool)
            ttft_s = (prefill + (step / 2 if running else 0.0)) / 1000
            evidence = ResponseEvidence(tokens=200, step_ms=step, ttft_s=ttft_s, dispatch=sent, decode_s=1.0)
            fleet.on_response(url, now, evidence)
            fleet.on_complete(url, now)
        decisions.append((now, policy.decide(request, fleet.snapshot(now))))
        now += tick_s
    return decisions


def first_time(decisions: list[tuple[float, Decision]], pool: str) -> float | None:
    return next((t for t, d in decisions if d.pool == pool), None)


def settles_on(decisions: list[tuple[float, Decision]], pool: str) -> float | None:
    """The time from which every decision goes to `pool` (None if the last one does not)."""
    if not decisions or decisions[-1][1].pool != pool:
        return None
    t = decisions[-1][0]
    for at, d in reversed(decisions):
        if d.pool != pool:
            break
        t = at
    return t


def predicted_step(fleet: FleetModel, now: float) -> float:
    return fleet.snapshot(now).cost.decode_step_ms("spec", int(BUSY) + 1, 4)


def test_a_doubled_decode_step_is_learned_within_seconds_and_unlearned_when_it_recovers() -> None:
    fleet, policy = fleet_model(), Goodput()
    request = Features(prompt_tokens=1000, max_tokens=400)
    truth = fleet.cost.seed_step_ms(BUSY + 1, 4)
    drive(fleet, 0.0, 20.0, lambda p: 1.0, lambda p: 1.0, request, policy)
    assert abs(predicted_step(fleet, 20.0) / truth - 1) < 0.05
    drive(fleet, 20.0, 20.0 + FOLLOW_S, lambda p: 2.0 if p == "spec" else 1.0, lambda p: 1.0, request, policy)
    assert abs(predicted_step(fleet, 20.0 + FOLLOW_S) / (2 * truth) - 1) < 0.10
    drive(fleet, 30.0, 30.0 + FOLLOW_S, lambda p: 1.0, lambda p: 1.0, request, policy)
    assert abs(predicted_step(fleet, 30.0 + FOLLOW_S) / truth - 1) < 0.10


def test_a_spec_step_that_loses_its_advantage_moves_traffic_and_its_recovery_brings_it_back() -> None:
    fleet, policy = fleet_model(), Goodput()
    request = Features(prompt_tokens=1000, max_tokens=400)
    normal = drive(fleet, 0.0, 20.0, lambda p: 1.0, lambda p: 1.0, request, policy)
    assert settles_on(normal, "spec") == 0.0  # quiet enough for speculation throughout
    slow = drive(fleet, 20.0, 60.0, lambda p: 4.0 if p == "spec" else 1.0, lambda p: 1.0, request, policy)
    moved = settles_on(slow, "base")
    assert moved is not None and moved - 20.0 <= FOLLOW_S, moved
    back = drive(fleet, 60.0, 100.0, lambda p: 1.0, lambda p: 1.0, request, policy)
    returned = settles_on(back, "spec")
    assert returned is not None and returned - 60.0 <= FOLLOW_S, returned


def test_a_slowed_prefill_is_followed_and_left_when_it_recovers() -> None:
    """Prefill is learned from requests that found their instance idle (fleet/model.py says
    why): one request at a time, two a second."""
    fleet, policy = fleet_model(), Goodput()
    request = Features(prompt_tokens=8000, max_tokens=40)  # a long prompt, a short answer: prefill decides

    def run(start: float, end: float, factor: float) -> list[tuple[float, Decision]]:
        slowed = lambda p: factor if p == "spec" else 1.0  # noqa: E731
        return drive(fleet, start, end, lambda p: 1.0, slowed, request, policy, running=0.0, tick_s=IDLE_TICK_S)

    assert settles_on(run(0.0, 20.0, 1.0), "spec") == 0.0
    slow = run(20.0, 60.0, 4.0)
    moved = settles_on(slow, "base")
    assert moved is not None and moved - 20.0 <= PREFILL_FOLLOW_S, moved
    assert slow[-1][1].scores["prefill_evidence_spec"] > 10  # the prediction rests on what was seen
    returned = settles_on(run(60.0, 100.0, 1.0), "spec")
    assert returned is not None and returned - 60.0 <= PREFILL_FOLLOW_S, returned
