"""`specroute sim ...` / `python -m sim ...`: run one SGLang twin on 127.0.0.1.

Flags use SGLang's spelling where SGLang has the flag (--max-running-requests,
--speculative-num-steps, --enable-metrics, --enable-trace, --otlp-traces-endpoint, ...); the
twin's own flags are --mode, --profile, --time-scale, --mean-alpha, --output-len and friends.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
from collections.abc import Sequence

from fleet.profile import builtin_names, load_profile
from sim.engine import EngineConfig, check_alpha
from sim.faults import Faults
from sim.lengths import parse_output_lengths

READY_LINE = "specroute-twin listening on http://{host}:{port}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specroute sim", description="Run a simulated SGLang server (the twin).")
    p.add_argument(
        "--mode", choices=("spec", "base"), required=True, help="spec: EAGLE-3 speculative server; base: plain"
    )
    p.add_argument(
        "--profile", default="h200-llama8b", help=f"step-time profile: {', '.join(builtin_names())} or a .json path"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed on stdout)")
    p.add_argument("--time-scale", type=float, default=1.0, help="run the same physics this many times faster")
    p.add_argument("--seed", "--random-seed", dest="seed", type=int, default=0)
    p.add_argument("--model-path", default="specroute/twin")
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--max-running-requests", type=int, default=None, help="default 48 in spec mode (as SGLang), 256 in base mode"
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="refuse a request arriving to a waiting queue this long (SGLang: a 503, in-band on a stream); default none",
    )
    p.add_argument("--speculative-algorithm", default=None, help="accepted for SGLang compatibility (EAGLE3)")
    p.add_argument(
        "--speculative-num-steps",
        type=int,
        default=None,
        help="k, draft tokens per verify step (default: the profile's, 3)",
    )
    p.add_argument("--speculative-eagle-topk", type=int, default=1, help="only 1 (chain drafting) is modelled")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None, help="must be num_steps + 1 with topk 1")
    p.add_argument(
        "--mean-alpha", type=float, default=None, help="mean per-token acceptance (default: the profile's, 0.64)"
    )
    p.add_argument(
        "--alpha-concentration", type=float, default=20.0, help="per-request alpha ~ Beta(mean*c, (1-mean)*c)"
    )
    p.add_argument("--alpha-decay", type=float, default=1.0, help="per-position acceptance decay (1 = i.i.d.)")
    p.add_argument(
        "--workload-alpha",
        type=parse_workload_alpha,
        default={},
        metavar="KEY=ALPHA[,KEY=ALPHA...]",
        help="mean acceptance per workload, matched against a request's x-specroute-workload header "
        "(e.g. code=0.8,chat=0.45); other requests use --mean-alpha",
    )
    p.add_argument(
        "--output-len",
        default="azure-conv",
        help="natural output lengths: azure-conv, azure-code, fixed:N, exp:MEAN, uniform:LO,HI",
    )
    p.add_argument(
        "--dp-size",
        "--data-parallel-size",
        dest="dp_size",
        type=int,
        default=1,
        help="data-parallel ranks: whole replicas behind one HTTP front (SGLang's without DP attention, "
        "dealt requests in turn; vLLM's engines, each request to the least loaded)",
    )
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--context-length", type=int, default=32768)
    p.add_argument(
        "--max-total-tokens",
        type=int,
        default=1_000_000,
        help="KV pool size in tokens: bounds the prefix cache (LRU eviction); token_usage is reported against it",
    )
    p.add_argument(
        "--page-size",
        type=int,
        default=None,
        help="tokens per prefix-cache page (SGLang's default 1; 16, vLLM's block size, with --server vllm)",
    )
    p.add_argument("--disable-radix-cache", action="store_true", help="no prefix cache (SGLang spelling)")
    p.add_argument(
        "--enable-cache-report",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens (SGLang spelling)",
    )
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="the same with --server vllm (vLLM's spelling)",
    )
    p.add_argument(
        "--enable-response-store",
        action="store_true",
        help="keep /v1/responses answers for retrieval, previous_response_id and background "
        "(SGLang spelling; the twin keeps the last 10,000)",
    )
    p.add_argument("--decode-log-interval", type=int, default=40)
    p.add_argument("--load-snapshot-publish-interval", type=int, default=15)
    p.add_argument("--enable-metrics", action="store_true", help="serve /metrics (as SGLang)")
    p.add_argument("--enable-trace", action="store_true", help="export OTLP traces (SGLang spelling)")
    p.add_argument("--otlp-traces-endpoint", default="localhost:4317")
    p.add_argument("--log-level", default="warning")
    p.add_argument(
        "--server",
        choices=("sglang", "vllm"),
        default="sglang",
        help="whose HTTP shapes to serve: SGLang's, or vLLM's OpenAI server (base mode only)",
    )
    p.add_argument(
        "--fault-error-rate", type=float, default=0.0, help="answer this share of completions 500 (reliability tests)"
    )
    p.add_argument(
        "--fault-first-token-delay-ms", type=float, default=0.0, help="hold every completion this long before it starts"
    )
    p.add_argument(
        "--fault-hang-after-chunks", type=int, default=None, help="streams stop after N chunks and never end"
    )
    p.add_argument(
        "--fault-drop-after-chunks", type=int, default=None, help="stream connections are cut after N chunks"
    )
    p.add_argument(
        "--fault-load-delay-ms", type=float, default=0.0, help="answer /v1/loads this late (completions run on)"
    )
    p.add_argument(
        "--fault-wedged",
        action="store_true",
        help="the engine stops stepping (a hung scheduler) while its HTTP front and /v1/loads answer",
    )
    p.add_argument(
        "--fault-wedged-rank",
        type=int,
        default=None,
        help="the same for one data-parallel rank (with --dp-size): the others serve on",
    )
    return p


def parse_workload_alpha(text: str) -> dict[str, float]:
    """`code=0.8,chat=0.45` -> {"code": 0.8, "chat": 0.45} (each alpha in [0, 1))."""
    table: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        try:
            if not sep or not key.strip():
                raise ValueError("expected KEY=ALPHA")
            alpha = float(value)
            check_alpha(alpha)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"bad --workload-alpha item {item!r}: {exc}") from None
        table[key.strip()] = alpha
    return table


def engine_config(args: argparse.Namespace) -> EngineConfig:
    profile = load_profile(args.profile)
    num_steps = args.speculative_num_steps or int(profile.defaults.get("num_steps", 3))
    if args.speculative_eagle_topk != 1:
        raise ValueError("the twin models chain drafting only: --speculative-eagle-topk must be 1")
    if args.speculative_num_draft_tokens not in (None, num_steps + 1):
        raise ValueError("with topk 1, --speculative-num-draft-tokens must be --speculative-num-steps + 1")
    if args.time_scale <= 0:
        raise ValueError("--time-scale must be > 0")
    mean_alpha = args.mean_alpha if args.mean_alpha is not None else float(profile.defaults.get("mean_alpha", 0.64))
    return EngineConfig(
        mode=args.mode,
        profile=profile,
        max_running_requests=args.max_running_requests,
        max_queued_requests=args.max_queued_requests,
        num_steps=num_steps,
        mean_alpha=mean_alpha,
        alpha_concentration=args.alpha_concentration,
        alpha_decay=args.alpha_decay,
        workload_alpha=args.workload_alpha,
        chunked_prefill_size=args.chunked_prefill_size,
        context_length=args.context_length,
        max_total_num_tokens=args.max_total_tokens,
        page_size=args.page_size if args.page_size is not None else (16 if args.server == "vllm" else 1),
        enable_prefix_cache=not args.disable_radix_cache,
        output_lengths=parse_output_lengths(args.output_len),
        decode_log_interval=args.decode_log_interval,
        load_publish_interval=args.load_snapshot_publish_interval,
        seed=args.seed,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = engine_config(args)
        faults = Faults(
            args.fault_error_rate,
            args.fault_first_token_delay_ms,
            args.fault_hang_after_chunks,
            args.fault_drop_after_chunks,
            args.fault_load_delay_ms,
            args.fault_wedged,
            args.fault_wedged_rank,
        )
        faults.check()
        if args.dp_size < 1:
            raise ValueError("--dp-size must be >= 1")
        faults.check_ranks(args.dp_size)
        if args.server == "vllm" and args.mode != "base":
            raise ValueError("--server vllm imitates a plain vLLM server: use it with --mode base")
    except ValueError as exc:
        print(f"specroute sim: {exc}", file=sys.stderr)
        return 2
    # Imported here so `--help` and config errors stay fast.
    import uvicorn

    from sim.server import TwinOptions, create_app

    # IPPROTO_TCP, not 0: the event loop sets TCP_NODELAY only on accepted sockets whose protocol
    # says TCP. Without it each chunk written after the response headers waits for the client's
    # delayed ACK (~40 ms per keep-alive request), which SGLang's own server never does.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        print(f"specroute sim: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    port = sock.getsockname()[1]
    options = TwinOptions(
        mode=args.mode,
        profile=args.profile,
        host=args.host,
        port=port,
        time_scale=args.time_scale,
        seed=args.seed,
        model_path=args.model_path,
        served_model_name=args.served_model_name,
        enable_metrics=args.enable_metrics,
        enable_trace=args.enable_trace,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        speculative_algorithm=args.speculative_algorithm,
        output_len=args.output_len,
        faults=faults,
        server=args.server,
        enable_cache_report=args.enable_cache_report or args.enable_prompt_tokens_details,
        enable_response_store=args.enable_response_store,
        dp_size=args.dp_size,
    )
    app = create_app(options, config)
    server = uvicorn.Server(
        uvicorn.Config(app, log_level=args.log_level, access_log=False, lifespan="on", timeout_graceful_shutdown=2)
    )
    print(READY_LINE.format(host=args.host, port=port), flush=True)
    asyncio.run(server.serve(sockets=[sock]))
    return 0
