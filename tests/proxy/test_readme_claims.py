"""README's failure-behaviour claims, each checked over real sockets: the attempt bound, the
total deadline, retry on a dropped connection, the request class, the base pool's key, the
least-loaded instance, the /metrics and /get_load probes, and health after failed polls."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from proxy_faults import FaultServer
from proxy_harness import TIME_SCALE, running_proxy, wait_for

from proxy.routing import Router
from proxy.settings import load_settings
from sim.testing import TwinSpec, twins

MESSAGES = [{"role": "user", "content": "Say hi."}]
CHAT = {"model": "m", "messages": MESSAGES, "max_tokens": 2}


def posts(server: FaultServer) -> int:
    return sum(1 for r in server.requests if r.method == "POST")


def test_max_attempts_bounds_the_servers_a_request_tries() -> None:
    with (
        FaultServer("status:503") as a,
        FaultServer("status:503") as b,
        FaultServer("status:503") as c,
        running_proxy(spec_urls=[a.url, b.url], base_urls=[c.url], policy="spec", max_attempts=2) as proxy,
    ):
        answer = httpx.post(proxy.base_url + "/chat/completions", json=CHAT)
        assert answer.status_code == 503
        assert posts(a) + posts(b) + posts(c) == 2


def test_the_total_timeout_bounds_a_json_request_across_attempts() -> None:
    with (
        FaultServer("drop") as dropping,
        FaultServer("hang") as hanging,
        running_proxy(
            spec_urls=[dropping.url, hanging.url],
            policy="spec",
            total_timeout_s=1.0,
            connect_timeout_s=0.5,
            first_token_timeout_s=60,
        ) as proxy,
    ):
        started = time.monotonic()
        answer = httpx.post(proxy.base_url + "/chat/completions", json=CHAT, timeout=30)
        took = time.monotonic() - started
        assert answer.status_code == 504 and answer.json()["error"]["code"] == "total_timeout"
        assert posts(dropping) >= 1 and posts(hanging) == 1  # one failed fast, the other used the rest
        assert 0.9 < took < 5
        wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")


def test_a_connection_dropped_before_the_first_byte_is_retried_on_another_server() -> None:
    with (
        FaultServer("drop") as dropping,
        FaultServer("echo") as good,
        running_proxy(spec_urls=[dropping.url, good.url], policy="spec") as proxy,
    ):
        for _ in range(4):
            answer = httpx.post(proxy.base_url + "/chat/completions", json=CHAT)
            assert answer.status_code == 200 and answer.headers["x-specroute-backend"] == "spec-1"
        assert posts(dropping) >= 1 and posts(good) == 4


@pytest.mark.parametrize(
    ("headers", "body", "expected"),
    [
        ({"x-specroute-class": "batch"}, {}, "batch"),
        ({}, {"service_tier": "flex"}, "batch"),
        ({"x-specroute-class": "latency"}, {"service_tier": "flex"}, "latency"),  # the header wins
        ({}, {}, "latency"),
    ],
)
def test_the_request_class_comes_from_the_header_or_the_flex_service_tier(twin_pair, headers, body, expected) -> None:
    spec, base = twin_pair
    with running_proxy(spec_urls=[spec.url], base_urls=[base.url]) as proxy:
        answer = httpx.post(proxy.base_url + "/chat/completions", json={**CHAT, **body}, headers=headers)
        assert answer.status_code == 200
        decisions = httpx.get(proxy.url + "/v1/specroute/state").json()["decisions"]
        assert decisions[-1]["class"] == expected


def test_a_decision_in_the_state_endpoint_carries_its_request_id_and_wall_clock_time(twin_pair) -> None:
    """From an operator's probe: decisions[].at is time.monotonic(), and nothing tied an entry to
    its request's log line."""
    import time

    spec, base = twin_pair
    with running_proxy(spec_urls=[spec.url], base_urls=[base.url]) as proxy:
        before = time.time()
        answer = httpx.post(proxy.base_url + "/chat/completions", json=CHAT, headers={"x-request-id": "probe-42"})
        assert answer.status_code == 200 and answer.headers["x-request-id"] == "probe-42"
        unnamed = httpx.post(proxy.base_url + "/chat/completions", json=CHAT)
        decisions = httpx.get(proxy.url + "/v1/specroute/state").json()["decisions"]
        assert [d["request_id"] for d in decisions[-2:]] == ["probe-42", unnamed.headers["x-request-id"]]
        assert before - 1 <= decisions[-2]["ts"] <= decisions[-1]["ts"] <= time.time() + 1
        assert decisions[-1]["at"] < before  # `at` stays the monotonic clock


def test_the_base_pools_key_is_sent_to_base_only(twin_pair) -> None:
    spec, _ = twin_pair
    with (
        FaultServer("echo") as base,
        running_proxy(
            spec_urls=[spec.url],
            base_urls=[base.url],
            policy="base",
            base_api_key="base-secret",
            spec_api_key="spec-secret",
        ) as proxy,
    ):
        openai.OpenAI(base_url=proxy.base_url, api_key="client", max_retries=0).chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=2
        )
    assert [r.headers["authorization"] for r in base.requests if r.method == "POST"] == ["Bearer base-secret"]


def test_requests_go_to_the_least_loaded_instance_of_a_pool() -> None:
    with twins(
        *(TwinSpec("spec", time_scale=1.0, seed=30 + i, args=("--output-len", "fixed:4096")) for i in range(2))
    ) as (first, second):
        with running_proxy(spec_urls=[first.url, second.url], policy="spec") as proxy:
            streams = [
                httpx.stream(
                    "POST",
                    proxy.base_url + "/chat/completions",
                    timeout=30,
                    json={"model": "m", "messages": MESSAGES, "max_tokens": 20000, "stream": True},
                )
                for _ in range(6)
            ]
            try:
                for s in streams:
                    assert s.__enter__().status_code == 200
                counts = sorted(i.in_flight for i in proxy.app.router.pools["spec"].instances)
                assert counts == [3, 3]  # never two on one while the other has fewer
            finally:
                for s in streams:
                    s.__exit__(None, None, None)
            wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")


@pytest.mark.parametrize("probe", ["/get_load", "/metrics"])
def test_a_server_without_v1_loads_is_polled_on_its_fallback_probe(probe: str) -> None:
    with (
        FaultServer("echo", probe=probe, load=(5, 2)) as server,
        running_proxy(spec_urls=[server.url], policy="spec", poll_interval_ms=50) as proxy,
    ):

        def instance() -> dict:
            return httpx.get(proxy.url + "/v1/specroute/state").json()["pools"]["spec"]["instances"][0]

        wait_for(
            lambda: instance()["probe"] == probe and (instance()["running"], instance()["waiting"]) == (5, 2),
            what=f"the load read from {probe}",
        )


def test_an_instance_turns_unhealthy_after_three_failed_polls() -> None:
    with twins(TwinSpec("spec", time_scale=TIME_SCALE, seed=40)) as (spec,):
        settings = load_settings(spec_urls=[spec.url], poll_interval_ms=60_000, stale_ms=120_000)  # only our own polls
        router = Router.from_settings(settings)

        async def scenario() -> list[bool]:
            await router.start()
            try:
                spec.process.terminate()
                await asyncio.to_thread(spec.process.wait, 10)
                health = []
                for _ in range(3):
                    await router.pollers.poll_once()
                    health.append(router.pools["spec"].instances[0].healthy)
                return health
            finally:
                await router.stop()

        assert asyncio.run(scenario()) == [True, True, False]
