"""End to end over HTTP: the OpenAI SDK -> the proxy (goodput policy) -> a spec and a base twin.

A load ramp moves traffic from spec to base and back, and the override header is obeyed. The
twins run 2x faster than the H200 they model: at 10x, CPU contention on a loaded test machine,
rather than the profile, could set the chunk gaps the cost model learns from, and one CI run saw
the router keep preferring base after the burst. The spec twin's running cap is lowered to 8 so
a small burst fills it.
"""

import asyncio

import httpx
import openai
import pytest
from proxy_harness import running_proxy

from sim.testing import TwinSpec, twins, wait_for

TIME_SCALE = 2.0
SPEC_CAP = 8


@pytest.fixture(scope="module")
def fleet():
    common = ("--output-len", "fixed:4096")
    with twins(
        TwinSpec("spec", time_scale=TIME_SCALE, seed=5, args=common + ("--max-running-requests", str(SPEC_CAP))),
        TwinSpec("base", time_scale=TIME_SCALE, seed=6, args=common),
    ) as (spec, base):
        with running_proxy(
            spec_urls=[spec.url],
            base_urls=[base.url],
            policy="goodput",
            poll_interval_ms=20,
            stale_ms=3000,
            profile="h200-llama8b",
        ) as proxy:
            yield proxy, spec


async def ask(
    client: openai.AsyncOpenAI, max_tokens: int, headers: dict[str, str] | None = None, parse: bool = True
) -> tuple[str, str]:
    """One streamed chat completion; returns the (pool, reason) the proxy answered with.

    Without `parse` the stream's SSE lines are read through the SDK's HTTP stack but not made
    into chunk objects: the SDK spends about 0.3 ms of CPU on each, and a burst's 12,000 chunks
    held this process's event loop for up to 3.9 s at a time on two cores (the watcher below took
    4-5 samples in the whole burst, and its idle keep-alive connection outlived the twin's 5 s)."""
    async with client.chat.completions.with_streaming_response.create(
        model="twin",
        messages=[{"role": "user", "content": "Tell me about routing."}],
        max_tokens=max_tokens,
        stream=True,
        extra_headers=headers or {},
    ) as response:
        pool, reason = response.headers["x-specroute-pool"], response.headers["x-specroute-reason"]
        if parse:
            chunks = [chunk async for chunk in await response.parse()]
            assert chunks, "the stream carried no chunks"
        else:
            events = [line async for line in response.iter_lines() if line.startswith("data: ")]
            assert len(events) > 1 and events[-1] == "data: [DONE]", events[-3:]
    return pool, reason


async def watch_spec(url: str, samples: list[int], stop: asyncio.Event) -> None:
    """Sample the spec twin's own running + waiting count until told to stop."""
    async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
        while not stop.is_set():
            load = (await client.get(url + "/v1/loads")).json()["loads"][0]
            samples.append(load["num_running_reqs"] + load["num_waiting_reqs"])
            await asyncio.sleep(0.005)


def quiet(proxy) -> bool:
    pools = httpx.get(proxy.url + "/v1/specroute/state", timeout=5).json()["pools"]
    return all(i["running"] + i["waiting"] == 0 for p in pools.values() for i in p["instances"])


def test_a_load_ramp_moves_traffic_to_base_and_back(fleet):
    proxy, spec = fleet
    samples: list[int] = []

    async def scenario():
        async with openai.AsyncOpenAI(base_url=proxy.base_url, api_key="none", max_retries=0, timeout=60) as client:
            before = [await ask(client, 32) for _ in range(3)]
            # The burst: 24 long streams at once. Dispatches are counted the moment they are sent,
            # so the spec twin's cap is seen before any poll reports it.
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch_spec(spec.url, samples, stop))
            burst = await asyncio.gather(*(ask(client, 600, parse=False) for _ in range(24)))
            stop.set()
            await watcher
            await asyncio.to_thread(wait_for, lambda: quiet(proxy), "the burst to drain", 30)
            after = [await ask(client, 32) for _ in range(3)]
            return before, burst, after

    before, burst, after = asyncio.run(scenario())
    assert [p for p, _ in before] == ["spec"] * 3, before
    to_base = [r for p, r in burst if p == "base"]
    assert len(to_base) >= len(burst) - 2 * SPEC_CAP, burst  # the overflow went to base
    assert set(to_base) <= {"spec-full", "base-sooner"}, burst
    assert samples and max(samples) <= SPEC_CAP  # never queued on spec past its cap
    assert [p for p, _ in after] == ["spec"] * 3, after
    state = httpx.get(proxy.url + "/v1/specroute/state", timeout=5).json()
    assert state["policy"] == "goodput"
    last = state["decisions"][-1]
    assert last["pool"] == "spec" and "t_spec_s" in last["scores"] and "spec.load" in last["scores"]
    assert state["cost_model"]["decode_step_ms"]["spec"]["1"] > 0
    # The streams just served taught it: its latest observation is seconds old, not a lull's.
    assert 0 <= state["cost_model"]["observed_age_s"] < state["cost_model"]["half_life_s"]
    # Every stream's TPOT against the TPOT its decision predicted (the proxy asked for the
    # usage these clients did not): spec's are counted, and base's.
    spec_pool, base_pool = state["pools"]["spec"], state["pools"]["base"]
    assert spec_pool["tpot_outcomes"] >= len(before) + len(after)
    # Below the minimum the median is taken in proportion to the outcomes (fleet/outcomes.py): the
    # twin's TPOT is within 3x of the prediction, so the bias moves at most 2 x n / min from 1.
    n, least = spec_pool["tpot_outcomes"], spec_pool["tpot_outcomes_min"]
    assert n < least and abs(spec_pool["tpot_bias"] - 1) <= 2 * n / least
    assert base_pool["tpot_outcomes"] >= len(to_base) > 0
    # No SLO targets here: nothing is counted against them (fleet/attainment.py).
    assert spec_pool["slo_met_per_s"] is None and base_pool["slo_met_share"] is None


def test_the_override_header_is_obeyed(fleet):
    proxy, _ = fleet

    async def scenario():
        async with openai.AsyncOpenAI(base_url=proxy.base_url, api_key="none", max_retries=0, timeout=60) as client:
            forced = await ask(client, 16, {"x-specroute-pool": "base"})
            auto = await ask(client, 16, {"x-specroute-pool": "auto"})
            with pytest.raises(openai.BadRequestError) as bad:
                await ask(client, 16, {"x-specroute-pool": "gpu-9"})
            return forced, auto, bad.value

    forced, auto, bad = asyncio.run(scenario())
    assert forced == ("base", "override")
    assert auto[0] == "spec" and auto[1] != "override"
    assert "x-specroute-pool" in str(bad)
