"""`specroute demo` (`make run`): a spec twin, a base twin and the proxy on 127.0.0.1:8000.

The twins are subprocesses on free ports (sim.testing); the proxy runs in this process and, when
it stops (Ctrl-C or SIGTERM, after its drain), the twins are stopped too.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

import httpx

from proxy.settings import load_settings
from sim.testing import TwinSpec, twins

DEMO_TWIN_ARGS = ("--enable-cache-report", "--enable-response-store")
"""As a deployment would start SGLang: prefix-cache hits reported, Responses API responses kept."""


def served_model(url: str) -> str:
    answer = httpx.get(url + "/v1/models", timeout=10).json()
    return str(answer["data"][0]["id"])


def banner(port: int, model: str, spec_url: str, base_url: str, keys: bool = False) -> str:
    base = f"http://127.0.0.1:{port}/v1"
    body = f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "stream": true}}'
    return "\n".join(
        [
            "",
            f"specroute is up: OpenAI base URL {base}  (model {model!r}, {'a key it was given' if keys else 'any API key'})",
            f"  spec pool (EAGLE-3 twin): {spec_url}",
            f"  base pool (plain twin):   {base_url}",
            "Try:",
            f"  curl -N {base}/chat/completions -H 'content-type: application/json' -d '{body}'",
            "Ctrl-C stops the proxy and both twins.",
            "",
        ]
    )


def _stop(signum: int, frame: FrameType | None) -> None:
    sys.exit(0)


def run_demo(port: int | None, profile: str, time_scale: float) -> int:
    """`port`: the proxy's (None: SPECROUTE_PORT's); the other SPECROUTE_* settings apply, but
    the demo's own: it listens on 127.0.0.1 in front of its twins."""
    # uvicorn re-raises the stop signal once it has drained; unwinding (instead of dying on the
    # default handler) is what lets the `twins` block below stop both twins.
    signal.signal(signal.SIGTERM, _stop)
    where = {"host": "127.0.0.1"} | ({} if port is None else {"port": port})
    given = load_settings(**where)
    if given.spec_urls or given.base_urls:  # set for `serve`, say: not what the demo will front
        print(
            "specroute demo: SPECROUTE_SPEC_URLS and SPECROUTE_BASE_URLS are ignored: the demo fronts "
            "its own twins (specroute serve fronts your servers)",
            file=sys.stderr,
            flush=True,
        )
    specs = (
        # Usage reports cached prompt tokens, as SGLang does with the flag README recommends.
        TwinSpec("spec", profile=profile, time_scale=time_scale, seed=1, args=DEMO_TWIN_ARGS),
        TwinSpec("base", profile=profile, time_scale=time_scale, seed=2, args=DEMO_TWIN_ARGS),
    )
    with twins(*specs) as (spec, base):
        settings = load_settings(**where, spec_urls=[spec.url], base_urls=[base.url])
        model = served_model(spec.url)
        keys = settings.api_keys is not None or settings.api_keys_file is not None
        from proxy.server import serve

        try:
            serve(settings, on_ready=lambda bound: print(banner(bound, model, spec.url, base.url, keys), flush=True))
        except KeyboardInterrupt:
            print("specroute demo: stopped", file=sys.stderr)  # Ctrl-C is how the demo ends
    return 0
