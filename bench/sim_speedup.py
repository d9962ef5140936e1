"""The twin against the design table: spec/base per-stream speed by batch size and acceptance.

    .venv/bin/python bench/sim_speedup.py [--profile h200-llama8b]

For each batch size B and mean alpha, B streams of 128 tokens after a 960-token prompt (mean
context about 1024) run on the virtual clock: once on a spec engine (k=3, acceptance with little
per-request spread, cap raised to B) and once on a base engine. The ratio of their per-stream
decode speeds is compared with the tables the project was designed from (../shared/DESIGN.md
for the H200 table, speculation-facts section 3.3 for the Kimi presets), which were computed
analytically with tau = (1 - alpha^(k+1)) / (1 - alpha). Prints a Markdown table; docs/twin.md
records it.
"""

from __future__ import annotations

import argparse

from fleet.profile import Profile, load_profile
from sim.engine import Engine, EngineConfig, Mode
from sim.virtual import Arrival, StepObservation, simulate

# Reference tables: batch sizes, then spec/base per-stream speed by mean alpha (k=3).
REFERENCE = {
    # ../shared/DESIGN.md, at L=1024 on the measured H200 table.
    "h200-llama8b": (
        (1, 16, 32, 64, 128, 192, 256),
        {
            0.45: (1.46, 1.44, 1.38, 1.15, 0.90, 0.82, 0.75),
            0.60: (1.83, 1.80, 1.72, 1.43, 1.13, 1.02, 0.94),
            0.75: (2.29, 2.26, 2.16, 1.80, 1.42, 1.28, 1.18),
        },
    ),
    # ../shared/speculation-facts.md section 3.3, tau 2.32 (alpha 0.64), 1.0 ms per draft step.
    "kimi-linear": ((1, 4, 8, 16, 32, 64, 128), {0.64: (1.86, 1.66, 1.47, 1.24, 1.02, 0.84, 0.72)}),
    "kimi-moe": ((1, 4, 8, 16, 32, 64, 128), {0.64: (1.74, 1.45, 1.31, 1.27, 1.37, 1.55, 1.58)}),
}


def per_stream_speed(mode: Mode, profile: Profile, batch: int, alpha: float) -> float:
    """Decode tokens/s of one stream, over the decode steps that ran the full batch (when spec
    streams start to finish, the batch shrinks and the rest speed up); small batches are
    repeated (seeds 1..R) to average out the randomness of acceptance over a short stream."""
    tokens = seconds = 0.0
    for seed in range(1, max(1, 64 // batch) + 1):
        steps: list[StepObservation] = []
        engine = Engine(
            EngineConfig(
                mode,
                profile,
                max_running_requests=batch,
                mean_alpha=alpha,
                alpha_concentration=1e6,
                chunked_prefill_size=1 << 30,
                seed=seed,
            ),
            mode,
        )
        arrivals = [Arrival(0.0, 960, max_tokens=129, ignore_eos=True) for _ in range(batch)]
        simulate([engine], arrivals, lambda a, f: 0, on_step=steps.append)
        for step in steps:
            if step.kind == "decode" and step.batch == batch:
                tokens += step.tokens / batch
                seconds += step.duration_s
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="h200-llama8b")
    args = parser.parse_args()
    profile = load_profile(args.profile)
    batches, reference = REFERENCE.get(args.profile, ((1, 16, 32, 64, 128, 256), {0.64: ()}))
    print(f"profile {args.profile}: spec/base per-stream decode speed (twin; reference in brackets)")
    print("| alpha | " + " | ".join(f"B={b}" for b in batches) + " |")
    print("|---" * (len(batches) + 1) + "|")
    for alpha, expected in reference.items():
        cells = []
        for i, b in enumerate(batches):
            ratio = per_stream_speed("spec", profile, b, alpha) / per_stream_speed("base", profile, b, alpha)
            cells.append(f"{ratio:.2f}" + (f" ({expected[i]:.2f})" if expected else ""))
        print(f"| {alpha:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
