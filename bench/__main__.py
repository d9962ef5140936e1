"""Run the benchmarks: `python -m bench` lists them, `python -m bench NAME [ARGS]` runs one,
`python -m bench all` runs the ones whose figures docs/ records, one after another.

Each benchmark is also runnable on its own as `python -m bench.NAME`; its docstring says how and
which page of docs/ records its figures.
"""

from __future__ import annotations

import importlib
import sys

# name -> what it measures; the order is the order of `all`.
BENCHMARKS = {
    "sim_virtual": "the twin's virtual clock: 10,000 requests at ~100 streams (docs/twin.md)",
    "sim_speedup": "the twin against the design tables, spec/base speed by batch (docs/twin.md)",
    "sim_http": "the HTTP twin: 200+ streams, its CPU and decode-rate error (docs/twin.md)",
    "kimi_speeds": "the Kimi base presets over HTTP, SGLang's and vLLM's, 1 and 128 streams (docs/twin.md)",
    "proxy_bench": "the proxy against a direct call, concurrency 1/64/256 (docs/benchmarks.md)",
    "first_token": "first-token latency the proxy adds, against an upstream that writes like a server (docs/benchmarks.md)",
    "proxy_parts": "where the proxy's CPU goes, parts switched off (docs/benchmarks.md)",
    "obs_trace_cost": "tracing every request against tracing off (docs/observability.md)",
    "body_work": "how long one hostile or large request body holds the proxy's event loop (README.md)",
    "routing": "the routing policies on the virtual clock; rewrites docs/routing.md",
    "workloads": "acceptance per workload: a mixed workload, per-workload against pool-wide alpha (docs/routing.md)",
    "admission": "admission control at twice the fleet's capacity, virtual clock (docs/routing.md)",
    "admission_http": "admission control at twice the capacity over HTTP, real-time twins (docs/reliability.md)",
    "chaos": "kill -9 under load, a 100,000-request soak, SIGTERM under load, a hung engine, a hung data-parallel rank, one hung in its first prefill after idling (docs/reliability.md)",
    "dp_view": "servers of two data-parallel ranks over HTTP, real-time twins, three policies (docs/routing.md)",
    "prefix_index": "the prefix index: hash + match per decision at 10,000 prefixes, memory (docs/routing.md)",
    "prefix_decision": "one routing decision in the served path (hash + match, snapshot, goodput) at 10,000 prefixes (docs/routing.md)",
    "decisions": "fingerprints of every routing decision, to show a refactor changed none (no doc)",
    "proxy_minimal": "minimal pass-through proxies, one per HTTP client library (docs/benchmarks.md)",
    "prefix_eval": "routing on workloads with sessions and prefix caches, against peers' policies (docs/routing.md)",
    "learning": "every fleet with its own profile, none, a wrong one and flow control; rewrites docs/learning.md (~20 min)",
    "trace_drop": "trace replays and the acceptance drop on every fleet (docs/learning.md)",
    "served": "issue 16's overload cells as served, admission on (docs/learning.md)",
    "profile_seed": "a profile specroute profile measured, as the router's seed, against the built-in file (docs/learning.md)",
    "lull": "a burst after three quiet minutes, no profile: trust aged by observed time against the wall clock (docs/learning.md)",
    "twin_curve": "the twin's spec/base ratio with and without engine overheads, PNG (docs/twin.md)",
}


def run(name: str, args: list[str]) -> None:
    module = importlib.import_module(f"bench.{name}")
    sys.argv = [f"python -m bench.{name}", *args]
    module.main()


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(__doc__)
        for name, what in BENCHMARKS.items():
            print(f"  {name:15} {what}")
        return 0
    name, args = argv[0], argv[1:]
    if name == "all":
        for each in BENCHMARKS:
            print(f"\n## bench.{each}\n", flush=True)
            run(each, args)
        return 0
    if name not in BENCHMARKS:
        print(f"unknown benchmark {name!r}; `python -m bench` lists them", file=sys.stderr)
        return 2
    run(name, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
