"""Writes the evaluation-only fleet profiles' step tables (bench/fleets/*-step-ms.csv).

`python -m bench.fleets.derive` regenerates them. Each table is a published or derived
step-time formula evaluated on a grid the twin interpolates exactly (every term is linear in B,
T and L), in the twin's table format (docs/twin.md: kind,B,T,L,ms). Derivations in
docs/learning.md, "Fleets"; these are not presets (fleet/profiles/), only evaluation fleets.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
BS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
TS = (1, 2, 4, 8)
LS = (256, 1024, 2048, 4096, 8192)


def llama70b_tp4_h100(kind: str, b: int, t: int, length: int) -> float:
    """TurboSpec's vLLM V1 fit for Llama-70B on 4x H100 (TP4): 18.345 ms + 64.0 us per token in
    the step + 0.0624 us per KV token read, +5 % engine overhead; the EAGLE draft step is 4 % of
    a plain target step (speculation-facts.md section 3.1)."""
    target = 1.05 * (18.345 + 0.0640 * b * t + 0.0000624 * b * length)
    if kind == "draft":
        return 0.04 * 1.05 * (18.345 + 0.0640 * b + 0.0000624 * b * length)
    return target


def llama3b_a10(kind: str, b: int, t: int, length: int) -> float:
    """Llama-3.2-3B (3.21 B params bf16 = 6.43 GB; 28 layers x 8 KV heads x 128 x 2 x 2 B =
    114.7 KB of KV per token) on one A10 (24 GB GDDR6, 600 GB/s, 125 TFLOPS bf16 dense), scaled
    from the 8B/H100 fit's efficiencies (speculation-facts.md 3.1: c0 5.886 ms against 4.8 ms of
    weight streaming = 1.23x; 21 us per token for 16 GFLOP = 77 % of peak; 0.0393 us per KV token
    = the bandwidth bound):
    fixed 6.43 GB / 600 GB/s x 1.23 = 13.2 ms; per token 6.42 GFLOP / (0.77 x 125 TFLOPS) =
    0.067 ms; per KV token 114.7 KB / 600 GB/s = 0.191 us. The EAGLE-3 head (one decoder layer
    and a 32k-vocab head, about 0.2 B params = 0.4 GB) streams in 0.67 ms x 1.23 = 0.82 ms, plus
    0.004 ms per token and one layer's KV (0.0068 us per KV token)."""
    if kind == "draft":
        return 0.82 + 0.0042 * b + 0.0000068 * b * length
    return 13.2 + 0.067 * b * t + 0.000191 * b * length


def write(name: str, formula: Callable[[str, int, int, int], float], provenance: str) -> Path:
    path = HERE / f"{name}-step-ms.csv"
    lines = [f"# {provenance}", "kind,B,T,L,ms"]
    for length in LS:
        for b in BS:
            for t in TS:
                lines.append(f"target,{b},{t},{length},{formula('target', b, t, length):.4f}")
            lines.append(f"draft,{b},1,{length},{formula('draft', b, 1, length):.4f}")
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    write(
        "llama70b-tp4-h100",
        llama70b_tp4_h100,
        "DERIVED (bench/fleets/derive.py), not measured: Llama-70B TP4 H100, TurboSpec vLLM V1 fit "
        "18.345 ms + 64 us/token + 0.0624 us/KV-token, +5 % overhead; draft 4 % of a target step",
    )
    write(
        "llama3b-a10",
        llama3b_a10,
        "DERIVED (bench/fleets/derive.py), not measured: Llama-3.2-3B bf16 on one A10 (600 GB/s, "
        "125 TFLOPS), the 8B/H100 fit's efficiencies: 13.2 ms + 0.067 ms/token + 0.191 us/KV-token",
    )


if __name__ == "__main__":
    main()
