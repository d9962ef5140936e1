"""A stream the client stops reading at [DONE] is a complete response, not a disconnect.

The openai SDK closes its connection as soon as it reads `data: [DONE]`, without waiting for
the end of the chunked body. An upstream whose body ends a little after its [DONE] (here half a
second) must still have its response read to the end: its usage tail (tokens, cached tokens)
teaches the fleet model, and the request counts as answered, not as a client that left.
"""

from __future__ import annotations

import httpx
import openai
from proxy_faults import STREAM_USAGE, FaultServer
from proxy_harness import running_proxy

from sim.testing import wait_for


def test_a_client_that_leaves_at_done_does_not_cut_the_response_short():
    with (
        FaultServer("lateend:0.5") as upstream,
        FaultServer("echo") as other,
        running_proxy(spec_urls=[upstream.url], base_urls=[other.url]) as proxy,
    ):
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0, timeout=30)
        stream = client.chat.completions.create(
            model="fault",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"x-specroute-pool": "spec"},
        )
        chunks = list(stream)  # the SDK closes the connection at [DONE]
        assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens_details.cached_tokens == 32
        wait_for(lambda: proxy.in_flight() == 0, "the proxy to end the request", timeout=10)
        stats = proxy.app.router.fleet.instances[upstream.url].cache
        assert (stats.responses, stats.cached_tokens, stats.prompt_tokens) == (1, 32, 40)
        metrics = httpx.get(proxy.url + "/metrics", timeout=5).text
        cached = STREAM_USAGE["usage"]["prompt_tokens_details"]["cached_tokens"]  # type: ignore[index]
        assert f'specroute_prefix_cached_tokens_total{{pool="spec"}} {float(cached)}' in metrics
        # Every outcome's series exists from the start (at 0): this one's stays there.
        assert 'outcome="client_disconnected",policy="goodput",pool="spec"} 0.0' in metrics
        assert 'outcome="ok",policy="goodput",pool="spec"} 1.0' in metrics


def test_a_stream_closed_early_says_how_far_it_got(twin_pair, capfd) -> None:  # type: ignore[no-untyped-def]
    """From earlier notes: a stream its client closed early carried no token count (its usage
    never comes); its log line now counts the text-carrying events relayed, and one read to its
    end too (the role's opening, the finish reason's closing and the usage event count for none)."""
    import json

    spec, base = twin_pair
    with running_proxy(spec_urls=[spec.url], base_urls=[base.url], request_log=True) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0, timeout=30)
        stream = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2000,
            stream=True,
            extra_headers={"x-request-id": "left-early"},
        )
        read = 0
        for _ in stream:
            read += 1
            if read == 5:
                break
        stream.close()
        whole = list(
            client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=8,
                stream=True,
                extra_headers={"x-request-id": "read-whole"},
            )
        )
        seen: list[str] = []

        def logged() -> dict[str, dict]:
            seen.append(capfd.readouterr().out)
            lines = [json.loads(line) for line in "".join(seen).splitlines() if line.startswith("{")]
            return {line["request_id"]: line for line in lines if line["request_id"] in ("left-early", "read-whole")}

        lines = wait_for(lambda: len(logged()) == 2 and logged(), timeout=10, what="both log lines")
        left, done = lines["left-early"], lines["read-whole"]
        assert left["outcome"] == "client_disconnected" and left["completion_tokens"] is None, left
        assert 4 <= left["events"] < 2000, left
        texts = sum(any(choice.delta.content for choice in chunk.choices) for chunk in whole)
        assert 0 < texts < len(whole), whole
        assert done["outcome"] == "ok" and done["events"] == texts, (done, texts, whole)
