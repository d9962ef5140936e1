"""How fast the twin's virtual clock runs: 10,000 requests at about 100 concurrent streams.

    .venv/bin/python bench/sim_virtual.py [--requests 10000] [--rate 16] [--profile h200-llama8b]

Requests take their prompt and output lengths from the Azure conversation trace (in trace
order) and arrive as a Poisson process; a spec and a base engine share them (spec while it has
a free slot). Prints a Markdown table of CPU seconds, simulated seconds and the mean number of
concurrent streams; docs/twin.md records the figures.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence

from fleet.profile import load_profile
from sim.engine import Engine, EngineConfig
from sim.lengths import read_trace
from sim.virtual import Arrival, EngineView, simulate

# Arrival rates (per simulated second) that keep about 100 streams in flight on a spec + base pair.
RATE_FOR_100_STREAMS = {"h200-llama8b": 31.0, "kimi-linear": 8.5, "kimi-moe": 7.5}


def arrivals(n: int, rate: float, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    rows = read_trace("azure-conv")
    t = 0.0
    out = []
    for i in range(n):
        t += rng.expovariate(rate)
        row = rows[i % len(rows)]
        out.append(Arrival(t, row.context_tokens, output_tokens=max(row.generated_tokens, 1)))
    return out


def run(n: int, rate: float, profile_name: str, seed: int) -> dict[str, float]:
    profile = load_profile(profile_name)
    fleet = [
        Engine(EngineConfig("spec", profile, seed=seed), "spec"),
        Engine(EngineConfig("base", profile, seed=seed + 1), "base"),
    ]
    batch = []

    def router(arrival: Arrival, views: Sequence[EngineView]) -> int:
        spec = views[0]
        return 0 if spec.running + spec.waiting < spec.max_running_requests else 1

    work = arrivals(n, rate, seed)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    records = simulate(fleet, work, router, on_step=lambda s: batch.append(s.batch) if s.kind == "decode" else None)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    span = max(r.finish_time for r in records) - min(r.arrival for r in records)
    return {
        "requests": len(records),
        "cpu_s": cpu,
        "wall_s": wall,
        "simulated_s": span,
        "mean_streams": sum(r.e2e for r in records) / span,
        "decode_steps": len(batch),
        "tokens": sum(r.output_tokens for r in records),
        "spec_share": sum(r.engine == 0 for r in records) / len(records),
        "ttft_p50_s": statistics.median(r.ttft for r in records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="arrivals per simulated second (default: about 100 concurrent streams per profile)",
    )
    parser.add_argument("--profile", action="append", help="repeat for several (default: all three built-ins)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    profiles = args.profile or ["h200-llama8b", "kimi-linear", "kimi-moe"]
    print("| profile | requests | mean streams | simulated s | decode steps | tokens | CPU s | requests per CPU s |")
    print("|---|---|---|---|---|---|---|---|")
    for name in profiles:
        r = run(args.requests, args.rate or RATE_FOR_100_STREAMS.get(name, 10.0), name, args.seed)
        print(
            f"| {name} | {r['requests']:,} | {r['mean_streams']:.0f} | {r['simulated_s']:,.0f} | "
            f"{r['decode_steps']:,} | {r['tokens']:,} | {r['cpu_s']:.2f} | {r['requests'] / r['cpu_s']:,.0f} |"
        )


if __name__ == "__main__":
    main()
