"""What one routing decision costs in the served path, the prefix index and sessions included.

    flock /tmp/specroute-bench.lock .venv/bin/python -m bench.prefix_decision [--quick]
        [--prefixes 10000] [--decisions 2000] [--seed 0] [--profile]

The decision as the proxy makes it for a parsed chat body: hash its prompt's blocks and take
each instance's credit (`PromptBlocks.of`, `FleetModel.cached`, the session's entry included),
the snapshot (`features.with_cached(credit)` when some instance is credited, as the proxy's
`Router.with_credit` does, and `FleetModel.snapshot(now, workload)`), the policy (`Goodput().decide`: with an instance holding part of the prompt it
predicts on every healthy instance of that pool), and the instance it names or the least loaded
one; then, reported apart, the insert after dispatch (`FleetModel.on_dispatch` with the blocks,
the match and the session). Each part of each decision is timed alone (perf_counter_ns, the
garbage collector on, the long-lived objects frozen out of its collections as the proxy freezes
its start-up objects).

The fleet: 2 spec + 2 base instances (cap 48) in one FleetModel seeded from the h200-llama8b
profile, readings every 0.2 s (10-40 running, 0-3 waiting with their unprefilled tokens; spec's
acceptance gauge and counters), responses teaching the step cost, acceptance per workload and
the cached tokens servers report, completions a few seconds after dispatch: the snapshot is
fresh and the cost model has learned buckets, as in service. Its prefix index first takes
`--prefixes` prompts (bench/prefix_index.py's workload: conversations on 40 shared system
prompts, each turn extending the previous one; every conversation named as a session), each
dispatched through `on_dispatch` at 40 requests/s. The decisions are next turns of indexed
conversations (60 %), new conversations on a shared system prompt (25 %) and prompts never seen
(15 %), each with its session's name or none (half of each). Ground truth: a next turn must be
credited at least its previous turn's whole blocks on the instance that holds it.

A digest of every decision (pool, reason, instance, scores, credits) is printed: a change that
must not change decisions keeps it (it covers the cache-credit path bench.decisions does not,
as the virtual clock does not use the index yet). `--profile` adds a cProfile of the decisions.
`--quick` (1,000 prefixes, 300 decisions) prints only; a full run writes its table into
docs/routing.md ("Prefix index"). The decision runs compiled when `make native` built the
sources as they are (fleet/native.py), else from source; the header says which.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import heapq
import io
import os
import platform
import pstats
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.markers import write_section
from bench.prefix_index import Conversation, Text, corpus, percentile
from fleet import native
from fleet.blocks import PromptBlocks
from fleet.costmodel import seed_from_profile
from fleet.features import count_prompt_tokens, workload_key
from fleet.model import FleetModel, PrefixMatch
from fleet.readings import Dispatch, Reading, ResponseEvidence
from fleet.types import Decision, Features
from policies.goodput import Goodput

DOC = Path(__file__).resolve().parent.parent / "docs" / "routing.md"
START, END = "<!-- prefix-decision:start -->", "<!-- prefix-decision:end -->"
PROFILE = "h200-llama8b"
SPEC = ("http://spec-0:30000", "http://spec-1:30000")
BASE = ("http://base-0:30000", "http://base-1:30000")
URLS = SPEC + BASE
MAX_RUNNING = 48
RATE = 40.0
"""Requests per second, while filling the index and while deciding (simulated time)."""
READ_EVERY_S = 0.2
PARTS = ("hash+match", "snapshot", "decide", "total", "insert")


@dataclass
class Query:
    kind: str
    body: dict[str, Any]
    session: str | None
    holder: str | None
    """The instance that holds its previous turn (next turns)."""
    held_blocks: int
    """Whole blocks of that previous turn."""


@dataclass
class Indexed:
    conversation: int
    body: dict[str, Any]


def build(prefixes: int, seed: int) -> tuple[list[Indexed], list[Conversation], list[dict[str, str]], Text]:
    """bench.prefix_index's workload, each prompt tagged with its conversation."""
    rng = random.Random(seed)
    text = Text(rng, corpus(rng, 4_000_000))
    systems = [{"role": "system", "content": text(rng.randint(1_800, 6_000))} for _ in range(40)]
    indexed: list[Indexed] = []
    conversations: list[Conversation] = []
    while len(indexed) < prefixes:
        conv = Conversation(rng.choice(systems), URLS[len(conversations) % len(URLS)])
        conversations.append(conv)
        for _ in range(rng.randint(1, 12)):
            body = conv.next_turn(text, rng) if len(indexed) < prefixes else None
            if body is None:
                break
            indexed.append(Indexed(len(conversations) - 1, body))
    return indexed, conversations, systems, text


def queries(
    conversations: list[Conversation], systems: list[dict[str, str]], text: Text, n: int, seed: int
) -> list[Query]:
    rng = random.Random(seed + 1)
    out: list[Query] = []
    fresh = 0
    while len(out) < n:
        roll = rng.random()
        named = rng.random() < 0.5
        if roll < 0.6:
            c = rng.randrange(len(conversations))
            conv = conversations[c]
            if not conv.messages:
                continue
            before = PromptBlocks.of(conv.body())
            body = Conversation(conv.system, conv.instance, list(conv.messages)).next_turn(text, rng)
            if body is not None:
                session = f"conv-{c}" if named else None
                out.append(Query("next turn", body, session, conv.instance, len(before)))
            continue
        system = rng.choice(systems) if roll < 0.85 else {"role": "system", "content": text(rng.randint(1_800, 6_000))}
        body = Conversation(system, "").next_turn(text, rng)
        if body is not None:
            fresh += 1
            kind = "shared system" if roll < 0.85 else "never seen"
            out.append(Query(kind, body, f"fresh-{fresh}" if named else None, None, 0))
    return out


class Fleet:
    """The FleetModel and what feeds it between decisions (readings, responses, completions),
    none of it timed."""

    def __init__(self, seed: int):
        self.model = FleetModel(pools={"spec": 3, "base": 0}, seed=seed_from_profile(PROFILE))
        for url in SPEC:
            self.model.add_instance(url, "spec", MAX_RUNNING)
        for url in BASE:
            self.model.add_instance(url, "base", MAX_RUNNING)
        self.rng = random.Random(seed + 2)
        self.now = 0.0
        self.next_read = 0.0
        self.finishing: list[tuple[float, int, str, Dispatch, str | None]] = []
        self.counters = {url: [0.0, 0.0] for url in SPEC}
        self.serial = 0

    def advance(self, now: float) -> None:
        """Responses and completions due by `now`, then the readings due."""
        rng = self.rng
        while self.finishing and self.finishing[0][0] <= now:
            at, _, url, sent, workload = heapq.heappop(self.finishing)
            spec = url in SPEC
            tokens = rng.randint(50, 600)
            evidence = ResponseEvidence(
                tokens=tokens,
                verify_steps=int(tokens / rng.uniform(2.0, 3.2)) if spec else None,
                step_ms=rng.uniform(9, 14) if spec else rng.uniform(7, 10),
                decode_s=tokens * 0.01,
                ttft_s=rng.uniform(0.05, 0.4),
                dispatch=sent,
                workload=workload,
                prompt_tokens=sent.prompt_tokens,
                cached_tokens=int(sent.matched_tokens * rng.uniform(0.8, 1.0)),
            )
            self.model.on_response(url, at, evidence)
            self.model.on_complete(url, at, sent)
        while self.next_read <= now:
            at = self.next_read
            for url in URLS:
                running = rng.randint(10, 40)
                waiting = rng.choice((0, 0, 0, 1, 2, 3))
                counters = self.counters.get(url)
                accept = None
                if counters is not None:
                    counters[1] += running * 20
                    counters[0] += running * 20 * rng.uniform(2.0, 3.2)
                    accept = rng.uniform(2.0, 3.2)
                self.model.on_reading(
                    url,
                    Reading(
                        at=at,
                        running=running,
                        waiting=waiting,
                        max_running=MAX_RUNNING,
                        waiting_tokens=waiting * rng.randint(500, 4_000),
                        accept_length=accept,
                        accept_steps=running * 20.0,
                        tokens_total=counters[0] if counters else None,
                        verify_total=counters[1] if counters else None,
                    ),
                )
            self.next_read += READ_EVERY_S
        self.now = now

    def dispatched(self, url: str, sent: Dispatch, workload: str | None) -> None:
        self.serial += 1
        heapq.heappush(self.finishing, (self.now + self.rng.uniform(1.0, 8.0), self.serial, url, sent, workload))


def features_of(body: dict[str, Any]) -> Features:
    """What the proxy has built before the decision (not timed here)."""
    return Features(prompt_tokens=count_prompt_tokens(body), workload=workload_key(body))


def fill(fleet: Fleet, indexed: list[Indexed]) -> None:
    model = fleet.model
    for k, item in enumerate(indexed):
        now = k / RATE
        fleet.advance(now)
        url = URLS[item.conversation % len(URLS)]
        features = features_of(item.body)
        blocks = PromptBlocks.of(item.body, max_blocks=model.prefix.max_blocks)
        session = f"conv-{item.conversation}"
        match = model.cached(blocks, features.prompt_tokens, now, session)
        sent = model.on_dispatch(url, now, features.prompt_tokens, blocks=blocks, match=match, session=session)
        fleet.dispatched(url, sent, features.workload)


def decide(
    fleet: Fleet, policy: Goodput, qs: list[Query], check: bool = True
) -> tuple[dict[str, list[float]], str, dict]:
    """Times each decision's parts; returns microseconds per part (and per kind of request for
    the total), the digest of the decisions, and a few counts."""
    model = fleet.model
    clock = time.perf_counter_ns
    times: dict[str, list[float]] = {part: [] for part in PARTS}
    digest = hashlib.sha256()
    counts = {"next turns": 0, "to holder": 0, "named instance": 0, "predicts>2": 0}
    start = fleet.now + 1.0
    featured = [features_of(q.body) for q in qs]
    gc.collect()
    gc.freeze()
    for k, (q, features) in enumerate(zip(qs, featured)):
        now = start + k / RATE
        fleet.advance(now)
        t0 = clock()
        blocks = PromptBlocks.of(q.body, max_blocks=model.prefix.max_blocks)
        match: PrefixMatch = model.cached(blocks, features.prompt_tokens, now, q.session)
        t1 = clock()
        routed = features.with_cached(match.credit) if match.credit else features
        snapshot = model.snapshot(now, routed.workload)
        t2 = clock()
        decision: Decision = policy.decide(routed, snapshot)
        url = decision.instance
        if url is None:
            pool = snapshot.pools[decision.pool]
            least = pool.least_loaded()
            assert least is not None
            url = least.url
        t3 = clock()
        sent = model.on_dispatch(url, now, features.prompt_tokens, blocks=blocks, match=match, session=q.session)
        t4 = clock()
        fleet.dispatched(url, sent, features.workload)
        for part, spent in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2, t3 - t0, t4 - t3)):
            times[part].append(spent / 1000)
        total = (t3 - t0) / 1000
        times.setdefault(q.kind, []).append(total)
        times.setdefault(f"{q.kind}, {'session' if q.session else 'no session'}", []).append(total)
        digest.update(
            f"{decision.pool} {decision.reason} {decision.instance} {sorted(decision.scores.items())!r} "
            f"{sorted(match.credit.items())!r} {sorted(match.matched.items())!r}\n".encode()
        )
        counts["named instance"] += decision.instance is not None
        if q.kind == "next turn":
            counts["next turns"] += 1
            counts["to holder"] += url == q.holder
            if check and q.holder is not None:
                expected = min(q.held_blocks * model.prefix.block_tokens, features.prompt_tokens - 1)
                if match.matched.get(q.holder, 0) < expected:
                    raise SystemExit(
                        f"next turn: {q.holder} matched {match.matched.get(q.holder, 0)} tokens, expected >= {expected}"
                    )
    gc.unfreeze()
    return times, digest.hexdigest()[:16], counts


def machine() -> str:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        pass
    return f"{platform.python_implementation()} {platform.python_version()}, {cpu}, {os.cpu_count()} cores"


def table(times: dict[str, list[float]]) -> str:
    def cell(key: str) -> str:
        values = times.get(key, [])
        if not values:
            return "- | -"
        return f"{percentile(values, 0.5):.1f} | {percentile(values, 0.99):.1f}"

    lines = ["| part | p50 (us) | p99 (us) | decisions |", "|---|---|---|---|"]
    names = {
        "hash+match": "hash + match (`PromptBlocks.of`, `FleetModel.cached`)",
        "snapshot": "snapshot (`features.with_cached`, `FleetModel.snapshot`)",
        "decide": "decide (`Goodput.decide`, the instance)",
        "total": "**the decision** (the three above)",
        "insert": "insert after dispatch (`FleetModel.on_dispatch`), apart",
    }
    for part in PARTS:
        lines.append(f"| {names[part]} | {cell(part)} | {len(times[part])} |")
    for kind in ("next turn", "shared system", "never seen"):
        for named in ("session", "no session"):
            key = f"{kind}, {named}"
            lines.append(f"| the decision: {key} | {cell(key)} | {len(times.get(key, []))} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1,000 prefixes, 300 decisions; prints only")
    parser.add_argument("--prefixes", type=int, default=None)
    parser.add_argument("--decisions", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="also profile the decisions (cProfile)")
    parser.add_argument("--no-write", action="store_true", help="print only, docs/routing.md untouched")
    args = parser.parse_args()
    prefixes = args.prefixes or (1_000 if args.quick else 10_000)
    n = args.decisions or (300 if args.quick else 2_000)

    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    indexed, conversations, systems, text = build(prefixes, args.seed)
    qs = queries(conversations, systems, text, n, args.seed)
    fleet = Fleet(args.seed)
    fill(fleet, indexed)
    model = fleet.model
    policy = Goodput()
    # A second fleet for the profile: the same state, not disturbed by the timed run's inserts.
    if args.profile:
        shadow = Fleet(args.seed)
        fill(shadow, indexed)
    built = time.perf_counter() - started
    times, digest, counts = decide(fleet, policy, qs)
    load_after = os.getloadavg()[0]
    lengths = sorted(count_prompt_tokens(i.body) for i in indexed)
    when = time.strftime("%Y-%m-%d %H:%M")
    path = "compiled (make native)" if native.status().compiled else "from source"
    header = (
        f"`python -m bench.prefix_decision{' --quick' if args.quick else ''}` ({when}; {machine()}, "
        f"shared; load average {load_before:.2f} -> {load_after:.2f}; decision path {path}): "
        f"{len(indexed):,} indexed prompts of "
        f"{lengths[0]:,}-{lengths[-1]:,} tokens in {len(conversations):,} conversations, "
        f"{len(model.prefix):,} (instance, block) entries, {len(model.sessions):,} sessions; {len(qs):,} "
        f"decisions on 2 spec + 2 base instances ({PROFILE} seed, 256-token blocks); decisions digest {digest}"
    )
    share = counts["to holder"] / max(counts["next turns"], 1)
    note = (
        f"Next turns sent to the instance holding their previous turn: {counts['to holder']} of "
        f"{counts['next turns']} ({share:.0%}); decisions naming an instance for its cached prefix: "
        f"{counts['named instance']} of {len(qs)}."
    )
    section = f"{header}\n\n{table(times)}\n\n{note}"
    print(section)
    print(f"\nbuilt in {built:.1f} s, total {time.perf_counter() - started:.0f} s")
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        decide(shadow, Goodput(), qs, check=False)
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(os.environ.get("SORT", "tottime")).print_stats(45)
        print(out.getvalue())
    if not args.quick and not args.no_write:
        write_section(DOC, section, START, END, title="Prefix decision cost")
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
