"""Acceptance per workload over HTTP: the OpenAI SDK -> the proxy (goodput) -> a spec twin that
accepts code far better than chat (--workload-alpha) and a base twin.

The proxy learns each x-specroute-workload key's acceptance from its streams, shows the keys on
the state endpoint, and with the spec twin loaded sends code there while chat goes to base. A bad
key is a 400 like the other routing headers. The acceptance half-life is raised to a minute so
the warm-up's evidence is still there when the burst runs (at 1.5 s it would fade into the
pool's estimate within seconds of the last finished stream).
"""

import asyncio
import json

import httpx
import openai
import pytest
from proxy_harness import running_proxy

from proxy.routing import RoutingInputError, read_workload
from sim.testing import TwinSpec, twins

TIME_SCALE = 2.0
BURST = 18
"""Long requests pinned to spec. With them decoding, a 300-token request is predicted 0.39-0.41 s
on spec against 0.69-0.75 s on base for code (accept length 3.2), and 0.80-0.83 s on spec for
chat (1.25) before what joining costs the burst (0.10-0.17 s more): chat's own time on spec is
the longer one. (At chat 0.3 its own times tied, 0.70 s each way, and the decision rested on that
cost alone, which moved with spec's prefill as learned then, a seventh of the twin's in most
runs: 2 runs in 10 sent chat to spec.) 5 runs each.

They are not streamed: 24 streams' chunks kept this test's own event loop (and the proxy's)
busy on two cores, so the two asks came up to 5.7 s after the burst instead of 0.3 s, after much
of it had finished, and the chunk gaps the proxy learns spec's step time from were the client's
(CI failed so). The asks wait for the burst to be running, not waiting for its prefill: what
joining costs the requests there is counted only for those decoding."""


@pytest.fixture(scope="module")
def fleet():
    lengths = ("--output-len", "fixed:4096")  # every stream runs to its max_tokens
    with twins(
        TwinSpec("spec", time_scale=TIME_SCALE, seed=5, args=("--workload-alpha", "code=0.85,chat=0.2", *lengths)),
        TwinSpec("base", time_scale=TIME_SCALE, seed=6, args=lengths),
    ) as (spec, base):
        with running_proxy(
            spec_urls=[spec.url],
            base_urls=[base.url],
            policy="goodput",
            poll_interval_ms=20,
            stale_ms=3000,
            profile="h200-llama8b",
            acceptance_half_life_s=60.0,
        ) as proxy:
            yield proxy


async def ask(client: openai.AsyncOpenAI, max_tokens: int, headers: dict[str, str]) -> tuple[str, str]:
    """One streamed chat completion; the (pool, reason) the proxy answered with."""
    async with client.chat.completions.with_streaming_response.create(
        model="twin",
        messages=[{"role": "system", "content": "secret system words"}, {"role": "user", "content": "Hello."}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},  # the usage tail is the proxy's acceptance evidence
        extra_headers=headers,
    ) as response:
        pool, reason = response.headers["x-specroute-pool"], response.headers["x-specroute-reason"]
        assert [chunk async for chunk in await response.parse()]
    return pool, reason


async def spec_running(proxy, count: int, timeout_s: float = 30.0) -> None:
    """Until the proxy's last reading of the spec pool shows `count` requests running (decoding:
    while they wait for their prefill, joining them costs them nothing the policy counts)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with httpx.AsyncClient(timeout=5) as http:
        while True:
            pool = (await http.get(proxy.url + "/v1/specroute/state")).json()["pools"]["spec"]
            running = sum(instance["running"] for instance in pool["instances"])
            if running >= count:
                return
            assert asyncio.get_running_loop().time() < deadline, f"spec shows {running} of {count} after {timeout_s} s"
            await asyncio.sleep(0.02)


def test_code_stays_on_spec_where_chat_goes_to_base(fleet):
    proxy = fleet

    async def scenario():
        async with openai.AsyncOpenAI(base_url=proxy.base_url, api_key="none", max_retries=0, timeout=60) as client:
            for _ in range(6):  # evidence: streams of each workload on spec, a few on base
                for workload in ("code", "chat"):
                    await ask(client, 300, {"x-specroute-workload": workload, "x-specroute-pool": "spec"})
                await ask(client, 300, {"x-specroute-pool": "base"})
            state = httpx.get(proxy.url + "/v1/specroute/state", timeout=5).json()
            # The burst: long requests pinned to spec load it; once the proxy sees them running,
            # one of each workload asks.
            burst = [
                asyncio.create_task(
                    client.chat.completions.create(
                        model="twin",
                        messages=[{"role": "user", "content": "Go on."}],
                        max_tokens=3000,
                        extra_headers={"x-specroute-workload": "bulk", "x-specroute-pool": "spec"},
                    )
                )
                for _ in range(BURST)
            ]
            await spec_running(proxy, BURST)
            code, chat = await asyncio.gather(
                ask(client, 300, {"x-specroute-workload": "code"}), ask(client, 300, {"x-specroute-workload": "chat"})
            )
            asks = httpx.get(proxy.url + "/v1/specroute/state", timeout=5).json()["decisions"][-2:]
            for task in burst:
                task.cancel()
            await asyncio.gather(*burst, return_exceptions=True)
            return state, code, chat, asks

    state, code, chat, asks = asyncio.run(scenario())
    rows = {row["key"]: row for row in state["acceptance"]["workloads"]["top"]}
    assert {"code", "chat"} <= rows.keys()
    pooled = state["acceptance"]["alpha"]
    # Each key's own accept length is its twin's (code 0.85: 3.2 tokens a step, chat 0.2: 1.25),
    # and what it is routed on lies between that and the pool's (shrunk by its evidence).
    assert rows["code"]["own_accept_length"] > 2.7 and rows["chat"]["own_accept_length"] < 1.45, rows
    assert rows["code"]["alpha"] > pooled + 0.1 > pooled - 0.1 > rows["chat"]["alpha"], (pooled, rows)
    assert "secret" not in str(state)
    # On a miss, the two decisions' scores say which term moved.
    assert code[0] == "spec", json.dumps([code, chat, asks])
    assert chat[0] == "base", json.dumps([code, chat, asks])


def test_a_bad_workload_key_is_a_400(fleet):
    proxy = fleet

    async def scenario():
        async with openai.AsyncOpenAI(base_url=proxy.base_url, api_key="none", max_retries=0, timeout=60) as client:
            errors = []
            for bad in ("x" * 65, "two words"):
                with pytest.raises(openai.BadRequestError) as caught:
                    await ask(client, 8, {"x-specroute-workload": bad})
                errors.append(caught.value)
            return errors

    for error in asyncio.run(scenario()):
        assert error.status_code == 400
        assert "x-specroute-workload" in str(error)
        assert isinstance(error.body, dict) and error.body.get("param") == "x-specroute-workload"


def test_read_workload_takes_a_short_printable_key():
    assert read_workload({}) is None
    assert read_workload({"x-specroute-workload": " code-review/v2 "}) == "code-review/v2"
    assert read_workload({"x-specroute-workload": "k" * 64}) == "k" * 64
    for bad in ("", "k" * 65, "a b", "caf\u00e9", "tab\there", "nul\x00"):
        with pytest.raises(RoutingInputError) as caught:
            read_workload({"x-specroute-workload": bad})
        assert caught.value.header == "x-specroute-workload" and "printable" in str(caught.value)
