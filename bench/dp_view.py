"""Data-parallel servers over HTTP: `python -m bench.dp_view` (docs/routing.md, "Signals").

SGLang with `--dp-size 2` runs two engines behind one front, dealt requests in turn. The router
sees such a server one engine at a time (a request joins one engine's batch and queue); seen
whole, a spec server with 50 running looked like one batch of 50, whose verify step is far
slower than two of 25. This runs `specroute serve` in front of a spec and a base twin of two
ranks each (h200-llama8b, alpha 0.6, real time), Poisson arrivals of streamed chat requests
(Azure conversation lengths) at a share of the two servers' capacity for 60 s, with the
goodput policy (its own profile, no SLO: mean latency) and the two static policies, and reports
each one's mean end-to-end latency, TPOT and spec share as the clients measured them.

    python -m bench.dp_view            # 50 % of capacity, three policies: about 5 minutes
    python -m bench.dp_view --quick    # 20 s of arrivals
    python -m bench.dp_view --policies goodput --load 0.5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.admission_http import offered_load
from bench.chaos import proxy_process
from bench.routing import SETUPS, capacity_rps, lengths
from sim.testing import TwinSpec, twins

SETUP = "h200-llama8b a=0.60"
RANKS = 2
POLICIES = ("spec", "base", "goodput")
MAX_OUTPUT = 2000
"""The longest answer asked for (the trace's longest would outlast the run)."""


async def one(client: httpx.AsyncClient, url: str, prompt_tokens: int, output: int, index: int) -> dict[str, Any]:
    # Its own first word: the twins keep a prefix cache, and prompts of one repeated word would be
    # each other's prefixes.
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": f"request{index} " + "w " * (2 * prompt_tokens - 1)}],
        "max_tokens": min(output, MAX_OUTPUT),
        "ignore_eos": True,
        "stream": True,
    }
    started = time.monotonic()
    first = None
    record: dict[str, Any] = {"done": False, "pool": ""}
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            record["pool"] = response.headers.get("x-specroute-pool", "")
            if response.status_code != 200:
                await response.aread()
                return record  # not finished: counted as such
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    record["done"] = first is not None
                    break
                if first is None and line.startswith("data: ") and '"content"' in line:
                    first = time.monotonic()
    except httpx.HTTPError as exc:
        record["error"] = type(exc).__name__
        return record
    end = time.monotonic()
    record["e2e_s"] = end - started
    if first is not None:
        record["ttft_s"] = first - started
        record["tpot_s"] = (end - first) / max(min(output, MAX_OUTPUT) - 1, 1)
    return record


def run(policy: str, load: float, duration_s: float) -> dict[str, Any]:
    setup = SETUPS[SETUP]
    sample = lengths()
    rate = load * RANKS * capacity_rps(setup, sample)
    common = ("--dp-size", str(RANKS), "--mean-alpha", str(setup.alpha))
    with twins(
        TwinSpec("spec", profile=setup.profile, seed=1, args=common),
        TwinSpec("base", profile=setup.profile, seed=2, args=common),
    ) as (spec, base):
        env = {"SPECROUTE_PROFILE": setup.profile, "SPECROUTE_POLICY": policy, "SPECROUTE_REQUEST_LOG": "false"}
        with proxy_process([spec.url], [base.url], Path(f"/tmp/specroute-dp-view-{policy}.log"), **env) as (_, url):
            records = asyncio.run(offered_load(url, duration_s, rate, sample, seed=100, send=one))
    done = [r for r in records if r["done"]]
    if not done:
        raise SystemExit(f"{policy}: no request finished (the proxy's log: /tmp/specroute-dp-view-{policy}.log)")
    return {
        "rate_rps": round(rate, 2),
        "requests": len(records),
        "unfinished": len(records) - len(done),
        "mean_e2e_s": statistics.fmean(r["e2e_s"] for r in done),
        "mean_ttft_s": statistics.fmean(r["ttft_s"] for r in done),
        "mean_tpot_ms": 1000 * statistics.fmean(r["tpot_s"] for r in done),
        "spec_share": sum(1 for r in done if r["pool"] == "spec") / max(len(done), 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dp_view", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 s of arrivals")
    parser.add_argument("--load", type=float, default=0.5, help="share of the two servers' capacity")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    args = parser.parse_args(argv)
    duration = 20.0 if args.quick else 60.0
    started = time.monotonic()
    rows = [(policy, run(policy, args.load, duration)) for policy in args.policies]
    print(
        f"`python -m bench.dp_view{' --quick' if args.quick else ''} --load {args.load:g}` "
        f"({time.strftime('%Y-%m-%d %H:%M')}, {time.monotonic() - started:.0f} s; {SETUP} twins of {RANKS} ranks "
        f"each in real time, {args.load:.0%} of capacity for {duration:.0f} s):\n"
    )
    print("| policy | offered rps | requests | unfinished | mean E2E s | mean TTFT s | mean TPOT ms | spec share |")
    print("|---|---|---|---|---|---|---|---|")
    for policy, r in rows:
        print(
            f"| {policy} | {r['rate_rps']} | {r['requests']} | {r['unfinished']} | {r['mean_e2e_s']:.2f} | "
            f"{r['mean_ttft_s']:.3f} | {r['mean_tpot_ms']:.1f} | {r['spec_share']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
