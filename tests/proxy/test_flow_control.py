"""Flow control over HTTP (SPECROUTE_HOLD_MAX_S): a request no pool can serve in time waits in
the proxy, is served once let go and says how long it waited; one whose client leaves while held
never reaches a server; the setting needs an SLO target."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest
from proxy_harness import RunningProxy, running_proxy, wait_for

from proxy.holding import HoldQueue
from proxy.settings import SettingsError, load_settings
from sim.testing import RunningTwin, TwinSpec, twins

MESSAGES = [{"role": "user", "content": "Say hi."}]
SLO = {"goodput_slo_ttft_s": 0.5, "admission_ttft_s": 0, "admission_tpot_ms": 0, "profile": "h200-llama8b"}
"""Half a second to the first token, admission off: the request behind a busy slot is lost."""
LONG = 400
"""Output tokens of each request here: about 1-2 s on a twin in real time (h200-llama8b)."""


@pytest.fixture(scope="module")
def one_slot_twins() -> Iterator[tuple[RunningTwin, RunningTwin]]:
    """A spec and a base twin in real time that run one request at a time: a second one waits
    for the first to finish, past any first-token target under a second."""
    common = ("--output-len", "fixed:4096", "--max-running-requests", "1")
    with twins(TwinSpec("spec", seed=1, args=common), TwinSpec("base", seed=2, args=common)) as pair:
        yield pair


def dispatched(proxy: RunningProxy) -> int:
    return sum(i.dispatched_total for i in proxy.app.router.instances())


def state(proxy: RunningProxy) -> dict:
    return httpx.get(proxy.url + "/v1/specroute/state", timeout=5).json()


def fill(proxy: RunningProxy) -> list[threading.Thread]:
    """One long stream on each twin's only slot, started and seen by the proxy."""
    client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)

    def stream(pool: str) -> None:
        for _ in client.chat.completions.create(
            model="m",
            messages=MESSAGES,
            max_tokens=LONG,
            stream=True,
            extra_headers={"x-specroute-pool": pool},  # pinned: never held
        ):
            pass

    threads = [threading.Thread(target=stream, args=(pool,)) for pool in ("spec", "base")]
    for thread in threads:
        thread.start()
    wait_for(lambda: proxy.in_flight() == 2, what="both slots taken")
    return threads


@contextmanager
def busy_proxy(
    twins_pair: tuple[RunningTwin, RunningTwin], hold_max_s: float
) -> Iterator[tuple[RunningProxy, HoldQueue]]:
    """The proxy with flow control in front of the one-slot twins, read once, both slots taken
    by a long stream each (joined on the way out)."""
    spec, base = twins_pair
    with running_proxy(spec_urls=[spec.url], base_urls=[base.url], hold_max_s=hold_max_s, **SLO) as proxy:
        wait_for(lambda: proxy.app.router.snapshot().pools["spec"].age_s < 1, what="a load reading")
        holding = proxy.app.router.holding
        assert holding is not None
        fillers = fill(proxy)
        try:
            yield proxy, holding
        finally:
            for filler in fillers:
                filler.join(30)


def post_long(proxy: RunningProxy, timeout: httpx.Timeout | float) -> httpx.Response:
    return httpx.post(
        proxy.base_url + "/chat/completions",
        json={"model": "m", "messages": MESSAGES, "max_tokens": LONG},
        timeout=timeout,
    )


def test_a_request_lost_behind_busy_slots_waits_in_the_proxy_until_one_frees(one_slot_twins) -> None:
    with busy_proxy(one_slot_twins, hold_max_s=60) as (proxy, _):
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        reply = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=LONG)
        assert reply.usage is not None and reply.usage.completion_tokens == LONG
        last = state(proxy)["decisions"][-1]
        # Held while both slots were busy (its first token predicted seconds away on either pool),
        # let go once one freed, well before the bound.
        assert last["held"]["released_by"] == "release-room" and 0 < last["held"]["seconds"] < 30
        assert last["instance"] is not None
        assert state(proxy)["flow_control"] == {"max_hold_s": 60, "held": 0, "oldest_held_s": 0.0, "fair_wait_s": None}
        metrics = httpx.get(proxy.url + "/metrics", timeout=5).text
        assert 'specroute_hold_released_seconds_count{rule="release-room"} 1.0' in metrics
        assert 'specroute_hold_released_seconds_count{rule="release-bound"} 0.0' in metrics
        assert 'specroute_hold_released_seconds_count{rule="release-due"} 0.0' in metrics
        assert "specroute_held_requests 0.0" in metrics


def test_a_request_whose_client_leaves_while_held_never_reaches_a_server(one_slot_twins) -> None:
    with busy_proxy(one_slot_twins, hold_max_s=60) as (proxy, holding):
        outcome: list[BaseException] = []

        def impatient() -> None:
            try:
                post_long(proxy, httpx.Timeout(5, read=0.3))
            except httpx.ReadTimeout as gone:
                outcome.append(gone)

        thread = threading.Thread(target=impatient)
        thread.start()
        wait_for(lambda: len(holding.held) == 1, what="the request held")
        thread.join(10)
        assert outcome and isinstance(outcome[0], httpx.ReadTimeout)
        wait_for(lambda: not holding.held, what="the departed request gone from the queue")
        wait_for(lambda: proxy.in_flight() == 0, what="the fillers done")
        assert dispatched(proxy) == 2  # the two fillers only
        # Its time held was waiting, not the proxy's work (a review saw 1.5 s of "overhead"): the
        # three requests' overhead together is milliseconds.
        metrics = httpx.get(proxy.url + "/metrics", timeout=5).text
        overhead = float(
            next(line.split()[-1] for line in metrics.splitlines() if line.startswith("specroute_overhead_seconds_sum"))
        )
        assert overhead < 0.2


def test_a_stopping_proxy_lets_its_held_requests_go_to_be_served_within_the_drain(one_slot_twins) -> None:
    """A probe's finding: SIGTERM left held requests waiting until the drain ran out (503 after
    32 s, for requests no server had seen)."""
    with busy_proxy(one_slot_twins, hold_max_s=120) as (proxy, holding):
        answers: list[int] = []
        thread = threading.Thread(target=lambda: answers.append(post_long(proxy, 30).status_code))
        thread.start()
        wait_for(lambda: len(holding.held) == 1, what="the request held")
        proxy.server.handle_exit(signal.SIGTERM, None)
        thread.join(30)
        assert answers == [200]  # let go at the stop, served within the drain


def test_a_quiet_fleet_holds_nothing(twin_pair) -> None:
    spec, base = twin_pair
    targets = {"goodput_slo_ttft_s": 5.0, "goodput_slo_tpot_ms": 1000, "profile": "h200-llama8b"}
    with running_proxy(spec_urls=[spec.url], base_urls=[base.url], hold_max_s=60, **targets) as proxy:
        wait_for(lambda: proxy.app.router.snapshot().pools["spec"].age_s < 1, what="a load reading")
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        for _ in range(3):
            client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)
        assert all("held" not in d for d in state(proxy)["decisions"])


def test_flow_control_needs_an_slo_target() -> None:
    with pytest.raises(SettingsError, match="SPECROUTE_HOLD_MAX_S needs an SLO target"):
        load_settings(hold_max_s=30, spec_urls=["http://127.0.0.1:1"])


def test_with_flow_control_the_pools_are_marked_held_to_their_targets() -> None:
    """With flow control the proxy keeps a plain pool near its TPOT target, so the policy checks
    it at the TPOT its requests came out at (`PoolState.load_held`, `Goodput.tpot_spread`);
    without, the marks stay off and routing alone is unchanged."""
    from proxy.routing import Router

    urls = {"spec_urls": ["http://127.0.0.1:1"], "base_urls": ["http://127.0.0.1:2"]}
    router = Router.from_settings(load_settings(hold_max_s=30, **SLO, **urls))
    held = router.snapshot()
    assert held.pools and all(p.load_held for p in held.pools.values())
    assert all(router.state()["pools"][name]["load_held"] for name in ("spec", "base"))  # shown
    alone = Router.from_settings(load_settings(**SLO, **urls)).snapshot()
    assert alone.pools and not any(p.load_held for p in alone.pools.values())
