"""`specroute demo` (what `make run` starts): two twins and the proxy, a banner, a clean stop."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile

import openai
from proxy_harness import wait_for


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def refuses(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return False
    except OSError:
        return True


def test_demo_serves_the_sdk_and_stops_its_twins_on_sigterm() -> None:
    """Settings from the environment apply to the demo, its port included (`make run` takes no
    arguments), and a misspelt one is reported as `serve` reports it."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECROUTE_")}
    env |= {"SPECROUTE_PORT": str(port), "SPECROUTE_POLCY": "spec", "SPECROUTE_SPEC_URLS": "http://127.0.0.1:1"}
    with tempfile.TemporaryFile() as out:
        demo = subprocess.Popen(
            [sys.executable, "-m", "proxy.cli", "demo", "--time-scale", "20"],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        try:

            def printed() -> str:
                out.seek(0)
                return out.read().decode(errors="replace")

            banner = wait_for(lambda: "Ctrl-C" in printed() and printed(), "the demo banner", timeout=60)
            base_url = f"http://127.0.0.1:{port}/v1"
            assert f"OpenAI base URL {base_url}" in banner
            assert "model 'specroute/twin'" in banner
            assert f"curl -N {base_url}/chat/completions" in banner
            twin_urls = re.findall(r"pool \([^)]*\):\s+(http://127\.0\.0\.1:\d+)", banner)
            assert len(twin_urls) == 2
            assert "SPECROUTE_POLCY is not a setting (did you mean SPECROUTE_POLICY?)" in banner
            assert "SPECROUTE_SPEC_URLS and SPECROUTE_BASE_URLS are ignored" in banner  # not fronted
            assert "http://127.0.0.1:1" not in twin_urls

            client = openai.OpenAI(base_url=base_url, api_key="any", max_retries=0)
            completion = client.completions.create(model="specroute/twin", prompt="Hello", max_tokens=4)
            assert completion.usage.completion_tokens == 4  # the banner comes once the proxy listens
            # Its twins keep responses as a deployment's SGLang would: a conversation continues.
            first = client.responses.create(model="specroute/twin", input="Hello", max_output_tokens=8)
            follow = client.responses.create(
                model="specroute/twin", input="More.", previous_response_id=first.id, max_output_tokens=8
            )
            assert follow.previous_response_id == first.id
        finally:
            demo.send_signal(signal.SIGTERM)
            demo.wait(30)
        assert all(refuses(url) for url in twin_urls)  # the twins went with the demo
