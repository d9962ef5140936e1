"""The prefix index (fleet/prefix.py) and the block hashes it keys on (fleet/blocks.py)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

from fleet.blocks import LEADING_CHUNK, PromptBlocks, block_hashes, chain, chain_ids, prompt_stream
from fleet.features import count_prompt_tokens
from fleet.prefix import PrefixIndex
from sim.tokens import prompt_token_ids

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = "You are a careful assistant. Answer in full sentences and cite the file you read. " * 40


def chat(*turns: str, system: str = SYSTEM) -> dict:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"model": "m", "messages": messages}


def linear_depth(index: PrefixIndex, instance: str, hashes) -> int:
    depth = 0
    for h in hashes:
        if not index.holds(instance, h):
            break
        depth += 1
    return depth


# -- hashes -------------------------------------------------------------------------------------


def test_each_hash_covers_the_whole_prefix_before_it():
    data = random.Random(1).randbytes(5000)
    hashes = chain(data, 256)
    assert len(hashes) == 5000 // 256  # whole blocks only
    for i, h in enumerate(hashes):
        assert h == xxhash.xxh3_64_intdigest(data[: (i + 1) * 256])


def test_equal_prefixes_share_hashes_up_to_where_they_diverge():
    rng = random.Random(2)
    base = rng.randbytes(4096)
    for at in (0, 1, 255, 256, 257, 1000, 4095):
        other = base[:at] + bytes([base[at] ^ 1]) + base[at + 1 :]
        a, b = chain(base, 256), chain(other, 256)
        shared = sum(1 for x, y in zip(a, b) if x == y)
        assert shared == at // 256
        assert a[: at // 256] == b[: at // 256]  # and they are the leading ones


def test_the_stream_follows_the_twins_tokens():
    # For ASCII text, byte 4n of the stream is the twin's token n: block i covers the same
    # tokens the twin's cache pages would.
    for body in (
        chat("hi"),
        chat("a" * 1001, "b" * 7, "c" * 64),
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "x" * 13}, {"type": "text", "text": "y"}]}
            ]
        },
        {"prompt": "z" * 999},
        {"prompt": "z" * 999, "messages": "not a list"},
        dict(chat("use a tool"), tools=[{"type": "function", "function": {"name": "grep", "description": "d" * 77}}]),
    ):
        assert len(prompt_stream(body)) == 4 * len(prompt_token_ids(body)) == 4 * count_prompt_tokens(body)


def test_a_conversations_next_turn_extends_its_previous_hashes():
    first = block_hashes(chat("What does fleet/model.py do?" * 30), 64)
    second = block_hashes(chat("What does fleet/model.py do?" * 30, "It keeps the fleet." * 40, "And why?"), 64)
    assert len(second) > len(first) > 0
    assert second[: len(first)] == first


def test_framing_cannot_be_imitated_by_text():
    def h(body):
        return block_hashes(body, 1)  # 4-byte blocks: every difference shows

    one = {"messages": [{"role": "user", "content": "abcd" * 4}]}
    split = {"messages": [{"role": "user", "content": "abcd" * 2}, {"role": "user", "content": "abcd" * 2}]}
    other_role = {"messages": [{"role": "system", "content": "abcd" * 4}]}
    as_prompt = {"prompt": prompt_stream(one).decode("latin-1")}
    ids = {"prompt": [1, 2, 3, 4]}
    text = {"prompt": "\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00\x04\x00\x00\x00"}
    seen = [h(b) for b in (one, split, other_role, as_prompt, ids, text)]
    assert len(set(seen)) == len(seen)
    assert h(one)[-1] not in h(split) and h(ids)[-1] not in h(text)


def test_what_a_template_renders_beyond_the_text_is_hashed():
    base = chat("call the tool")
    with_tools = dict(base, tools=[{"type": "function", "function": {"name": "grep"}}])
    other_tools = dict(base, tools=[{"type": "function", "function": {"name": "sed"}}])
    hashes = [block_hashes(b, 4) for b in (base, with_tools, other_tools)]
    assert len(set(hashes)) == 3 and hashes[1][0] != hashes[0][0]

    def turn(args):
        call = {"id": "c1", "type": "function", "function": {"name": "grep", "arguments": args}}
        body = chat("find it")
        body["messages"] += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "found " * 100},
        ]
        return block_hashes(body, 4)

    a, b = turn('{"q": "x"}'), turn('{"q": "y"}')
    assert a != b and a[0] == b[0]  # the shared system prompt still matches

    def image(url):
        parts = [{"type": "text", "text": "look " * 40}, {"type": "image_url", "image_url": {"url": url}}]
        return block_hashes(
            {"messages": [{"role": "user", "content": parts + [{"type": "text", "text": "ok" * 99}]}]}, 4
        )

    assert image("data:a") != image("data:b")
    # The key order of a parsed object does not matter.
    assert block_hashes(dict(base, tools=[{"a": 1, "b": 2}]), 4) == block_hashes(
        dict(base, tools=[{"b": 2, "a": 1}]), 4
    )


def test_fields_that_change_what_a_server_caches_start_the_chain():
    # A LoRA adapter (another `model`, or SGLang's `lora_path`), the template's arguments and
    # the reasoning effort change the KV a server holds for the same messages: no block is
    # shared; the blocks keep their number (the stream is unchanged).
    base = {"messages": [{"role": "user", "content": "q" * 8000}]}
    plain = block_hashes(base)
    assert tuple(PromptBlocks.of(base)) == plain  # no such field: the chain is as it was
    variants = [
        {"model": "lora-A"},
        {"model": "lora-B"},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"chat_template_kwargs": {"enable_thinking": True}},
        {"reasoning_effort": "high"},
        {"lora_path": "adapter-1"},
    ]
    seen = [plain]
    for extra in variants:
        hashes = block_hashes({**base, **extra})
        assert len(hashes) == len(plain)
        assert not set(hashes) & set(plain), extra
        assert tuple(PromptBlocks.of({**base, **extra})) == hashes
        seen.append(hashes)
    assert len(set(seen)) == len(seen)
    # Equal values chain alike, whatever their key order; a completion prompt takes them too.
    assert block_hashes({**base, "chat_template_kwargs": {"a": 1, "b": 2}}) == block_hashes(
        {**base, "chat_template_kwargs": {"b": 2, "a": 1}}
    )
    prompt = {"prompt": "p" * 4000}
    assert block_hashes({**prompt, "model": "lora-A"})[0] != block_hashes(prompt)[0]
    # A review's finding: fields that change only the prompt's end, and empty or default values,
    # split requests whose every block a server shares.
    for same in (
        {"add_generation_prompt": False},
        {"continue_final_message": True},
        {"chat_template_kwargs": {}},
        {"reasoning_effort": None},
    ):
        assert block_hashes({**base, **same}) == plain, same


def test_shapes_without_a_single_prompt_have_no_blocks():
    assert block_hashes({"prompt": ["a", "b"]}) == ()
    assert block_hashes({"messages": None}) == ()
    assert block_hashes({}) == ()
    assert block_hashes(chat("short"), 10_000) == ()  # shorter than one block
    assert len(block_hashes({"prompt": list(range(1000))}, 16)) == (1000 + 1) // 16  # 4-byte marker + ids
    assert len(block_hashes({"prompt": [2**40] * 100}, 1)) > 0  # ids past 32 bits still hash


def test_hashing_stops_at_max_blocks():
    body = chat("x" * 100_000)
    full = block_hashes(body, 64)
    assert block_hashes(body, 64, max_blocks=10) == full[:10]


def test_prompt_blocks_are_the_same_hashes_computed_when_read():
    body = chat("x" * 40_000)
    eager = block_hashes(body, 64)
    lazy = PromptBlocks.of(body, 64)
    assert len(lazy) == len(eager) and lazy.computed == 0
    assert lazy[3] == eager[3] and lazy.computed == 4
    assert lazy[-1] == eager[-1] and lazy.computed == len(eager)
    assert lazy[2:9:3] == eager[2:9:3] and tuple(lazy) == lazy.all() == eager
    assert PromptBlocks.of(body, 64)[::-1] == eager[::-1]
    with pytest.raises(IndexError):
        lazy[len(eager)]
    capped = PromptBlocks.of(body, 64, max_blocks=5)
    assert len(capped) == 5 and capped.all() == eager[:5]
    assert len(PromptBlocks.of({"prompt": ["a", "b"]})) == 0
    assert PromptBlocks(b"x" * 100, 10).all() == chain(b"x" * 100, 10)


def test_a_decision_hashes_only_as_far_as_some_instance_holds_the_prompt():
    index = PrefixIndex(block_tokens=64)
    turn = chat("Summarise docs/routing.md " * 40)
    index.insert("a", PromptBlocks.of(turn, 64), 0.0)  # the insert hashes all of it
    other = block_hashes(chat("something else " * 200), 64)
    index.insert("b", other, 0.0)
    held = len(block_hashes(turn, 64))
    system = sum(1 for x, y in zip(other, block_hashes(turn, 64)) if x == y)
    follow_up = PromptBlocks.of(chat("Summarise docs/routing.md " * 40, "It says " * 900, "Go on"), 64)
    assert index.match(follow_up, 1.0) == {"a": held, "b": system}  # b: the shared system prompt
    assert 0 < system < held
    assert held + 1 <= follow_up.computed <= 2 * held + LEADING_CHUNK and follow_up.computed < len(follow_up)
    unseen = PromptBlocks.of(chat("x" * 50_000, system="no one has this"), 64)
    assert index.match(unseen, 1.0) == {"a": 0, "b": 0} and unseen.computed == LEADING_CHUNK
    assert index.match(PromptBlocks.of({}, 64), 1.0) == {"a": 0, "b": 0}
    assert PrefixIndex().match(unseen, 1.0) == {}


def test_given_block_ids_are_chained_by_position():
    a = chain_ids([1, 2, 3])
    assert chain_ids([1, 2, 4])[:2] == a[:2] and chain_ids([1, 2, 4])[2] != a[2]
    assert not set(chain_ids([9, 2, 3])) & set(a)  # the same ids after another prefix differ
    assert chain_ids([1, 2, 3], max_blocks=2) == a[:2]
    assert chain_ids(["1", (1, 2), -5, 2**70])[0] != chain_ids([1])[0]
    assert chain_ids([]) == ()


def test_hashes_are_the_same_in_every_process():
    # No Python `hash` anywhere: other hash seeds give the same hashes and the same matches.
    script = (
        "import json; from fleet.blocks import block_hashes, chain_ids; from fleet.prefix import PrefixIndex\n"
        "body = {'messages': [{'role': 'user', 'content': 'héllo wörld ' * 300}], 'tools': [{'b': 1, 'a': 'x'}]}\n"
        "h = block_hashes(body, 16); ids = chain_ids([3, 'x', (1, 'y'), 2**80])\n"
        "ix = PrefixIndex(block_tokens=16); ix.insert('b', h[:7], 0.0); ix.insert('a', h, 0.0)\n"
        "print(json.dumps([h, ids, ix.match(h[:9] + (1,), 0.0)]))\n"
    )
    outputs = []
    for seed in ("1", "2", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(ROOT))
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        outputs.append(json.loads(done.stdout))
    assert outputs[0] == outputs[1] == outputs[2]
    assert outputs[0][2] == {"b": 7, "a": 9}


# -- the index ----------------------------------------------------------------------------------


def test_an_equal_prefix_matches_and_a_diverging_one_up_to_the_divergence():
    index = PrefixIndex(block_tokens=64)
    asked = block_hashes(chat("Summarise docs/routing.md " * 40), 64)
    index.insert("spec-0", asked, now=1.0)
    assert index.match(asked, 2.0) == {"spec-0": len(asked)}
    follow_up = block_hashes(chat("Summarise docs/routing.md " * 40, "It says..." * 50, "Shorter"), 64)
    assert index.match(follow_up, 2.0) == {"spec-0": len(asked)}
    other_question = block_hashes(chat("Now the twin " * 80), 64)
    shared = sum(1 for x, y in zip(asked, other_question) if x == y)
    assert 0 < shared < len(asked)  # the system prompt
    assert index.match(other_question, 2.0) == {"spec-0": shared}
    assert index.match(block_hashes(chat("x" * 9000, system="Another system prompt " * 20), 64), 2.0) == {"spec-0": 0}
    assert index.match((), 2.0) == {"spec-0": 0}
    assert index.match_tokens(asked, 2.0) == {"spec-0": 64 * len(asked)}


def test_match_reports_each_instance():
    index = PrefixIndex(block_tokens=1)
    chain_a = chain_ids(range(10))
    index.insert("a", chain_a, 0.0)
    index.insert("b", chain_a[:4], 0.0)
    index.set_capacity("c", 1000)
    assert index.match(chain_a, 0.0) == {"a": 10, "b": 4, "c": 0}
    assert index.match(chain_a, 0.0, instances=["b", "z"]) == {"b": 4, "z": 0}
    assert index.instances == ("a", "b", "c")


def test_an_instance_evicts_its_least_recently_used_blocks_first():
    index = PrefixIndex(block_tokens=100)
    index.set_capacity("i", 400)  # four blocks
    a, b, c = chain_ids(["a", 1]), chain_ids(["b"]), chain_ids(["c"])
    index.insert("i", a, 0.0)
    index.insert("i", b, 1.0)
    index.insert("i", a, 2.0)  # a is used again: b is now the oldest
    index.insert("i", c, 3.0)
    assert index.blocks("i") == 4 and len(index) == 4
    d = chain_ids(["d"])
    index.insert("i", d, 4.0)
    assert index.match(b, 5.0) == {"i": 0}
    assert index.match(a, 5.0) == {"i": 2} and index.match(c, 5.0) == {"i": 1}
    assert index.evicted == 1


def test_eviction_takes_leaves_before_their_prefix():
    index = PrefixIndex(block_tokens=1)
    index.set_capacity("i", 3)
    long = chain_ids(["s", 1, 2])
    index.insert("i", long, 0.0)
    index.insert("i", chain_ids(["t"]), 1.0)
    # The chain's last block went, not its first: the rest still matches.
    assert index.match(long, 2.0) == {"i": 2}
    # A chain longer than the instance holds keeps its leading blocks.
    index.insert("i", chain_ids(range(10)), 3.0)
    assert index.match(chain_ids(range(10)), 4.0) == {"i": 3}


def test_capacity_shrinks_at_once():
    index = PrefixIndex(block_tokens=10)
    index.insert("i", chain_ids(range(50)), 0.0)
    index.set_capacity("i", 205)  # 20 blocks
    assert index.blocks("i") == 20 == len(index)
    assert index.match(chain_ids(range(50)), 1.0) == {"i": 20}
    index.set_capacity("i", None)
    index.insert("i", chain_ids(range(50)), 0.0)
    assert index.blocks("i") == 50


def test_the_global_cap_evicts_the_oldest_entry_of_any_instance():
    index = PrefixIndex(block_tokens=1, max_blocks=5)
    a, b, c = chain_ids(["a", 1]), chain_ids(["b", 1]), chain_ids(["c", 1])
    index.insert("x", a, 0.0)
    index.insert("y", b, 1.0)
    index.insert("x", c, 2.0)  # six entries: a's leaf goes
    assert len(index) == 5
    assert index.match(a, 3.0) == {"x": 1, "y": 0}
    index.insert("y", chain_ids(["d", 1, 2]), 4.0)  # three more: a's root, then b's leaf and root
    assert len(index) == 5
    assert index.match(a, 5.0)["x"] == 0
    assert index.match(b, 5.0)["y"] == 0
    assert index.match(c, 5.0)["x"] == 2


def test_a_flood_of_unique_prompts_stays_within_the_caps():
    index = PrefixIndex(block_tokens=64)  # the default global cap: 100,000 entries
    caps = {"spec-0": 1_000_000, "spec-1": 500_000, "base-0": None, "base-1": 2_000_000}
    for name, tokens in caps.items():
        index.set_capacity(name, tokens)
    names = list(caps)
    rng = random.Random(3)
    shared = block_hashes(chat("the agent's tools " * 200), 64)
    for i in range(100_000):
        hashes = (
            shared + chain_ids([i, *range(rng.randint(1, 6))]) if i % 10 == 0 else chain_ids([i] * rng.randint(1, 8))
        )
        index.insert(names[i % 4], hashes, i * 0.01)
        if i % 5_000 == 0 or i == 99_999:
            assert len(index) <= index.max_blocks
            assert len(index) == sum(index.blocks(n) for n in names)
            for name in names:
                assert index.blocks(name) <= index.capacity_blocks(name)
    assert len(index) == index.max_blocks  # full, not past it
    assert index.blocks("spec-1") <= 500_000 // 64
    assert index.evicted > 100_000


def test_bisection_finds_the_leading_run_under_random_traffic():
    rng = random.Random(4)
    index = PrefixIndex(block_tokens=1, max_blocks=300)
    names = ["a", "b", "c"]
    index.set_capacity("a", 80)

    def stream(prompt: tuple[int, ...]) -> bytes:
        return b"".join(k.to_bytes(4, "little") for k in prompt)  # one 4-byte block per item

    # Conversations: each prompt extends an earlier one (or starts one of a few system prompts).
    prompts: list[tuple[int, ...]] = [(1000 + k,) for k in range(4)]
    deep = 0
    for step in range(3000):
        stem = rng.choice(prompts)
        prompt = stem + tuple(rng.randrange(5) for _ in range(rng.randint(0, 12)))
        prompts.append(prompt)
        index.insert(rng.choice(names), chain(stream(prompt), 4), float(step))
        if step % 500 == 499:
            index.forget(rng.choice(names))
        asked = stream(rng.choice(prompts) + (rng.randrange(5),))
        probe = chain(asked, 4)
        got = index.match(probe, float(step), raw=True, instances=names)
        assert got == {n: linear_depth(index, n, probe) for n in names}
        lazy = PromptBlocks(asked, 4)
        assert index.match(lazy, float(step), raw=True, instances=names) == got
        assert lazy.computed <= 2 * max(got.values()) + LEADING_CHUNK
        deep += max(got.values()) > 3
    assert len(index) <= 300 and index.blocks("a") <= 80
    assert index.evicted > 1000 and deep > 300  # the caps were hit, and long prefixes matched


def test_forget_drops_one_instance():
    index = PrefixIndex(block_tokens=1)
    hashes = chain_ids(range(20))
    index.insert("a", hashes, 0.0)
    index.insert("b", hashes[:5], 0.0)
    index.observe_hit("a", 20, 0, 1.0)
    index.forget("a")
    assert index.match(hashes, 2.0) == {"a": 0, "b": 5}
    assert len(index) == 5 and index.trust("a", 2.0) == 1.0
    index.insert("a", hashes[:3], 3.0)  # learned again from new traffic
    assert index.match(hashes, 4.0)["a"] == 3
    index.remove("b")
    assert index.instances == ("a",) and len(index) == 3


def test_reported_cache_hits_scale_the_credit_and_the_doubt_fades():
    index = PrefixIndex(block_tokens=10, trust_half_life_s=60.0, trust_weight=0.25)
    hashes = chain_ids(range(100))
    index.insert("a", hashes, 0.0)
    index.insert("b", hashes, 0.0)
    assert index.match(hashes, 0.0) == {"a": 100, "b": 100}
    # "a" keeps reporting a quarter of what the index claims (its cache is smaller than assumed).
    for _ in range(30):
        index.observe_hit("a", 1000, 250, 19.0)
    assert index.trust("a", 20.0) == pytest.approx(0.25, abs=0.01)
    assert index.match(hashes, 20.0)["a"] == 25
    assert index.match(hashes, 20.0, raw=True)["a"] == 100
    assert index.match_tokens(hashes, 20.0)["a"] == 250
    # "b" reports more than claimed (another replica's traffic, a finer page): no doubt.
    index.observe_hit("b", 1000, 1500, 1.0)
    assert index.trust("b", 1.0) == 1.0 and index.match(hashes, 20.0)["b"] == 100
    # Without new reports the doubt halves every half-life, so "a" is credited (and tried) again.
    assert 1 - index.trust("a", 79.0) == pytest.approx((1 - index.trust("a", 19.0)) / 2, rel=1e-9)
    assert index.trust("a", 19.0 + 600) > 0.999
    # Nothing predicted: a report says nothing about the index.
    assert index.observe_hit("b", 0, 500, 2.0) == 1.0


def test_a_claim_under_a_block_moves_the_trust_in_proportion():
    # A session's short last prompt is credited below a block; the server's report of a few
    # tokens against it is mostly its page rounding, and must not cost the instance a quarter
    # of its trust for every conversation on it (a user's probe: a sixth per 8-token claim).
    index = PrefixIndex(block_tokens=256, trust_weight=0.25)
    assert index.observe_hit("a", 8, 3, 0.0) == pytest.approx(1 - 0.25 * (8 / 256) * (1 - 3 / 8))
    assert index.observe_hit("b", 512, 0, 0.0) == pytest.approx(0.75)  # a block or more: the whole step


def test_a_report_is_read_in_the_estimates_units():
    index = PrefixIndex(block_tokens=10)
    # The server's tokenizer counts 1,200 tokens where the 4-characters rule counts 1,000: its
    # 1,200 cached tokens are the 1,000 the index predicted.
    trust = index.observe_hit("a", 1000, 1200, 0.0, estimated_prompt_tokens=1000, reported_prompt_tokens=1200)
    assert trust == 1.0
    assert index.observe_hit("a", 1000, 600, 0.0, estimated_prompt_tokens=1000, reported_prompt_tokens=1200) < 1.0


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError):
        PrefixIndex(max_blocks=0)
    with pytest.raises(ValueError):
        PrefixIndex(trust_weight=0.0)
    with pytest.raises(ValueError):
        chain(b"abc", 0)


def test_blocks_only_unanswered_requests_put_there_go_when_all_of_them_are_refused():
    index = PrefixIndex(block_tokens=4)
    held, prompt = [1, 2], [1, 2, 3, 4]
    index.settle("a", *index.insert("a", held, 0.0))  # answered: the instance holds 1 and 2
    first = index.insert("a", prompt, 1.0)
    second = index.insert("a", prompt, 1.1)  # the same prompt before the first's answer came
    assert first[1] and second[1]  # both claim 3 and 4 (the second only re-stamped them)
    index.withdraw("a", *first)
    assert index.blocks("a") == 4  # the second still claims them
    index.withdraw("a", *second)
    assert index.blocks("a") == 2 and index.holds("a", 2) and not index.holds("a", 3)
    # Refused in the other order, or one answered: what an answered request put there stays.
    first, second = index.insert("a", prompt, 2.0), index.insert("a", prompt, 2.1)
    index.withdraw("a", *second)
    index.settle("a", *first)
    index.withdraw("a", *index.insert("a", prompt, 2.2))
    assert index.blocks("a") == 4
    # A block evicted and put there again by others is not the withdrawn insert's to take.
    small = PrefixIndex(block_tokens=4)
    small.set_capacity("b", 8)  # two blocks
    gone = small.insert("b", [1, 2], 3.0)
    small.settle("b", *small.insert("b", [7, 8], 3.1))  # evicts 1 and 2
    small.settle("b", *small.insert("b", [1, 2], 3.2))
    small.withdraw("b", *gone)
    assert small.holds("b", 1) and small.holds("b", 2)
    small.forget("b")
    small.withdraw("b", *gone)  # nothing left to take back
    assert small.blocks("b") == 0
