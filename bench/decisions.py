"""Fingerprints of every routing decision of the evaluation: `python -m bench.decisions [--quick]`.

A refactor that must not change routing shows it here: the same fingerprints before and after
(`--out FILE` writes them, `--against FILE` compares and exits 1 on any difference). Each run of
bench.routing's job list (seed 0, the adaptive policies) is reduced to a SHA-256 of its decisions
(time, pool, reason, the spec pool's alpha estimate) and of its requests' timings, all printed at
full float precision, so one decision that went the other way or one prediction that moved a
request's finish time by a nanosecond changes the fingerprint. About a fifth of the full
evaluation's time (one seed, three policies).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench.routing import Job, jobs_for, workload_of
from bench.routing_sim import run

POLICIES = ("goodput", "threshold", "round-robin")


def fingerprint(job: Job) -> tuple[str, str]:
    setup, workload = workload_of(job)
    result = run(setup, workload, job.policy)
    digest = hashlib.sha256()
    for t, pool, reason, alpha in result.decisions:
        digest.update(f"{t!r} {pool} {reason} {alpha!r}\n".encode())
    for r in result.records:
        digest.update(f"{r.index} {r.engine} {r.first_token_time!r} {r.finish_time!r} {r.output_tokens}\n".encode())
    name = f"{job.setup_name} {job.kind} {job.level} {job.trace if job.kind == 'trace' else ''} {job.policy}"
    return name.strip(), digest.hexdigest()[:16]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decisions", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="bench.routing --quick's job list")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    parser.add_argument("--out", type=Path, help="write the fingerprints (JSON) here")
    parser.add_argument("--against", type=Path, help="compare with fingerprints written before")
    args = parser.parse_args(argv)
    started = time.monotonic()
    jobs = [job for job in jobs_for(args.quick) if job.policy in POLICIES]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        prints = dict(pool.map(fingerprint, jobs, chunksize=2))
    print(f"{len(prints)} runs fingerprinted in {time.monotonic() - started:.0f} s")
    if args.out:
        args.out.write_text(json.dumps(prints, indent=1, sort_keys=True) + "\n")
    if args.against:
        before = json.loads(args.against.read_text())
        changed = sorted(k for k in before.keys() | prints.keys() if before.get(k) != prints.get(k))
        for name in changed:
            print(f"  changed: {name}: {before.get(name)} -> {prints.get(name)}")
        print(f"{len(prints) - len(changed)} of {len(prints)} runs decide bit for bit as before")
        return 1 if changed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
