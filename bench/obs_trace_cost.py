"""What tracing every request costs the proxy: its CPU per request, so its throughput, traced vs not.

    flock /tmp/specroute-bench.lock .venv/bin/python -m bench.obs_trace_cost   # 6 rounds, about 10 minutes
    .venv/bin/python -m bench.obs_trace_cost --quick    # one round, shorter windows (a smoke run)

On a shared 2-vCPU machine the same configuration's throughput drifts by +-20 % from one minute
to the next, more than the effect measured. So each traced configuration runs side by side with
a tracing-off proxy, at the same time: both pinned to CPU 1, each loaded by its own 64 clients
for the same window, while the load generator, the fast fake upstream (bench.proxy_upstream),
the OTLP receivers and the span export processes share CPU 0. Whatever slows the machine slows
both alike, and the ratio of their CPU time per request (from /proc) is what tracing costs. The
proxy serves from one event loop and is bound by its CPU, so its throughput when saturated
changes by off/on - 1 of that ratio ("capacity"); the measured request rates are shown too.

Traced configurations (sampler always_on, 3 spans per request): the span export in its own
process (the default) and inline (SPECROUTE_TRACE_EXPORT=inline), both to bench.otlp_sink, a
receiver that stores nothing; and the default to a real Jaeger v2 over http/protobuf and grpc.
The export process's CPU per request (it has CPU 0 here) is a column of its own.
docs/observability.md records the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import uvloop

from bench.proxy_bench import BODY, CHUNKS, STREAM_BODY, cpu_seconds, free_port, process, specroute_cmd
from bench.proxy_loadgen import _Conn, build_request, check
from tests.observability.obs_jaeger import Jaeger, jaeger_binary

CONFIGS = ("process/sink", "inline/sink", "process/http", "process/grpc")
PROXY_CPU, OTHERS_CPU = 1, 0
CONNECTIONS = 64


def tracing_env(config: str, jaeger: Jaeger, sink_port: int) -> dict[str, str]:
    if config == "off":
        return {"SPECROUTE_TRACES": "false"}
    export, receiver = config.split("/")
    endpoints = {
        "grpc": jaeger.otlp_grpc_endpoint,
        "http": jaeger.otlp_http_endpoint,
        "sink": f"http://127.0.0.1:{sink_port}",
    }
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoints[receiver],
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc" if receiver == "grpc" else "http/protobuf",
        "OTEL_TRACES_SAMPLER": "always_on",
        "OTEL_SERVICE_NAME": "specroute-bench",
        "SPECROUTE_TRACE_EXPORT": export,
    }


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def children_cpu(pid: int) -> float:
    return sum(cpu_seconds(child) for child in children(pid))


async def side_by_side(
    pids: dict[int, int], raw: bytes, events: int | None, warm_s: float, window_s: float
) -> dict[int, dict[str, float]]:
    """Load every proxy (port -> pid) at once over CONNECTIONS connections each; count, for
    `window_s` after `warm_s`, each one's answered requests, its CPU and its children's."""
    loop = asyncio.get_running_loop()
    counts = dict.fromkeys(pids, 0)
    errors = dict.fromkeys(pids, 0)
    state = {"counting": False, "stop": False}

    async def client(port: int) -> None:
        _, conn = await loop.create_connection(_Conn, "127.0.0.1", port)
        try:
            while not state["stop"]:
                try:
                    status, body, _ = await asyncio.wait_for(conn.request(raw), 30)
                except (TimeoutError, ConnectionError):
                    errors[port] += 1
                    conn.transport.close()
                    _, conn = await loop.create_connection(_Conn, "127.0.0.1", port)
                    continue
                if state["counting"]:
                    if check(status, body, events):
                        counts[port] += 1
                    else:
                        errors[port] += 1
        finally:
            conn.transport.close()

    tasks = [loop.create_task(client(port)) for port in pids for _ in range(CONNECTIONS)]
    await asyncio.sleep(warm_s)
    before = {port: (cpu_seconds(pid), children_cpu(pid)) for port, pid in pids.items()}
    state["counting"] = True
    await asyncio.sleep(window_s)
    state["counting"] = False
    after = {port: (cpu_seconds(pid), children_cpu(pid)) for port, pid in pids.items()}
    state["stop"] = True
    await asyncio.gather(*tasks)
    return {
        port: {
            "rate": counts[port] / window_s,
            "cpu_us": (after[port][0] - before[port][0]) / max(counts[port], 1) * 1e6,
            "export_us": (after[port][1] - before[port][1]) / max(counts[port], 1) * 1e6,
            "errors": errors[port],
        }
        for port in pids
    }


def run_pair(
    config: str, stream: bool, upstream_port: int, jaeger: Jaeger, sink_port: int, warm_s: float, window_s: float
) -> tuple[dict[str, float], dict[str, float]]:
    """A tracing-off proxy and one traced with `config`, side by side: (off, traced)."""
    with ExitStack() as stack:
        pids = {}
        for name in ("off", config):
            port = free_port()
            cmd, env = specroute_cmd(upstream_port, port)
            proxy = stack.enter_context(
                process(["taskset", "-c", str(PROXY_CPU), *cmd], port, {**env, **tracing_env(name, jaeger, sink_port)})
            )
            pids[port] = proxy.pid
        raw = build_request("/v1/chat/completions", STREAM_BODY if stream else BODY)
        events = CHUNKS + 2 if stream else None
        uvloop.run(side_by_side(pids, raw, events, 0.5, 1.0))  # the export process has imported
        for pid in pids.values():
            for child in children(pid):  # the export process runs beside the load, not the proxy
                os.sched_setaffinity(child, {OTHERS_CPU})
        measured = uvloop.run(side_by_side(pids, raw, events, warm_s, window_s))
        off_port, traced_port = pids
        return measured[off_port], measured[traced_port]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one round, 2 s windows")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--window", type=float, default=6.0, help="seconds measured per pair")
    args = parser.parse_args()
    rounds, window = (1, 2.0) if args.quick else (args.rounds, args.window)
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs two CPUs (one for the proxies, one for the rest)")
    os.sched_setaffinity(0, {OTHERS_CPU})  # inherited by the upstream, receivers and Jaeger
    results: dict[tuple[str, str], list[tuple[dict[str, float], dict[str, float]]]] = {}
    scenarios = (("c64-json", False), ("c64-stream", True))

    with tempfile.TemporaryDirectory() as tmp:
        jaeger = Jaeger(jaeger_binary(), Path(tmp))
        try:
            upstream_port, sink_port = free_port(), free_port()
            upstream = [sys.executable, "-m", "bench.proxy_upstream", str(upstream_port), str(CHUNKS)]
            sink = [sys.executable, "-m", "bench.otlp_sink", str(sink_port)]
            with process(upstream, upstream_port), process(sink, sink_port):
                for round_number in range(rounds):
                    for scenario, stream in scenarios:
                        for config in CONFIGS if round_number % 2 == 0 else CONFIGS[::-1]:
                            off, on = run_pair(config, stream, upstream_port, jaeger, sink_port, 1.0, window)
                            results.setdefault((scenario, config), []).append((off, on))
                            print(
                                f"round {round_number + 1} {scenario:>10} {config:>13}: off {off['rate']:,.0f} req/s "
                                f"{off['cpu_us']:,.0f} us/req; traced {on['rate']:,.0f} req/s {on['cpu_us']:,.0f} us/req "
                                f"(+{on['export_us']:,.0f} us in the export process); errors {off['errors'] + on['errors']:.0f}",
                                flush=True,
                            )
        finally:
            jaeger.stop()
    print()
    print(table(results))


def table(results: dict[tuple[str, str], list[tuple[dict[str, float], dict[str, float]]]]) -> str:
    lines = [
        "| scenario | traced: export / receiver | proxy CPU us/req: off / traced | CPU change (range) "
        "| capacity change | req/s measured: off / traced | export process CPU us/req | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (scenario, config), pairs in results.items():
        changes = [on["cpu_us"] / off["cpu_us"] - 1 for off, on in pairs]
        change = statistics.median(changes)
        med: Any = statistics.median
        export, receiver = config.split("/")
        export_cpu = f"{med(t['export_us'] for _, t in pairs):,.0f}" if export == "process" else "-"
        lines.append(
            f"| {scenario} | {export} / {receiver} | {med(o['cpu_us'] for o, _ in pairs):,.0f} / "
            f"{med(t['cpu_us'] for _, t in pairs):,.0f} | {change * 100:+.1f} % ({min(changes) * 100:+.1f} to "
            f"{max(changes) * 100:+.1f}) | {(1 / (1 + change) - 1) * 100:+.1f} % "
            f"| {med(o['rate'] for o, _ in pairs):,.0f} / {med(t['rate'] for _, t in pairs):,.0f} "
            f"| {export_cpu} | {sum(o['errors'] + t['errors'] for o, t in pairs):.0f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
