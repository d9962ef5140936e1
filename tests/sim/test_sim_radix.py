"""The twin's prefix cache: the radix tree itself, the token model, and the engine on the virtual clock."""

from __future__ import annotations

import pytest

from fleet.features import count_prompt_tokens
from fleet.profile import load_profile
from sim.engine import Engine, EngineConfig
from sim.radix import RadixCache
from sim.tokens import EOT_ID, START_HEADER_ID, prompt_token_ids
from sim.virtual import Arrival, simulate

KIMI = load_profile("kimi-linear")

# ---- the radix tree --------------------------------------------------------------------------


def test_insert_and_match_share_prefixes_and_split_nodes():
    cache = RadixCache()
    assert cache.insert((1, 2, 3, 4, 5)) == (0, cache.root.children[1])
    assert cache.total_size == 5 and cache.evictable_size == 5 and cache.protected_size == 0
    pages, _ = cache.insert((1, 2, 3, 9, 9, 9))  # shares 1 2 3: splits the first node
    assert pages == 3
    assert cache.total_size == 8
    assert cache.peek((1, 2, 3, 4, 5, 6)) == 5
    assert cache.peek((1, 2, 7)) == 2
    assert cache.peek((7,)) == 0
    pages, node = cache.match_prefix((1, 2, 3, 9, 8))
    assert pages == 4 and RadixCache.depth(node) == 4  # split after 1 2 3 9
    assert cache.total_size == 8  # splitting moves nothing


def test_pages_larger_than_one_token():
    cache = RadixCache(page_size=16)
    cache.insert(((1,) * 16, (2,) * 16))
    assert cache.total_size == 32
    assert cache.peek(((1,) * 16, (3,) * 16)) == 1


def test_locked_nodes_are_protected_and_never_evicted():
    cache = RadixCache()
    _, a = cache.insert((1, 2, 3, 4))
    _, b = cache.insert((1, 2, 5, 6))  # a and b now hang under a shared (1, 2)
    cache.lock(a)
    assert cache.protected_size == 4  # a's own 2 tokens and the shared 2
    assert cache.evictable_size == 2
    assert cache.evict(100) == 2  # only b can go
    assert cache.peek((1, 2, 5, 6)) == 2
    assert cache.peek((1, 2, 3, 4)) == 4
    cache.lock(a)
    cache.unlock(a)
    assert cache.protected_size == 4  # still held once
    cache.unlock(a)
    assert cache.protected_size == 0 and cache.evictable_size == 4
    with pytest.raises(RuntimeError):
        cache.unlock(a)


def test_eviction_is_least_recently_used_first_and_frees_parents():
    cache = RadixCache()
    cache.insert((1, 1, 1))
    cache.insert((2, 2, 2))
    cache.insert((3, 3, 3))
    cache.match_prefix((1, 1, 1))  # touch 1: now 2 is the least recently used
    assert cache.evict(1) == 3
    assert cache.peek((2, 2, 2)) == 0
    assert cache.peek((1, 1, 1)) == 3 and cache.peek((3, 3, 3)) == 3
    assert cache.evict(3) == 3  # then 3
    assert cache.peek((3, 3, 3)) == 0
    # a chain: the leaf goes first, then its parent becomes a leaf and may go too
    cache.insert((1, 1, 1, 4, 4))
    cache.insert((1, 1, 1, 5))
    assert cache.evict(100) == 6
    assert cache.total_size == 0 and cache.root.children == {}


# ---- the token model ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "abcdefghi"}, {"type": "image_url"}]}]},
        {"messages": [{"role": "user", "content": ""}]},
        {"prompt": "Once upon a time"},
        {"prompt": [1, 2, 3]},
    ],
)
def test_token_ids_count_as_the_proxy_counts(body):
    ids = prompt_token_ids(body)
    assert ids is not None and len(ids) == count_prompt_tokens(body)
    assert ids == prompt_token_ids(body)  # deterministic


def test_messages_sharing_a_prefix_share_leading_ids():
    system = {"role": "system", "content": "You are a helpful assistant. " * 40}
    a = prompt_token_ids({"messages": [system, {"role": "user", "content": "What is a radix tree?"}]})
    b = prompt_token_ids({"messages": [system, {"role": "user", "content": "Tell me a joke."}]})
    assert a is not None and b is not None
    sys_tokens = count_prompt_tokens({"messages": [system]})
    assert a[:sys_tokens] == b[:sys_tokens]
    assert a[0] == START_HEADER_ID and a[sys_tokens - 1] == EOT_ID
    # the next message's framing (header start, role, header end) is shared too, its text is not
    assert a[: sys_tokens + 3] == b[: sys_tokens + 3] and a[sys_tokens + 3] != b[sys_tokens + 3]


# ---- the engine on the virtual clock ---------------------------------------------------------


def engine(seed=1, **kw):
    kw.setdefault("output_lengths", __import__("sim.lengths", fromlist=["x"]).parse_output_lengths("fixed:8"))
    return Engine(EngineConfig("base", KIMI, seed=seed, **kw), "base")


def chunked_prefill_s(tokens: int, chunk: int = 8192) -> float:
    ms = 0.0
    while tokens > 0:
        take = min(tokens, chunk)
        ms += KIMI.prefill_ms(take)
        tokens -= take
    return ms / 1000.0


def test_a_repeated_prefix_skips_its_prefill_on_the_virtual_clock():
    blocks = tuple(range(24))  # 24 blocks of 512 tokens, as a Mooncake prompt of 12,000 tokens
    arrivals = [
        Arrival(time=0.0, prompt_tokens=12_000, output_tokens=8, prefix=blocks),
        Arrival(time=10.0, prompt_tokens=12_000, output_tokens=8, prefix=blocks),
        Arrival(time=20.0, prompt_tokens=12_300, output_tokens=8, prefix=blocks + (99,)),  # the next turn
    ]
    records = sorted(simulate([engine(page_size=512)], arrivals, router=lambda a, v: 0), key=lambda r: r.index)
    first, again, longer = records
    assert first.cached_tokens == 0
    assert first.ttft == pytest.approx(chunked_prefill_s(12_000))
    # 12,000 tokens hold 23 full blocks (11,776 tokens); the partial 24th is not cached
    assert again.cached_tokens == 23 * 512
    assert again.ttft == pytest.approx(chunked_prefill_s(12_000 - 23 * 512))
    assert longer.cached_tokens == 23 * 512
    assert longer.ttft == pytest.approx(chunked_prefill_s(12_300 - 23 * 512))


def test_requests_without_a_prefix_are_untouched_by_the_cache():
    arrivals = [Arrival(time=0.05 * i, prompt_tokens=3000 + 7 * i, max_tokens=40) for i in range(60)]

    def run(**kw):
        records = simulate([engine(seed=5, **kw)], arrivals, router=lambda a, v: 0)
        return [(r.index, r.first_token_time, r.finish_time, r.output_tokens, r.cached_tokens) for r in records]

    assert run() == run(enable_prefix_cache=False)
    assert all(r[4] == 0 for r in run())


def test_the_cache_stays_within_the_kv_pool_and_evicts_lru():
    pool = 20_000
    eng = engine(page_size=512, max_total_num_tokens=pool)
    sessions = [tuple(range(s * 1000, s * 1000 + 16)) for s in range(6)]  # 6 prompts of 16 blocks (8,192 tokens)
    arrivals = [Arrival(time=5.0 * i, prompt_tokens=8192, output_tokens=4, prefix=sessions[i % 6]) for i in range(18)]
    sizes = []

    def watch(step):
        cache = eng.cache
        assert cache is not None
        sizes.append(cache.total_size)
        # cache + the running requests' own tokens fit in the pool (nothing is locked between requests)
        assert cache.total_size + eng._context_sum - eng._running_locked <= pool

    records = sorted(simulate([eng], arrivals, router=lambda a, v: 0, on_step=watch), key=lambda r: r.index)
    assert max(sizes) <= pool
    # two prompts fit (16,384 tokens); six in turn evict each other before they come back: no hits
    assert all(r.cached_tokens == 0 for r in records)
    # the same prompt back to back hits
    again = simulate(
        [engine(page_size=512, max_total_num_tokens=pool)],
        [Arrival(time=5.0 * i, prompt_tokens=8192, output_tokens=4, prefix=sessions[0]) for i in range(3)],
        router=lambda a, v: 0,
    )
    assert sorted(r.cached_tokens for r in again) == [0, 8192 - 512, 8192 - 512]


def test_running_requests_hold_their_prefix_against_eviction():
    # Request A runs long on a shared prefix; B floods the pool with another prompt: A's prefix stays.
    eng = engine(page_size=512, max_total_num_tokens=12_000)
    shared, other = tuple(range(8)), tuple(range(100, 116))
    arrivals = [
        Arrival(time=0.0, prompt_tokens=4096, output_tokens=2000, prefix=shared),
        Arrival(time=1.0, prompt_tokens=8192, output_tokens=4, prefix=other),
        Arrival(time=2.0, prompt_tokens=4096, output_tokens=4, prefix=shared),
    ]
    records = sorted(simulate([eng], arrivals, router=lambda a, v: 0), key=lambda r: r.index)
    assert records[2].cached_tokens == 4096 - 512
