"""The twin's spec/base speed ratio by batch size, GPU table alone and with SGLang's engine
overheads (profiles h200-llama8b and h200-llama8b-sglang), beside SGLang's published figures.

    python -m bench.twin_curve            # prints the table (markdown) and writes docs/twin-sglang-curve.png

The ratio is per-stream decode speed at the same batch: tau / spec step over 1 / base step
(k = 3 chain drafting, 1,024-token context), as in the README's table. Published: SGLang +
EAGLE-3, chain of 3, Llama-3.1-8B on one H100, throughput gain at each batch size (EAGLE-3
paper, arXiv 2503.01840, Table 3; ../shared/speculation-facts.md). The twin's table is an H200's,
so only the ratio is compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from fleet.profile import Profile, load_profile, tokens_per_verify_step

ALPHA = 0.6
NUM_STEPS = 3
CONTEXT = 1024.0
PUBLISHED = {2: 1.81, 4: 1.82, 8: 1.62, 16: 1.48, 24: 1.39, 32: 1.32, 48: 1.38, 56: 1.34, 64: 1.38}
BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 56, 64, 96, 128, 192, 256)
PNG = Path(__file__).resolve().parents[1] / "docs" / "twin-sglang-curve.png"


def ratio(profile: Profile, batch: int, alpha: float = ALPHA) -> float:
    tau = tokens_per_verify_step(alpha, NUM_STEPS)
    return tau * profile.base_step_ms(batch, CONTEXT) / profile.spec_step_ms(batch, NUM_STEPS, CONTEXT)


def crossover(profile: Profile, alpha: float = ALPHA) -> int | None:
    """The smallest batch at which speculation is slower per stream (up to 512)."""
    return next((b for b in range(1, 513) if ratio(profile, b, alpha) < 1.0), None)


def table(gpu: Profile, sglang: Profile) -> str:
    rows = ["| batch | twin, GPU table only | twin + SGLang overheads | SGLang published |", "|---|---|---|---|"]
    for b in BATCHES:
        published = f"{PUBLISHED[b]:.2f}" if b in PUBLISHED else ""
        rows.append(f"| {b} | {ratio(gpu, b):.2f} | {ratio(sglang, b):.2f} | {published} |")
    rmse = {
        name: (sum((ratio(p, b) - v) ** 2 for b, v in PUBLISHED.items()) / len(PUBLISHED)) ** 0.5
        for name, p in (("gpu", gpu), ("sglang", sglang))
    }
    rows.append(f"| rms error vs published | {rmse['gpu']:.2f} | {rmse['sglang']:.2f} | |")
    rows.append(f"| crossover batch (ratio < 1) | {crossover(gpu)} | {crossover(sglang)} | |")
    return "\n".join(rows)


def plot(gpu: Profile, sglang: Profile, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    xs = list(range(1, 257))
    ax.plot(xs, [ratio(gpu, b) for b in xs], label="twin: GPU table only (h200-llama8b)")
    ax.plot(xs, [ratio(sglang, b) for b in xs], label="twin + SGLang overheads (h200-llama8b-sglang)")
    ax.plot(list(PUBLISHED), list(PUBLISHED.values()), "ko", label="SGLang + EAGLE-3, chain 3 (EAGLE-3 paper, Table 3)")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch (running requests)")
    ax.set_ylabel(f"spec / base speed per stream (alpha {ALPHA}, k {NUM_STEPS})")
    ax.set_title("Speculation's gain by batch: the twin against SGLang")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    gpu, sglang = load_profile("h200-llama8b"), load_profile("h200-llama8b-sglang")
    print(table(gpu, sglang))
    plot(gpu, sglang, PNG)
    print(f"\nwrote {PNG}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
