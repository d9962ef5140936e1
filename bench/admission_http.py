"""Admission control over HTTP: `specroute serve` in front of a kimi-moe spec and base twin (real
time), Poisson arrivals of streamed chat requests at twice the fleet's capacity for 60 s, the
goodput policy told the SLO (TTFT 2 s, TPOT 100 ms), with admission control on (its default
limits: the SLO's targets) and off, and with flow control (SPECROUTE_HOLD_MAX_S) alone and
beside admission.

    python -m bench.admission_http            # every mode, ~10 minutes; docs/reliability.md records it
    python -m bench.admission_http --quick    # 20 s of arrivals
    python -m bench.admission_http --modes off hold

Measured at the client: each request's first token and time per output token (from the usage's
token count: a spec chunk carries several tokens; SLO met or not),
each refusal's latency (429), and whether every admitted stream ended with [DONE] (lost if not).
Prompts and natural output lengths follow the Azure conversation trace, as on the virtual clock.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.chaos import proxy_process
from bench.routing import KIMI_SLO, SETUPS, capacity_rps, lengths
from sim.testing import TwinSpec, twins

LOAD = 2.0
SETUP = "kimi-moe a=0.64"
ADMISSION_OFF = {"SPECROUTE_ADMISSION_TTFT_S": "0", "SPECROUTE_ADMISSION_TPOT_MS": "0"}
HOLD = {"SPECROUTE_HOLD_MAX_S": "120"}
MODES: dict[str, dict[str, str]] = {
    "off": ADMISSION_OFF,
    "on": {},
    "hold": {**ADMISSION_OFF, **HOLD},
    "on+hold": HOLD,
}
"""Admission off or on (its default limits), flow control off or holding up to 120 s."""


Send = Callable[[httpx.AsyncClient, str, int, int, int], Coroutine[Any, Any, dict[str, Any]]]
"""One request of an offered load: (client, url, prompt tokens, output tokens, index) -> its record."""


async def one(
    client: httpx.AsyncClient, url: str, prompt_tokens: int, output_tokens: int, index: int
) -> dict[str, Any]:
    """A streamed chat request of `prompt_tokens`, its output its natural length (the twin's)."""
    # Its own first word: the twins keep a prefix cache, and prompts of one repeated word were
    # each other's prefixes, so their prefill was nearly free and twice the capacity was not.
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": f"request{index} " + "w " * (2 * prompt_tokens - 1)}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.monotonic()
    first = None
    chunks = tokens = 0
    record: dict[str, Any] = {"status": 0, "done": False}
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            record["status"] = response.status_code
            if response.status_code != 200:
                await response.aread()
                record["refused_ms"] = (time.monotonic() - started) * 1000
                record["retry_after"] = response.headers.get("retry-after")
                return record
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    record["done"] = True
                    break
                if line.startswith("data: ") and '"content"' in line:
                    chunks += 1
                    if first is None:
                        first = time.monotonic()
                elif line.startswith("data: ") and '"usage"' in line and '"choices":[]' in line:
                    tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        record["error"] = type(exc).__name__
    end = time.monotonic()
    if first is not None:
        record["ttft_s"] = first - started
        # Per token (a spec chunk carries several): the usage's count, the chunks if it is missing.
        record["tpot_s"] = (end - first) / max((tokens or chunks) - 1, 1)
    return record


async def offered_load(
    url: str, duration_s: float, rate: float, sample: Sequence[tuple[int, int]], seed: int, send: Send = one
) -> list[dict[str, Any]]:
    """Poisson arrivals at `rate` for `duration_s`, each a request of the sample's lengths sent
    by `send`; every record once all are answered."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=4000, max_keepalive_connections=4000)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:
        tasks: list[asyncio.Task[dict[str, Any]]] = []
        started = time.monotonic()
        at = 0.0
        i = 0
        while True:
            at += rng.expovariate(rate)
            if at > duration_s:
                break
            await asyncio.sleep(max(0.0, started + at - time.monotonic()))  # the arrival process itself
            prompt, output = sample[(i * 7 + seed) % len(sample)]
            tasks.append(asyncio.create_task(send(client, url, prompt, output, i)))
            i += 1
        return list(await asyncio.wait_for(asyncio.gather(*tasks), 600))


def summarise(records: list[dict[str, Any]], duration_s: float) -> dict[str, Any]:
    admitted = [r for r in records if r["status"] == 200]
    refused = [r for r in records if r["status"] == 429]
    met = [r for r in admitted if r.get("done") and r["ttft_s"] <= KIMI_SLO.ttft_s and r["tpot_s"] <= KIMI_SLO.tpot_s]
    refusal_ms = sorted(r["refused_ms"] for r in refused)
    return {
        "offered": len(records),
        "refused": len(refused),
        "admitted": len(admitted),
        "lost": sum(1 for r in admitted if not r.get("done")),
        "admitted_met": len(met) / max(len(admitted), 1),
        "goodput_rps": len(met) / duration_s,
        "refusal_ms_p50": statistics.median(refusal_ms) if refusal_ms else None,
        "refusal_ms_p99": refusal_ms[min(int(0.99 * len(refusal_ms)), len(refusal_ms) - 1)] if refusal_ms else None,
        "mean_ttft_admitted_s": statistics.fmean(r["ttft_s"] for r in admitted if "ttft_s" in r) if admitted else None,
        "other_statuses": sorted({r["status"] for r in records} - {200, 429}),
    }


def run(duration_s: float, modes: Sequence[str] = tuple(MODES)) -> list[tuple[str, dict[str, Any]]]:
    sample = lengths()
    rate = LOAD * capacity_rps(SETUPS[SETUP], sample)
    rows = []
    for mode in modes:
        extra = MODES[mode]
        with twins(TwinSpec("spec", profile="kimi-moe", seed=1), TwinSpec("base", profile="kimi-moe", seed=2)) as (
            spec,
            base,
        ):
            env = {
                "SPECROUTE_PROFILE": "kimi-moe",
                "SPECROUTE_GOODPUT_SLO_TTFT_S": str(KIMI_SLO.ttft_s),
                "SPECROUTE_GOODPUT_SLO_TPOT_MS": str(KIMI_SLO.tpot_s * 1000),
                "SPECROUTE_REQUEST_LOG": "false",
                **extra,
            }
            with proxy_process(
                [spec.url], [base.url], Path(f"/tmp/specroute-admission-{mode.replace('+', '-')}.log"), **env
            ) as (_, url):
                records = asyncio.run(offered_load(url, duration_s, rate, sample, seed=100))
        rows.append((mode, {"rate_rps": round(rate, 1), **summarise(records, duration_s)}))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.admission_http", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 s of arrivals")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES), help="runs to make")
    args = parser.parse_args(argv)
    duration = 20.0 if args.quick else 60.0
    started = time.monotonic()
    rows = run(duration, args.modes)
    print(
        f"`python -m bench.admission_http{' --quick' if args.quick else ''}` ({time.strftime('%Y-%m-%d %H:%M')}, "
        f"{time.monotonic() - started:.0f} s; {SETUP} twins in real time, {LOAD:.0%} of capacity for {duration:.0f} s, "
        f"SLO {KIMI_SLO.ttft_s:g} s / {KIMI_SLO.tpot_s * 1000:g} ms):\n"
    )
    print(
        "| admission / flow control | offered rps | offered | refused | admitted | admitted meeting SLO | lost | SLO goodput rps | refusal p50 / p99 ms | mean TTFT admitted | other statuses |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for mode, r in rows:
        refusal = f"{r['refusal_ms_p50']:.1f} / {r['refusal_ms_p99']:.1f}" if r["refusal_ms_p50"] is not None else "-"
        ttft = f"{r['mean_ttft_admitted_s']:.2f} s" if r["mean_ttft_admitted_s"] is not None else "-"
        print(
            f"| {mode} | {r['rate_rps']} | {r['offered']} | {r['refused']} | {r['admitted']} | {r['admitted_met']:.1%} | "
            f"{r['lost']} | {r['goodput_rps']:.2f} | {refusal} | {ttft} | {r['other_statuses'] or '-'} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
