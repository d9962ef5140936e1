"""Trace replays and the acceptance drop on any fleet, with its own profile (issue 16, item 3):
`python -m bench.trace_drop [--fleets NAME ...] [--quick]`.

`bench.routing` replays the two Azure traces and runs the acceptance drop on two of its setups
only; this runs those very jobs (bench.routing's `trace_drop_jobs`, `execute`, `analyse` and
`report`) on any of `bench.learning`'s fleets (bench.routing's SETUPS and bench/fleets, each
with the SLO given there; the router seeded with the fleet's own profile), and adds each trace
cell's per-seed ratios and the drop's settling on each seed (goodput; bench.routing runs the
drop on one). Regenerates the trace/drop section of docs/learning.md (between its
markers). --quick: one fleet, the five policies without the fixed splits (a smoke test).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench import routing
from bench.learning import FLEETS, static_of
from bench.markers import sweep_parser, write_section
from bench.routing_sim import HOLD_S, HOLD_SUFFIX

DOC = Path(__file__).resolve().parent.parent / "docs" / "learning.md"
START, END = "<!-- trace-drop:start -->", "<!-- trace-drop:end -->"
TITLE = "Traces and the acceptance drop on every fleet (results)"
HOLD = "goodput" + HOLD_SUFFIX


def per_seed_rows(results: list[dict[str, Any]], analysis: dict[str, Any]) -> list[str]:
    """Each trace cell's goodput ratios seed by seed, against the references the pooled cell chose."""
    by_seed = routing.seed_summaries(results)
    out = [
        "### Trace cells per seed (seeds 0 / 1 / 2; references as pooled)",
        "",
        "| fleet | trace | mean E2E / better static | p99 E2E / better static | SLO goodput / oracle split |",
        "|---|---|---|---|---|",
    ]
    for r in analysis["rows"]:
        if r["kind"] != "trace":
            continue
        seeds = by_seed.get(routing.cell_key(routing.Job(r["setup"], "trace", r["level"], "goodput", r["trace"])), {})
        runs = r["runs"]
        better = min(("spec", "base"), key=lambda p: runs[p]["mean_e2e_s"])
        better_p99 = min(("spec", "base"), key=lambda p: runs[p]["p99_e2e_s"])
        oracle_policy = static_of(r["oracle"])
        notes = [
            routing.per_seed_note(seeds, better, "mean_e2e_s"),
            routing.per_seed_note(seeds, better_p99, "p99_e2e_s"),
            routing.per_seed_note(seeds, oracle_policy, "slo_goodput_rps"),
        ]
        cells = [n.removeprefix(" (per seed: ").removesuffix(")") for n in notes]
        out.append(f"| {r['setup']} | {r['trace']} @{r['level']:.0%} | " + " | ".join(cells) + " |")
    out.append("")
    return out


def hold_rows(analysis: dict[str, Any]) -> list[str]:
    """Each trace cell with flow control (`goodput+hold`) beside goodput alone, against the same
    references (the oracle split, the better static policy by mean and by p99)."""
    out = [
        f"### Traces with flow control (goodput, requests lost on both pools held up to {HOLD_S:.0f} s)",
        "",
        "| fleet | trace | SLO goodput / oracle split: goodput, with flow control | mean E2E / better static | p99 E2E / better static | held |",
        "|---|---|---|---|---|---|",
    ]
    for r in analysis["rows"]:
        runs = r["runs"]
        held = runs.get(HOLD)
        if r["kind"] != "trace" or held is None:
            continue
        plain, oracle = runs["goodput"], runs[static_of(r["oracle"])]
        better = min(("spec", "base"), key=lambda p: runs[p]["mean_e2e_s"])
        better_p99 = min(("spec", "base"), key=lambda p: runs[p]["p99_e2e_s"])

        def pair(
            field: str, ref: dict[str, float], plain: dict[str, float] = plain, held: dict[str, float] = held
        ) -> str:
            return f"{plain[field] / ref[field]:.2f} / {held[field] / ref[field]:.2f}"

        out.append(
            f"| {r['setup']} | {r['trace']} @{r['level']:.0%} | {pair('slo_goodput_rps', oracle)} | "
            f"{pair('mean_e2e_s', runs[better])} | {pair('p99_e2e_s', runs[better_p99])} | "
            f"{held.get('held_share', 0.0):.0%} |"
        )
    out.append("")
    return out


def drop_seed_rows(results: list[dict[str, Any]], extra: list[dict[str, Any]], seeds: Sequence[int]) -> list[str]:
    """The drop's settling for goodput on each seed: `results`' run (seed 0) and `extra`'s."""
    out = [
        f"### Acceptance drop per seed (goodput; seeds {' / '.join(map(str, seeds))}: the length sample and acceptance draws; the arrival stream's seed is fixed)",
        "",
        "| fleet | delivered alpha after | estimate within 0.05 after (s) | decisions as with the true alpha from then | every 5 s window >= 90 % after (s) |",
        "|---|---|---|---|---|",
    ]
    for r0 in results:
        job = r0["job"]
        if job.kind != "drop" or job.policy != "goodput":
            continue
        runs = [r0, *(r for r in extra if r["job"] == job)]
        settled = [routing.settle(r["decisions"], r["alphas"][1]) for r in runs]
        out.append(
            f"| {job.setup_name} | "
            + " / ".join(f"{r['alphas'][1]:.2f}" for r in runs)
            + " | "
            + " / ".join("never" if reached is None else f"{reached:.1f}" for reached, _, _ in settled)
            + " | "
            + " / ".join(f"{agreement:.0%}" for _, agreement, _ in settled)
            + " | "
            + " / ".join(str(strict) for _, _, strict in settled)
            + " |"
        )
    out.append("")
    return out


def parser() -> argparse.ArgumentParser:
    p = sweep_parser("bench.trace_drop", __doc__, "one fleet, no fixed splits (a smoke test)")
    p.add_argument(
        "--fleets",
        nargs="+",
        choices=list(FLEETS),
        default=list(FLEETS),
        metavar="NAME",
        help="fleets to run (bench.learning's FLEETS; default all): " + ", ".join(FLEETS),
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    started = time.monotonic()
    fleets = args.fleets[:1] if args.quick else args.fleets
    jobs = routing.trace_drop_jobs(
        fleets, FLEETS, routing.POLICIES if args.quick else routing.POLICIES + routing.SPLITS
    )
    # Flow control on the traces, beside the policies (bench.learning runs it on its cells).
    jobs += [
        routing.Job(j.setup_name, "trace", j.level, HOLD, j.trace, j.setup)
        for j in jobs
        if j.kind == "trace" and j.policy == "goodput"
    ]
    # The drop runs once in bench.routing's tables (seed 0); goodput's also on the other seeds,
    # for its spread.
    extra_jobs = [(j, s) for s in routing.SEEDS[1:] for j in jobs if j.kind == "drop" and j.policy == "goodput"]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(routing.execute, jobs, chunksize=1))
        extra = list(pool.map(routing.execute, [j for j, _ in extra_jobs], [s for _, s in extra_jobs]))
    analysis = routing.analyse(results)
    command = "python -m bench.trace_drop --fleets " + " ".join(f"'{f}'" for f in fleets)
    section = routing.report(analysis, time.monotonic() - started, args.quick, [], command=command)
    section = section.rstrip() + "\n\n" + "\n".join(per_seed_rows(results, analysis))
    section += "\n" + "\n".join(hold_rows(analysis))
    section += "\n" + "\n".join(drop_seed_rows(results, extra, routing.SEEDS))
    print(section)
    if not args.no_write and not args.quick:
        write_section(DOC, section, START, END, title=TITLE)
        print(f"wrote {DOC} ({len(jobs)} jobs, {time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
