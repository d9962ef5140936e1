"""The HTTP driver's clock: one asyncio task runs the engine against real time.

Each step ends at an absolute deadline on the engine's own timeline,
wall = start + virtual_time / time_scale, so a late wake-up does not delay the steps after it
and the mean decode rate of a stream stays exact: after a stall (a busy CPU, a late wake-up)
the loop catches up by running the overdue steps back to back. Only if it falls more than
`max_lag_s` (wall) behind is the timeline re-anchored, so a long stall does not turn into a
long burst.

A wedged loop (`wedge`, the twin's `wedged` fault) takes no step until it is healed; a step
under way when it wedged ends only then, as a forward pass stuck in a collective does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from sim.engine import Engine, Request


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        time_scale: float = 1.0,
        max_lag_s: float = 2.0,
        on_step: Callable[[], None] | None = None,
    ):
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.engine = engine
        self.time_scale = time_scale
        self.max_lag_s = max_lag_s
        self._t0 = time.monotonic()
        self._epoch0 = time.time()
        self._wake = asyncio.Event()
        self._unwedged = asyncio.Event()
        self._unwedged.set()
        self._task: asyncio.Task | None = None
        self.steps = 0
        self.on_step = on_step
        """Called after each step (the server hears its scheduler's output)."""

    def now(self) -> float:
        """Simulated seconds since the server started."""
        return (time.monotonic() - self._t0) * self.time_scale

    def epoch(self, virtual: float) -> float:
        """The wall-clock epoch time at which simulated time `virtual` happens."""
        return self._epoch0 + virtual / self.time_scale

    def submit(self, req: Request) -> None:
        self.engine.add(req)
        self._wake.set()

    def abort(self, rid: str) -> bool:
        return self.engine.abort(rid, self.now())

    def abort_prefixed(self, rid: str) -> int:
        return self.engine.abort_prefixed(rid, self.now())

    def wedge(self, wedged: bool) -> None:
        """Stop stepping (True) or go on (False)."""
        if wedged:
            self._unwedged.clear()
        else:
            self._unwedged.set()

    @property
    def wedged(self) -> bool:
        return not self._unwedged.is_set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="twin-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        now = self.now()
        for rid in list(self.engine.waiting) + list(self.engine.running):
            self.engine.abort(rid, now)
        if self.engine.prefilling is not None:
            self.engine.abort(self.engine.prefilling.rid, now)

    async def _run(self) -> None:
        engine = self.engine
        t = self.now()
        while True:
            if not self._unwedged.is_set():
                await self._unwedged.wait()
                t = self.now()  # the hang's time is lost, not caught up
            step = engine.begin_step(t)
            if step is None:
                self._wake.clear()
                await self._wake.wait()
                t = self.now()
                continue
            end = t + step.duration_s
            delay = self._t0 + end / self.time_scale - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -self.max_lag_s:
                end = self.now()  # too far behind to catch up: re-anchor
            else:
                await asyncio.sleep(0)  # let request handlers run between back-to-back steps
            if not self._unwedged.is_set():  # hung mid-step: it ends once healed
                await self._unwedged.wait()
                end = self.now()
            engine.finish_step(step, end)
            self.steps += 1
            if self.on_step is not None:
                self.on_step()
            t = end
