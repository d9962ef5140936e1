"""Routing that learns the fleet: `python -m bench.learning [--quick]` (issue 16, item 3).

Every fleet runs three ways: the router's cost model seeded with the fleet's own profile, with
none (the generic prior, `fleet.costmodel.AffineSeed`, as the proxy without SPECROUTE_PROFILE),
and with a wrong one (another fleet's). Only `goodput` reads the cost model; the static
baselines (always-spec, always-base, the fixed splits) run once per fleet and cell and are
shared by the three ways. The router learns for WARMUP_S of simulated traffic before scoring
starts. Regenerates the results section of docs/learning.md (between its results markers).
Fleets: bench/routing.py's SETUPS plus two of this evaluation's own (bench/fleets/*.json, see
docs/learning.md, "Fleets").
"""

from __future__ import annotations

import datetime as dt
import math
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.markers import sweep_parser, write_section
from bench.routing import CONCURRENCY, LOADS, SEEDS, SETUPS, SPLITS, capacity_rps, lengths, poisson
from bench.routing_sim import HOLD_S, Setup, Slo, Workload, closed_loop, run, summarize

DOC = Path(__file__).resolve().parent.parent / "docs" / "learning.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"
FLEETS_DIR = Path(__file__).resolve().parent / "fleets"
LLAMA70B = str(FLEETS_DIR / "llama70b-tp4-h100.json")
LLAMA3B = str(FLEETS_DIR / "llama3b-a10.json")

WARMUP_S = 60.0
"""Simulated seconds of traffic the router learns from before scoring starts (the issue's rule:
at most 60 s). Poisson runs score POISSON_SCORED requests after it; closed loops max(600, 6N)."""
POISSON_SCORED = 540
STATIC = ("spec", "base", *SPLITS)
WAYS = ("own", "none", "wrong", "hold")
"""`hold`: seeded with the fleet's profile, with flow control (policies/flow.py) holding the
requests lost on both pools for up to HOLD_S, as SPECROUTE_HOLD_MAX_S does in the proxy."""

FLEETS: dict[str, Setup] = {
    **SETUPS,
    # A large dense model on several GPUs: larger fixed step, slower tokens and prefill. SLO:
    # MLPerf llama2-70b Server's TTFT (2 s); TPOT 50 ms as the h200 fleets' (MLPerf interactive
    # 40 ms, Server 200 ms): base at 256 running (58 ms a step) misses it.
    "llama70b-tp4-h100 a=0.60": Setup(LLAMA70B, 0.60, Slo(ttft_s=2.0, tpot_s=0.050)),
    # A small model on a small GPU: KV for ~109k tokens caps base at 64 running. SLO: MLPerf
    # llama2-70b-interactive's (450 ms, 40 ms) rounded to a small chat model's 0.5 s / 40 ms.
    "llama3b-a10 a=0.50": Setup(LLAMA3B, 0.50, Slo(ttft_s=0.5, tpot_s=0.040), base_max_running=64),
}
# Each fleet's wrong profile: another fleet's, from the other end of the step-cost range.
WRONG: dict[str, str] = {
    "h200-llama8b a=0.45": "kimi-linear",
    "h200-llama8b a=0.60": "kimi-linear",
    "h200-llama8b a=0.75": "kimi-linear",
    "h200-llama8b-sglang a=0.60": "kimi-moe",
    "kimi-linear a=0.64": "h200-llama8b",
    "kimi-moe a=0.64": "h200-llama8b-sglang",
    "llama70b-tp4-h100 a=0.60": LLAMA3B,
    "llama3b-a10 a=0.50": LLAMA70B,
}


def profile_label(profile: str | None) -> str:
    return "generic prior" if profile is None else Path(profile).name.removesuffix(".json")


@dataclass(frozen=True)
class Job:
    fleet: str
    kind: str
    """poisson | closed"""
    level: float
    policy: str
    way: str = "own"
    """own | none | wrong (the static policies run `own` only: they read no cost model)"""


def router_profile(job: Job) -> str | None:
    return {"own": "", "none": None, "wrong": WRONG[job.fleet], "hold": ""}[job.way]


def workload_of(
    job: Job, seed: int, warmup_s: float = WARMUP_S, scored: int = POISSON_SCORED
) -> tuple[Setup, Workload]:
    """bench/routing.py's cells (the same lengths and seeds), each preceded by `warmup_s` of
    traffic the router learns from and nobody scores."""
    setup = replace(FLEETS[job.fleet], seed=seed, router_profile=router_profile(job))
    if job.kind == "closed":
        clients = int(job.level)
        loop = closed_loop(clients, max(600, 6 * clients), lengths(seed=clients + 1000 * seed))
        return setup, replace(loop, warmup_s=warmup_s, closed_extra_s=warmup_s)
    sample = lengths(seed=7 + 1000 * seed)
    rate = job.level * capacity_rps(setup, sample)
    arrivals = poisson(rate, math.ceil(rate * warmup_s) + scored, sample, seed=int(job.level * 100) + 1000 * seed)
    return setup, Workload(arrivals, warmup_s=warmup_s)


def execute(job: Job, quick: bool = False) -> dict[str, Any]:
    runs = []
    for seed in SEEDS[:1] if quick else SEEDS:
        setup, workload = workload_of(job, seed, *((20.0, 120) if quick else ()))
        runs.append(run(setup, workload, job.policy, max_hold_s=HOLD_S if job.way == "hold" else None))
    return {"job": job, "summary": summarize(runs), "seeds": [r.summary() for r in runs]}


def _execute_quick(job: Job) -> dict[str, Any]:
    return execute(job, quick=True)


def jobs_for(quick: bool) -> list[Job]:
    fleets = ["h200-llama8b a=0.60", "llama3b-a10 a=0.50"] if quick else list(FLEETS)
    loads = (0.5, 1.1) if quick else LOADS
    conc = (16,) if quick else CONCURRENCY
    cells = [("poisson", x) for x in loads] + [("closed", float(n)) for n in conc]
    jobs = [Job(f, kind, level, p) for f in fleets for kind, level in cells for p in STATIC]
    jobs += [Job(f, kind, level, "goodput", way) for f in fleets for kind, level in cells for way in WAYS]
    # The longest runs first (overloaded Poisson, many clients), so two workers end together.
    return sorted(jobs, key=lambda j: -(j.level * 100 if j.kind == "poisson" else j.level))


# -- analysis ------------------------------------------------------------------------------------


def oracle_name(runs: dict[str, dict[str, float]]) -> str:
    """bench/routing.py's oracle: the best fixed split by SLO goodput, then mean latency."""
    candidates = {"split-0.0": runs["base"], "split-1.0": runs["spec"], **{s: runs[s] for s in SPLITS if s in runs}}
    return max(candidates, key=lambda k: (round(candidates[k]["slo_goodput_rps"], 6), -candidates[k]["mean_e2e_s"]))


def static_of(name: str) -> str:
    """The static policy an oracle name stands for (split-0.0 is always-base, split-1.0 always-spec)."""
    return {"split-0.0": "base", "split-1.0": "spec"}.get(name, name)


def targets(way: str) -> dict[str, float]:
    """Per way: SLO goodput / oracle split >= slo; mean / better static <= mean; p99 <= p99."""
    if way in ("own", "hold"):
        return {"slo": 1.0, "mean": 1.02, "p99": 1.10, "throughput": 1.3}
    return {"slo": 0.97, "mean": 1.05, "p99": math.inf, "throughput": 0.0}


def analyse(results: list[dict[str, Any]]) -> dict[str, Any]:
    cells: dict[tuple[str, str, float], dict[str, dict[str, Any]]] = {}
    for r in results:
        job: Job = r["job"]
        key = job.policy if job.policy != "goodput" else f"goodput/{job.way}"
        cells.setdefault((job.fleet, job.kind, job.level), {})[key] = r
    rows, misses = [], []
    for (fleet, kind, level), runs in sorted(
        cells.items(), key=lambda kv: (list(FLEETS).index(kv[0][0]), kv[0][1] != "poisson", kv[0][2])
    ):
        pooled = {k: v["summary"] for k, v in runs.items()}
        best = static_of(oracle_name(pooled))
        better = min(("spec", "base"), key=lambda p: pooled[p]["mean_e2e_s"])
        better_p99 = min(("spec", "base"), key=lambda p: pooled[p]["p99_e2e_s"])
        row: dict[str, Any] = {"fleet": fleet, "kind": kind, "level": level, "oracle": best, "ways": {}}
        for way in WAYS:
            name = f"goodput/{way}"
            if name not in runs:
                continue
            g = pooled[name]
            seeds = runs[name]["seeds"]

            def ratio(a: dict[str, float], b: dict[str, float], field: str) -> float:
                return a[field] / b[field] if b[field] > 0 else math.inf

            per_seed = {
                "slo": [ratio(s, o, "slo_goodput_rps") for s, o in zip(seeds, runs[best]["seeds"])],
                "mean": [ratio(s, o, "mean_e2e_s") for s, o in zip(seeds, runs[better]["seeds"])],
                "p99": [ratio(s, o, "p99_e2e_s") for s, o in zip(seeds, runs[better_p99]["seeds"])],
                "throughput": [ratio(s, o, "throughput_tok_s") for s, o in zip(seeds, runs["base"]["seeds"])],
            }
            stats = {
                "slo": ratio(g, pooled[best], "slo_goodput_rps"),
                "mean": ratio(g, pooled[better], "mean_e2e_s"),
                "p99": ratio(g, pooled[better_p99], "p99_e2e_s"),
                "spec_share": g["spec_share"],
                "throughput": ratio(g, pooled["base"], "throughput_tok_s"),
                "per_seed": per_seed,
            }
            row["ways"][way] = stats
            t = targets(way)
            told = router_profile(Job(fleet, kind, level, "goodput", way))
            seeded = profile_label(FLEETS[fleet].profile if told == "" else told)
            label = f"{fleet} {cell_name(kind, level)}, {way} ({seeded})"

            def seeds_note(metric: str, per_seed: dict[str, list[float]] = per_seed) -> str:
                return " (per seed: " + " / ".join(fmt(x) for x in per_seed[metric]) + ")"

            if stats["slo"] < t["slo"] - 1e-9:
                misses.append(
                    (
                        way,
                        f"{label}: SLO goodput {fmt(stats['slo'])}x the oracle split ({best}) (target >= {t['slo']:.2f}x){seeds_note('slo')}",
                    )
                )
            if stats["mean"] > t["mean"] + 1e-9:
                misses.append(
                    (
                        way,
                        f"{label}: mean E2E {fmt(stats['mean'])}x the better static policy ({better}) (target <= {t['mean']:.2f}x){seeds_note('mean')}",
                    )
                )
            if stats["p99"] > t["p99"] + 1e-9:
                misses.append(
                    (
                        way,
                        f"{label}: p99 E2E {fmt(stats['p99'])}x the better static policy ({better_p99}) (target <= {t['p99']:.2f}x){seeds_note('p99')}",
                    )
                )
            saturated = (kind == "closed" and level == max(CONCURRENCY)) or (kind == "poisson" and level == max(LOADS))
            if saturated and stats["throughput"] < t["throughput"]:
                misses.append(
                    (
                        way,
                        f"{label}: throughput {fmt(stats['throughput'])}x always-base (target >= {t['throughput']:.1f}x){seeds_note('throughput')}",
                    )
                )
        rows.append(row)
    return {"rows": rows, "misses": misses}


# -- report --------------------------------------------------------------------------------------


def cell_name(kind: str, level: float) -> str:
    return f"Poisson {level:.0%}" if kind == "poisson" else f"N={int(level)}"


def fmt(x: float, digits: int = 2) -> str:
    return "inf" if math.isinf(x) else f"{x:.{digits}f}"


def _cell(stats: dict[str, Any] | None, way: str) -> str:
    if stats is None:
        return "-"
    t = targets(way)
    parts = []
    for metric, bad in (
        ("slo", stats["slo"] < t["slo"] - 1e-9),
        ("mean", stats["mean"] > t["mean"] + 1e-9),
        ("p99", stats["p99"] > t["p99"] + 1e-9),
    ):
        parts.append(f"**{fmt(stats[metric])}**" if bad else fmt(stats[metric]))
    return " / ".join(parts)


def report(analysis: dict[str, Any], elapsed_s: float, quick: bool, workers: int) -> str:
    rows, misses = analysis["rows"], analysis["misses"]
    out = [
        f"Generated by `python -m bench.learning{' --quick' if quick else ''}` in {elapsed_s:.0f} s on {workers} "
        f"worker process(es) ({dt.date.today().isoformat()}). "
        + (
            f"Each cell pools {len(SEEDS)} seeds' requests, scored after {WARMUP_S:.0f} s of warm-up traffic. "
            if not quick
            else "Quick mode: one seed, 20 s warm-up, 120 scored requests (a smoke test, not results). "
        )
        + "Ratios are goodput / reference; **bold** marks a missed target.",
        "",
        "### Targets",
        "",
        "| way | router seeded with | SLO goodput / oracle split | mean E2E / better static | p99 / better static | misses |",
        "|---|---|---|---|---|---|",
    ]
    for way in WAYS:
        t = targets(way)
        stats = [r["ways"][way] for r in rows if way in r["ways"]]
        if not stats:
            continue
        worst_slo = min(rows, key=lambda r: r["ways"][way]["slo"] if way in r["ways"] else math.inf)
        worst_mean = max(rows, key=lambda r: r["ways"][way]["mean"] if way in r["ways"] else -math.inf)
        worst_p99 = max(rows, key=lambda r: r["ways"][way]["p99"] if way in r["ways"] else -math.inf)

        def where(r: dict[str, Any]) -> str:
            return f"{r['fleet']} {cell_name(r['kind'], r['level'])}"

        seeded = {
            "own": "the fleet's profile",
            "none": "nothing (generic prior)",
            "wrong": "another fleet's profile",
            "hold": f"the fleet's profile, flow control (held up to {HOLD_S:.0f} s)",
        }[way]
        out.append(
            f"| {way} | {seeded} | >= {t['slo']:.2f}: min {fmt(worst_slo['ways'][way]['slo'])} ({where(worst_slo)}) | "
            f"<= {t['mean']:.2f}: max {fmt(worst_mean['ways'][way]['mean'])} ({where(worst_mean)}) | "
            f"{'<= ' + fmt(t['p99']) if math.isfinite(t['p99']) else 'no target'}: max {fmt(worst_p99['ways'][way]['p99'])} ({where(worst_p99)}) | "
            f"{sum(1 for w, _ in misses if w == way)} |"
        )
    out += [
        "",
        "Wrong profiles: "
        + "; ".join(f"{f} <- {profile_label(p)}" for f, p in WRONG.items() if any(r["fleet"] == f for r in rows))
        + ".",
        "",
    ]
    for way in WAYS:
        mine = [m for w, m in misses if w == way]
        out += [f"### Misses, {way}: {len(mine) or 'none'}", ""]
        out += [f"- {m}" for m in mine] or ["- every target was met on every cell"]
        out.append("")
    out += [
        "### Per cell",
        "",
        "Each way: SLO goodput / oracle split, mean E2E / better static, p99 / better static; then goodput's spec share per way.",
        "",
        "| fleet | cell | oracle split | own | none | wrong | hold | spec share own / none / wrong / hold |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        level = cell_name(r["kind"], r["level"])
        shares = " / ".join(f"{r['ways'][w]['spec_share']:.2f}" if w in r["ways"] else "-" for w in WAYS)
        out.append(
            f"| {r['fleet']} | {level} | {r['oracle'].removeprefix('split-')} | "
            + " | ".join(_cell(r["ways"].get(w), w) for w in WAYS)
            + f" | {shares} |"
        )
    out.append("")
    return "\n".join(out)


def write_doc(section: str, doc: Path = DOC) -> None:
    write_section(doc, section, START, END)


def main(argv: Sequence[str] | None = None) -> int:
    parser = sweep_parser("bench.learning", __doc__, "two fleets, three cells, one seed (a smoke test)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    jobs = jobs_for(args.quick)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(_execute_quick if args.quick else execute, jobs, chunksize=1))
    analysis = analyse(results)
    section = report(analysis, time.monotonic() - started, args.quick, args.jobs)
    if args.no_write or args.quick:
        print(section)
    else:
        write_doc(section)
        print(f"wrote {DOC} ({len(jobs)} jobs, {time.monotonic() - started:.0f} s); misses: {len(analysis['misses'])}")
        for way, miss in analysis["misses"]:
            print(f"  [{way}] {miss}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
