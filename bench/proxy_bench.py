"""Proxy overhead benchmark: the proxy against a direct call to the same fast upstream, one run.

    .venv/bin/python -m bench.proxy_bench                  # specroute vs direct, all scenarios
    .venv/bin/python -m bench.proxy_bench --clients        # + minimal proxies per HTTP client
    .venv/bin/python -m bench.proxy_bench --quick          # fewer requests (a smoke run)

Every server is its own process on 127.0.0.1 (free ports); the load generator (bench.proxy_loadgen)
runs in this process. Prints a Markdown table; docs/benchmarks.md records the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import uvloop

from bench.proxy_loadgen import build_request, percentile, run

CHUNKS = 64
CLIENTS = ("httpx", "httpx-tuned", "httpx-aiohttp", "httpx2", "aiohttp", "aiohttp+fastapi", "aiohttp+h11", "raw")
BODY = json.dumps(
    {"model": "bench-model", "messages": [{"role": "user", "content": "Say ok."}], "max_tokens": 16}
).encode()
STREAM_BODY = json.dumps(
    {
        "model": "bench-model",
        "messages": [{"role": "user", "content": "Say ok."}],
        "max_tokens": 64,
        "stream": True,
        # Asked as the SDKs' users ask for it: the answer is the same direct and through the proxy
        # (unasked, the proxy asks for usage itself and keeps it back: one event fewer, which the
        # check counted as an error on every stream since the proxy began to).
        "stream_options": {"include_usage": True},
    }
).encode()


@dataclass(frozen=True)
class Scenario:
    name: str
    concurrency: int
    stream: bool
    requests: int


SCENARIOS = (
    Scenario("c1-json", 1, False, 3000),
    Scenario("c1-stream", 1, True, 2000),
    Scenario("c64-json", 64, False, 30000),
    Scenario("c64-stream", 64, True, 10000),
    Scenario("c256-stream", 256, True, 10000),
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(port: int, deadline_s: float = 30.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listening on 127.0.0.1:{port} after {deadline_s} s")


@contextmanager
def process(args: list[str], port: int, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    # stdout (the proxy's JSON request log) is discarded, as a log shipper would take it away.
    proc = subprocess.Popen(args, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL)
    try:
        wait_ready(port)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (robust to other load on the machine)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(
    port: int, scenario: Scenario, scale: float, pid: int | None = None, path: str = "/v1/chat/completions"
) -> dict[str, float]:
    raw = build_request(path, STREAM_BODY if scenario.stream else BODY)
    events = CHUNKS + 2 if scenario.stream else None
    requests = max(scenario.concurrency, int(scenario.requests * scale))
    warm = min(requests // 10, 2000)
    uvloop.run(run(port, raw, scenario.concurrency, warm, events))
    cpu_before = cpu_seconds(pid) if pid else 0.0
    result = uvloop.run(run(port, raw, scenario.concurrency, requests, events))
    cpu = (cpu_seconds(pid) - cpu_before) if pid else float("nan")
    return {
        "cpu_us": cpu / max(result.count, 1) * 1e6,
        "rate": result.count / result.elapsed,
        "p50_ms": percentile(result.latencies, 0.50) * 1e3,
        "p99_ms": percentile(result.latencies, 0.99) * 1e3,
        "ttfb_p50_ms": percentile(result.first_bytes, 0.50) * 1e3,
        "errors": result.errors,
    }


LEAN = {"SPECROUTE_POLICY": "spec", "SPECROUTE_REQUEST_LOG": "false"}
"""specroute-lean: the static policy (no cost model) and no JSON request log."""


def specroute_cmd(
    upstream_port: int, port: int, extra: dict[str, str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """`specroute serve` with its defaults (goodput policy, request log on) unless `extra` says."""
    env = {
        "SPECROUTE_SPEC_URLS": f"http://127.0.0.1:{upstream_port}",
        "SPECROUTE_BASE_URLS": "",
        "SPECROUTE_PORT": str(port),
        "SPECROUTE_LOG_LEVEL": "warning",
        **(extra or {}),
    }
    return [sys.executable, "-m", "proxy.cli", "serve"], env


def table(rows: list[tuple[str, str, dict[str, float]]]) -> str:
    out = [
        "| target | scenario | req/s | p50 ms | p99 ms | first byte p50 ms | CPU us/req | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for target, scenario, m in rows:
        out.append(
            f"| {target} | {scenario} | {m['rate']:,.0f} | {m['p50_ms']:.3f} | {m['p99_ms']:.3f} "
            f"| {m['ttfb_p50_ms']:.3f} | {m['cpu_us']:.0f} | {m['errors']:.0f} |"
        )
    return "\n".join(out)


def memory_run(upstream_port: int, requests: int) -> str:
    port = free_port()
    cmd, env = specroute_cmd(upstream_port, port)
    json_raw = build_request("/v1/chat/completions", BODY)
    stream_raw = build_request("/v1/chat/completions", STREAM_BODY)
    with process(cmd, port, env) as proc:
        uvloop.run(run(port, json_raw, 64, 10000, None))  # warm: pools, caches, allocator
        uvloop.run(run(port, stream_raw, 64, 2000, CHUNKS + 2))
        before = rss_kb(proc.pid)
        errors = uvloop.run(run(port, json_raw, 64, requests // 2, None)).errors
        errors += uvloop.run(run(port, stream_raw, 64, requests - requests // 2, CHUNKS + 2)).errors
        after = rss_kb(proc.pid)
    return (
        f"RSS over {requests:,} requests (half JSON, half 64-chunk streams, concurrency 64) after a warm-up: "
        f"{before / 1024:.1f} MiB -> {after / 1024:.1f} MiB (growth {(after - before) / 1024:.2f} MiB), errors {errors}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", action="store_true", help="also measure minimal proxies per HTTP client")
    parser.add_argument("--no-specroute", action="store_true", help="skip the specroute proxy")
    parser.add_argument("--quick", action="store_true", help="a tenth of the requests")
    parser.add_argument("--memory", type=int, default=0, metavar="N", help="RSS growth over N requests")
    args = parser.parse_args()
    scale = 0.1 if args.quick else 1.0

    upstream_port = free_port()
    rows: list[tuple[str, str, dict[str, float]]] = []
    upstream = [sys.executable, "-m", "bench.proxy_upstream", str(upstream_port), str(CHUNKS)]
    with process(upstream, upstream_port) as upstream_proc:
        targets: list[tuple[str, list[str] | None, dict[str, str]]] = [("direct", None, {})]
        if not args.no_specroute:
            cmd, env = specroute_cmd(upstream_port, 0)
            targets.append(("specroute", cmd, env))
            cmd, env = specroute_cmd(upstream_port, 0, LEAN)
            targets.append(("specroute-lean", cmd, env))
        if args.clients:
            for client in CLIENTS:
                cmd = [sys.executable, "-m", "bench.proxy_minimal", client, str(upstream_port), "{port}"]
                targets.append((f"minimal/{client}", cmd, {}))
        for name, template, env in targets:
            if template is None:
                for scenario in SCENARIOS:
                    rows.append((name, scenario.name, measure(upstream_port, scenario, scale, upstream_proc.pid)))
                    print(table(rows[-1:]).splitlines()[-1], flush=True)
                continue
            port = free_port()
            cmd = [part.replace("{port}", str(port)) for part in template]
            if "SPECROUTE_PORT" in env:
                env = {**env, "SPECROUTE_PORT": str(port)}
            with process(cmd, port, env) as proc:
                for scenario in SCENARIOS:
                    rows.append((name, scenario.name, measure(port, scenario, scale, proc.pid)))
                    print(table(rows[-1:]).splitlines()[-1], flush=True)
        print()
        print(table(rows))
        if args.memory:
            print(memory_run(upstream_port, args.memory))


if __name__ == "__main__":
    main()
