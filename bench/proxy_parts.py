"""Where the proxy's CPU goes: the same server with parts switched off, measured in one run.

    .venv/bin/python -m bench.proxy_parts            # all variants, c64-json and c64-stream

Variants (each `specroute serve` in its own process, in front of bench.proxy_upstream):
  bare      the request path only: no telemetry, the `spec` policy, load polls once a minute
  signals   + the load pollers every 100 ms (proxy/poller.py)
  telemetry + telemetry (metrics, traces when configured), no JSON request log
  log       + the JSON request log
  defaults  + the goodput policy: `specroute serve` as shipped
"""

from __future__ import annotations

import sys

from bench.proxy_bench import CHUNKS, SCENARIOS, free_port, measure, process

VARIANTS: dict[str, dict[str, str]] = {
    "bare": {"SPECROUTE_POLICY": "spec", "SPECROUTE_POLL_INTERVAL_MS": "60000", "SPECROUTE_STALE_MS": "120000"},
    "signals": {"SPECROUTE_POLICY": "spec"},
    "telemetry": {"SPECROUTE_POLICY": "spec", "SPECROUTE_REQUEST_LOG": "false"},
    "log": {"SPECROUTE_POLICY": "spec"},
    "defaults": {},
}


def serve(variant: str) -> None:
    from proxy.app import SpecrouteApp
    from proxy.server import DrainingServer, build_app, uvicorn_config
    from proxy.settings import load_settings

    settings = load_settings()
    if variant in ("bare", "signals"):
        app = SpecrouteApp(settings)  # the default Telemetry() records nothing
    else:
        app = build_app(settings)
    DrainingServer(uvicorn_config(app, settings), app).run()


def main() -> None:
    upstream_port = free_port()
    scenarios = [s for s in SCENARIOS if s.name in ("c64-json", "c64-stream")]
    print("| variant | " + " | ".join(f"{s.name} CPU us | {s.name} req/s" for s in scenarios) + " |")
    print("|---|" + "---|---|" * len(scenarios))
    with process([sys.executable, "-m", "bench.proxy_upstream", str(upstream_port), str(CHUNKS)], upstream_port):
        for variant, env in VARIANTS.items():
            port = free_port()
            env = {
                **env,
                "SPECROUTE_SPEC_URLS": f"http://127.0.0.1:{upstream_port}",
                "SPECROUTE_BASE_URLS": "",
                "SPECROUTE_PORT": str(port),
                "SPECROUTE_LOG_LEVEL": "warning",
            }
            with process([sys.executable, "-m", "bench.proxy_parts", "serve", variant], port, env) as proc:
                cells = []
                for scenario in scenarios:
                    m = measure(port, scenario, 0.2, proc.pid)
                    cells.append(f"{m['cpu_us']:.0f} | {m['rate']:,.0f}")
            print(f"| {variant} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2])  # uvicorn runs it on uvloop
    else:
        main()
