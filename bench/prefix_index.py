"""What the prefix index costs per routing decision, and what it holds in memory.

    flock /tmp/specroute-bench.lock .venv/bin/python -m bench.prefix_index [--prefixes 10000]
        [--queries 2000] [--instances 4] [--block-tokens 64,128,256] [--seed 0]

A decision is what the router will do per request once the index is wired in: hash the parsed
chat body (fleet.blocks) and match it against every instance (fleet.prefix.PrefixIndex.match). The index first holds `--prefixes` prompts of 2-20k tokens
(conversations on 40 shared system prompts of 1.8-6k tokens, each turn extending the previous
one; each conversation on one of `--instances` instances); the decisions are the next turn of an
indexed conversation (60 %), a new conversation on a shared system prompt (25 %) and a prompt
never seen (15 %). Each decision is timed alone (perf_counter_ns, the garbage collector on, the workload and the
index frozen out of its collections as the proxy freezes its start-up objects).
Ground truth: a next turn must match on its conversation's instance exactly the blocks of the
previous turn, a new prompt nowhere; the run stops if it does not.

A decision hashes the prompt (fleet.blocks.PromptBlocks) only up to the first block no
instance holds; the rest is hashed by the insert that follows the dispatch. Both are timed, and
so is hashing every block first (block_hashes), for comparison. Also printed: where the time
goes for a 12,000-token prompt (building the byte stream, one XXH3-64 over it, the per-block
chain (XXH3-64, fleet.blocks), SHA-256 and BLAKE2b for comparison, the match, the decision for its next turn and for a prompt as
long that no instance holds), the index's memory (tracemalloc: the OrderedDicts and the hash ints they
keep) with all prefixes held and under a flood of 100,000 unique prompts at the default cap.
Figures: docs/routing.md, "Prefix index".
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import platform
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import xxhash

from fleet.blocks import PromptBlocks, block_hashes, chain, chain_ids, prompt_stream
from fleet.features import CHARS_PER_TOKEN, count_prompt_tokens
from fleet.prefix import DEFAULT_MAX_BLOCKS, PrefixIndex

WORDS = (
    "the of and to in is that for it as with was on be by this are or from at which an have not "
    "request server router token cache prefix block model batch decode prefill speculative draft "
    "verify accept latency throughput instance pool policy snapshot reading stream chunk "
    "def return class import self none true false if else for while yield async await "
).split()
MAX_TOKENS = 20_000


def corpus(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS)
        if rng.random() < 0.05:
            word += str(rng.randrange(10_000))  # identifiers, numbers: text that does not repeat
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


@dataclass
class Text:
    """Slices of one random corpus: unique text of any length without generating it each time."""

    rng: random.Random
    source: str

    def __call__(self, tokens: int) -> str:
        chars = tokens * CHARS_PER_TOKEN
        start = self.rng.randrange(len(self.source) - chars)
        return self.source[start : start + chars]


@dataclass
class Conversation:
    system: dict[str, str]
    instance: str
    messages: list[dict[str, str]] = field(default_factory=list)

    def body(self) -> dict[str, Any]:
        return {"model": "m", "messages": [self.system, *self.messages], "stream": True}

    def tokens(self) -> int:
        return count_prompt_tokens(self.body())

    def next_turn(self, text: Text, rng: random.Random) -> dict[str, Any] | None:
        """The body of the next request (an assistant answer and a new user turn added), or None
        past MAX_TOKENS."""
        added: list[dict[str, str]] = []
        if self.messages:
            added.append({"role": "assistant", "content": text(rng.randint(100, 600))})
        user = rng.randint(3_000, 8_000) if rng.random() < 0.1 else rng.randint(50, 1_500)
        added.append({"role": "user", "content": text(user)})
        candidate = self.body()
        candidate["messages"] = candidate["messages"] + added
        if count_prompt_tokens(candidate) > MAX_TOKENS:
            return None
        self.messages += added
        return candidate


@dataclass
class Workload:
    systems: list[dict[str, str]]
    indexed: list[tuple[str, dict[str, Any]]]
    """(instance, body) in the order they were routed."""
    conversations: list[Conversation]
    text: Text


def workload(prefixes: int, instances: int, seed: int) -> Workload:
    rng = random.Random(seed)
    text = Text(rng, corpus(rng, 4_000_000))
    names = [f"i{k}" for k in range(instances)]
    systems = [{"role": "system", "content": text(rng.randint(1_800, 6_000))} for _ in range(40)]
    indexed: list[tuple[str, dict[str, Any]]] = []
    conversations: list[Conversation] = []
    while len(indexed) < prefixes:
        conv = Conversation(rng.choice(systems), names[len(conversations) % instances])
        conversations.append(conv)
        for _ in range(rng.randint(1, 12)):
            body = conv.next_turn(text, rng) if len(indexed) < prefixes else None
            if body is None:
                break
            indexed.append((conv.instance, body))
    return Workload(systems, indexed, conversations, text)


def queries(work: Workload, n: int, seed: int) -> list[tuple[str, dict[str, Any], str | None, dict[str, Any] | None]]:
    """(kind, body, instance expected to hold its previous turn, that previous turn's body)."""
    rng = random.Random(seed + 1)
    out: list[tuple[str, dict[str, Any], str | None, dict[str, Any] | None]] = []
    while len(out) < n:
        roll = rng.random()
        if roll < 0.6:
            conv = rng.choice(work.conversations)
            if not conv.messages:
                continue
            before = conv.body()
            body = Conversation(conv.system, conv.instance, list(conv.messages)).next_turn(work.text, rng)
            if body is not None:
                out.append(("next turn", body, conv.instance, before))
        elif roll < 0.85:
            fresh = Conversation(rng.choice(work.systems), "")
            body = fresh.next_turn(work.text, rng)
            if body is not None:
                out.append(("shared system", body, None, None))
        else:
            system = {"role": "system", "content": work.text(rng.randint(1_800, 6_000))}
            body = Conversation(system, "").next_turn(work.text, rng)
            if body is not None:
                out.append(("new", body, None, None))
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def fill(index: PrefixIndex, work: Workload, block_tokens: int) -> None:
    cap = index.max_blocks
    for k, (instance, body) in enumerate(work.indexed):
        # Answered, as a served request is: its blocks are no longer claims.
        index.settle(instance, *index.insert(instance, block_hashes(body, block_tokens, cap), k * 0.01))


def decisions(index: PrefixIndex, qs: list, block_tokens: int, now: float) -> dict[str, list[float]]:
    """Per decision kind, microseconds per decision; checks each against the ground truth."""
    times: dict[str, list[float]] = {"all": [], ">= 10k tokens": [], "parse": []}
    cap = index.max_blocks
    clock = time.perf_counter_ns
    raws = [orjson.dumps(body) for _, body, _, _ in qs]
    # The workload and the index are long-lived, as the proxy's start-up objects it freezes
    # (proxy.server.tune_gc): collections during the decisions see only what they allocate.
    gc.collect()
    gc.freeze()
    for (kind, _, holder, before), raw in zip(qs, raws):
        # The proxy hashes the body it has just parsed (so its text is in the CPU's caches).
        t0 = clock()
        body = orjson.loads(raw)
        # Every block hashed first, for comparison; which of the two runs first alternates (the
        # second finds the text and the index's entries in the CPU's caches).
        lazy_first = len(times["all"]) % 2 == 0
        t1 = clock()
        if lazy_first:
            matched = index.match(PromptBlocks.of(body, block_tokens, cap), now)
        t2 = clock()
        eager = index.match(block_hashes(body, block_tokens, cap), now)
        t3 = clock()
        if not lazy_first:
            matched = index.match(PromptBlocks.of(body, block_tokens, cap), now)
        t4 = clock()
        if eager != matched:
            raise SystemExit(f"{kind}: hashing all blocks matched {eager}, hashing as needed {matched}")
        spent = (t2 - t1 if lazy_first else t4 - t3) / 1000
        times["parse"].append((t1 - t0) / 1000)
        times.setdefault("eager", []).append((t3 - t2) / 1000)
        times["all"].append(spent)
        times.setdefault(kind, []).append(spent)
        if count_prompt_tokens(body) >= 10_000:
            times[">= 10k tokens"].append(spent)
        if holder is not None and before is not None:
            expected = len(block_hashes(before, block_tokens, cap))
            if matched[holder] != expected:
                raise SystemExit(f"{kind}: {holder} matched {matched[holder]} blocks, expected {expected}")
        if kind == "new" and any(matched.values()):
            raise SystemExit(f"a prompt never seen matched {matched}")
    gc.unfreeze()
    return times


def best_of(fn: Callable[[], object], repeat: int = 200) -> float:
    """Median microseconds of `fn` over `repeat` calls (the garbage collector on)."""
    spent = []
    clock = time.perf_counter_ns
    for _ in range(repeat):
        t0 = clock()
        fn()
        spent.append((clock() - t0) / 1000)
    return statistics.median(spent)


def breakdown(work: Workload, block_tokens: int) -> dict[str, float]:
    messages = [work.systems[0]]
    body: dict[str, Any] = {"model": "m", "messages": messages}
    while count_prompt_tokens(body) < 11_000:
        messages += [{"role": "user", "content": work.text(800)}, {"role": "assistant", "content": work.text(400)}]
    last = 12_000 - count_prompt_tokens(body) - 4  # the message's framing
    messages.append({"role": "user", "content": work.text(last)})
    tokens = count_prompt_tokens(body)
    data = prompt_stream(body)
    assert data is not None
    block_bytes = block_tokens * CHARS_PER_TOKEN
    hashes = block_hashes(body, block_tokens)
    # i0 holds the conversation up to its last turn, the others other conversations on its
    # system prompt; `unseen` is as long, on a system prompt no one has.
    held = PrefixIndex(block_tokens=block_tokens)
    held.insert("i0", block_hashes(dict(body, messages=messages[:-1]), block_tokens), 0.0)
    for k in (1, 2, 3):
        other = [messages[0], {"role": "user", "content": work.text(3_000)}]
        held.insert(f"i{k}", block_hashes({"messages": other}, block_tokens), 0.0)
    unseen = dict(body, messages=[{"role": "system", "content": work.text(3_000)}, *messages[1:]])

    def blake_chain() -> None:
        running = hashlib.blake2b(digest_size=8)
        view = memoryview(data)
        for start in range(0, len(data) // block_bytes * block_bytes, block_bytes):
            running.update(view[start : start + block_bytes])
            running.copy().digest()

    return {
        "tokens": tokens,
        "blocks": len(hashes),
        "stream": best_of(lambda: prompt_stream(body)),
        "xxh3 once": best_of(lambda: xxhash.xxh3_64_intdigest(data)),
        "sha256 once": best_of(lambda: hashlib.sha256(data).digest()),
        "blake2b once": best_of(lambda: hashlib.blake2b(data, digest_size=8).digest()),
        "chain": best_of(lambda: chain(data, block_bytes)),
        "blake2b chain": best_of(blake_chain),
        "match": best_of(lambda: held.match(hashes, 1e6)),
        "decision": best_of(lambda: held.match(block_hashes(body, block_tokens), 1e6)),
        "lazy next turn": best_of(lambda: held.match(PromptBlocks.of(body, block_tokens), 1e6)),
        "lazy unseen": best_of(lambda: held.match(PromptBlocks.of(unseen, block_tokens), 1e6)),
    }


def insert_cost(index: PrefixIndex, qs: list, block_tokens: int) -> list[float]:
    clock = time.perf_counter_ns
    spent = []
    for k, (_, body, holder, _) in enumerate(qs):
        blocks = PromptBlocks.of(body, block_tokens, index.max_blocks)
        index.match(blocks, 1e6 + k)
        t0 = clock()
        inserted = index.insert(holder or "i0", blocks, 1e6 + k)  # hashes what the decision did not
        index.settle(holder or "i0", *inserted)  # at its answer: part of what a request costs
        spent.append((clock() - t0) / 1000)
    return spent


def memory_held(work: Workload, block_tokens: int, max_blocks: int) -> tuple[int, int]:
    """(bytes, entries) of an index holding the workload's prefixes: its dicts and the ints."""
    gc.collect()
    tracemalloc.start()
    index = PrefixIndex(block_tokens=block_tokens, max_blocks=max_blocks)
    fill(index, work, block_tokens)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return held, len(index)


def memory_flood(block_tokens: int, prompts: int = 100_000) -> tuple[int, int, int]:
    """(bytes, entries, peak bytes) after `prompts` unique prompts at the default global cap."""
    gc.collect()
    tracemalloc.start()
    index = PrefixIndex(block_tokens=block_tokens)
    for i in range(prompts):
        index.settle(f"i{i % 4}", *index.insert(f"i{i % 4}", chain_ids([i, *range(i % 8)]), float(i)))
    gc.collect()
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(index) <= DEFAULT_MAX_BLOCKS
    return held, len(index), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefixes", type=int, default=10_000)
    parser.add_argument("--queries", type=int, default=2_000)
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--block-tokens", default="64,128,256")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sizes = [int(s) for s in args.block_tokens.split(",")]

    t0 = time.perf_counter()
    work = workload(args.prefixes, args.instances, args.seed)
    qs = queries(work, args.queries, args.seed)
    lengths = sorted(count_prompt_tokens(body) for _, body in work.indexed)
    print(
        f"{platform.python_implementation()} {platform.python_version()}, {platform.machine()}; "
        f"{len(work.indexed)} indexed prompts of {lengths[0]}-{lengths[-1]} tokens (median "
        f"{lengths[len(lengths) // 2]}) in {len(work.conversations)} conversations on {args.instances} instances; "
        f"{len(qs)} decisions; workload built in {time.perf_counter() - t0:.1f} s\n"
    )
    rows = []
    parts = []
    for bt in sizes:
        # A cap that holds every prefix: the decisions run at the full 10,000.
        index = PrefixIndex(block_tokens=bt, max_blocks=10_000_000)
        fill(index, work, bt)
        times = decisions(index, qs, bt, now=1e6)
        parts.append((bt, breakdown(work, bt)))
        inserts = insert_cost(index, qs, bt)
        held, entries = memory_held(work, bt, 10_000_000)
        flood, flood_entries, _ = memory_flood(bt)
        rows.append((bt, times, inserts, held, entries, flood, flood_entries))
        del index
        gc.collect()

    print("Per decision (hash the parsed body as far as it matches + match on every instance), microseconds:\n")
    print(
        "| block tokens | p50 | p99 | p50 >= 10k tokens | p99 >= 10k tokens | p50 next turn | p50 new "
        "| p50 / p99 hashing every block | insert after dispatch p50 / p99 | JSON parse p50 (paid already) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for bt, times, inserts, *_ in rows:
        long = times[">= 10k tokens"]
        print(
            f"| {bt} | {percentile(times['all'], 0.5):.0f} | {percentile(times['all'], 0.99):.0f} | "
            f"{percentile(long, 0.5):.0f} | {percentile(long, 0.99):.0f} | "
            f"{percentile(times['next turn'], 0.5):.0f} | {percentile(times['new'], 0.5):.0f} | "
            f"{percentile(times['eager'], 0.5):.0f} / {percentile(times['eager'], 0.99):.0f} | "
            f"{percentile(inserts, 0.5):.0f} / {percentile(inserts, 0.99):.0f} | "
            f"{percentile(times['parse'], 0.5):.0f} |"
        )
    print("\nOne 12,000-token chat prompt, microseconds (medians of 200):\n")
    print(
        "| block tokens | blocks | byte stream | XXH3-64 of it once | SHA-256 once | BLAKE2b once | XXH3-64 chain "
        "| BLAKE2b chain "
        "| match, 4 instances | decision, every block | decision, next turn | decision, unseen |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for bt, p in parts:
        print(
            f"| {bt} | {p['blocks']:.0f} | {p['stream']:.1f} | {p['xxh3 once']:.1f} | {p['sha256 once']:.1f} | "
            f"{p['blake2b once']:.1f} | "
            f"{p['chain']:.1f} | {p['blake2b chain']:.1f} | {p['match']:.1f} | {p['decision']:.1f} | "
            f"{p['lazy next turn']:.1f} | {p['lazy unseen']:.1f} |"
        )
    print("\nMemory (tracemalloc: the index's dicts and the hash ints it keeps):\n")
    print(
        "| block tokens | all prefixes held: entries | MB | bytes / entry | 100,000 unique prompts at the default cap: entries | MB |"
    )
    print("|---|---|---|---|---|---|")
    for bt, _, _, held, entries, flood, flood_entries in rows:
        print(
            f"| {bt} | {entries:,} | {held / 1e6:.1f} | {held / max(entries, 1):.0f} | {flood_entries:,} | {flood / 1e6:.1f} |"
        )
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
