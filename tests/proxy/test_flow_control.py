"""Flow control over HTTP (SPECROUTE_HOLD_MAX_S): a request no pool can serve in time waits in
the proxy, is served once let go and says how long it waited; one whose client leaves while held
never reaches a server; the setting needs an SLO target."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from proxy_harness import RunningProxy, running_proxy, wait_for

from proxy.settings import SettingsError, load_settings

MESSAGES = [{"role": "user", "content": "Say hi."}]
# A first token within 1 ms is beyond any prefill: every request is lost on both pools.
LOST = {"goodput_slo_ttft_s": 0.001, "admission_ttft_s": 0, "admission_tpot_ms": 0, "profile": "h200-llama8b"}


def dispatched(proxy: RunningProxy) -> int:
    return sum(i.dispatched_total for i in proxy.app.router.instances())


def state(proxy: RunningProxy) -> dict:
    return httpx.get(proxy.url + "/v1/specroute/state", timeout=5).json()


def test_a_lost_request_waits_out_the_bound_in_the_proxy_then_is_served(twin_pair) -> None:
    spec, base = twin_pair
    with running_proxy(spec_urls=[spec.url], base_urls=[base.url], hold_max_s=0.5, **LOST) as proxy:
        wait_for(lambda: proxy.app.router.snapshot().pools["spec"].age_s < 1, what="a load reading")
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        started = time.monotonic()
        reply = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)
        assert time.monotonic() - started >= 0.5  # held to its bound: never room within 1 ms
        assert reply.usage is not None and reply.usage.completion_tokens == 4
        last = state(proxy)["decisions"][-1]
        assert last["held"]["released_by"] == "release-bound" and last["held"]["seconds"] >= 0.5
        assert last["instance"] is not None  # sent once let go
        assert state(proxy)["flow_control"] == {"max_hold_s": 0.5, "held": 0, "oldest_held_s": 0.0}
        metrics = httpx.get(proxy.url + "/metrics", timeout=5).text
        assert 'specroute_hold_released_seconds_count{rule="release-bound"} 1.0' in metrics
        assert 'specroute_hold_released_seconds_count{rule="release-room"} 0.0' in metrics
        assert "specroute_held_requests 0.0" in metrics


def test_a_request_whose_client_leaves_while_held_never_reaches_a_server(twin_pair) -> None:
    spec, base = twin_pair
    with running_proxy(spec_urls=[spec.url], base_urls=[base.url], hold_max_s=60, **LOST) as proxy:
        wait_for(lambda: proxy.app.router.snapshot().pools["spec"].age_s < 1, what="a load reading")
        holding = proxy.app.router.holding
        assert holding is not None
        outcome: list[BaseException] = []

        def impatient() -> None:
            try:
                httpx.post(
                    proxy.base_url + "/chat/completions",
                    json={"model": "m", "messages": MESSAGES, "max_tokens": 4},
                    timeout=httpx.Timeout(5, read=0.3),
                )
            except httpx.ReadTimeout as gone:
                outcome.append(gone)

        thread = threading.Thread(target=impatient)
        thread.start()
        wait_for(lambda: len(holding.held) == 1, what="the request held")
        assert state(proxy)["flow_control"]["held"] == 1
        thread.join(10)
        assert outcome and isinstance(outcome[0], httpx.ReadTimeout)
        wait_for(lambda: not holding.held, what="the departed request gone from the queue")
        assert dispatched(proxy) == 0 and proxy.in_flight() == 0


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
