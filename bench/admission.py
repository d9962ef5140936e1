"""Admission control under overload, on the virtual clock: Poisson arrivals at twice the fleet's
capacity for 60 s of simulated time, the goodput policy told the SLO, with and without
admission control (its limits: the SLO's TTFT and TPOT targets, the proxy's defaults).

    python -m bench.admission            # every fleet of bench.routing, three seeds (~2 min)
    python -m bench.admission --quick    # one fleet, one seed

Per run: requests offered, refused (by class), admitted; of the admitted, the share that met the
SLO and how many never finished (lost); SLO goodput (requests that met the SLO per second of
the arrival window, counting every offered request); mean time to first token of the admitted.
Targets (issue 17): admitted meet the SLO >= 95 %, nothing admitted lost, goodput >= without.
A fifth of the requests are `batch` class, which admission sheds first.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from bench.routing import SETUPS, capacity_rps, lengths
from bench.routing_sim import RunResult, Workload, run
from policies.admission import Admission
from sim.virtual import Arrival

LOAD = 2.0
DURATION_S = 60.0
BATCH_SHARE = 0.2
SEEDS = (0, 1, 2)


def arrivals(rate: float, sample: Sequence[tuple[int, int]], seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    t = 0.0
    out: list[Arrival] = []
    i = 0
    while True:
        t += rng.expovariate(rate)
        if t > DURATION_S:
            return out
        prompt, output = sample[(i * 7 + seed) % len(sample)]
        request_class = "batch" if rng.random() < BATCH_SHARE else "latency"
        out.append(Arrival(time=t, prompt_tokens=prompt, output_tokens=output, request_class=request_class))
        i += 1


def score(result: RunResult, offered: int, offered_batch: int) -> dict[str, Any]:
    records = result.records
    met = [r for r in records if result.slo.met(r)]
    refused_batch = sum(1 for _, _, c in result.refusals if c == "batch")
    return {
        "offered": offered,
        "offered_batch": offered_batch,
        "refused": len(result.refusals),
        "refused_batch": refused_batch,
        "admitted": offered - len(result.refusals),
        "lost": offered - len(result.refusals) - len(records),
        "admitted_met": len(met) / len(records) if records else 1.0,
        "latency_met": (
            sum(1 for r in met if r.request_class == "latency")
            / max(1, sum(1 for r in records if r.request_class == "latency"))
        ),
        "goodput_rps": len(met) / DURATION_S,
        "mean_ttft_s": statistics.fmean(r.ttft for r in records) if records else 0.0,
    }


def pooled(rows: list[dict[str, Any]]) -> dict[str, Any]:
    admitted = sum(r["admitted"] for r in rows)
    met = sum(r["admitted_met"] * (r["admitted"] - r["lost"]) for r in rows)
    return {
        "offered": sum(r["offered"] for r in rows),
        "offered_batch": sum(r["offered_batch"] for r in rows),
        "refused": sum(r["refused"] for r in rows),
        "refused_batch": sum(r["refused_batch"] for r in rows),
        "admitted": admitted,
        "lost": sum(r["lost"] for r in rows),
        "admitted_met": met / max(admitted, 1),
        "latency_met": statistics.fmean(r["latency_met"] for r in rows),
        "goodput_rps": statistics.fmean(r["goodput_rps"] for r in rows),
        "goodput_by_seed": [round(r["goodput_rps"], 2) for r in rows],
        "mean_ttft_s": statistics.fmean(r["mean_ttft_s"] for r in rows),
    }


def evaluate(setups: Sequence[str], seeds: Sequence[int]) -> list[dict[str, Any]]:
    sample = lengths()
    out = []
    for name in setups:
        base_setup = SETUPS[name]
        rate = LOAD * capacity_rps(base_setup, sample)
        cells: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        for seed in seeds:
            setup = replace(base_setup, seed=seed)
            offered = arrivals(rate, sample, seed=100 + seed)
            for mode, admission in (("off", None), ("on", Admission(setup.slo.ttft_s, setup.slo.tpot_s))):
                result = run(setup, Workload(arrivals=offered), "goodput", admission=admission)
                cells[mode].append(score(result, len(offered), sum(1 for a in offered if a.request_class == "batch")))
        out.append(
            {
                "setup": name,
                "rate_rps": rate,
                "slo": base_setup.slo,
                "off": pooled(cells["off"]),
                "on": pooled(cells["on"]),
            }
        )
    return out


def report(rows: list[dict[str, Any]], elapsed_s: float, seeds: Sequence[int]) -> str:
    lines = [
        f"`python -m bench.admission` ({time.strftime('%Y-%m-%d %H:%M')}, {elapsed_s:.0f} s; seeds "
        f"{', '.join(map(str, seeds))} pooled; {LOAD:.0%} of capacity for {DURATION_S:.0f} s simulated, "
        f"{BATCH_SHARE:.0%} batch class, goodput policy with the SLO):",
        "",
        "| fleet (SLO) | offered rps | admission | refused | of latency / batch | admitted meeting SLO | lost | SLO goodput rps (per seed) | mean TTFT admitted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        slo = row["slo"]
        for mode in ("off", "on"):
            c = row[mode]
            lines.append(
                f"| {row['setup']} ({slo.ttft_s:g} s, {slo.tpot_s * 1000:g} ms) | {row['rate_rps']:.1f} | {mode} | "
                f"{c['refused']} of {c['offered']} | "
                f"{(c['refused'] - c['refused_batch']) / max(c['offered'] - c['offered_batch'], 1):.0%} / "
                f"{c['refused_batch'] / max(c['offered_batch'], 1):.0%} | {c['admitted_met']:.1%} | {c['lost']} | "
                f"{c['goodput_rps']:.2f} ({', '.join(map(str, c['goodput_by_seed']))}) | {c['mean_ttft_s']:.2f} s |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.admission", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one fleet, one seed")
    args = parser.parse_args(argv)
    setups = ["h200-llama8b a=0.60"] if args.quick else list(SETUPS)
    seeds = SEEDS[:1] if args.quick else SEEDS
    started = time.monotonic()
    rows = evaluate(setups, seeds)
    print(report(rows, time.monotonic() - started, seeds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
