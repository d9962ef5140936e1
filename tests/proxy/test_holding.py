"""Flow control's queue (proxy/holding.py) on the event loop, with the real policy and rules on
hand-built fleets: who is let go, in what order, and that a request leaving is gone from it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

import pytest

from fleet.costmodel import StepCostModel, seed_from_profile
from fleet.types import Features, InstanceState, PoolState, Snapshot
from policies.flow import FlowControl, fair_wait_s
from policies.goodput import Goodput
from policies.goodput_params import GoodputParams
from proxy.holding import HoldQueue


def snapshot(spec_load: float, base_load: float, cost: StepCostModel) -> Snapshot:
    def instance(name: str, load: float, cap: int) -> InstanceState:
        return InstanceState(f"http://{name}", running=min(load, cap), waiting=max(load - cap, 0), max_running=cap)

    spec = PoolState("spec", (instance("spec", spec_load, 48),), speculative=True, num_draft_tokens=3, alpha=0.6)
    return Snapshot({"spec": spec, "base": PoolState("base", (instance("base", base_load, 256),))}, cost)


COST = StepCostModel(seed_from_profile("h200-llama8b"), num_draft_tokens=3)
SLO = GoodputParams(slo_ttft_s=1.0, slo_tpot_ms=50)
FLOODED = snapshot(48 + 400, 256 + 2000, COST)
QUIET = snapshot(2, 10, COST)
WAIT_S = 5.0
"""Bound on every wait here (the queue looks every 10 ms)."""


class Fleet:
    """The fleet the queue reads: flooded until a test says otherwise."""

    def __init__(self) -> None:
        self.now: Snapshot = FLOODED
        self.looks = 0
        """How often the queue has read it (once per look)."""
        self.leaving = 0
        """Requests that leave the fleet between two reads (`PoolState.left_total` grows so)."""
        self.left = 0

    def __call__(self, workload: str | None) -> Snapshot:
        self.looks += 1
        self.left += self.leaving
        pools = {
            name: replace(pool, left_total=self.left if name == "spec" else 0) for name, pool in self.now.pools.items()
        }
        return replace(self.now, pools=pools)


def queue(fleet: Fleet, max_hold_s: float, released: list[tuple[str, float]]) -> HoldQueue:
    return HoldQueue(
        FlowControl(Goodput(SLO), max_hold_s), fleet, 0.01, on_release=lambda r, s: released.append((r, s))
    )


async def until(condition: Callable[[], bool]) -> None:
    """Yield to the loop until `condition` holds (each held task runs to its wait), bounded."""
    async with asyncio.timeout(WAIT_S):
        while not condition():
            await asyncio.sleep(0)


def request(tokens: int) -> Features:
    return Features(prompt_tokens=tokens, max_tokens=64)


def room_for_small_only(q: HoldQueue, small: int) -> tuple[Snapshot, int]:
    """A fleet whose queue (`waiting` past each cap) leaves room for a `small` prompt and none
    for a 20,000-token one, and that queue's length."""
    for waiting in range(1, 200):
        busy = snapshot(48 + waiting, 256 + waiting, COST)
        if q.flow.room(request(small), busy) and not q.flow.room(request(20_000), busy):
            return busy, waiting
    raise AssertionError(f"no queue leaves room for a {small}-token prompt only")


def test_a_held_request_that_does_not_fit_does_not_stop_an_older_one_that_does() -> None:
    """A probe's finding: the newest alone was judged, and one whose prompt could never get its
    first token within the room's share of the target kept everyone held until the bound."""

    async def scenario() -> list[int]:
        fleet, released = Fleet(), []
        q = queue(fleet, 60.0, released)
        order: list[int] = []

        async def client(tokens: int) -> None:
            held, _ = await q.wait(request(tokens))
            order.append(tokens)
            held.land()

        small = asyncio.create_task(client(100))
        await asyncio.sleep(0)
        big = asyncio.create_task(q.wait(request(20_000)))
        await until(lambda: len(q.held) == 2)
        fleet.now, _ = room_for_small_only(q, 100)  # the big one (newer) has none
        await asyncio.wait_for(small, WAIT_S)
        assert [h.features.prompt_tokens for h in q.held] == [20_000]
        big.cancel()
        await asyncio.gather(big, return_exceptions=True)
        await q.stop()
        return order

    assert asyncio.run(scenario()) == [100]


def test_draining_lets_every_held_request_go_at_once() -> None:
    async def scenario() -> None:
        fleet, released = Fleet(), []
        q = queue(fleet, 60.0, released)
        waits = [asyncio.create_task(q.wait(request(t))) for t in (100, 200, 300)]
        await until(lambda: len(q.held) == 3)
        assert q.holds(request(100), FLOODED)
        q.release_all("release-drain")
        done = await asyncio.wait_for(asyncio.gather(*waits), WAIT_S)
        assert [rule for _, rule in done] == ["release-drain"] * 3 and q.held == []
        # A review's probe: a request arriving during the drain delay was held, and waited past
        # the drain's end, never sent. Draining, nothing more is held.
        assert not q.holds(request(100), FLOODED)
        await q.stop()

    asyncio.run(scenario())


def test_the_queue_starts_again_after_a_bug_ends_it(caplog) -> None:
    """Its task ended by an error (a telemetry callback's, say) left the held waiting for the next
    request held, or the drain."""

    async def scenario() -> None:
        fleet, released = Fleet(), []
        q = queue(fleet, 60.0, released)
        calls = []

        def flaky(rule: str, seconds: float) -> None:
            calls.append(rule)
            if len(calls) == 1:
                raise RuntimeError("a telemetry bug")

        q.on_release = flaky
        waits = [asyncio.create_task(q.wait(request(100))) for _ in range(2)]
        await until(lambda: len(q.held) == 2)
        fleet.now = QUIET
        for finished in asyncio.as_completed(waits, timeout=WAIT_S):
            held, _ = await finished
            held.land()
        assert len(calls) == 2
        await q.stop()

    asyncio.run(scenario())
    assert "flow control's queue failed" in caplog.text


def test_the_newest_goes_first_when_there_is_room_each_once_the_last_landed() -> None:
    async def scenario() -> list[int]:
        fleet, released = Fleet(), []
        q = queue(fleet, 60.0, released)
        assert q.holds(request(100), FLOODED) and not q.holds(request(100), QUIET)
        order: list[int] = []

        async def client(tokens: int) -> None:
            held, rule = await q.wait(request(tokens))
            assert rule == "release-room"
            order.append(tokens)
            held.land()  # dispatched: the queue may judge the next

        tasks = []
        for tokens in (100, 200, 300):
            tasks.append(asyncio.create_task(client(tokens)))
            await asyncio.sleep(0)  # each is held before the next arrives
        await until(lambda: len(q.held) == 3 and fleet.looks >= 3)
        assert order == [] and len(q.held) == 3  # flooded: three looks, nobody goes
        fleet.now = QUIET
        await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
        assert q.held == [] and [rule for rule, _ in released] == ["release-room"] * 3
        await q.stop()
        return order

    assert asyncio.run(scenario()) == [300, 200, 100]


def test_those_held_past_their_fair_share_go_first_oldest_first_then_the_newest() -> None:
    """`release-due`: with the fleet's finishing rate measured, a request held longer than the
    fleet's mean time in system goes before newer ones (without it the newest always went
    first, and in a closed loop the oldest waited out the bound)."""

    async def scenario() -> list[tuple[int, str]]:
        fleet, released = Fleet(), []
        q = queue(fleet, 120.0, released)
        order: list[tuple[int, str]] = []

        async def client(tokens: int) -> None:
            held, rule = await q.wait(request(tokens))
            order.append((tokens, rule))
            held.land()

        big = asyncio.create_task(q.wait(request(20_000)))  # the oldest, and it never fits
        await asyncio.sleep(0)
        tasks = []
        for tokens in (100, 200, 300):
            tasks.append(asyncio.create_task(client(tokens)))
            await asyncio.sleep(0)
        await until(lambda: len(q.held) == 4)
        now = q.held[-1].since
        for entry, waited in zip(q.held, (100.0, 90.0, 60.0, 1.0)):  # oldest first, as held
            entry.since = now - waited
        # A queue where the small ones have room and the big one has not, finishing at a rate
        # that makes the fair share 30 s.
        busy, waiting = room_for_small_only(q, 300)
        in_system = 48 + 256 + 2 * waiting + 4  # every request on the fleet ours, and 4 held
        pools = {
            name: replace(
                pool,
                finished_per_s=in_system / 30 / 2,
                instances=tuple(replace(i, in_flight=int(i.running + i.waiting)) for i in pool.instances),
            )
            for name, pool in busy.pools.items()
        }
        fleet.now = replace(busy, pools=pools)
        fleet.leaving = 1  # one leaves between two looks: one due request may go each look
        assert fair_wait_s(fleet.now, 4) == pytest.approx(30.0)
        await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
        assert not big.done() and len(q.held) == 1  # due, but with no room it waits on
        big.cancel()
        await q.stop()
        return order

    assert asyncio.run(scenario()) == [(100, "release-due"), (200, "release-due"), (300, "release-room")]


def test_the_oldest_goes_at_the_bound_while_the_fleet_stays_flooded() -> None:
    async def scenario() -> None:
        fleet, released = Fleet(), []
        q = queue(fleet, 0.2, released)
        loop = asyncio.get_running_loop()
        started = loop.time()
        first = asyncio.create_task(q.wait(request(100)))
        await asyncio.sleep(0.05)  # not to synchronise: the second is held 50 ms after the first
        second = asyncio.create_task(q.wait(request(200)))
        held, rule = await asyncio.wait_for(first, WAIT_S)
        assert rule == "release-bound" and held.features.prompt_tokens == 100
        assert loop.time() - started >= 0.2
        held.land()
        held, rule = await asyncio.wait_for(second, WAIT_S)
        assert rule == "release-bound" and held.features.prompt_tokens == 200
        held.land()
        assert [r for r, _ in released] == ["release-bound", "release-bound"] and released[0][1] >= 0.2
        await q.stop()

    asyncio.run(scenario())


def test_a_request_whose_client_left_is_gone_from_the_queue() -> None:
    async def scenario() -> None:
        fleet, released = Fleet(), []
        q = queue(fleet, 60.0, released)
        leaving = asyncio.create_task(q.wait(request(100)))
        staying = asyncio.create_task(q.wait(request(200)))
        await until(lambda: len(q.held) == 2)
        leaving.cancel()
        await asyncio.gather(leaving, return_exceptions=True)
        assert [h.features.prompt_tokens for h in q.held] == [200]
        fleet.now = QUIET
        held, _ = await asyncio.wait_for(staying, WAIT_S)
        held.land()
        assert len(released) == 1 and q.held == []
        await q.stop()

    asyncio.run(scenario())


def test_a_request_let_go_that_never_lands_holds_the_queue_only_for_a_bounded_time() -> None:
    async def scenario() -> None:
        from proxy import holding

        holding.LANDING_TIMEOUT_S, saved = 0.05, holding.LANDING_TIMEOUT_S
        try:
            fleet, released = Fleet(), []
            q = queue(fleet, 60.0, released)
            first = asyncio.create_task(q.wait(request(100)))
            second = asyncio.create_task(q.wait(request(200)))
            await until(lambda: len(q.held) == 2)
            fleet.now = QUIET
            # Neither lands: each goes after the other's landing wait ran out.
            await asyncio.wait_for(asyncio.gather(first, second), WAIT_S)
            assert len(released) == 2
            await q.stop()
        finally:
            holding.LANDING_TIMEOUT_S = saved

    asyncio.run(scenario())


def test_one_past_its_fair_share_goes_for_each_request_that_left_and_nobody_passes_it() -> None:
    """One in for one out: every due request the fleet seemed to have room for went at one look,
    each judged before a server showed the last one's effect, and under lasting overload the
    plain pool filled past its targets (the 3B fleet at Poisson 110 %: 0.72x the oracle split
    on the virtual clock)."""

    async def scenario() -> None:
        fleet, released = Fleet(), []
        q = queue(fleet, 600.0, released)
        order: list[tuple[int, str]] = []

        async def client(tokens: int) -> None:
            held, rule = await q.wait(request(tokens))
            order.append((tokens, rule))
            held.land()

        tasks = []
        for tokens in (100, 200, 300, 400):
            tasks.append(asyncio.create_task(client(tokens)))
            await asyncio.sleep(0)
        await until(lambda: len(q.held) == 4)
        now = q.held[-1].since
        for entry, waited in zip(q.held, (300.0, 290.0, 280.0, 1.0)):
            entry.since = now - waited
        busy, _ = room_for_small_only(q, 400)
        pools = {
            name: replace(
                pool,
                finished_per_s=2.5,
                instances=tuple(replace(i, in_flight=int(i.running + i.waiting)) for i in pool.instances),
            )
            for name, pool in busy.pools.items()
        }
        fleet.now = replace(busy, pools=pools)
        assert 1.0 < fair_wait_s(fleet.now, 4) < 280.0
        looks = fleet.looks
        await until(lambda: fleet.looks >= looks + 5)
        # Nothing left the fleet: the oldest went (the allowance a queue starts with), and the
        # others wait, the newest too, though it has room: nobody passes a due request.
        assert order == [(100, "release-due")]
        fleet.leaving = 1
        await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
        assert order == [(100, "release-due"), (200, "release-due"), (300, "release-due"), (400, "release-room")]
        await q.stop()

    asyncio.run(scenario())
