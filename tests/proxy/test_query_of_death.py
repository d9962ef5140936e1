"""A request that makes servers fail (a query of death) is judged the cause, not its servers:
bad inputs do not eject healthy servers, and one that drops servers' connections (a crash) is
not carried on to the next server, nor taken again while remembered."""

from __future__ import annotations

import httpx
import openai
import pytest
from proxy_faults import FaultServer
from proxy_harness import running_proxy, wait_for
from test_outliers import Clock, detector, fleet_of

from proxy.outliers import EJECTED, PROBING
from proxy.suspects import Culprit, Suspects, request_key, request_may_cause

POISON = "POISON-INPUT"


def poison(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{POISON} number {i}"}]


def ok_messages() -> list[dict[str, str]]:
    return [{"role": "user", "content": "Say hi."}]


# -- the rules, on a clock the test moves ----------------------------------------------------


def test_which_failures_a_request_may_cause() -> None:
    assert request_may_cause("status_500") and request_may_cause("status_501")
    assert request_may_cause("upstream_disconnected")
    for kind in ("status_502", "status_503", "status_504", "connect", "first_token_timeout", "chunk_timeout"):
        assert not request_may_cause(kind), kind
    assert request_key("/v1/chat/completions", b"{}") != request_key("/v1/completions", b"{}")
    assert request_key("/v1/chat/completions", b"{}") == request_key("/v1/chat/completions", b"{}")


def test_a_request_is_judged_on_its_own_failures_on_different_servers() -> None:
    suspects = Suspects(2, 60.0)
    culprit = Culprit()
    culprit.failed("http://a", "status_500")
    culprit.failed("http://a", "upstream_disconnected")  # the same server again: still one
    assert not suspects.judged(culprit) and not suspects.crashes(culprit)
    culprit.failed("http://b", "status_500")
    assert suspects.judged(culprit) and culprit.servers == ["http://a", "http://b"]
    assert not suspects.crashes(culprit)  # only one of them dropped it
    culprit.failed("http://c", "upstream_disconnected")
    assert suspects.crashes(culprit)
    assert not Suspects(0, 60.0).judged(culprit) and not Suspects(0, 60.0).crashes(culprit)


def test_a_refused_request_is_forgotten_after_its_time() -> None:
    clock = Clock()
    suspects = Suspects(2, 60.0, clock=clock)
    key = request_key("/v1/chat/completions", b'{"x": 1}')
    assert not suspects.any()
    suspects.refuse(key)
    assert suspects.any() and suspects.refuses(key)
    assert not suspects.refuses(request_key("/v1/chat/completions", b'{"x": 2}'))
    clock.now += 61
    assert not suspects.any() and not suspects.refuses(key)


def test_absolving_takes_back_exactly_a_judged_requests_failures() -> None:
    clock = Clock()
    fleet, pools = fleet_of(3, 1)
    outliers = detector(pools, fleet, clock)
    outliers.suspects = Suspects(2, 60.0, clock=clock)
    a, b, c = pools[0].instances
    bad, other = Culprit(), Culprit()
    for _ in range(3):
        outliers.failed(a, "first_token_timeout")  # a's own failures: they stay
    outliers.failed(a, "status_500", other)
    outliers.failed(a, "status_500", bad)  # a's fifth: ejected, by the bad request's failure
    assert outliers.state_of(a.url)["state"] == EJECTED
    outliers.failed(b, "status_500", bad)
    assert outliers.state_of(b.url)["consecutive_failures"] == 1
    assert outliers.absolve(other) == []  # failed on one server only: not judged
    assert outliers.absolve(bad) == [a.url, b.url]
    # Four failures without it are below the threshold: half-open, as after any ejection
    assert outliers.state_of(a.url)["state"] == PROBING and a.healthy
    assert outliers.state_of(a.url)["ejections"] == 0
    assert outliers.state_of(b.url)["consecutive_failures"] == 0
    # A copy of the same body is another request: its failure on c, served elsewhere, stands.
    copy = Culprit()
    outliers.failed(c, "status_500", copy)
    outliers.failed(c, "status_500", bad)
    outliers.absolve(copy)
    assert outliers.state_of(c.url)["consecutive_failures"] == 2
    outliers.absolve(bad)
    assert outliers.state_of(c.url)["consecutive_failures"] == 1


def test_a_sick_servers_count_is_not_taken_back_by_requests_another_server_served() -> None:
    clock = Clock()
    fleet, pools = fleet_of(3, 1)
    outliers = detector(pools, fleet, clock)
    outliers.suspects = Suspects(2, 60.0, clock=clock)
    sick, _, other = pools[0].instances
    for _ in range(4):  # the same body each time, served by another server after failing here
        outliers.failed(sick, "status_500", Culprit())
    unlucky = Culprit()  # then one that also failed on another server and ended unanswered
    outliers.failed(sick, "status_500", unlucky)
    outliers.failed(other, "status_500", unlucky)
    assert outliers.state_of(sick.url)["state"] == EJECTED
    outliers.absolve(unlucky)
    assert outliers.state_of(sick.url)["state"] == PROBING  # four below the threshold: one probe
    outliers.failed(sick, "status_500", Culprit())  # the probe fails: ejected again
    assert outliers.state_of(sick.url)["state"] == EJECTED


def test_the_requests_behind_a_count_are_bounded_when_no_ejection_is_allowed() -> None:
    clock = Clock()
    fleet, pools = fleet_of(1, 0)
    outliers = detector(pools, fleet, clock)
    (only,) = pools[0].instances
    for _ in range(1000):  # the fleet's last server: never ejected
        outliers.failed(only, "status_500", Culprit())
    assert outliers.state_of(only.url)["state"] == "ok"
    assert len(outliers.records[only.url].run) == 5


# -- through the proxy, with the OpenAI SDK ----------------------------------------------------


@pytest.mark.parametrize("judged", [True, False])
def test_requests_that_fail_every_server_do_not_eject_them(judged: bool) -> None:
    with (
        FaultServer(f"poison:{POISON}") as a,
        FaultServer(f"poison:{POISON}") as b,
        FaultServer(f"poison:{POISON}") as c,
        running_proxy(
            spec_urls=[a.url, b.url],
            base_urls=[c.url],
            policy="spec",
            query_of_death_servers=2 if judged else 0,
        ) as proxy,
    ):
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none")  # the SDK's own retries on
        for i in range(6):
            with pytest.raises(openai.InternalServerError):
                client.chat.completions.create(model="m", messages=poison(i), max_tokens=8)
        state = httpx.get(proxy.url + "/v1/specroute/state", timeout=5).json()
        outlier_states = [i["outlier"]["state"] for p in state["pools"].values() for i in p["instances"]]
        if judged:
            assert outlier_states == ["ok", "ok", "ok"], outlier_states
            assert all(
                i["outlier"]["consecutive_failures"] == 0 for p in state["pools"].values() for i in p["instances"]
            )
        else:  # counted against the servers, six bad inputs eject healthy ones
            assert "ejected" in outlier_states, outlier_states
        answer = client.chat.completions.create(model="m", messages=ok_messages(), max_tokens=8)
        assert answer.choices[0].message.content
        wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")


def test_a_request_that_drops_two_servers_is_not_sent_to_a_third_nor_taken_again() -> None:
    with (
        FaultServer(f"poisondrop:{POISON}") as a,
        FaultServer(f"poisondrop:{POISON}") as b,
        FaultServer(f"poisondrop:{POISON}") as c,
        running_proxy(spec_urls=[a.url, b.url], base_urls=[c.url], policy="spec") as proxy,
    ):
        servers = (a, b, c)

        def poisons_received() -> int:
            return sum(1 for s in servers for r in s.requests if POISON.encode() in r.body)

        client = openai.OpenAI(base_url=proxy.base_url, api_key="none")  # the SDK's own retries on
        with pytest.raises(openai.APIStatusError) as first:
            client.chat.completions.create(model="m", messages=poison(0), max_tokens=8)
        assert first.value.status_code == 502
        assert first.value.response.headers["x-should-retry"] == "false"
        assert poisons_received() == 2  # two servers dropped it: the third never got it
        with pytest.raises(openai.APIStatusError) as again:
            client.chat.completions.create(model="m", messages=poison(0), max_tokens=8)
        assert again.value.status_code == 502
        assert again.value.code == "request_fails_servers"
        assert again.value.response.headers["x-should-retry"] == "false"
        assert poisons_received() == 2
        # Another request, even with the same bad word, is its own: tried as usual.
        with pytest.raises(openai.APIStatusError):
            client.chat.completions.create(model="m", messages=poison(1), max_tokens=8)
        assert poisons_received() == 4
        answer = client.chat.completions.create(model="m", messages=ok_messages(), max_tokens=8)
        assert answer.choices[0].message.content
        state = httpx.get(proxy.url + "/v1/specroute/state", timeout=5).json()
        assert all(i["outlier"]["state"] == "ok" for p in state["pools"].values() for i in p["instances"])
        wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")


def test_a_request_that_crashes_a_server_on_a_kept_alive_connection_is_not_taken_to_a_third() -> None:
    """A request on a pooled connection its server closed unanswered is sent once more on a new
    connection (a keep-alive close crossing it); a server that crashed on it refuses that one,
    and the first failure is what counts: before, the refusal read as `connect`, no server was
    counted as dropping the request, and it crashed every server of both pools."""
    with (
        FaultServer(f"poisondie:{POISON}") as a,
        FaultServer(f"poisondie:{POISON}") as b,
        FaultServer(f"poisondie:{POISON}") as c,
        running_proxy(spec_urls=[a.url, b.url], base_urls=[c.url], policy="spec") as proxy,
    ):
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        for _ in range(4):  # pooled connections to the spec servers
            assert client.chat.completions.create(model="m", messages=ok_messages(), max_tokens=8).choices
        with pytest.raises(openai.APIStatusError) as crashed:
            client.chat.completions.create(model="m", messages=poison(0), max_tokens=8)
        assert crashed.value.status_code == 502
        received = [sum(1 for r in s.requests if POISON.encode() in r.body) for s in (a, b, c)]
        assert received == [1, 1, 0], received
        assert proxy.app.upstream.resent >= 1  # the warm connection's close was resent, and refused
        wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")


def test_a_request_another_server_serves_still_counts_against_the_server_that_failed_it() -> None:
    with (
        FaultServer("status:500") as sick,
        FaultServer("echo") as well,
        running_proxy(spec_urls=[sick.url], base_urls=[well.url], policy="spec") as proxy,
    ):
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        for _ in range(2):  # the same body each time: remembered, but served elsewhere
            answer = client.chat.completions.create(model="m", messages=ok_messages(), max_tokens=8)
            assert answer.choices[0].message.content
        state = httpx.get(proxy.url + "/v1/specroute/state", timeout=5).json()
        assert state["pools"]["spec"]["instances"][0]["outlier"]["consecutive_failures"] == 2


def test_a_request_after_a_servers_500_does_not_meet_the_connection_it_then_closed() -> None:
    # A uvicorn server (SGLang, vLLM) closes its connection after answering an exception's 500;
    # the pooled connection must not carry the next request into that reset.
    with (
        FaultServer(f"poison500close:{POISON}") as spec,
        FaultServer("echo") as base,
        running_proxy(spec_urls=[spec.url], base_urls=[base.url], policy="spec") as proxy,
    ):
        client = openai.OpenAI(
            base_url=proxy.base_url, api_key="none", max_retries=0, default_headers={"x-specroute-pool": "spec"}
        )
        for i in range(3):
            with pytest.raises(openai.InternalServerError):
                client.chat.completions.create(model="m", messages=poison(i), max_tokens=8)
            answer = client.chat.completions.with_raw_response.create(model="m", messages=ok_messages(), max_tokens=8)
            assert answer.headers["x-specroute-backend"] == "spec-0"
            assert answer.parse().choices[0].message.content


@pytest.mark.parametrize("max_attempts", [3, 1])
def test_bad_inputs_pinned_to_a_lone_server_do_not_eject_it(max_attempts: int) -> None:
    """A request pinned by its client to a pool of one server can fail on no second server, so the
    rule could never judge it: one client's bad inputs sent so ejected the server, and each
    half-open probe it then sent kept it out (a review). A request that failed so on every
    server it could be sent to is not held against them (with one attempt allowed too: a
    review found the first version judged it only once a further attempt found no server)."""
    with (
        FaultServer(f"poison:{POISON}") as lone,
        FaultServer("echo") as base,
        running_proxy(spec_urls=[lone.url], base_urls=[base.url], policy="base", max_attempts=max_attempts) as proxy,
    ):
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        for i in range(6):
            with pytest.raises(openai.InternalServerError):
                client.chat.completions.create(
                    model="m", messages=poison(i), max_tokens=8, extra_headers={"x-specroute-pool": "spec"}
                )
        shown = httpx.get(proxy.url + "/v1/specroute/state", timeout=5).json()["pools"]["spec"]["instances"][0]
        assert shown["outlier"]["state"] == "ok" and shown["outlier"]["consecutive_failures"] == 0, shown["outlier"]
        answer = client.chat.completions.with_raw_response.create(
            model="m", messages=ok_messages(), max_tokens=8, extra_headers={"x-specroute-pool": "spec"}
        )
        assert answer.headers["x-specroute-backend"] == "spec-0"
        wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")
