"""Admission control over HTTP: a refused request gets a fast OpenAI-shaped 429 with retry-after,
which the SDK knows, and never reaches a server; the proxy's own open requests are bounded."""

from __future__ import annotations

import threading
import time

import httpx
import openai
from proxy_harness import RunningProxy, running_proxy, wait_for

from bench.admission import evaluate

MESSAGES = [{"role": "user", "content": "Say hi."}]


def dispatched(proxy: RunningProxy) -> int:
    return sum(i.dispatched_total for i in proxy.app.router.instances())


def test_a_request_the_fleet_cannot_serve_in_time_gets_a_429_with_retry_after(twin_pair) -> None:
    spec, base = twin_pair
    # A token every millisecond is beyond any decode step: every request is refused. (A first
    # token target beyond any prefill refuses nothing on an idle fleet: a prompt whose own prefill
    # is past it is held to its prefill plus as much wait, tests/policies/test_policy_admission.py.)
    with running_proxy(
        spec_urls=[spec.url], base_urls=[base.url], profile="h200-llama8b", admission_tpot_ms=1.0
    ) as proxy:
        wait_for(lambda: proxy.app.router.snapshot().pools["spec"].age_s < 1, what="a load reading")
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        try:
            client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, stream=True)
            raise AssertionError("admitted")
        except openai.RateLimitError as refused:
            assert refused.status_code == 429 and refused.code == "fleet_overloaded"
            assert int(refused.response.headers["retry-after"]) >= 1
            assert "predicted-tpot" in refused.message and "against 1 ms now" in refused.message
            # What refused it, in its headers and the decision log (a user's probe: they showed
            # where the request would have gone and why, spec-sooner, not why it was refused).
            assert refused.response.headers["x-specroute-reason"] == "predicted-tpot"
            state = httpx.get(proxy.url + "/v1/specroute/state", timeout=5).json()
            assert state["decisions"][-1]["refused"] == "predicted-tpot"
        raw = httpx.post(
            proxy.base_url + "/chat/completions",
            json={"model": "m", "messages": MESSAGES},
            headers={"x-specroute-class": "batch"},
        )
        assert raw.status_code == 429 and raw.json()["error"]["type"] == "rate_limit_error"
        assert dispatched(proxy) == 0 and proxy.in_flight() == 0
        # Counted apart from clients' mistakes, so that an alert can watch admission.
        metrics = httpx.get(proxy.url + "/metrics", timeout=5).text
        assert 'specroute_requests_total{outcome="refused",policy="goodput",pool="none"} 2.0' in metrics
    # Off (the default without an SLO): the same request is served.
    with running_proxy(spec_urls=[spec.url], base_urls=[base.url], profile="h200-llama8b") as proxy:
        reply = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0).chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=4
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 4


def test_an_idle_fleet_admits_again_once_an_overloads_shrink_has_faded(twin_pair) -> None:
    """The scale an overload left at its floor refuses even an idle fleet's requests; the proxy
    judges it on its own clock, so the shrink fades and the same request is served."""
    import time

    from policies.admission import MIN_SCALE, SCALE_HALF_LIFE_S

    spec, base = twin_pair
    with running_proxy(
        spec_urls=[spec.url], base_urls=[base.url], profile="h200-llama8b", admission_ttft_s=1.0, admission_tpot_ms=20
    ) as proxy:
        wait_for(lambda: proxy.app.router.snapshot().pools["spec"].age_s < 1, what="a load reading")
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        admission = proxy.app.router.admission
        assert admission is not None
        admission.scale, admission.scale_at = MIN_SCALE, time.monotonic()  # just after an overload
        try:
            client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, stream=True)
            raise AssertionError("admitted at the floor: 2 ms per token is beyond any decode step")
        except openai.RateLimitError as refused:
            assert "ms per output token" in refused.message
        admission.scale_at = time.monotonic() - 6 * SCALE_HALF_LIFE_S  # quiet since
        stream = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        state = httpx.get(proxy.url + "/v1/specroute/state", timeout=5).json()
        assert state["admission"]["scale"] > 0.9


def test_past_max_open_requests_new_requests_are_refused_at_once_and_the_open_ones_finish(twin_pair) -> None:
    spec, base = twin_pair
    with running_proxy(spec_urls=[spec.url], base_urls=[base.url], max_open_requests=2) as proxy:
        streams = [
            httpx.stream(
                "POST",
                proxy.base_url + "/chat/completions",
                timeout=30,
                json={"model": "m", "messages": MESSAGES, "max_tokens": 20000, "stream": True},
            )  # megabytes: open until read
            for _ in range(2)
        ]
        opened = [s.__enter__() for s in streams]
        try:
            assert all(r.status_code == 200 for r in opened)
            refused = httpx.post(
                proxy.base_url + "/chat/completions",
                timeout=10,
                json={"model": "m", "messages": MESSAGES, "max_tokens": 2},
            )
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_open_requests"
            assert refused.headers["retry-after"] == "1"
            bodies = []
            readers = [threading.Thread(target=lambda r=r: bodies.append(b"".join(r.iter_bytes()))) for r in opened]
            for reader in readers:
                reader.start()
            for reader in readers:
                reader.join(60)
            assert len(bodies) == 2 and all(b.rstrip().endswith(b"data: [DONE]") for b in bodies)
        finally:
            for s in streams:
                s.__exit__(None, None, None)
        wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")
        ok = httpx.post(
            proxy.base_url + "/chat/completions", timeout=10, json={"model": "m", "messages": MESSAGES, "max_tokens": 2}
        )
        assert ok.status_code == 200


def test_the_admission_evaluation_meets_its_targets_on_one_fleet() -> None:
    """bench.admission at twice the capacity on the virtual clock (one fleet, one seed)."""
    [row] = evaluate(["h200-llama8b a=0.60"], (0,))
    off, on = row["off"], row["on"]
    assert on["lost"] == 0 and off["lost"] == 0
    assert on["admitted_met"] >= 0.95 > off["admitted_met"]
    assert on["goodput_rps"] >= off["goodput_rps"]
    assert on["refused_batch"] / on["offered_batch"] > (on["refused"] - on["refused_batch"]) / (
        on["offered"] - on["offered_batch"]
    )


def test_a_streams_pace_is_judged_on_its_tokens_not_its_chunks() -> None:
    """Admission learns from each finished stream whether it met the targets: a spec stream's
    chunk carries several tokens, so the pace is per token (the usage's count when sent)."""
    from fleet.model import FleetModel
    from policies.admission import Admission
    from proxy.pools import Instance
    from proxy.routing import Attempt

    fleet = FleetModel()
    instance = Instance("http://spec", "spec", fleet.add_instance("http://spec", "spec", 48), name="spec-0")
    attempt = Attempt(fleet, instance, stream=True)
    attempt.dispatched_at -= 1.0  # dispatched a second ago, first token at 0.1 s: 0.9 s of decoding
    attempt.ttft_s = 0.1
    targets = Admission(ttft_limit_s=1.0, tpot_limit_s=0.05)
    assert attempt.met_targets(targets, 10) is False  # 10 chunks: 100 ms apart
    assert attempt.met_targets(targets, 30) is True  # 30 tokens in them: 31 ms each
    # A prompt whose own prefill alone is past the TTFT target is judged against the time its
    # prefill allows (judged against the target, its miss shrank every other request's limits).
    tight = Admission(ttft_limit_s=0.05, tpot_limit_s=0.05)
    own_s = tight.predictor.alone_prefill_ms("spec", 8192, fleet.cost.at(time.monotonic())) / 1000
    assert own_s > 0.05
    long_prompt = Attempt(fleet, instance, prompt_tokens=8192, stream=True)
    long_prompt.dispatched_at -= 1.0
    long_prompt.ttft_s = own_s + 0.02  # within its prefill and half the target
    assert long_prompt.met_targets(tight, 30) is True
    long_prompt.ttft_s = own_s + 0.04
    assert long_prompt.met_targets(tight, 30) is False
    short_prompt = Attempt(fleet, instance, prompt_tokens=10, stream=True)
    short_prompt.dispatched_at -= 1.0
    short_prompt.ttft_s = 0.1
    assert short_prompt.met_targets(tight, 30) is False


def test_a_refusal_shows_its_prediction_apart_from_the_limit() -> None:
    """A review read "first token predicted in 0.20 s against 0.2 s" (0.2049 rounded)."""
    from proxy.relay import apart

    shown = [apart(v, limit) for v, limit in ((0.2049, 0.2), (12.3456, 0.2), (50.0004, 50.0), (0.5, 0.0))]
    assert shown == ["0.205", "12.3", "50.0004", "0.5"]
    # Plain notation however large (a review saw "1.23e+03"), and a rounding that reads as the limit goes on.
    assert [apart(1234.5, 10.0), apart(2500.0, 50.0), apart(99.96, 100.0)] == ["1234", "2500", "99.96"]
