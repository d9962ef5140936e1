"""Flow control on the virtual clock: `simulate` keeps the requests a router holds and sends them
with their arrival time when let go; the router's flow control (policies/flow.py, as the proxy
runs it) holds what is lost on both pools in a burst and serves more of it in time."""

import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.learning import FLEETS  # noqa: E402
from bench.routing import capacity_rps, lengths  # noqa: E402
from bench.routing_sim import Workload, closed_loop, run  # noqa: E402
from fleet.profile import load_profile  # noqa: E402
from sim.engine import Engine, EngineConfig  # noqa: E402
from sim.virtual import HOLD, Arrival, EngineView, Held, simulate  # noqa: E402


def test_held_requests_reach_their_engine_with_their_arrival_time_newest_first() -> None:
    engine = Engine(EngineConfig(mode="base", profile=load_profile("h200-llama8b"), seed=1), "base")
    arrivals = [Arrival(time=0.1 * i, prompt_tokens=100, output_tokens=8) for i in range(3)]
    order: list[float] = []

    def hold_all(arrival: Arrival, views: Sequence[EngineView]) -> Held:
        return HOLD

    def release(now: float, held: Sequence[Arrival]) -> tuple[int, int] | None:
        if now < 2.0:
            return None
        order.append(held[-1].time)
        return len(held) - 1, 0

    records = simulate([engine], arrivals, hold_all, release=release)
    assert sorted(r.arrival for r in records) == [a.time for a in arrivals]
    assert order == [0.2, 0.1, 0.0]  # newest first
    assert all(r.first_token_time >= 2.0 and r.ttft >= 2.0 - r.arrival - 1e-9 for r in records)


def test_flow_control_holds_a_burst_lost_on_both_pools_and_serves_more_of_it_in_time() -> None:
    setup = replace(FLEETS["h200-llama8b a=0.60"], seed=0)
    sample = lengths(seed=7)
    rate = capacity_rps(setup, sample)
    # Quiet, then five seconds at three times the fleet's capacity, then quiet again.
    times = [i / (0.3 * rate) for i in range(int(0.3 * rate * 20))]
    times += [20 + i / (3 * rate) for i in range(int(3 * rate * 5))]
    times += [25 + i / (0.3 * rate) for i in range(int(0.3 * rate * 40))]
    arrivals = [Arrival(t, *sample[i % len(sample)]) for i, t in enumerate(times)]
    workload = Workload(arrivals, warmup_s=10.0)
    plain = run(setup, workload, "goodput")
    held = run(setup, workload, "goodput", max_hold_s=30.0)
    assert not plain.held and held.held
    assert all(20 <= arrival <= 40 for arrival, _ in held.held)  # only in and just after the burst
    assert all(released - arrival <= 30.0 + 0.2 for arrival, released in held.held)  # the bound
    assert len(held.records) == len(plain.records) == len(arrivals)  # every request served
    assert held.summary()["slo_goodput_rps"] > plain.summary()["slo_goodput_rps"]
    # A look lets go every held request that has room, one after another, as the proxy's queue
    # does (it judges again as soon as the last one is dispatched): the virtual clock once let
    # one go per poll interval, 10 a second, a quarter of this fleet's capacity.
    released = sorted(at for _, at in held.held)
    assert max(sum(1 for at in released if start <= at < start + 1.0) for start in released) > 20


def test_in_a_closed_loop_the_oldest_held_go_once_past_their_fair_share_not_at_the_bound() -> None:
    """`release-due`: 256 clients on the 3B fleet (each sends again once answered), held up to
    120 s. Newest first alone, a fresh request took every freed slot and 81 of the held waited
    out the bound (the tail: p99 1.86x the better static policy's in bench.learning); the
    oldest past the fleet's mean time in system now go first, and none waits that long."""
    setup = replace(FLEETS["llama3b-a10 a=0.50"], seed=0)
    result = run(setup, closed_loop(256, 1200, lengths(seed=256)), "goodput", max_hold_s=120.0)
    waits = [released - arrival for arrival, released in result.held]
    assert result.released_by.get("release-due", 0) > 100 and "release-bound" not in result.released_by
    assert max(waits) < 0.75 * 120.0  # 68 s here; 120 s without the rule
    assert len(result.records) == 1200
