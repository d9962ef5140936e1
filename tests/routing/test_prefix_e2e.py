"""End to end over HTTP: the OpenAI SDK -> the proxy (goodput) -> two spec and two base twins
with their prefix caches reporting (--enable-cache-report).

A multi-turn conversation whose turns extend each other (several 256-token blocks each) stays on
the instance that holds its prefix, by the prefix index alone, and its later turns find their
prefix cached there; once that instance's running slots are full, the next turn goes elsewhere.
Short turns, below one block, stay together only when the client names the session
(prompt_cache_key). The spec twins' running cap is 3, so three long requests sent to a twin
directly fill it. Twins run 2x faster than the H200 they model (as test_routing_e2e).
"""

from __future__ import annotations

import contextlib
import random
from typing import Any

import httpx
import openai
import pytest
from proxy_harness import running_proxy

from sim.testing import TwinSpec, twins, wait_for

TIME_SCALE = 2.0
SPEC_CAP = 3
WORDS = "route cache prefix block token server batch draft verify accept queue decode prefill".split()


@pytest.fixture(scope="module")
def fleet():
    common = ("--enable-cache-report", "--output-len", "fixed:64")
    spec_args = common + ("--max-running-requests", str(SPEC_CAP))
    with twins(
        TwinSpec("spec", time_scale=TIME_SCALE, seed=11, args=spec_args),
        TwinSpec("spec", time_scale=TIME_SCALE, seed=12, args=spec_args),
        TwinSpec("base", time_scale=TIME_SCALE, seed=13, args=common + ("--max-running-requests", "8")),
        TwinSpec("base", time_scale=TIME_SCALE, seed=14, args=common + ("--max-running-requests", "8")),
    ) as (spec0, spec1, base0, base1):
        with running_proxy(
            spec_urls=[spec0.url, spec1.url],
            base_urls=[base0.url, base1.url],
            policy="goodput",
            poll_interval_ms=20,
            stale_ms=3000,
            profile="h200-llama8b",
        ) as proxy:
            yield proxy


def text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


def state(proxy) -> dict[str, Any]:
    return httpx.get(proxy.url + "/v1/specroute/state", timeout=5).json()


def instances(proxy) -> dict[str, dict[str, Any]]:
    """The state's instances by name (spec-0, base-1, ...)."""
    return {i["name"]: i for pool in state(proxy)["pools"].values() for i in pool["instances"]}


def turn(client: openai.OpenAI, messages: list[dict[str, str]], **extra: Any) -> tuple[str, str, Any]:
    """One streamed chat turn with its usage: (backend name, its answer, the usage)."""
    with client.chat.completions.with_streaming_response.create(
        model="twin",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    ) as response:
        backend = response.headers["x-specroute-backend"]
        chunks = list(response.parse())
    answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage is not None and answer, "the stream carried no usage or no text"
    return backend, answer, usage


@contextlib.contextmanager
def saturated(url: str, count: int):
    """`count` long ignore_eos streams sent to the twin at `url` directly, open for the block
    (closing them aborts them there)."""
    body = {
        "model": "twin",
        "messages": [{"role": "user", "content": "keep busy"}],
        "max_tokens": 20000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=30, trust_env=False) as client, contextlib.ExitStack() as streams:
        for _ in range(count):
            response = streams.enter_context(client.stream("POST", url + "/v1/chat/completions", json=body))
            assert response.status_code == 200
        yield


def test_a_conversation_stays_on_the_instance_holding_its_prefix_until_that_one_is_full(fleet):
    proxy = fleet
    rng = random.Random(7)
    messages = [
        {"role": "system", "content": text(rng, 4000)},
        {"role": "user", "content": text(rng, 1200)},
    ]
    client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0, timeout=60)
    backends: list[str] = []
    usages = []
    for _ in range(4):
        backend, answer, usage = turn(client, messages)
        backends.append(backend)
        usages.append(usage)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": text(rng, 600)}]
    home = backends[0]
    assert home.startswith("spec-"), backends  # an idle fleet: the spec pool
    assert backends == [home] * 4, backends
    # The first turn found nothing; each later one its predecessor's whole prompt (the twin caches
    # every prompt token it computed and none of the generated ones).
    assert not usages[0].prompt_tokens_details or not usages[0].prompt_tokens_details.cached_tokens
    for before, after in zip(usages, usages[1:]):
        assert after.prompt_tokens_details is not None
        assert after.prompt_tokens_details.cached_tokens >= before.prompt_tokens, (before, after)
    assert usages[0].prompt_tokens > 1200  # several 256-token blocks
    # The router credited the home instance, named it, sent the turns there, and learned from its
    # reports (read from the stream's usage tail; the proxy reads it once the client has it all).
    # The first turn's miss is SGLang's null, a report only from a server seen to report (the
    # turns after it): three reports.
    wait_for(lambda: reported(proxy, home) >= 3, "the proxy to read the last turn's usage", timeout=10)
    seen = state(proxy)
    turns = seen["decisions"][-3:]
    by_name = instances(proxy)
    home_url = by_name[home]["url"]
    for decision in turns:
        assert decision["instance"] == home_url and decision["chosen"] == home_url, decision
        assert decision["cached_tokens"] > 1024 and decision["cached"][home_url] == decision["cached_tokens"]
        assert decision["scores"]["cached_spec_tokens"] == decision["cached_tokens"]
    prefix = by_name[home]["prefix"]
    assert prefix["blocks"] >= usages[-1].prompt_tokens // 256 - 1
    assert prefix["reported_responses"] >= 3 and prefix["reported_cached_tokens"] > 0
    assert 0 < prefix["reported_hit_rate"] < 1 and prefix["trust"] > 0.9
    assert prefix["credited_tokens"] > 0
    assert seen["prefix"]["block_tokens"] == 256 and seen["prefix"]["entries"] >= prefix["blocks"]
    others = [i for name, i in by_name.items() if name != home]
    assert all(i["prefix"]["blocks"] == 0 for i in others)
    # Metrics: credited and reported cached tokens of the spec pool.
    metrics = httpx.get(proxy.url + "/metrics", timeout=5).text
    assert metric(metrics, 'specroute_prefix_credited_tokens_total{pool="spec"}') > 0
    assert metric(metrics, 'specroute_prefix_cached_tokens_total{pool="spec"}') >= sum(
        u.prompt_tokens_details.cached_tokens for u in usages[1:]
    )

    # The home instance fills up (requests the router did not send, seen by its polls): the next
    # turn goes elsewhere, though the home instance still holds its prefix.
    with saturated(home_url, SPEC_CAP):
        wait_for(
            lambda: instances(proxy)[home]["running"] + instances(proxy)[home]["waiting"] >= SPEC_CAP,
            "the router to see the home instance full",
            timeout=15,
        )
        moved, _, usage = turn(client, messages)
    assert moved != home, (home, moved)
    last = state(proxy)["decisions"][-1]
    assert last["instance"] != home_url and last["cached"].get(home_url, 0) > 1024, last
    assert usage.prompt_tokens_details is None  # nothing cached there: SGLang leaves the 0 out


def test_short_turns_stay_together_only_when_the_session_is_named(fleet):
    proxy = fleet
    client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0, timeout=60)
    rng = random.Random(3)
    # Below one block: the prefix index cannot see them, least-loaded ties rotate. Each turn is
    # sent once the router sees the fleet idle again (a user's think time), so that load, which
    # outweighs a credit this small, is equal everywhere.
    unnamed = []
    for _ in range(6):
        unnamed.append(turn(client, [{"role": "user", "content": text(rng, 400)}])[0])
        wait_for(lambda: quiet(proxy), "the fleet to be idle", timeout=10)
    assert len(set(unnamed)) >= 2, unnamed
    named: list[str] = []
    messages = [{"role": "user", "content": text(rng, 400)}]
    for _ in range(4):
        backend, answer, _ = turn(client, messages, prompt_cache_key="conversation-42")
        named.append(backend)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": text(rng, 100)}]
        wait_for(lambda: quiet(proxy), "the fleet to be idle", timeout=10)
    assert named == [named[0]] * 4, named
    assert state(proxy)["prefix"]["sessions"] >= 1
    # The header names a session too, and wins; a bad one is an OpenAI-shaped 400 naming it.
    headed, _, _ = turn(
        client, messages, prompt_cache_key="another", extra_headers={"x-specroute-session": "conversation-42"}
    )
    assert headed == named[0]
    with pytest.raises(openai.BadRequestError) as bad:
        turn(client, messages, extra_headers={"x-specroute-session": "not valid"})
    assert "x-specroute-session" in str(bad.value) and "not valid" not in str(bad.value)
    assert bad.value.body["param"] == "x-specroute-session"  # type: ignore[index]


def quiet(proxy) -> bool:
    """Whether the router sees nothing running or waiting anywhere."""
    return all(i["running"] + i["waiting"] == 0 for i in instances(proxy).values())


def reported(proxy, name: str) -> int:
    return instances(proxy)[name]["prefix"]["reported_responses"]


def metric(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} not in /metrics")
