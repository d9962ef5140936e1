"""How light the HTTP twin is: many concurrent streams, the twin's CPU, and its decode rate.

    .venv/bin/python bench/sim_http.py [--streams 200] [--seconds 15] [--profile kimi-linear]

Starts one base twin and one spec twin (sim/testing.py), holds `--streams` concurrent streams
on the base twin (48 on the spec twin, its cap) for `--seconds`, and reports per twin: the CPU
it used (from /proc), chunks per second, and the mean chunk interval of the streams against the
profile's step time for that batch (the drift-free clock should keep it within a few percent).
Prints a Markdown table; docs/twin.md records the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import httpx

from fleet.profile import load_profile
from sim.testing import RunningTwin, TwinSpec, twins


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def hold_streams(t: RunningTwin, n: int, seconds: float) -> list[list[float]]:
    """n streams that run for `seconds`; returns each stream's chunk arrival times."""
    body = {"messages": [{"role": "user", "content": "Go."}], "max_tokens": 30_000, "ignore_eos": True, "stream": True}
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(base_url=t.url, limits=limits, timeout=60) as client:
        stop_at = time.monotonic() + seconds

        async def one() -> list[float]:
            times = []
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        now = time.monotonic()
                        times.append(now)
                        if now > stop_at:
                            break
            return times

        return await asyncio.gather(*(one() for _ in range(n)))


def itl_totals(t: RunningTwin) -> tuple[float, float]:
    """(sum, count) of the twin's own inter-token latency histogram (simulated seconds)."""
    text = httpx.get(t.url + "/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        for key in ("sum", "count"):
            if line.startswith(f"sglang:inter_token_latency_seconds_{key}"):
                values[key] = float(line.rsplit(" ", 1)[1])
    return values.get("sum", 0.0), values.get("count", 0.0)


def measure(t: RunningTwin, n: int, seconds: float, expected_step_s: float, scale: float) -> dict[str, float]:
    cpu0, wall0 = cpu_seconds(t.process.pid), time.monotonic()
    itl0 = itl_totals(t)
    streams = asyncio.run(hold_streams(t, n, seconds))
    cpu, wall = cpu_seconds(t.process.pid) - cpu0, time.monotonic() - wall0
    itl1 = itl_totals(t)
    # Steady state: skip each stream's first 2 s (all streams admitted by then).
    intervals = []
    for times in streams:
        steady = [x for x in times if x > times[0] + 2.0]
        if len(steady) > 2:
            intervals.append((steady[-1] - steady[0]) / (len(steady) - 1) * scale)
    interval = statistics.mean(intervals)
    return {
        "streams": n,
        "cpu_pct": 100 * cpu / wall,
        "chunks_per_s": sum(len(s) for s in streams) / wall,
        "interval_ms": interval * 1000,
        "expected_ms": expected_step_s * 1000,
        "error_pct": 100 * (interval / expected_step_s - 1),
        # Per-token ITL as the twin itself records it; for base it is the step time.
        "server_itl_ms": 1000 * (itl1[0] - itl0[0]) / max(itl1[1] - itl0[1], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--profile", default="kimi-linear")
    parser.add_argument("--time-scale", type=float, default=1.0)
    args = parser.parse_args()
    profile = load_profile(args.profile)
    scale = args.time_scale
    spec_alpha_args = ("--mean-alpha", "0.64")
    with twins(
        TwinSpec("base", args.profile, time_scale=scale),
        TwinSpec("spec", args.profile, time_scale=scale, args=spec_alpha_args),
    ) as (base, spec):
        rows = [
            ("base", measure(base, args.streams, args.seconds, profile.base_step_ms(args.streams, 200) / 1000, scale)),
            ("spec", measure(spec, 48, args.seconds, profile.spec_step_ms(48, 3, 200) / 1000, scale)),
        ]
    print(f"profile {args.profile}, time scale {scale}, {args.seconds:.0f} s per run, {os.cpu_count()} cores")
    print(
        "| twin | streams | twin CPU % | chunks/s | client-seen chunk interval ms | profile step ms | error % "
        "| twin's own ITL ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        print(
            f"| {name} | {r['streams']} | {r['cpu_pct']:.0f} | {r['chunks_per_s']:,.0f} | {r['interval_ms']:.2f} | "
            f"{r['expected_ms']:.2f} | {r['error_pct']:+.1f} | {r['server_itl_ms']:.2f} |"
        )


if __name__ == "__main__":
    main()
