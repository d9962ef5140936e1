"""Outlier detection: a server that answers its load polls but serves completions badly stops
getting traffic within a few requests, comes back through a half-open probe, and never takes
more than half a pool (or the fleet's last server) with it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from proxy_faults import FaultServer
from proxy_harness import TIME_SCALE, RunningProxy, aiohttp_upstream, running_proxy, wait_for

from fleet.model import FleetModel
from proxy.outliers import OutlierDetector
from proxy.pools import DEFAULT_MAX_RUNNING, Instance, Pool
from sim.testing import RunningTwin, TwinSpec, twin, twins

MESSAGES = [{"role": "user", "content": "Say hi."}]
CHAT = {"model": "m", "messages": MESSAGES, "max_tokens": 2}


# -- the rules, on a clock the test moves ----------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fleet_of(spec: int, base: int) -> tuple[FleetModel, list[Pool]]:
    fleet = FleetModel()
    pools = []
    for name, count in (("spec", spec), ("base", base)):
        instances = [
            Instance(
                f"http://{name}{i}",
                name,
                fleet.add_instance(f"http://{name}{i}", name, DEFAULT_MAX_RUNNING),
                name=f"{name}-{i}",
            )
            for i in range(count)
        ]
        pools.append(Pool(name, instances))  # type: ignore[arg-type]
    return fleet, pools


def detector(pools: list[Pool], fleet: FleetModel, clock: Clock, **overrides: float) -> OutlierDetector:
    params = {"consecutive_failures": 5, "ejection_s": 30.0, "max_ejection_s": 300.0, "slow_factor": 5.0} | overrides
    return OutlierDetector(pools, fleet, clock=clock, **params)  # type: ignore[arg-type]


def test_five_failures_in_a_row_eject_for_a_period_that_grows_and_a_probe_decides_the_return() -> None:
    clock = Clock()
    fleet, pools = fleet_of(2, 1)
    outliers = detector(pools, fleet, clock)
    sick, well = pools[0].instances
    for _ in range(4):
        outliers.failed(sick, "status_500")
    outliers.succeeded(sick, None)  # a success in between resets the count
    for _ in range(4):
        outliers.failed(sick, "upstream_disconnected")
    outliers.failed(sick, "status_400")  # not the server's fault: not counted
    assert outliers.admits(sick)
    outliers.failed(sick, "first_token_timeout")
    assert not outliers.admits(sick) and not sick.healthy
    assert fleet.snapshot(clock.now).pools["spec"].instances[0].ejected
    assert outliers.state_of(sick.url)["reason"] == "consecutive-failures:first_token_timeout"
    clock.now += 29.9
    assert not outliers.admits(sick)
    clock.now += 0.2  # 30 s: half-open, one request at a time
    assert not sick.healthy  # until someone asks: the router refreshes before each decision
    outliers.refresh()
    assert sick.healthy and outliers.admits(sick)
    outliers.dispatched(sick)
    assert not outliers.admits(sick)
    outliers.failed(sick, "status_503")  # the probe failed: out again, for twice as long
    assert outliers.state_of(sick.url)["ejections"] == 2
    clock.now += 59.0
    assert not outliers.admits(sick)
    clock.now += 1.1
    outliers.dispatched(sick)
    outliers.succeeded(sick, 0.05)  # the probe succeeded: full traffic again
    assert outliers.admits(sick) and outliers.state_of(sick.url)["state"] == "ok"
    assert outliers.admits(well)


def test_an_ejection_is_logged_counted_and_its_return_logged(caplog: pytest.LogCaptureFixture) -> None:
    """From an operator's probe: an ejection left no log line and no counter (only a gauge, at 0
    again by the next scrape)."""
    clock = Clock()
    fleet, pools = fleet_of(2, 1)
    told: list[tuple[str, str, str]] = []
    outliers = detector(pools, fleet, clock)
    outliers.on_ejected = lambda *event: told.append(event)
    sick = pools[0].instances[0]
    caplog.set_level("INFO", logger="specroute.outliers")
    for _ in range(5):
        outliers.failed(sick, "status_502")
    assert told == [("spec", sick.url, "consecutive-failures")]
    [warning] = [r for r in caplog.records if r.levelname == "WARNING"]
    assert warning.name == "specroute.outliers"
    assert sick.url in warning.getMessage() and "for 30 s" in warning.getMessage()
    assert "consecutive-failures:status_502" in warning.getMessage()
    assert not [r for r in caplog.records if r.levelname == "INFO"]
    clock.now += 30.0
    outliers.refresh()  # half-open: let back, one request at a time
    [back] = [r for r in caplog.records if r.levelname == "INFO"]
    assert sick.url in back.getMessage() and "half-open" in back.getMessage()
    outliers.dispatched(sick)
    outliers.failed(sick, "connect")  # the probe failed: ejected again, for twice as long
    assert told[-1] == ("spec", sick.url, "probe-failed")
    assert "for 60 s" in caplog.records[-1].getMessage() and caplog.records[-1].levelname == "WARNING"
    clock.now += 60.0
    outliers.dispatched(sick)
    outliers.succeeded(sick, 0.05)
    assert caplog.records[-1].levelname == "INFO" and "full rotation" in caplog.records[-1].getMessage()


def test_every_ejection_reason_is_a_rule_the_counter_knows() -> None:
    import re
    from pathlib import Path

    from proxy.outliers import RULES
    from proxy.telemetry.names import EJECTION_REASONS

    assert RULES == EJECTION_REASONS
    source = (Path(__file__).resolve().parents[2] / "proxy" / "outliers.py").read_text()
    used = {reason.partition(":")[0] for reason in re.findall(r'self\._eject\([^"]*f?"([a-z:{}_-]+)"', source)}
    assert used == set(RULES), used


def test_never_more_than_half_a_pool_nor_the_fleets_last_server() -> None:
    clock = Clock()
    fleet, pools = fleet_of(4, 1)
    outliers = detector(pools, fleet, clock, consecutive_failures=1)
    for instance in pools[0].instances:
        outliers.failed(instance, "status_500")
    assert sum(outliers.ejected(i.url) for i in pools[0].instances) == 2
    fleet, pools = fleet_of(1, 1)
    outliers = detector(pools, fleet, clock, consecutive_failures=1)
    spec, base = pools[0].instances[0], pools[1].instances[0]
    outliers.failed(spec, "status_500")
    assert outliers.ejected(spec.url)  # a pool of one may lose it: the other pool serves
    outliers.failed(base, "status_500")
    assert not outliers.ejected(base.url)  # but the fleet keeps its last server


def beside_two_quick_peers(clock: Clock) -> tuple[OutlierDetector, Instance]:
    """A detector over three spec servers, two of them with five quick first tokens each; the
    third is returned."""
    fleet, pools = fleet_of(3, 1)
    outliers = detector(pools, fleet, clock)
    slow, a, b = pools[0].instances
    for _ in range(5):
        outliers.succeeded(a, 0.04)
        outliers.succeeded(b, 0.06)
    return outliers, slow


def test_a_first_token_far_later_than_the_pools_others_ejects() -> None:
    clock = Clock()
    outliers, slow = beside_two_quick_peers(clock)
    for _ in range(4):
        outliers.succeeded(slow, 2.0)
    assert not outliers.ejected(slow.url)  # too few samples yet
    outliers.succeeded(slow, 2.0)
    assert outliers.ejected(slow.url) and outliers.state_of(slow.url)["reason"] == "slow-first-token"
    # Slower than the others but not by much, or not by enough in absolute terms: kept.
    fleet, pools = fleet_of(2, 1)
    outliers = detector(pools, fleet, clock)
    quick, busy = pools[0].instances
    for _ in range(10):
        outliers.succeeded(quick, 0.01)
        outliers.succeeded(busy, 0.3)  # 30x, but only 0.29 s later: queueing, not sickness
    assert not outliers.ejected(busy.url)


def test_a_probe_as_slow_as_what_ejected_it_fails_and_a_quick_one_starts_the_average_afresh() -> None:
    # A slow probe counted as a success put a still slow server back on full traffic, and its slow
    # samples then ejected it again once it had healed.
    clock = Clock()
    outliers, slow = beside_two_quick_peers(clock)
    for _ in range(5):
        outliers.succeeded(slow, 2.0)
    assert outliers.ejected(slow.url)
    clock.now += 30.0
    assert outliers.admits(slow)
    outliers.dispatched(slow)
    outliers.succeeded(slow, 2.2)  # still slow
    assert outliers.ejected(slow.url) and outliers.state_of(slow.url)["reason"] == "probe-slow-first-token"
    assert outliers.state_of(slow.url)["ejections"] == 2
    clock.now += 60.0
    assert outliers.admits(slow)
    outliers.dispatched(slow)
    outliers.succeeded(slow, 0.05)  # healed
    assert not outliers.ejected(slow.url) and outliers.state_of(slow.url)["ttft_s"] == 0.05
    for _ in range(5):
        outliers.succeeded(slow, 0.05)
    assert not outliers.ejected(slow.url)


def test_the_ejection_count_falls_for_each_max_ejection_served_without_one() -> None:
    clock = Clock()
    fleet, pools = fleet_of(2, 1)
    outliers = detector(pools, fleet, clock, max_ejection_s=100.0)
    flaky = pools[0].instances[0]
    for _ in range(5):
        outliers.failed(flaky, "connect")
    clock.now += 30.0
    outliers.admits(flaky)
    outliers.dispatched(flaky)
    outliers.succeeded(flaky, None)
    assert outliers.state_of(flaky.url)["ejections"] == 1
    clock.now += 99.0
    outliers.succeeded(flaky, None)
    assert outliers.state_of(flaky.url)["ejections"] == 1
    clock.now += 2.0
    outliers.succeeded(flaky, None)
    assert outliers.state_of(flaky.url)["ejections"] == 0  # the next ejection is 30 s again


def test_a_restarted_server_is_back_at_once_and_its_ejection_count_stays() -> None:
    clock = Clock()
    fleet, pools = fleet_of(2, 1)
    outliers = detector(pools, fleet, clock)
    sick = pools[0].instances[0]
    for _ in range(5):
        outliers.failed(sick, "status_500")
    assert not outliers.admits(sick) and not sick.healthy
    outliers.restarted(sick.url)
    assert outliers.admits(sick) and sick.healthy and outliers.state_of(sick.url)["state"] == "ok"
    assert not fleet.snapshot(clock.now).pools["spec"].instances[0].ejected
    for _ in range(5):  # still broken after the restart: out again, for twice as long
        outliers.failed(sick, "status_500")
    assert outliers.state_of(sick.url)["ejections"] == 2
    assert outliers.state_of(sick.url)["ejected_for_s"] == 60.0


def test_failures_of_requests_in_flight_when_a_server_was_ejected_do_not_eject_it_again() -> None:
    """A stall breaks every stream on a server at once: six broken streams are one failure of
    the server, not six in a row (which ejected it a second time, for twice as long)."""
    clock = Clock()
    fleet, pools = fleet_of(2, 1)
    outliers = detector(pools, fleet, clock)
    sick = pools[0].instances[0]
    sent = clock.now - 1.0  # eleven requests in flight on it
    for _ in range(11):
        outliers.failed(sick, "upstream_disconnected", dispatched_at=sent)
    state = outliers.state_of(sick.url)
    assert (state["ejections"], state["ejected_for_s"], state["consecutive_failures"]) == (1, 30.0, 0)
    clock.now += 30.0  # half-open: a late failure of one of them is not its probe's
    assert outliers.admits(sick)
    outliers.dispatched(sick)
    outliers.failed(sick, "upstream_disconnected", dispatched_at=sent)
    assert outliers.state_of(sick.url)["state"] == "probing"
    outliers.failed(sick, "upstream_disconnected", dispatched_at=clock.now)  # the probe fails: out for twice as long
    assert outliers.state_of(sick.url)["ejections"] == 2 and outliers.state_of(sick.url)["ejected_for_s"] == 60.0


def test_a_server_ejected_for_its_silence_is_let_back_half_open_once_it_answers_its_polls() -> None:
    """A paused process (SIGSTOP, a host stall) fails every request waiting on it at once; once
    its polls are answered again it is on probation, not out for the rest of its 30 s."""
    clock = Clock()
    fleet, pools = fleet_of(2, 1)
    outliers = detector(pools, fleet, clock)
    paused, sick = pools[0].instances[0], pools[1].instances[0]
    for _ in range(5):
        outliers.failed(paused, "upstream_unresponsive")
    outliers.failed(sick, "upstream_unresponsive")
    for _ in range(4):
        outliers.failed(sick, "status_500")  # the failure that ejects it is an answer, not silence
    assert outliers.ejected(paused.url) and outliers.ejected(sick.url)
    outliers.answering(paused.url)
    assert outliers.state_of(paused.url)["state"] == "probing" and paused.healthy
    outliers.answering(sick.url)  # answering polls says nothing of its 500s
    assert outliers.ejected(sick.url) and not sick.healthy


def test_a_hung_server_is_ejected_at_once_and_again_if_its_probe_hangs() -> None:
    clock = Clock()
    fleet, pools = fleet_of(2, 1)
    outliers = detector(pools, fleet, clock)
    hung = pools[0].instances[0]
    outliers.hung(hung)
    assert outliers.state_of(hung.url)["reason"] == "no-progress" and not hung.healthy
    outliers.hung(hung)  # judged again while out: nothing more
    assert outliers.state_of(hung.url)["ejections"] == 1
    clock.now += 30.0
    assert outliers.admits(hung)
    outliers.dispatched(hung)  # the probe
    outliers.hung(hung)
    state = outliers.state_of(hung.url)
    assert (state["reason"], state["ejections"], state["ejected_for_s"]) == (
        "probe-failed:upstream_no_progress",
        2,
        60.0,
    )


@pytest.mark.parametrize("kind", ["upstream_rank_hung", "total_timeout", "status_400"])
def test_a_probe_that_ends_in_no_failure_of_the_servers_lets_the_next_one_be_tried(kind: str) -> None:
    """A half-open server takes one request at a time. A probe that ended in an outcome not
    counted against the server (a hung data-parallel rank's, a deadline, a refusal) left the
    probe in flight for good: the server stayed out of rotation (a review's finding)."""
    clock = Clock()
    fleet, pools = fleet_of(2, 1)
    outliers = detector(pools, fleet, clock)
    sick = pools[0].instances[0]
    outliers.hung(sick)
    clock.now += 30.0
    assert outliers.admits(sick)
    outliers.dispatched(sick)
    assert not outliers.admits(sick)  # the probe is out
    outliers.failed(sick, kind, dispatched_at=clock.now)
    assert outliers.admits(sick) and outliers.state_of(sick.url)["state"] == "probing"


def test_a_rank_is_judged_hung_only_while_a_request_of_ours_waits_there_as_long() -> None:
    """A rank's snapshot may hold still on a healthy server (a forward pass longer than the
    limit, a raised publish interval): the rule judges only while one of our requests has been
    silent there that long, and once judged keeps the judgement until the rank moves."""
    from fleet.readings import Reading
    from proxy.routing import Attempt, Router
    from proxy.settings import load_settings

    router = Router.from_settings(load_settings(spec_urls="http://s0", base_urls="http://b0", no_progress_s=1.0))
    spec = router.pools["spec"].instances[0]
    spec.kind = "sglang"
    signals = spec.signals
    now = time.monotonic()
    busy = {"rank_running": (2.0, 2.0), "rank_waiting": (0.0, 0.0), "rank_waiting_tokens": (0.0, 0.0)}
    signals.on_ranks(Reading(now - 10.0, 4, 0, rank_marks=(1.0, 1.0), **busy))
    signals.on_ranks(Reading(now, 4, 0, rank_marks=(2.0, 1.0), **busy))  # rank 0 moves, rank 1 held still 10 s
    router.check_ranks(spec, now, grace_s=3.0)
    assert signals.out_ranks == () and spec.next_rank() is None  # none of ours waits there
    attempt = Attempt(router.fleet, spec, stream=True)
    attempt.reading_since = now - 5.0  # silent 5 s
    router.check_ranks(spec, now, grace_s=3.0)
    assert signals.out_ranks == (1,) and [spec.next_rank(), spec.next_rank()] == [0, 0]
    attempt.abandoned = "finished"  # no longer waiting: the judgement stands until rank 1 moves
    attempt.reading_since = None
    router.check_ranks(spec, now, grace_s=3.0)
    assert signals.out_ranks == (1,)
    signals.on_ranks(Reading(now + 1.0, 4, 0, rank_marks=(3.0, 2.0), **busy))
    router.check_ranks(spec, now + 1.0, grace_s=3.0)
    assert signals.out_ranks == () and spec.next_rank() is None


# -- over HTTP, with the twin's fault modes ------------------------------------------------------


@pytest.fixture()
def two_spec_twins() -> Iterator[list[RunningTwin]]:
    common = ("--output-len", "fixed:4096")
    with twins(
        TwinSpec("spec", time_scale=TIME_SCALE, seed=11, args=common),
        TwinSpec("spec", time_scale=TIME_SCALE, seed=12, args=common),
        TwinSpec("base", time_scale=TIME_SCALE, seed=13, args=common),
    ) as started:
        yield started


def make_sick(twin: RunningTwin, **faults: object) -> None:
    answer = httpx.post(twin.url + "/specroute/twin/faults", json=faults, timeout=5)
    assert answer.status_code == 200, answer.text


def instance(proxy: RunningProxy, pool: str, index: int):
    return proxy.app.router.pools[pool].instances[index]


def state_of(proxy: RunningProxy, name: str) -> dict:
    state = httpx.get(proxy.url + "/v1/specroute/state", timeout=5).json()
    return next(i for p in state["pools"].values() for i in p["instances"] if i["name"] == name)


@pytest.mark.parametrize(
    ("faults", "kind", "streamed"),
    [
        ({"error_rate": 1.0}, "status_500", False),
        ({"drop_after_chunks": 2}, "upstream_disconnected", True),
        ({"hang_after_chunks": 2}, "chunk_timeout", True),
        ({"first_token_delay_ms": 5000}, "first_token_timeout", True),
    ],
)
def test_a_server_that_answers_polls_but_fails_completions_stops_getting_traffic(
    two_spec_twins: list[RunningTwin],
    faults: dict,
    kind: str,
    streamed: bool,
) -> None:
    sick, well, base = two_spec_twins
    make_sick(sick, **faults)
    with running_proxy(
        spec_urls=[sick.url, well.url],
        base_urls=[base.url],
        policy="spec",
        chunk_timeout_s=0.5,
        first_token_timeout_s=0.5,
    ) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        outcomes = []
        for _ in range(30):
            try:
                if streamed:
                    text = "".join(
                        c.choices[0].delta.content or ""
                        for c in client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8, stream=True)
                        if c.choices
                    )
                else:
                    text = (
                        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8)
                        .choices[0]
                        .message.content
                    )
                outcomes.append(bool(text))
            except (openai.APIError, httpx.HTTPError):
                outcomes.append(False)
        got = instance(proxy, "spec", 0).dispatched_total
        assert got <= 6, f"the sick server got {got} of 30 requests"  # 5 in a row eject it (+1 racing)
        assert all(outcomes[-20:]), outcomes  # after that, everything is served by the others
        assert state_of(proxy, "spec-0")["outlier"]["state"] == "ejected"
        assert state_of(proxy, "spec-0")["outlier"]["reason"] == f"consecutive-failures:{kind}"
        metrics = httpx.get(proxy.url + "/metrics").text
        assert f'specroute_upstream_ejected{{instance="{sick.url}",pool="spec"}} 1.0' in metrics
        counted = (
            f'specroute_upstream_ejections_total{{instance="{sick.url}",pool="spec",reason="consecutive-failures"}} 1.0'
        )
        assert counted in metrics
        wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")


def test_a_healed_server_returns_through_a_half_open_probe(two_spec_twins: list[RunningTwin]) -> None:
    sick, well, base = two_spec_twins
    make_sick(sick, error_rate=1.0)
    with running_proxy(
        spec_urls=[sick.url, well.url], base_urls=[base.url], policy="spec", outlier_ejection_s=1.0
    ) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)

        def ejected() -> bool:
            client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)  # 5xx: retried on spec-1
            return state_of(proxy, "spec-0")["outlier"]["ejections"] == 1

        wait_for(ejected, what="the sick server ejected", timeout=20)
        make_sick(sick)  # healed
        ejected_with = instance(proxy, "spec", 0).dispatched_total

        def back() -> bool:
            # Only requests here (the state endpoint is not asked: it must not be what ends an ejection).
            client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
            return instance(proxy, "spec", 0).dispatched_total > ejected_with + 1  # the probe, then more

        wait_for(back, what="the healed server back in rotation", timeout=20)
        assert state_of(proxy, "spec-0")["outlier"]["state"] == "ok"
        before = instance(proxy, "spec", 0).dispatched_total
        for _ in range(6):
            client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
        assert instance(proxy, "spec", 0).dispatched_total > before  # takes traffic again


def test_a_server_restarted_on_its_address_takes_traffic_again_before_its_ejection_ends() -> None:
    common = ("--output-len", "fixed:4096")
    with (
        twins(
            TwinSpec("spec", time_scale=TIME_SCALE, seed=12, args=common),
            TwinSpec("base", time_scale=TIME_SCALE, seed=13, args=common),
        ) as (well, base),
        contextlib.ExitStack() as first_run,
    ):
        sick = first_run.enter_context(twin("spec", time_scale=TIME_SCALE, seed=11, args=common))
        make_sick(sick, error_rate=1.0)
        with running_proxy(
            spec_urls=[sick.url, well.url], base_urls=[base.url], policy="spec", outlier_ejection_s=300.0
        ) as proxy:
            client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)

            def ejected() -> bool:
                client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)  # 5xx: retried on spec-1
                return state_of(proxy, "spec-0")["outlier"]["state"] == "ejected"

            wait_for(ejected, what="the sick server ejected", timeout=20)
            first_run.close()  # it goes away ...
            wait_for(lambda: not state_of(proxy, "spec-0")["reached"], what="the polls missing it", timeout=20)
            assert state_of(proxy, "spec-0")["outlier"]["state"] == "ejected"
            # ... and comes back on its address, healthy: traffic again, not in 300 s.
            with twin("spec", time_scale=TIME_SCALE, seed=11, args=(*common, "--port", str(sick.port))):
                wait_for(
                    lambda: state_of(proxy, "spec-0")["outlier"]["state"] == "ok", what="the ejection ended", timeout=20
                )
                assert state_of(proxy, "spec-0")["outlier"]["ejections"] == 1
                before = instance(proxy, "spec", 0).dispatched_total

                def served_again() -> bool:
                    # Bounded by wait_for: its first poll after the restart (a fresh reading) may
                    # come a few requests after the ejection ended.
                    client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
                    return instance(proxy, "spec", 0).dispatched_total > before

                wait_for(served_again, what="the restarted server taking traffic", timeout=20)


def test_a_stopped_server_gets_no_new_requests_while_its_pool_mate_answers(two_spec_twins: list[RunningTwin]) -> None:
    """A stopped process (SIGSTOP, a hung host) still accepts connections: only its silence shows."""
    stopped, well, base = two_spec_twins
    with running_proxy(spec_urls=[stopped.url, well.url], base_urls=[base.url], policy="spec") as proxy:
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0, timeout=10)

        def served_there() -> bool:
            client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
            return instance(proxy, "spec", 0).dispatched_total > 0

        wait_for(served_there, what="both servers taking traffic", timeout=20)
        os.kill(stopped.process.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: state_of(proxy, "spec-0")["lagging"], what="the silent server set aside", timeout=10)
            before = instance(proxy, "spec", 0).dispatched_total
            for _ in range(6):  # each would wait the 120 s first-token timeout there
                client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
            assert instance(proxy, "spec", 0).dispatched_total == before
        finally:
            os.kill(stopped.process.pid, signal.SIGCONT)
        wait_for(lambda: not state_of(proxy, "spec-0")["lagging"], what="the server answering again", timeout=10)
        set_aside = instance(proxy, "spec", 0).dispatched_total

        def back() -> bool:
            client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
            return instance(proxy, "spec", 0).dispatched_total > set_aside

        wait_for(back, what="the server taking traffic again", timeout=20)


def test_requests_waiting_on_a_server_that_stopped_answering_fail_over(two_spec_twins: list[RunningTwin]) -> None:
    """Sent to a server just before it stopped (SIGSTOP, a paused host), requests waited for their
    first byte until the first-token timeout (streams) or the total one (JSON)."""
    stopped, well, base = two_spec_twins
    with running_proxy(
        spec_urls=[stopped.url, well.url], base_urls=[base.url], policy="spec", first_token_timeout_s=60
    ) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0, timeout=40)
        before = instance(proxy, "spec", 0).dispatched_total
        os.kill(stopped.process.pid, signal.SIGSTOP)
        try:
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                calls = [
                    pool.submit(
                        lambda stream: client.chat.completions.with_raw_response.create(
                            model="m", messages=MESSAGES, max_tokens=4, stream=stream
                        ),
                        i % 2 == 0,
                    )
                    for i in range(6)
                ]
                answers = [call.result(timeout=60) for call in calls]
        finally:
            os.kill(stopped.process.pid, signal.SIGCONT)
        assert instance(proxy, "spec", 0).dispatched_total > before  # some went to it before it lagged
        # All answered by its pool-mate within the client's 40 s, against 60 s of first-token
        # timeout (and 600 s of total timeout for the JSON ones) had they waited.
        assert {a.headers["x-specroute-backend"] for a in answers} == {"spec-1"}
        assert instance(proxy, "spec", 0).failed_total >= 1
        assert state_of(proxy, "spec-0")["outlier"]["consecutive_failures"] >= 1
        wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")


@contextlib.contextmanager
def streams_on_spec_0(
    time_scale: float = 1.0, **overrides: float
) -> Iterator[tuple[RunningProxy, RunningTwin, list[openai.Stream]]]:
    """Two spec twins and the proxy (`overrides`: its settings); long streams under way on
    spec-0 (the others closed)."""
    common = ("--output-len", "fixed:4096")  # at real speed a stream lasts about ten seconds
    with (
        twins(
            TwinSpec("spec", seed=21, time_scale=time_scale, args=common),
            TwinSpec("spec", seed=22, time_scale=time_scale, args=common),
            TwinSpec("base", seed=23),
        ) as (first, second, base),
        running_proxy(
            spec_urls=[first.url, second.url],
            base_urls=[base.url],
            policy="spec",
            **({"chunk_timeout_s": 60} | overrides),
        ) as proxy,
    ):
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0, timeout=90)
        streams: list[openai.Stream] = []
        while not any(s.response.headers["x-specroute-backend"] == "spec-0" for s in streams):
            assert len(streams) < 8, "no stream went to spec-0"
            stream = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4000, stream=True)
            next(iter(stream))  # under way: its first chunk reached the client
            streams.append(stream)
        on_first = [s for s in streams if s.response.headers["x-specroute-backend"] == "spec-0"]
        for other in streams:
            if other not in on_first:
                other.close()
        yield proxy, first, on_first


def read_to_the_end(stream: openai.Stream) -> BaseException | None:
    try:
        for _ in stream:
            pass
    except openai.APIError as error:
        return error
    return None


def test_a_stream_under_way_on_a_server_that_stopped_answering_ends_before_its_chunk_timeout() -> None:
    """Bytes reached the client, so the stream cannot fail over; it waited out the chunk timeout
    (60 s) for a server that had stopped (SIGSTOP, a paused host). Now it ends with an error event
    once the server is known to be silent while its pool-mate answers."""
    with streams_on_spec_0() as (proxy, stopped, on_stopped):
        os.kill(stopped.process.pid, signal.SIGSTOP)
        try:
            with concurrent.futures.ThreadPoolExecutor(len(on_stopped)) as pool:
                # Bounded below the 60 s chunk timeout: the server's silence ends them first.
                ended = [f.result(timeout=45) for f in [pool.submit(read_to_the_end, s) for s in on_stopped]]
        finally:
            os.kill(stopped.process.pid, signal.SIGCONT)
        assert all(isinstance(e, openai.APIError) and e.code == "upstream_unresponsive" for e in ended), ended
        assert state_of(proxy, "spec-0")["outlier"]["consecutive_failures"] >= 1
        wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")


def test_a_stream_flowing_from_a_server_whose_polls_go_unanswered_runs_to_its_end() -> None:
    """The other side of the rule: a server too busy to answer its load polls (its scheduler, or a
    slow front process) while it still streams is set aside for new requests, but what it is
    streaming is not cut: the relay keeps hearing from it."""
    with streams_on_spec_0(time_scale=0.4) as (proxy, busy, on_busy):
        httpx.post(busy.url + "/specroute/twin/faults", json={"load_delay_ms": 120_000}, timeout=5)
        bound_s = proxy.app.router.unresponsive_after_s
        lagging_since: float | None = None
        stream, finish = on_busy[0], None
        for number, chunk in enumerate(stream):
            finish = chunk.choices[0].finish_reason if chunk.choices else finish
            if lagging_since is None and number % 20 == 0 and state_of(proxy, "spec-0")["lagging"]:
                lagging_since = time.monotonic()
        ended_at = time.monotonic()
        httpx.post(busy.url + "/specroute/twin/faults", json={}, timeout=5)
        assert finish == "length"  # ran to its end, no error event
        # The rule had its chance: the server was silent-to-polls longer than the bound.
        assert lagging_since is not None and ended_at - lagging_since > bound_s, (lagging_since, ended_at)
        assert state_of(proxy, "spec-0")["outlier"]["consecutive_failures"] == 0


def test_only_attempts_waiting_on_a_silent_server_are_abandoned() -> None:
    """Router.abandon_silent ends what the server left waiting, never a relay that is busy with
    its client (a slow reader: bytes may sit unread in the proxy's buffer), nor one that heard
    from the server within the bound."""
    from proxy.routing import Router
    from proxy.settings import load_settings

    url = "http://127.0.0.1:9"
    router = Router.from_settings(load_settings(spec_urls=url, base_urls="http://127.0.0.1:10"))
    instance = router.by_url[url]

    async def scenario() -> dict[str, str | None]:
        ready: dict[str, asyncio.Event] = {}
        attempts = {}

        async def hold(name: str, waited_s: float | None) -> None:
            attempt = attempts[name] = router.dispatch(instance, 10, True)
            attempt.first_byte()  # under way; then waiting on the server `waited_s`, or relaying
            attempt.reading_since = None if waited_s is None else time.monotonic() - waited_s
            ready[name].set()
            try:
                await asyncio.Event().wait()
            finally:
                attempt.finished()

        cases = {"silent": router.unresponsive_after_s + 1, "heard-lately": 1.0, "relaying": None}
        for name in cases:
            ready[name] = asyncio.Event()
        tasks = {name: asyncio.create_task(hold(name, waited)) for name, waited in cases.items()}
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in ready.values())), 5)
        router.abandon_silent(url)
        abandoned = {name: attempts[name].abandoned for name in cases}
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        assert not instance.attempts  # every attempt released
        return abandoned

    assert asyncio.run(scenario()) == {"silent": "upstream_unresponsive", "heard-lately": None, "relaying": None}


def test_a_pool_whose_servers_are_all_ejected_sends_its_requests_to_the_other_pool(
    two_spec_twins: list[RunningTwin],
) -> None:
    sick, _, base = two_spec_twins
    make_sick(sick, error_rate=1.0)
    with running_proxy(spec_urls=[sick.url], base_urls=[base.url], policy="spec") as proxy:
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        for _ in range(5):  # each fails over to base (a 5xx before the first byte)
            client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
        raw = client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, max_tokens=2)
        assert raw.headers["x-specroute-pool"] == "base" and raw.headers["x-specroute-reason"] == "ejected"
        assert instance(proxy, "spec", 0).dispatched_total == 5


def test_no_upstream_says_to_retry_when_the_ejection_ends(two_spec_twins: list[RunningTwin]) -> None:
    """From an earlier note: requests pinned to a pool whose servers were all ejected for
    minutes were answered 503 `no_upstream` with retry-after 1, and the SDKs asked again every
    second to no avail."""
    sick, _, base = two_spec_twins
    make_sick(sick, error_rate=1.0)
    with running_proxy(spec_urls=[sick.url], base_urls=[base.url], policy="spec", outlier_ejection_s=300.0) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        for _ in range(5):  # five 5xx in a row eject it (each request fails over to base)
            client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(
                model="m", messages=MESSAGES, max_tokens=2, extra_headers={"x-specroute-pool": "spec"}
            )
        assert refused.value.status_code == 503 and refused.value.code == "no_upstream", refused.value
        assert 290 <= int(refused.value.response.headers["retry-after"]) <= 300
        # Not pinned, the other pool serves it.
        raw = client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, max_tokens=2)
        assert raw.headers["x-specroute-pool"] == "base"


def test_a_request_retried_on_another_server_of_its_pool_says_so(two_spec_twins: list[RunningTwin], capfd) -> None:  # type: ignore[no-untyped-def]
    """From an earlier note: a request whose first server failed and whose second, in the same
    pool, answered said only the decision's reason, as if it had gone where the decision sent it.
    Its header and its log line say `+retry` alike."""
    import json

    sick, well, base = two_spec_twins
    make_sick(sick, error_rate=1.0)
    with running_proxy(spec_urls=[sick.url, well.url], base_urls=[base.url], policy="spec", request_log=True) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        answers = [
            client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, max_tokens=2).headers
            for _ in range(4)  # the first attempts rotate over both servers: some start on the sick one
        ]
        said = {(h["x-specroute-reason"], h["x-specroute-backend"]) for h in answers}
        assert ("static+retry", "spec-1") in said, said
        assert said <= {("static+retry", "spec-1"), ("static", "spec-1")}, said
        header = {h["x-request-id"]: h["x-specroute-reason"] for h in answers}
        seen: list[str] = []

        def logged() -> dict[str, str]:
            seen.append(capfd.readouterr().out)
            lines = [json.loads(line) for line in "".join(seen).splitlines() if line.startswith("{")]
            return {line["request_id"]: line["reason"] for line in lines if line["request_id"] in header}

        wait_for(lambda: logged() == header, timeout=10, what="log lines with the headers' reasons")


# -- a server that answers its polls while its engine is stuck ---------------------------------


def test_a_request_sent_to_a_hung_engine_behind_a_live_front_fails_over_long_before_its_timeout() -> None:
    """SGLang's /v1/loads and vLLM's /metrics answer while the engine is stuck (an NCCL hang):
    polls look fine, and each request sent there waited the first-token timeout (120 s) for a
    504. Now the server is judged hung once nothing came from it for SPECROUTE_NO_PROGRESS_S,
    and the request is served by the other pool."""
    with twins(TwinSpec("spec", time_scale=TIME_SCALE, seed=31), TwinSpec("base", time_scale=TIME_SCALE, seed=32)) as (
        hung,
        base,
    ):
        with running_proxy(spec_urls=[hung.url], base_urls=[base.url], policy="spec", no_progress_s=1.0) as proxy:
            client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0, timeout=30)
            # A request served first: its engine mark moves (a mark is trusted once seen to move).
            client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
            wait_for(lambda: state_of(proxy, "spec-0")["engine_still_s"] is not None, what="the engine mark moving")
            make_sick(hung, wedged=True)
            # Bounded by the client's 30 s, a quarter of the first-token timeout.
            stream = client.chat.completions.with_raw_response.create(
                model="m", messages=MESSAGES, max_tokens=4, stream=True
            )
            text = "".join(c.choices[0].delta.content or "" for c in stream.parse() if c.choices)
            assert text
            assert stream.headers["x-specroute-backend"] == "base-0"
            assert stream.headers["x-specroute-reason"].endswith("+failover")
            assert state_of(proxy, "spec-0")["outlier"]["state"] == "ejected"
            assert state_of(proxy, "spec-0")["outlier"]["reason"] == "no-progress"
            assert state_of(proxy, "spec-0")["outlier"]["ejections"] == 1
            metrics = httpx.get(proxy.url + "/metrics").text
            assert (
                f'specroute_upstream_ejections_total{{instance="{hung.url}",pool="spec",reason="no-progress"}} 1.0'
                in metrics
            )
            for _ in range(3):  # the next ones go to base at once
                answer = client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, max_tokens=2)
                assert answer.headers["x-specroute-backend"] == "base-0"
            make_sick(hung)
            wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")


def test_streams_under_way_on_a_hung_engine_end_with_an_error_event_before_their_chunk_timeout() -> None:
    with streams_on_spec_0(no_progress_s=1.0) as (proxy, hung, on_hung):
        make_sick(hung, wedged=True)
        try:
            with concurrent.futures.ThreadPoolExecutor(len(on_hung)) as pool:
                # Bounded below the 60 s chunk timeout: the rule ends them first.
                ended = [f.result(timeout=45) for f in [pool.submit(read_to_the_end, s) for s in on_hung]]
        finally:
            make_sick(hung)
        assert all(isinstance(e, openai.APIError) and e.code == "upstream_no_progress" for e in ended), ended
        shown = state_of(proxy, "spec-0")
        assert shown["outlier"]["reason"] == "no-progress"
        assert shown["last_byte_age_s"] >= 1.0 and shown["attempts"] == 0  # silent past the limit; none left
        wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")


@pytest.mark.parametrize("server", ["sglang", "vllm"])
def test_a_json_request_on_a_hung_engine_fails_over_long_before_its_total_timeout(server: str) -> None:
    """A JSON request is silent until it ends, so its own silence says nothing; the engine's
    progress marks in the server's load answers do (SGLang's /v1/loads snapshot time, published
    by the scheduler alone; vLLM's token counters, its engine's iteration stats). Held still
    long after a request reached it (whether the engine stopped before or after taking it), the
    engine is stuck: the request fails over instead of waiting out the total timeout (600 s)."""
    hung_pool, other_pool = ("spec", "base") if server == "sglang" else ("base", "spec")
    long = ("--output-len", "fixed:4096")
    specs = {
        hung_pool: TwinSpec(hung_pool, time_scale=1.0, seed=41, args=long, server=server),
        other_pool: TwinSpec(other_pool, time_scale=TIME_SCALE, seed=42),
    }
    with twins(specs["spec"], specs["base"]) as (spec, base):
        hung = spec if hung_pool == "spec" else base
        # vLLM's marks (token counters) are judged after the chunk timeout at least.
        with running_proxy(
            spec_urls=[spec.url], base_urls=[base.url], policy=hung_pool, no_progress_s=1.0, chunk_timeout_s=2.0
        ) as proxy:
            client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0, timeout=30)
            # A request served first: its engine mark moves (a mark is trusted once seen to move).
            client.chat.completions.create(model="specroute/twin", messages=MESSAGES, max_tokens=2)
            wait_for(lambda: state_of(proxy, f"{hung_pool}-0")["engine_still_s"] is not None, what="the mark moving")
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                call = pool.submit(
                    client.chat.completions.with_raw_response.create,
                    model="specroute/twin",  # vLLM serves only its own model name
                    messages=MESSAGES,
                    max_tokens=2000,
                )
                # Taken there (the proxy counts it), then the engine stuck.
                wait_for(lambda: state_of(proxy, f"{hung_pool}-0")["running"] >= 1, what="the request sent")
                make_sick(hung, wedged=True)
                answer = call.result(timeout=40)  # bounded: the client's own 30 s
            assert answer.headers["x-specroute-backend"] == f"{other_pool}-0"
            assert answer.headers["x-specroute-reason"].endswith("+failover")
            assert answer.parse().choices[0].message.content
            shown = state_of(proxy, f"{hung_pool}-0")
            assert shown["outlier"]["reason"] == "no-progress" and shown["engine_still_s"] >= 1.0  # still wedged
            make_sick(hung)
            wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")


def test_a_busy_healthy_server_is_not_judged_hung_however_long_its_queue_keeps_requests_silent() -> None:
    """One request at a time on spec, JSON requests and streams queued behind each other: each
    waits seconds with no byte, past a no-progress limit of 1 s, while the engine works (the limit must
    exceed the engine mark's cadence: SGLang publishes every 15 decode steps)."""
    with twins(
        TwinSpec("spec", seed=51, args=("--max-running-requests", "1", "--output-len", "fixed:4096")),
        TwinSpec("base", time_scale=TIME_SCALE, seed=52),
    ) as (spec, base):
        with running_proxy(spec_urls=[spec.url], base_urls=[base.url], policy="spec", no_progress_s=1.0) as proxy:
            client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0, timeout=60)

            def one(stream: bool) -> str:
                answer = client.chat.completions.with_raw_response.create(
                    model="m", messages=MESSAGES, max_tokens=150, stream=stream
                )
                if stream:
                    "".join(c.choices[0].delta.content or "" for c in answer.parse() if c.choices)
                else:
                    answer.parse()
                return answer.headers["x-specroute-backend"] + " " + answer.headers["x-specroute-reason"]

            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                served = [f.result(timeout=90) for f in [pool.submit(one, i % 2 == 0) for i in range(6)]]
            assert served == ["spec-0 static"] * 6  # none failed over
            shown = state_of(proxy, "spec-0")
            assert shown["outlier"]["state"] == "ok" and shown["outlier"]["ejections"] == 0
            assert shown["engine_still_s"] is not None  # judged by its engine mark, which moved


def test_a_vllm_server_prefilling_another_clients_long_prompt_is_not_judged_hung() -> None:
    """vLLM counts a prompt's tokens only when its prefill ends, and nothing else moves its token
    counters while one long prompt is prefilled alone; its KV usage grows with every chunk."""
    with twins(
        TwinSpec("spec", time_scale=TIME_SCALE, seed=61),
        TwinSpec("base", "kimi-linear-vllm", seed=62, server="vllm", args=("--context-length", "200000")),
    ) as (spec, base):
        with running_proxy(
            spec_urls=[spec.url], base_urls=[base.url], policy="base", no_progress_s=1.0, chunk_timeout_s=2.0
        ) as proxy:
            client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0, timeout=60)
            client.chat.completions.create(model="specroute/twin", messages=MESSAGES, max_tokens=2)
            wait_for(lambda: state_of(proxy, "base-0")["engine_still_s"] is not None, what="the mark moving")
            long = {"model": "specroute/twin", "messages": [{"role": "user", "content": "word " * 64_000}]}
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                # Another client (another proxy replica) straight to the server: seconds of prefill.
                other = pool.submit(
                    httpx.post, base.url + "/v1/chat/completions", json=long | {"max_tokens": 2}, timeout=60
                )
                wait_for(
                    lambda: (
                        "vllm:num_requests_running" in httpx.get(base.url + "/metrics").text
                        and state_of(proxy, "base-0")["running"] >= 1
                    ),
                    what="the long prompt running",
                )
                answer = client.chat.completions.with_raw_response.create(
                    model="specroute/twin", messages=MESSAGES, max_tokens=4, stream=True
                )
                text = "".join(c.choices[0].delta.content or "" for c in answer.parse() if c.choices)
                assert other.result(timeout=60).status_code == 200
            assert text and answer.headers["x-specroute-backend"] == "base-0"
            assert answer.headers["x-specroute-reason"] == "static"  # waited behind the prefill, no failover
            assert state_of(proxy, "base-0")["outlier"]["ejections"] == 0


def test_a_server_with_no_engine_mark_sending_to_one_stream_is_not_judged_hung_for_another(caplog) -> None:
    """A server whose load answer carries no engine mark (SGLang polled on /metrics) is judged by
    our streams' bytes alone: one stream's bytes are the server's progress, and a stream queued
    behind it, silent for longer than the limit, is not judged to be on a hung server. The log
    says once that the server gives no mark (the rule's fallback is otherwise silent)."""
    caplog.set_level("INFO", logger="specroute.poller")
    with (
        FaultServer("drip:40", probe="/metrics", load=(1, 0)) as slow,
        running_proxy(
            spec_urls=[slow.url], policy="spec", no_progress_s=0.5, chunk_timeout_s=1.0, log_level="info"
        ) as proxy,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):

        def read(content: str) -> bytes:
            chat = {**CHAT, "stream": True, "messages": [{"role": "user", "content": content}]}
            with httpx.stream("POST", proxy.base_url + "/chat/completions", json=chat, timeout=30) as response:
                return b"".join(response.iter_bytes())

        with httpx.stream(
            "POST", proxy.base_url + "/chat/completions", json={**CHAT, "stream": True}, timeout=30
        ) as response:
            chunks = response.iter_bytes()
            first = next(chunks)  # under way: 4 s of events, 0.1 s apart
            queued = pool.submit(read, "slowstart")  # its first byte 2.5 s later
            body = first + b"".join(chunks)
        later = queued.result(timeout=30)
        for answer in (body, later):
            assert b"upstream_no_progress" not in answer and answer.endswith(b"data: [DONE]\n\n"), answer[-200:]
            assert answer.count(b"data: {") == 40
        assert state_of(proxy, "spec-0")["outlier"]["state"] == "ok"
        assert state_of(proxy, "spec-0")["engine_still_s"] is None
        wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")
    said = [r.getMessage() for r in caplog.records if "engine progress mark" in r.getMessage()]
    assert said == [
        f"spec server {slow.url}: its /metrics answer carries no engine progress mark; a hung engine there"
        " is judged by our streams alone, after the chunk timeout"
    ], said


def test_a_hung_server_is_judged_however_many_requests_keep_arriving_there() -> None:
    """The prefill allowed is the longest waiting prompt's, not the sum of them all: a hung server
    that kept getting long prompts put its own judgement off for as long as they came."""
    from fleet.readings import Reading
    from proxy.routing import Router
    from proxy.settings import load_settings

    url = "http://127.0.0.1:9"
    router = Router.from_settings(load_settings(spec_urls=url, base_urls="http://127.0.0.1:10", no_progress_s=1.0))
    instance = router.by_url[url]
    long_ago = time.monotonic() - 100.0
    router.fleet.on_reading(url, Reading(at=long_ago, running=1.0, waiting=0.0, engine_mark=1.0))
    router.fleet.on_reading(url, Reading(at=long_ago + 0.1, running=1.0, waiting=0.0, engine_mark=2.0))  # moved
    waiting = [router.dispatch(instance, 100_000, True) for _ in range(200)]  # 20 M prompt tokens in all
    for attempt in waiting:
        attempt.dispatched_at = attempt.reading_since = time.monotonic() - 60.0
    router.check_progress(url)
    assert router.outliers.state_of(url)["reason"] == "no-progress"
    for attempt in waiting:
        attempt.failed("upstream_no_progress")


def test_a_request_sent_before_an_ejection_that_succeeds_during_probation_does_not_end_it() -> None:
    clock = Clock()
    fleet, pools = fleet_of(2, 1)
    outliers = detector(pools, fleet, clock)
    sick = pools[0].instances[0]
    sent = clock.now - 1.0
    outliers.hung(sick)
    clock.now += 30.0
    assert outliers.admits(sick)
    outliers.dispatched(sick)  # the probe
    outliers.succeeded(sick, 0.05, dispatched_at=sent)  # a stream from before the ejection ends well
    outliers.released(sick, dispatched_at=sent)
    assert outliers.state_of(sick.url)["state"] == "probing" and not outliers.admits(sick)  # the probe is out
    outliers.succeeded(sick, 0.05, dispatched_at=clock.now)
    assert outliers.state_of(sick.url)["state"] == "ok"


def test_a_server_its_silence_ejected_is_half_open_at_its_first_fresh_reading() -> None:
    from fleet.readings import Reading
    from proxy.routing import Router
    from proxy.settings import load_settings

    url = "http://127.0.0.1:9"
    router = Router.from_settings(load_settings(spec_urls=url, base_urls="http://127.0.0.1:10"))
    instance = router.by_url[url]
    for _ in range(5):
        router.outliers.failed(instance, "upstream_unresponsive")
    assert router.outliers.ejected(url)
    router.check_progress(url)  # no reading yet: still out
    assert router.outliers.ejected(url)
    router.fleet.on_reading(url, Reading(at=time.monotonic(), running=0.0, waiting=0.0))
    router.check_progress(url)
    assert router.outliers.state_of(url)["state"] == "probing"


class Waiting:
    """An attempt as `stalled` sees it."""

    def __init__(self, stream: bool, started: bool, reading_since: float | None) -> None:
        self.stream, self.started, self.reading_since = stream, started, reading_since


@pytest.mark.parametrize(
    ("attempts", "progress_at", "hung"),
    [
        ([Waiting(True, True, 0.0)], 0.0, True),  # a stream under way, nothing for 10 s
        ([Waiting(True, True, 0.0)], 6.0, False),  # bytes 4 s ago (another request's)
        ([Waiting(True, True, 6.0)], 0.0, False),  # waiting only 4 s
        ([Waiting(True, False, 0.0)], 0.0, True),  # a stream waiting for its first token alone
        ([Waiting(True, False, 0.0), Waiting(False, False, 0.0)], 0.0, False),  # a JSON request may hold it back
        ([Waiting(True, True, 0.0), Waiting(False, False, 0.0)], 0.0, False),  # likewise
        ([Waiting(False, False, 0.0)], 0.0, False),  # JSON requests alone are silent until they end
        ([Waiting(True, True, None)], 0.0, False),  # relaying to its client, not waiting on the server
        ([Waiting(True, False, 0.0), Waiting(True, True, None)], 0.0, False),  # a slow client's stream unread
    ],
)
def test_without_an_engine_mark_a_server_is_judged_hung_only_by_streams_all_waiting_on_it(
    attempts: list[Waiting], progress_at: float, hung: bool
) -> None:
    from proxy.routing import stalled

    assert stalled(attempts, progress_at, 10.0, 5.0, None) is hung  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("attempts", "progress_at", "still_s", "hung"),
    [
        ([Waiting(False, False, 0.0)], 0.0, 10.0, True),  # a JSON request: the engine says what it cannot
        ([Waiting(False, False, 0.0)], 0.0, 4.0, False),  # the engine moved 4 s ago (another proxy's work)
        ([Waiting(True, True, 0.0)], 0.0, 4.0, False),  # a quiet stream on a working engine (buffered tool call)
        ([Waiting(False, False, 6.0)], 0.0, 10.0, False),  # sent 4 s ago
        ([Waiting(False, False, 0.0)], 6.0, 10.0, False),  # bytes 4 s ago
        ([Waiting(True, True, None)], 0.0, 10.0, False),  # nothing waiting on the server
    ],
)
def test_with_an_engine_mark_a_server_is_judged_hung_when_it_held_still_whatever_waits(
    attempts: list[Waiting], progress_at: float, still_s: float, hung: bool
) -> None:
    from proxy.routing import stalled

    assert stalled(attempts, progress_at, 10.0, 5.0, still_s) is hung  # type: ignore[arg-type]


# -- one data-parallel rank hung among working ones ------------------------------------------


@contextlib.contextmanager
def spec_of_two_ranks(seed: int, *args: str) -> Iterator[tuple[RunningProxy, RunningTwin, openai.OpenAI]]:
    """The proxy (static spec policy, no-progress limit 1 s) before a spec twin of two
    data-parallel ranks in real time (a long stream lasts about 40 s) and a base twin; both
    ranks read."""
    long = ("--output-len", "fixed:16384")
    with twins(
        TwinSpec("spec", seed=seed, args=("--dp-size", "2", *long, *args)),
        TwinSpec("base", time_scale=TIME_SCALE, seed=seed + 1),
    ) as (spec, base):
        with running_proxy(
            spec_urls=[spec.url], base_urls=[base.url], policy="spec", no_progress_s=1.0, chunk_timeout_s=60
        ) as proxy:
            client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0, timeout=45)
            wait_for(lambda: state_of(proxy, "spec-0")["dp_ranks"] == 2, what="both ranks read")
            yield proxy, spec, client


def under_way(client: openai.OpenAI, headers: dict[str, str] | None = None) -> openai.Stream:
    """A long stream, its first chunk read."""
    stream = client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=16000, stream=True, extra_headers=headers
    )
    next(iter(stream))
    return stream


def test_a_hung_data_parallel_rank_is_found_its_requests_fail_over_and_the_rest_go_to_its_working_rank() -> None:
    """SGLang with --dp-size 2 deals requests to its ranks in turn. With one rank's scheduler
    hung, the server's other requests stream, so its engine mark (the ranks' snapshot times
    summed) moves and the no-progress rule never fired: every other request waited the
    first-token timeout (120 s) for a 504. Now the rank is found by its own snapshot, held still
    with work while the other moves: what waits on it fails over (a stream under way ends with
    `upstream_rank_hung`), the server is not ejected, and its next requests name the working
    rank by `x-data-parallel-rank` until the hung one moves again."""
    with spec_of_two_ranks(seed=61) as (proxy, spec, client):
        assert (state_of(proxy, "spec-0")["engines"], state_of(proxy, "spec-0")["max_running"]) == (2, 96)
        # The first two requests the twin takes: dealt to rank 0, then to rank 1 (a client's
        # x-data-parallel-rank is dropped: the server deals them itself).
        working, doomed = under_way(client, {"x-data-parallel-rank": "0"}), under_way(client)
        make_sick(spec, wedged_rank=1)  # hung mid-step, a request on it
        reader = concurrent.futures.ThreadPoolExecutor(1)
        read = reader.submit(read_to_the_end, working)  # rank 0 streams on: the server makes progress
        try:
            ended = read_to_the_end(doomed)  # bounded by the client's 45 s, below the 60 s chunk timeout
            assert not read.done()  # the other rank still streaming: the server's mark moved throughout
            assert isinstance(ended, openai.APIError) and ended.code == "upstream_rank_hung", ended
            shown = state_of(proxy, "spec-0")
            assert shown["hung_ranks"] == [1] and shown["outlier"]["state"] != "ejected"
            assert (shown["engines"], shown["max_running"]) == (1, 48)  # rank 0 alone serves
            gauge = f'specroute_upstream_hung_ranks{{instance="{spec.url}",pool="spec"}}'
            assert f"{gauge} 1.0" in httpx.get(proxy.url + "/metrics").text
            for _ in range(4):  # dealt to the working rank: none waits, none fails over
                answer = client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, max_tokens=2)
                assert answer.headers["x-specroute-backend"] == "spec-0"
                assert not answer.headers["x-specroute-reason"].endswith("failover")
            assert state_of(proxy, "spec-0")["outlier"]["consecutive_failures"] == 0
        finally:
            make_sick(spec)
            working.close()
            reader.shutdown()
        wait_for(lambda: state_of(proxy, "spec-0")["hung_ranks"] == [], what="the rank serving again")
        wait_for(lambda: f"{gauge} 0.0" in httpx.get(proxy.url + "/metrics").text, what="the gauge back at 0")
        wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")


def test_requests_queued_on_the_working_rank_are_not_taken_for_the_hung_ranks() -> None:
    """Once a rank is judged hung, the server's requests name its working ranks; one queued
    there past the limit (the working rank full) is that rank's queue, not the hung rank's, and
    waits its turn (a review saw such requests failed over as `upstream_rank_hung`)."""
    with spec_of_two_ranks(63, "--max-running-requests", "1") as (proxy, spec, client):
        # Dealt to rank 0, then rank 1: each rank's one slot taken.
        working, doomed = under_way(client), under_way(client)
        make_sick(spec, wedged_rank=1)
        pool = concurrent.futures.ThreadPoolExecutor(2)
        try:
            pool.submit(read_to_the_end, working)  # rank 0 streams on
            ended = read_to_the_end(doomed)
            assert isinstance(ended, openai.APIError) and ended.code == "upstream_rank_hung", ended
            queued = pool.submit(
                client.chat.completions.with_raw_response.create, model="m", messages=MESSAGES, max_tokens=2
            )
            spec_0 = instance(proxy, "spec", 0)

            def silent_on_rank_0() -> bool:
                now = time.monotonic()
                return any(a.rank == 0 and a.reading_since and now - a.reading_since > 3.0 for a in spec_0.attempts)

            wait_for(silent_on_rank_0, what="a request queued on rank 0 past the limit")
            assert all(a.abandoned is None for a in spec_0.attempts)
            working.close()  # rank 0's slot frees: the queued request is served there
            answer = queued.result(timeout=40)
            assert answer.headers["x-specroute-backend"] == "spec-0"
            assert not answer.headers["x-specroute-reason"].endswith("failover")
        finally:
            make_sick(spec)
            working.close()
            pool.shutdown()
        wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")


@contextlib.contextmanager
def base_of_two_vllm_engines(seed: int) -> Iterator[tuple[RunningProxy, RunningTwin, openai.OpenAI]]:
    """The proxy (static base policy, no-progress limit 1 s, chunk timeout 3 s: vLLM's marks are
    judged after it) before a base vLLM twin of two data-parallel engines in real time (a long
    stream lasts about 40 s) and a spec twin; both engines read."""
    long = ("--output-len", "fixed:16384")
    with twins(
        TwinSpec("spec", time_scale=TIME_SCALE, seed=seed),
        TwinSpec("base", seed=seed + 1, server="vllm", args=("--data-parallel-size", "2", *long)),
    ) as (spec, base):
        with running_proxy(
            spec_urls=[spec.url], base_urls=[base.url], policy="base", no_progress_s=1.0, chunk_timeout_s=3.0
        ) as proxy:
            client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0, timeout=45)
            wait_for(lambda: state_of(proxy, "base-0")["dp_ranks"] == 2, what="both engines read")
            yield proxy, base, client


def test_a_hung_vllm_engine_among_working_ones_is_found_by_its_own_counters() -> None:
    """vLLM with --data-parallel-size 2 labels each engine's metrics `engine`, and its balancer
    sends a request to the least loaded engine as it last heard. With one engine's core hung,
    its series hold still while the other engine's counters move (so the server's own mark
    moves): found by its own mark, a JSON request waiting there fails over (after the chunk
    timeout at least, vLLM's margin), the server is not ejected, and its next requests name the
    working engine by X-data-parallel-rank, which vLLM reads too."""
    with base_of_two_vllm_engines(seed=71) as (proxy, base, client):
        assert (state_of(proxy, "base-0")["engines"], state_of(proxy, "base-0")["max_running"]) == (2, 512)
        reader = concurrent.futures.ThreadPoolExecutor(2)
        working: openai.Stream | None = None
        try:
            # Engine 0 takes the first (a tie goes to the lowest); JSON: silent until it ends.
            doomed = reader.submit(
                client.chat.completions.with_raw_response.create,
                model="specroute/twin",
                messages=MESSAGES,
                max_tokens=16000,
            )
            wait_for(lambda: state_of(proxy, "base-0")["running"] >= 1, what="the request on engine 0")
            working = client.chat.completions.create(
                model="specroute/twin", messages=MESSAGES, max_tokens=16000, stream=True
            )
            next(iter(working))  # under way on engine 1, the less loaded
            make_sick(base, wedged_rank=0)
            read = reader.submit(read_to_the_end, working)  # engine 1 streams on
            answer = doomed.result(timeout=40)
            assert answer.headers["x-specroute-backend"] == "spec-0"
            assert answer.headers["x-specroute-reason"].endswith("+failover")
            assert not read.done()  # engine 1 still streaming throughout
            shown = state_of(proxy, "base-0")
            assert shown["hung_ranks"] == [0] and shown["outlier"]["state"] != "ejected"
            assert (shown["engines"], shown["max_running"]) == (1, 256)  # engine 1 alone serves
            # Named to the working engine: none waits, none fails over. Left to vLLM, they
            # would go to the hung one, whose frozen count (1 running) ties engine 1's.
            for _ in range(4):
                served = client.chat.completions.with_raw_response.create(
                    model="specroute/twin", messages=MESSAGES, max_tokens=2
                )
                assert served.headers["x-specroute-backend"] == "base-0"
                assert not served.headers["x-specroute-reason"].endswith("failover")
        finally:
            make_sick(base)
            if working is not None:
                working.close()
            reader.shutdown()
        wait_for(lambda: state_of(proxy, "base-0")["hung_ranks"] == [], what="the engine serving again")
        wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")


def test_a_rank_hung_in_its_first_prefill_after_idling_is_asked_and_judged() -> None:
    """A rank that hangs in the first prefill after it idled shows no work: SGLang published its
    snapshot once as it went idle and publishes next after a prefill, so its figures are an idle
    rank's and the work rule cannot judge it. While a request of ours waits on the server
    without a byte, each rank that shows no work and holds still is sent a one-token completion
    named to it: one that does not answer is judged hung, its waiting request fails over, the
    server's next requests name the working rank, and once the rank answers again it serves."""
    with spec_of_two_ranks(seed=65) as (proxy, spec, client):
        make_sick(spec, wedged_rank=1)  # idle: it hangs at the next request it takes
        reader = concurrent.futures.ThreadPoolExecutor(1)
        working = under_way(client)  # dealt to rank 0, which streams on
        read = reader.submit(read_to_the_end, working)
        try:
            # Dealt to rank 1: silent, while its snapshot still reads idle.
            answer = client.chat.completions.with_raw_response.create(
                model="m", messages=MESSAGES, max_tokens=2, stream=True
            )
            assert answer.headers["x-specroute-backend"] == "base-0"
            assert answer.headers["x-specroute-reason"].endswith("+failover")
            assert "".join(c.choices[0].delta.content or "" for c in answer.parse() if c.choices)
            assert not read.done()
            shown = state_of(proxy, "spec-0")
            assert shown["hung_ranks"] == [1] and shown["outlier"]["state"] != "ejected"
            for _ in range(4):  # named to rank 0: none waits, none fails over
                served = client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, max_tokens=2)
                assert served.headers["x-specroute-backend"] == "spec-0"
                assert not served.headers["x-specroute-reason"].endswith("failover")
        finally:
            make_sick(spec)
            working.close()
            reader.shutdown()
        # Healed, idle: nothing moves its snapshot; the next request named to it is answered.
        wait_for(lambda: state_of(proxy, "spec-0")["hung_ranks"] == [], what="the rank answering again")
        wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")


def test_an_idle_rank_that_answers_its_probe_is_not_judged_though_a_request_waits_elsewhere() -> None:
    """One of ours queued on a full rank past the limit while the other rank idles: the idle rank
    is asked, answers, and nothing is judged; the queued request is served where it waits."""
    with spec_of_two_ranks(67, "--max-running-requests", "1") as (proxy, spec, client):
        working = under_way(client)  # rank 0's one slot
        pool = concurrent.futures.ThreadPoolExecutor(1)
        try:
            short = client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, max_tokens=2)
            assert short.headers["x-specroute-backend"] == "spec-0"  # served by rank 1, idle after
            queued = pool.submit(
                client.chat.completions.with_raw_response.create, model="m", messages=MESSAGES, max_tokens=2
            )  # dealt to rank 0: queued behind the stream
            spec_0 = instance(proxy, "spec", 0)
            wait_for(lambda: 1 in spec_0.probed_at and 1 not in spec_0.probing, what="rank 1 asked and answering")
            assert spec_0.silent_ranks == {} and state_of(proxy, "spec-0")["hung_ranks"] == []
            working.close()  # rank 0's slot frees: the queued request is served there
            answer = queued.result(timeout=40)
            assert answer.headers["x-specroute-backend"] == "spec-0"
            assert not answer.headers["x-specroute-reason"].endswith("failover")
        finally:
            working.close()
            pool.shutdown()
        wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")


def test_a_vllm_engine_hung_in_its_first_prefill_is_asked_by_its_served_model() -> None:
    """The same on vLLM, whose hung core's series keep an idle engine's figures: the one-token
    request names the model vLLM serves (its /v1/models; any other is a 404)."""
    with base_of_two_vllm_engines(seed=73) as (proxy, base, client):
        make_sick(base, wedged_rank=1)  # idle: it hangs at the next request it takes
        working = client.chat.completions.create(
            model="specroute/twin", messages=MESSAGES, max_tokens=16000, stream=True
        )
        try:
            next(iter(working))  # engine 0 (a tie goes to the lowest)
            answer = client.chat.completions.with_raw_response.create(
                model="specroute/twin", messages=MESSAGES, max_tokens=2
            )  # engine 1, the less loaded: silent
            assert answer.headers["x-specroute-backend"] == "spec-0"
            assert answer.headers["x-specroute-reason"].endswith("+failover")
            assert state_of(proxy, "base-0")["hung_ranks"] == [1]
        finally:
            make_sick(base)
            working.close()
        wait_for(lambda: state_of(proxy, "base-0")["hung_ranks"] == [], what="the engine answering again")
        wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")


def test_a_rank_probe_gives_no_verdict_when_the_servers_model_cannot_be_read_in_time() -> None:
    """The probe names the model the server's /v1/models lists; a slow answer there (a busy front,
    a gateway before it) timed out as if the rank had not answered, and a healthy idle rank was
    judged hung without a completion sent (a review). Now no verdict; once the model is read,
    a rank that answers is one."""
    from aiohttp import web

    from proxy.poller import Pollers

    sent: list[str | None] = []

    async def models(request: web.Request) -> web.Response:
        if not sent:
            await asyncio.sleep(2.0)  # slower than the polls' 0.5 s timeout, the first time
        return web.json_response({"object": "list", "data": [{"id": "served"}]})

    async def completions(request: web.Request) -> web.Response:
        sent.append(request.headers.get("x-data-parallel-rank"))
        return web.json_response({"choices": [{"text": "k"}]})

    async def probe_twice() -> tuple[bool | None, bool | None]:
        routes = [("GET", "/v1/models", models), ("POST", "/v1/completions", completions)]
        async with aiohttp_upstream(routes) as url:
            fleet = FleetModel()
            fleet.add_instance(url, "spec", 48)
            pollers = Pollers([Instance(url, "spec", fleet.instances[url])], fleet, interval_s=60.0, timeout_s=0.5)
            pollers._client = httpx.AsyncClient(timeout=httpx.Timeout(0.5), trust_env=False)  # noqa: SLF001
            try:
                slow = await pollers.probe_rank(url, 1, 3.0)
                sent.append("models read")
                answered = await pollers.probe_rank(url, 1, 3.0)
            finally:
                await pollers._client.aclose()  # noqa: SLF001
        return slow, answered

    assert asyncio.run(probe_twice()) == (None, True)
    assert sent == ["models read", "1"]
