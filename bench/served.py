"""Overload as served: `python -m bench.served` (issue 16's overload cells with admission on).

bench.learning judges routing alone: every request is sent somewhere. The proxy, told SLO
targets (as the evaluation tells `goodput`), also runs admission control (policies/admission.py,
on by default with them), which refuses up front what the fleet cannot serve in time. This runs
bench.learning's fleets and lengths at its loads past the knee (Poisson, 90 % and 110 % of
capacity), each fixed split and `goodput` (three ways) with that admission, and compares goodput
with the best split given the same admission, and with the best split without it (bench.learning's
oracle). Closed loops are left out: a refused client there would need the SDK's retries
modelled, and scoring a retried request from its first send. Regenerates the served section of
docs/learning.md (between its served markers).
"""

from __future__ import annotations

import datetime as dt
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from bench.learning import DOC, FLEETS, STATIC, WAYS, Job, oracle_name, static_of, workload_of
from bench.markers import sweep_parser, write_section
from bench.routing import SEEDS
from bench.routing_sim import run, summarize
from policies.admission import Admission

START, END = "<!-- served:start -->", "<!-- served:end -->"
LOADS = (0.9, 1.1)


@dataclass(frozen=True)
class ServedJob:
    job: Job
    admission: bool


def execute(served: ServedJob, seeds: Sequence[int] = SEEDS) -> dict[str, Any]:
    runs, refused, offered = [], 0, 0
    for seed in seeds:
        setup, workload = workload_of(served.job, seed)
        admission = Admission(setup.slo.ttft_s, setup.slo.tpot_s) if served.admission else None
        result = run(setup, workload, served.job.policy, admission=admission)
        runs.append(result)
        refused += sum(1 for at, _, _ in result.refusals if at >= workload.warmup_s)
        offered += sum(1 for a in workload.arrivals if a.time >= workload.warmup_s)
    return {"served": served, "summary": summarize(runs), "refused": refused / max(offered, 1)}


def _quick(served: ServedJob) -> dict[str, Any]:
    return execute(served, SEEDS[:1])


def jobs_for(quick: bool) -> list[ServedJob]:
    fleets = ["kimi-linear a=0.64"] if quick else list(FLEETS)
    loads = LOADS[1:] if quick else LOADS
    jobs = []
    for fleet in fleets:
        for load in loads:
            for admission in (False, True):
                jobs += [ServedJob(Job(fleet, "poisson", load, p), admission) for p in STATIC]
            jobs += [ServedJob(Job(fleet, "poisson", load, "goodput", way), True) for way in WAYS]
    return sorted(jobs, key=lambda j: -j.job.level)


def report(results: list[dict[str, Any]], elapsed_s: float, quick: bool) -> str:
    cells: dict[tuple[str, float], dict[str, dict[str, Any]]] = {}
    for r in results:
        served: ServedJob = r["served"]
        job = served.job
        name = f"goodput/{job.way}" if job.policy == "goodput" else job.policy + ("+adm" if served.admission else "")
        cells.setdefault((job.fleet, job.level), {})[name] = r
    when = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines = [
        f"`python -m bench.served{' --quick' if quick else ''}` ({when}, {elapsed_s:.0f} s; seeds "
        f"{', '.join(map(str, SEEDS[:1] if quick else SEEDS))} pooled; Poisson arrivals, bench.learning's "
        "warm-up and scored requests). SLO goodput of `goodput` with admission over the best fixed split "
        f"with the same admission ({' / '.join(WAYS)}), and over the best split without it; the share "
        "of the scored arrivals refused (own).",
        "",
        "| fleet | load | best split, no admission (rps) | best split, admission (rps) "
        "| goodput + admission / split + admission | / split, no admission | refused |",
        "|---|---|---|---|---|---|---|",
    ]
    for (fleet, level), runs in sorted(cells.items(), key=lambda kv: (list(FLEETS).index(kv[0][0]), kv[0][1])):
        plain = {p: runs[p]["summary"] for p in STATIC}
        gated = {p: runs[p + "+adm"]["summary"] for p in STATIC}
        best_plain, best_gated = oracle_name(plain), oracle_name(gated)
        plain_rps = plain[static_of(best_plain)]["slo_goodput_rps"]
        gated_rps = gated[static_of(best_gated)]["slo_goodput_rps"]
        ours = [runs[f"goodput/{way}"]["summary"]["slo_goodput_rps"] for way in WAYS]
        lines.append(
            f"| {fleet} | Poisson {level:.0%} | {best_plain} {plain_rps:.2f} | {best_gated} {gated_rps:.2f} | "
            + " / ".join(f"{g / gated_rps:.2f}" for g in ours)
            + " | "
            + " / ".join(f"{g / plain_rps:.2f}" for g in ours)
            + f" | {runs['goodput/own']['refused']:.0%} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = sweep_parser("bench.served", __doc__, "kimi-linear at 110 %, one seed (a smoke test)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    jobs = jobs_for(args.quick)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(_quick if args.quick else execute, jobs, chunksize=1))
    section = report(results, time.monotonic() - started, args.quick)
    if args.no_write or args.quick:
        print(section)
    else:
        write_section(DOC, section, START, END, title="Overload as served")
        print(f"wrote {DOC} ({len(jobs)} jobs, {time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
