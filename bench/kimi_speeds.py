"""The Kimi base presets' decode speed over HTTP, SGLang's and vLLM's, beside the seed deployment's
measurements (SGLang 63.6 tok/s single stream and 2,370 at 128 streams; vLLM 82.5 and 1,536).

    python -m bench.kimi_speeds        # about 30 s; prints a markdown table

Each preset runs as a base twin at time scale 1 (`--server vllm` for the vLLM ones), streamed by
N concurrent chat requests over real sockets. A stream's decode speed is its content chunks after
the first over the time between its first and last; the table gives the mean per stream and N
times it (aggregate). At 128 streams, prefill steps of late arrivals interrupt decoding, so the
aggregate comes out a little under the step model's.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx

from sim.testing import TwinSpec, twins

PRESETS = (("kimi-moe", "sglang"), ("kimi-linear", "sglang"), ("kimi-moe-vllm", "vllm"), ("kimi-linear-vllm", "vllm"))
MODEL = "specroute/twin"
"""The twins' served model name (a vLLM server answers 404 for any other)."""
RUNS = ((1, 300), (128, 60))
"""(concurrent streams, tokens per stream)"""
MEASURED = {("sglang", 1): 63.6, ("sglang", 128): 2370.0, ("vllm", 1): 82.5, ("vllm", 128): 1536.0}


async def stream_speed(client: httpx.AsyncClient, url: str, tokens: int) -> float:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens, "stream": True}
    stamps: list[float] = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            # content chunks only: not vLLM's opening role chunk, nor the usage tail
            if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


async def decode_speed(url: str, streams: int, tokens: int) -> float:
    """Mean per-stream decode speed of `streams` concurrent streams, tokens/s."""
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=streams + 8)) as client:
        speeds = await asyncio.gather(*(stream_speed(client, url, tokens) for _ in range(streams)))
    return statistics.fmean(speeds)


def main() -> None:
    print("| Preset | Server | Streams | tok/s per stream | tok/s aggregate | Deployment measured |")
    print("|---|---|---|---|---|---|")
    for profile, server in PRESETS:
        spec = TwinSpec("base", profile, time_scale=1.0, seed=3, server=server, args=("--output-len", "fixed:4096"))
        with twins(spec) as (twin,):
            for streams, tokens in RUNS:
                per_stream = asyncio.run(decode_speed(twin.url, streams, tokens))
                print(
                    f"| `{profile}` | {server} | {streams} | {per_stream:.1f} | {per_stream * streams:,.1f} "
                    f"| {MEASURED[server, streams]:,.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
