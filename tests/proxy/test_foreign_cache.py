"""A server that holds prompts the router never credited says so in the state endpoint.

The prompts were sent before the proxy started (by this proxy before a restart, or by another
client), so the server's prefix cache has them and its prefill counters, read from the proxy's
start, count almost nothing for them; the router, which did not send them, takes them as
uncached. The fleet model reads the prefill
it learns from that share (docs/routing.md, "What is learned"), and `GET /v1/specroute/state`
shows it per instance as `prefilled_share`: here well under 1 on the warmed server, 1 on the
other, to which only new prompts went.
"""

from __future__ import annotations

import httpx
import openai
from proxy_harness import running_proxy

from sim.testing import RunningTwin, wait_for

PROMPTS = 6


def prompt(n: int) -> str:
    """About 2,000 tokens, different from the first word on (no prefix shared between them)."""
    return f"conversation {n}: " + " ".join(f"w{n}x{i}" for i in range(1500))


def ask(client: openai.OpenAI, text: str, pool: str | None = None) -> None:
    headers = {"x-specroute-pool": pool} if pool else {}
    client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": text}], max_tokens=1, extra_headers=headers
    )


def share(proxy_url: str, pool: str) -> float:
    state = httpx.get(proxy_url + "/v1/specroute/state", timeout=5).json()
    (instance,) = state["pools"][pool]["instances"]
    return instance["prefilled_share"]


def test_prompts_cached_before_the_proxy_started_show_as_a_low_prefilled_share(
    twin_pair: tuple[RunningTwin, RunningTwin],
) -> None:
    spec, base = twin_pair
    direct = openai.OpenAI(base_url=base.url + "/v1", api_key="none", max_retries=0, timeout=30)
    for n in range(PROMPTS):
        ask(direct, prompt(n))  # before this proxy's time: base caches them
    with running_proxy(spec_urls=[spec.url], base_urls=[base.url]) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0, timeout=30)
        assert share(proxy.url, "base") == 1.0  # nothing known yet
        for n in range(PROMPTS):
            ask(client, prompt(n), "base")  # uncached as far as the proxy knows
            ask(client, prompt(1000 + n), "spec")  # a new prompt: spec prefills all of it
        wait_for(lambda: share(proxy.url, "base") < 0.3, "base's counters to show its cached prompts", timeout=15)
        # Spec's counters catch up with its last prefills at its next published snapshot and poll
        # (asserted at once, the share read 0.33 on 3 of 6 runs).
        wait_for(lambda: share(proxy.url, "spec") > 0.8, "spec's counters to show what it prefilled", timeout=15)
