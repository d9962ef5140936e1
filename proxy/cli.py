"""`specroute serve | sim | demo | config | profile`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from proxy.settings import SettingsError, load_settings, share_dotenv_otel, unknown_variables


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specroute",
        description="OpenAI-compatible proxy routing each request to a speculative or a plain SGLang pool.",
        epilog="Settings come from SPECROUTE_* environment variables and a .env file; see `specroute config`.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser("serve", help="run the proxy in front of SPECROUTE_SPEC_URLS / SPECROUTE_BASE_URLS")
    serve.add_argument("--host", help="listen address (default: SPECROUTE_HOST)")
    serve.add_argument("--port", type=int, help="listen port (default: SPECROUTE_PORT)")
    commands.add_parser("sim", help="run one simulated SGLang server (see `specroute sim --help`)", add_help=False)
    demo = commands.add_parser("demo", help="a spec twin, a base twin and the proxy on 127.0.0.1:8000")
    demo.add_argument("--port", type=int, help="proxy port (default: SPECROUTE_PORT, 8000)")
    demo.add_argument("--profile", default="h200-llama8b", help="twin step-time profile")
    demo.add_argument("--time-scale", type=float, default=1.0, help="run the twins this many times faster")
    commands.add_parser("config", help="print the effective settings (secrets masked)")
    from proxy.profiler import add_arguments

    add_arguments(commands.add_parser("profile", help="measure live servers and write a step-time profile"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sim"]:
        from sim.cli import main as sim_main

        return sim_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "config":
            return print_config()
        if args.command == "profile":
            from proxy.profiler import main_from_args

            return main_from_args(args)
        if args.command == "demo":
            from proxy.demo import run_demo

            warn_unknown_variables()
            return run_demo(port=args.port, profile=args.profile, time_scale=args.time_scale)
        overrides: dict[str, Any] = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
        settings = load_settings(**overrides)
        warn_unknown_variables()
        share_dotenv_otel()
        from proxy.server import serve

        serve(settings)
        return 0
    except KeyboardInterrupt:  # Ctrl-C: uvicorn re-raises it once the server drained and stopped
        return 130
    except SettingsError as exc:
        print(f"specroute: {exc}", file=sys.stderr)
        return 2


def warn_unknown_variables() -> None:
    for line in unknown_variables():
        print(f"specroute: warning: {line}", file=sys.stderr)


def print_config() -> int:
    view = load_settings().public_view()
    warn_unknown_variables()
    width = max(len(name) for name in view)
    for name, value in view.items():
        print(f"{name:<{width}}  {'' if value is None else value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
