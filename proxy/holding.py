"""Flow control's queue: requests no pool can serve in time wait here (policies/flow.py's rules).

A request held waits on its own future; one task (running only while something is held) looks
at the fleet at every poll interval and lets go:
- every request that has waited SPECROUTE_HOLD_MAX_S (`release-bound`), at once, wherever
  routing then sends it (or admission refuses it);
- else the oldest that has waited its fair share (the fleet's mean time in system) and has
  room on some pool (`release-due`), one for each request that left the fleet;
- else the newest with room on some pool (`release-room`): newest first, the one most likely
  still in time, while the older ones wait out the overload; one that does not fit (a long
  prompt) does not stop a newer one behind it. No more than MAX_SCAN of each are judged.
One at a time: the next is judged once the last was dispatched (or ended), so that the fleet
model counts it first.
When the proxy starts draining, every held request goes (`release-drain`), and nothing is held
from then on (requests still arrive during SPECROUTE_DRAIN_DELAY_S).
A request let go is routed afresh from the fleet as it is then.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from time import monotonic

from fleet.types import Features, Snapshot
from policies.flow import FlowControl, due_allowance, fair_wait_s, left_total

log = logging.getLogger("specroute")

LANDING_TIMEOUT_S = 1.0
"""How long the queue waits for a request it let go to be dispatched before judging again (it
is dispatched without awaiting anything: this only bounds a bug's cost)."""


class Held:
    """One held request: its features, since when it waits, and how it is let go."""

    __slots__ = ("features", "since", "released", "landed")

    def __init__(self, features: Features, since: float) -> None:
        self.features = features
        self.since = since
        self.released: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        """Resolved with the rule that let it go."""
        self.landed = asyncio.Event()
        """Set once it was dispatched or ended (`land`)."""

    def land(self) -> None:
        self.landed.set()


class HoldQueue:
    def __init__(
        self,
        flow: FlowControl,
        snapshot: Callable[[str | None], Snapshot],
        interval_s: float,
        on_release: Callable[[str, float], None] | None = None,
    ) -> None:
        self.flow = flow
        self.snapshot = snapshot
        """The fleet now, as a request of a workload sees it (`Router.snapshot`)."""
        self.interval_s = interval_s
        """How often the queue looks at the fleet while something is held (the poll interval:
        the fleet's view changes with each load reading)."""
        self.on_release = on_release
        """Told the rule and the seconds held of each request let go (metrics)."""
        self.held: list[Held] = []
        """Oldest first."""
        self._task: asyncio.Task[None] | None = None
        self.closed = False
        """Set by `release_all`: the proxy is draining, and holds nothing more."""
        self.due_left = 1
        """What `release-due` may still let go (policies.flow.due_allowance)."""
        self.look_at = -math.inf
        """When the look under way began: one lasts a poll interval."""
        self.left_seen: int | None = None
        """The fleet's departures counted at the last look's start."""

    @property
    def max_hold_s(self) -> float:
        return self.flow.max_hold_s

    def holds(self, features: Features, snapshot: Snapshot) -> bool:
        """Whether a new request is lost on both pools (`hold-lost`); never once draining: it
        would wait past the drain's end for nothing (a review's probe)."""
        return not self.closed and self.flow.holds(features, snapshot)

    async def wait(self, features: Features) -> tuple[Held, str]:
        """Hold a request until it is let go: the entry (its caller calls `land` once it has
        been dispatched) and the rule that let it go. Cancelled (its client left), it is gone
        from the queue, and the queue is not kept waiting for it."""
        entry = Held(features, monotonic())
        self.held.append(entry)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="specroute-hold-queue")
            self._task.add_done_callback(self._ended)
        try:
            rule = await entry.released
        except BaseException:
            if entry in self.held:
                self.held.remove(entry)
            entry.land()  # let go but cancelled before it could be dispatched, too
            raise
        return entry, rule

    def _ended(self, task: asyncio.Task[None]) -> None:
        """The queue's task ended: said if by a bug, and started again while requests are held
        (else they would wait for the next request held, or the drain)."""
        if task.cancelled():
            return
        error = task.exception()
        if error is None:
            return
        log.error("flow control's queue failed; it starts again", exc_info=error)
        if self.held:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="specroute-hold-queue")
            self._task.add_done_callback(self._ended)

    def fair_wait_s(self) -> float | None:
        """Held past this, a request is judged first (`release-due`); None until measured."""
        fair = fair_wait_s(self.snapshot(None), len(self.held))
        return None if fair is None else round(fair, 3)

    def oldest_s(self, now: float) -> float:
        return now - self.held[0].since if self.held else 0.0

    async def _run(self) -> None:
        while self.held:
            now = monotonic()
            while self.held and self.flow.expired(now - self.held[0].since):
                self._let_go(self.held[0], "release-bound", now)  # no landing wait: they go whatever
            if not self.held:
                return
            try:
                chosen = self._with_room(now)
            except Exception:
                # Judging room failed (a bug): the oldest goes rather than everyone waiting on.
                log.exception("flow control could not judge the fleet; the oldest held request goes")
                chosen = self.held[0], "release-room"
            if chosen is None:
                await asyncio.sleep(self._pause(monotonic()))
                continue
            entry, rule = chosen
            self._let_go(entry, rule, monotonic())
            try:
                await asyncio.wait_for(entry.landed.wait(), LANDING_TIMEOUT_S)
            except TimeoutError:
                log.warning("a held request let go was not dispatched within %.0f s", LANDING_TIMEOUT_S)

    def _let_go(self, entry: Held, rule: str, now: float) -> None:
        self.held.remove(entry)
        if not entry.released.done():
            entry.released.set_result(rule)
        if self.on_release is not None:
            self.on_release(rule, now - entry.since)

    def _with_room(self, now: float) -> tuple[Held, str] | None:
        """The held request to let go now and its rule (`release-due`, else `release-room`)."""
        snapshots: dict[str | None, Snapshot] = {None: self.snapshot(None)}
        waits = [now - entry.since for entry in self.held]
        if now - self.look_at >= self.interval_s:  # a new look: as many as left since the last
            left = left_total(snapshots[None])
            self.due_left = due_allowance(
                self.due_left, left - (left if self.left_seen is None else self.left_seen), snapshots[None]
            )
            self.left_seen, self.look_at = left, now
        for i, rule in self.flow.judging_order(waits, snapshots[None]):
            entry = self.held[i]
            workload = entry.features.workload
            snapshot = snapshots.get(workload)
            if snapshot is None:
                snapshot = snapshots[workload] = self.snapshot(workload)
            if self.flow.room(entry.features, snapshot):
                if rule == "release-due":
                    if self.due_left < 1:
                        return None  # it goes first, once as many have left the fleet
                    self.due_left -= 1
                return entry, rule
        return None

    def release_all(self, rule: str) -> None:
        """Let every held request go now (`release-drain` when the proxy stops), and hold no more."""
        self.closed = True
        now = monotonic()
        for entry in list(self.held):
            self._let_go(entry, rule, now)

    def _pause(self, now: float) -> float:
        """Until the next look: a poll interval, or less when the oldest's bound comes sooner."""
        until_bound = self.flow.max_hold_s - self.oldest_s(now)
        return max(0.0, min(self.interval_s, until_bound))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
