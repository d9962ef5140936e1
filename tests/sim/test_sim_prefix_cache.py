"""The twin's prefix cache over HTTP: a repeated prompt skips its prefill, the cached tokens are
reported as SGLang reports them, and memory pressure brings the full prefill back."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from fleet.features import count_prompt_tokens
from fleet.profile import load_profile
from sim.testing import TwinSpec, twin, twins, wait_for
from sim.tokens import prompt_token_ids

KIMI = load_profile("kimi-linear")
SCALE = 2.0  # kimi-linear prefills 0.05 ms per token: 20,000 tokens take about 1 s of simulated time


def long_text(tokens: int, salt: str) -> str:
    """Text of exactly `tokens` chunks of 4 characters, different for each salt."""
    words = " ".join(f"{salt}{i}" for i in range(tokens))
    return words[: 4 * tokens]


def body_of(messages, **kw):
    return {"model": "twin", "messages": messages, "max_tokens": 1, **kw}


def prefill_s(tokens: int, chunk: int = 8192) -> float:
    """The profile's prefill time of `tokens` uncached tokens, in chunks as the twin runs them."""
    ms = 0.0
    while tokens > 0:
        take = min(tokens, chunk)
        ms += KIMI.prefill_ms(take)
        tokens -= take
    return ms / 1000.0


def timed(t, body):
    """(response body, simulated seconds to the first token as the client saw them)."""
    started = time.monotonic()
    response = httpx.post(t.url + "/v1/chat/completions", json=body, timeout=60)
    elapsed = (time.monotonic() - started) * SCALE
    response.raise_for_status()
    return response.json(), elapsed


def metric(t, name):
    text = httpx.get(t.url + "/metrics", timeout=5).text
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return sum(float(v) for v in values) if values else None


def loads(t):
    return httpx.get(t.url + "/v1/loads", timeout=5).json()["loads"][0]


@pytest.fixture(scope="module")
def cached():
    args = ("--enable-cache-report", "--enable-metrics", "--output-len", "fixed:4")
    with twin("base", "kimi-linear", time_scale=SCALE, seed=3, args=args) as t:
        yield t


def test_a_repeated_long_prompt_skips_its_prefill(cached):
    messages = [{"role": "user", "content": long_text(19_996, "a")}]
    tokens = count_prompt_tokens({"messages": messages})
    assert tokens == 20_000
    first, ttft_first = timed(cached, body_of(messages))
    second, ttft_second = timed(cached, body_of(messages))
    assert first["usage"]["prompt_tokens_details"] is None  # SGLang leaves out a zero count
    # all but the last prompt token, whose logits give the first output token
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": tokens - 1}
    full, skipped = prefill_s(tokens), prefill_s(1)
    assert full - skipped > 0.9  # the profile's prefill it skips: 20,000 x 0.05 ms + 3 chunks
    # wall-clock TTFT (x time scale) against the profile, with room for the twin's HTTP and Python:
    # reading and counting a 20,000-token prompt took 0.12-0.13 s of wall clock (0.25 simulated)
    # on a 2-core machine, in both; their difference is the prefill skipped
    assert ttft_first == pytest.approx(full, abs=0.5)
    assert ttft_second < skipped + 0.5
    assert ttft_first - ttft_second == pytest.approx(full - skipped, abs=0.3)
    # the server's own TTFT histogram (simulated seconds) holds both
    assert metric(cached, "sglang:time_to_first_token_seconds_sum") == pytest.approx(full + skipped, abs=0.1)
    assert metric(cached, "sglang:cached_tokens_total") == tokens - 1
    snapshot = loads(cached)
    assert snapshot["cache_hit_rate"] >= 0.999  # the last prefill batch: 19,999 of 20,000 cached
    assert snapshot["token_usage"] == 0.0  # idle: the cache is evictable, not used


def test_cached_tokens_equal_the_shared_prefix_streamed_and_not(cached):
    system = {"role": "system", "content": long_text(3000, "sys")}
    a = [system, {"role": "user", "content": "What is a radix tree?"}]
    b = [system, {"role": "user", "content": "Tell me a joke, please."}]
    ids_a, ids_b = prompt_token_ids({"messages": a}), prompt_token_ids({"messages": b})
    assert ids_a is not None and ids_b is not None
    shared = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y)
    assert shared == count_prompt_tokens({"messages": [system]}) + 3  # + the next message's header
    first, _ = timed(cached, body_of(a))
    # at most the template's opening token, which every earlier prompt on this twin began with
    assert (first["usage"]["prompt_tokens_details"] or {"cached_tokens": 0})["cached_tokens"] <= 1
    stream = httpx.post(
        cached.url + "/v1/chat/completions",
        json=body_of(b, stream=True, stream_options={"include_usage": True}),
        timeout=60,
    )
    chunks = [line[6:] for line in stream.text.splitlines() if line.startswith("data: {")]
    usage = [c for c in (httpx.Response(200, content=c).json() for c in chunks) if c.get("usage")]
    assert usage[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": shared}
    again, _ = timed(cached, body_of(b, stream=False))
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": len(ids_b) - 1}
    # n choices: the prompt's cached tokens once, as its prompt tokens (SGLang's UsageProcessor)
    twice, _ = timed(cached, body_of(b, stream=False, n=2))
    assert twice["usage"]["prompt_tokens_details"] == {"cached_tokens": len(ids_b) - 1}
    assert twice["usage"]["prompt_tokens"] == len(ids_b)


def cached_tokens(t, body) -> int:
    response = httpx.post(t.url + "/v1/chat/completions", json=body, timeout=60)
    response.raise_for_status()
    return (response.json()["usage"]["prompt_tokens_details"] or {"cached_tokens": 0})["cached_tokens"]


def test_a_cache_salt_keeps_a_prompt_apart_from_other_salts_and_the_shared_cache(cached):
    """SGLang keys its radix tree by `cache_salt` and `extra_key` joined (vLLM by `cache_salt`):
    a prompt reuses only what its own salt's requests left (a few tokens of the chat template's
    opening are what another test's unsalted prompts left)."""
    messages = [{"role": "user", "content": long_text(2000, "salted")}]
    tokens = count_prompt_tokens({"messages": messages})
    assert cached_tokens(cached, body_of(messages, cache_salt="alice")) < 10
    assert cached_tokens(cached, body_of(messages, cache_salt="alice")) == tokens - 1
    assert cached_tokens(cached, body_of(messages, cache_salt="bob")) < 10
    assert cached_tokens(cached, body_of(messages)) < 10  # unsalted: the shared cache
    assert cached_tokens(cached, body_of(messages)) == tokens - 1
    # joined: the salt "ali" with the key "ce" is the salt "alice"
    assert cached_tokens(cached, body_of(messages, cache_salt="ali", extra_key="ce")) == tokens - 1
    refused = httpx.post(cached.url + "/v1/chat/completions", json=body_of(messages, cache_salt=["a"]), timeout=60)
    assert refused.status_code == 400 and "cache_salt" in refused.json()["message"]


def test_loads_count_waiting_uncached_tokens():
    args = ("--max-running-requests", "1", "--enable-metrics", "--load-snapshot-publish-interval", "1")
    with twin("base", "kimi-linear", time_scale=SCALE, seed=4, args=args) as t:
        messages = [{"role": "user", "content": long_text(4996, "w")}]  # 5,000 tokens
        timed(t, body_of(messages))  # now cached
        # hold the only slot with a long stream, then queue the cached prompt and a fresh one
        holder = threading.Thread(
            target=httpx.post,
            args=(t.url + "/v1/chat/completions",),
            kwargs={"json": body_of([{"role": "user", "content": "hold"}], max_tokens=400, ignore_eos=True)},
            daemon=True,
        )
        holder.start()
        wait_for(lambda: loads(t)["num_running_reqs"] == 1, "the holder to run", timeout=20)
        fresh = [{"role": "user", "content": long_text(996, "f")}]  # 1,000 tokens, nothing cached
        queued = [
            threading.Thread(
                target=httpx.post,
                args=(t.url + "/v1/chat/completions",),
                kwargs={"json": body_of(m), "timeout": 60},
                daemon=True,
            )
            for m in (messages, fresh)
        ]
        for q in queued:
            q.start()
        snapshot = wait_for(lambda: (s := loads(t))["num_waiting_reqs"] == 2 and s, "two queued requests", timeout=20)
        # the repeated prompt waits for its last token only; the fresh one for all of its tokens
        # (its header's first two tokens are cached too: the same user header starts both)
        assert snapshot["num_waiting_uncached_tokens"] == 1 + (1000 - 3)
        for thread in (holder, *queued):
            thread.join(timeout=60)
            assert not thread.is_alive()


def test_without_the_report_flag_usage_has_no_details_and_radix_cache_can_be_disabled():
    with twin("base", "kimi-linear", time_scale=SCALE, seed=5, args=("--output-len", "fixed:2")) as t:
        messages = [{"role": "user", "content": long_text(996, "n")}]
        timed(t, body_of(messages))
        body, _ = timed(t, body_of(messages))
        assert body["usage"]["prompt_tokens_details"] is None
        info = httpx.get(t.url + "/server_info", timeout=5).json()
        assert info["page_size"] == 1 and info["disable_radix_cache"] is False
    args = ("--disable-radix-cache", "--enable-cache-report", "--output-len", "fixed:2")
    with twin("base", "kimi-linear", time_scale=SCALE, seed=5, args=args) as t:
        timed(t, body_of(messages))
        body, _ = timed(t, body_of(messages))
        assert body["usage"]["prompt_tokens_details"] is None  # nothing cached: SGLang says null
        assert metric(t, "sglang:cached_tokens_total") in (None, 0.0)


def test_eviction_under_memory_pressure_brings_the_full_prefill_back():
    # A pool of 21,000 tokens holds one 20,000-token prompt, not two. Eviction frees what the
    # next chunk needs, leaves first: a's last chunks go when b's first chunk comes, a's first
    # chunk when b's second comes (b's own pages are locked while it runs).
    args = ("--enable-cache-report", "--max-total-tokens", "21000", "--output-len", "fixed:2")
    with twin("base", "kimi-linear", time_scale=SCALE, seed=6, args=args) as t:
        a = [{"role": "user", "content": long_text(19_996, "a")}]
        b = [{"role": "user", "content": long_text(19_996, "b")}]
        _, ttft_first = timed(t, body_of(a))
        hit, ttft_hit = timed(t, body_of(a))
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == 19_999
        timed(t, body_of(b))  # needs the room: a's pages (unlocked, least recently used) go
        back, ttft_back = timed(t, body_of(a))
        # only the user header (3 tokens, shared with b) is still cached
        assert back["usage"]["prompt_tokens_details"]["cached_tokens"] == 3
        # against the cached request's, which took as long to read (0.12 s of wall clock here; more
        # beside a busy core): the difference is the prefill eviction brought back
        assert ttft_back - ttft_hit == pytest.approx(prefill_s(20_000 - 3) - prefill_s(1), abs=0.3)
        snapshot = loads(t)
        assert snapshot["max_total_num_tokens"] == 21_000


def test_vllm_twin_counts_prefix_cache_queries_and_hits():
    args = ("--enable-prompt-tokens-details", "--output-len", "fixed:2")
    with twins(TwinSpec("base", "kimi-moe-vllm", time_scale=SCALE, seed=7, args=args, server="vllm")) as (t,):
        messages = [{"role": "user", "content": long_text(1996, "v")}]  # 2,000 tokens
        body = {"model": "specroute/twin", "messages": messages, "max_tokens": 1}
        first = httpx.post(t.url + "/v1/chat/completions", json=body, timeout=60).json()
        second = httpx.post(t.url + "/v1/chat/completions", json=body, timeout=60).json()
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        # vLLM caches full blocks of 16 tokens: 1,999 usable tokens hold 124 blocks
        assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 124 * 16}
        assert metric(t, "vllm:prefix_cache_queries_total") == 4000
        assert metric(t, "vllm:prefix_cache_hits_total") == 124 * 16


def test_loads_count_the_prefill_work_done():
    """/v1/loads' cumulative total_prefill_uncached_tokens and total_prefill_busy_us, as SGLang's
    scheduler ledger reports them: a fresh prompt adds its tokens and its profile's prefill
    time, a repeated one only what its cache did not hold."""
    args = ("--enable-cache-report", "--load-snapshot-publish-interval", "1")
    with twin("base", "kimi-linear", time_scale=SCALE, seed=5, args=args) as t:
        before = loads(t)
        assert (before["total_prefill_uncached_tokens"], before["total_prefill_busy_us"]) == (0, 0)
        messages = [{"role": "user", "content": long_text(2996, "p")}]  # 3,000 tokens
        timed(t, body_of(messages))
        first = wait_for(lambda: (s := loads(t))["total_prefill_uncached_tokens"] > 0 and s, "the counters", timeout=20)
        assert first["total_prefill_uncached_tokens"] == 3000
        assert first["total_prefill_busy_us"] == round(KIMI.prefill_ms(3000) * 1000)
        timed(t, body_of(messages))  # all cached but its last token
        again = wait_for(
            lambda: (s := loads(t))["total_prefill_uncached_tokens"] > 3000 and s, "the second prefill", timeout=20
        )
        assert again["total_prefill_uncached_tokens"] == 3001
        assert again["total_prefill_busy_us"] == first["total_prefill_busy_us"] + round(KIMI.prefill_ms(1) * 1000)
