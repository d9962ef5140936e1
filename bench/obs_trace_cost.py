"""What tracing every request costs the proxy: throughput and CPU per request, tracing off vs on.

    flock /tmp/specroute-bench.lock .venv/bin/python -m bench.obs_trace_cost   # 8 rounds
    .venv/bin/python -m bench.obs_trace_cost --quick    # fewer requests, one round (a smoke run)

The proxy runs in front of bench.proxy_upstream (the fast fake upstream of the proxy benchmark);
tracing exports every request's spans (server, decision, attempt: 3 per request, sampler
always_on) over OTLP to a real Jaeger v2 on this machine (http/protobuf and grpc: Jaeger's own CPU
shares the 2 cores, so these are upper bounds), and over http to bench.otlp_sink, a receiver that
stores nothing ("sink": the proxy's own cost of tracing). Configurations run interleaved, round
after round, in reverse order every other round, so background load on the machine falls on all
of them alike; the table gives the median and the best round of each (noise only ever lowers
throughput and raises CPU, so the best rounds are the least disturbed), and the median of each
round's change against that round's tracing-off run (a pair measured a minute apart, so slow
swings in the machine's load cancel). CPU is the proxy process's (all its threads, from /proc).
docs/observability.md records the figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from bench.proxy_bench import SCENARIOS, free_port, measure, process, specroute_cmd
from tests.observability.obs_jaeger import Jaeger, jaeger_binary

CONFIGS = ("off", "sink", "http/protobuf", "grpc")
MEASURED = ("c64-json", "c64-stream")


def tracing_env(config: str, jaeger: Jaeger, sink_port: int) -> dict[str, str]:
    if config == "off":
        return {"SPECROUTE_TRACES": "false"}
    endpoints = {"grpc": jaeger.otlp_grpc_endpoint, "http/protobuf": jaeger.otlp_http_endpoint,
                 "sink": f"http://127.0.0.1:{sink_port}"}
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoints[config],
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc" if config == "grpc" else "http/protobuf",
        "OTEL_TRACES_SAMPLER": "always_on",
        "OTEL_SERVICE_NAME": "specroute-bench",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tenth of the requests, one round")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--scale", type=float, default=0.2, help="of the proxy benchmark's request counts")
    args = parser.parse_args()
    scale, rounds = (0.1, 1) if args.quick else (args.scale, args.rounds)
    scenarios = [s for s in SCENARIOS if s.name in MEASURED]
    results: dict[tuple[str, str], list[dict[str, float]]] = {}

    with tempfile.TemporaryDirectory() as tmp:
        jaeger = Jaeger(jaeger_binary(), Path(tmp))
        try:
            upstream_port, sink_port = free_port(), free_port()
            upstream = [sys.executable, "-m", "bench.proxy_upstream", str(upstream_port), "64"]
            sink = [sys.executable, "-m", "bench.otlp_sink", str(sink_port)]
            with process(upstream, upstream_port), process(sink, sink_port):
                for round_number in range(rounds):
                    for config in CONFIGS if round_number % 2 == 0 else CONFIGS[::-1]:
                        port = free_port()
                        cmd, env = specroute_cmd(upstream_port, port)
                        with process(cmd, port, {**env, **tracing_env(config, jaeger, sink_port)}) as proxy:
                            for scenario in scenarios:
                                m = measure(port, scenario, scale, proxy.pid)
                                results.setdefault((config, scenario.name), []).append(m)
                                print(f"round {round_number + 1} {config:>13} {scenario.name:>10}: "
                                      f"{m['rate']:,.0f} req/s, {m['cpu_us']:,.0f} us CPU/req, "
                                      f"p50 {m['p50_ms']:.2f} ms, errors {m['errors']:.0f}", flush=True)
        finally:
            jaeger.stop()

    print()
    print("| scenario | tracing | req/s median (best) | vs off: medians (best; paired) "
          "| CPU us/req median (best) | vs off: medians (best; paired) | errors |")
    print("|---|---|---|---|---|---|---|")
    for scenario in scenarios:
        off_runs = results[("off", scenario.name)]
        off = summary(off_runs)
        for config in CONFIGS:
            runs = results[(config, scenario.name)]
            m = summary(runs)
            errors = sum(r["errors"] for r in runs)
            paired_rate = statistics.median(r["rate"] / o["rate"] - 1 for r, o in zip(runs, off_runs)) * 100
            paired_cpu = statistics.median(r["cpu_us"] / o["cpu_us"] - 1 for r, o in zip(runs, off_runs)) * 100
            print(f"| {scenario.name} | {config} | {m['rate']:,.0f} ({m['best_rate']:,.0f}) "
                  f"| {change(m['rate'], off['rate'])} ({change(m['best_rate'], off['best_rate'])}; {paired_rate:+.1f} %) "
                  f"| {m['cpu']:,.0f} ({m['best_cpu']:,.0f}) "
                  f"| {change(m['cpu'], off['cpu'])} ({change(m['best_cpu'], off['best_cpu'])}; {paired_cpu:+.1f} %) "
                  f"| {errors:.0f} |")


def summary(runs: list[dict[str, float]]) -> dict[str, float]:
    return {
        "rate": statistics.median(r["rate"] for r in runs),
        "best_rate": max(r["rate"] for r in runs),
        "cpu": statistics.median(r["cpu_us"] for r in runs),
        "best_cpu": min(r["cpu_us"] for r in runs),
    }


def change(value: float, base: float) -> str:
    return f"{(value / base - 1) * 100:+.1f} %"


if __name__ == "__main__":
    main()
