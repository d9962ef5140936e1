"""How long one hostile body holds the proxy's event loop: `specroute serve` in its own process,
a client probing GET /health back to back on one connection while another posts a body; the
slowest /health answer during the post is the loop's stall (the least of three posts'). Bodies at and past the defaults of
SPECROUTE_MAX_JSON_ITEMS / SPECROUTE_MAX_JSON_VALUES, all under SPECROUTE_MAX_BODY_BYTES.

    python -m bench.body_work        (figures in README.md, failure behaviour, and docs/security.md)
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import httpx

from sim.testing import wait_for


def shapes() -> dict[str, Callable[[], bytes]]:
    def array(n: int, item: bytes) -> bytes:
        return b'{"model":"m","messages":[' + b",".join([item] * n) + b"]}"

    return {
        "a small chat (baseline)": lambda: array(1, b'{"role":"user","content":"hi"}'),
        "5.5M empty objects (refused)": lambda: array(5_500_000, b"{}"),
        "7M numbers (refused)": lambda: array(7_000_000, b"0"),
        "1.2M unique keys (refused)": lambda: (
            b'{"messages":[{' + b",".join(b'"k%d":0' % i for i in range(1_200_000)) + b"}]}"
        ),
        "60k objects of 2 members (at the limits)": lambda: array(60_000, b'{"role":"user","content":"hi"}'),
        "250k numbers (at the limit)": lambda: array(249_000, b"0"),
        "124k unique keys (at the limit)": lambda: (
            b'{"messages":[{' + b",".join(b'"k%d":0' % i for i in range(124_000)) + b"}]}"
        ),
        "one 15 MiB string": lambda: b'{"model":"m","prompt":"' + b"word " * 3_200_000 + b'"}',
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stall(url: str, body: bytes) -> tuple[int, float]:
    slowest, stop = [0.0], threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                started = time.perf_counter()
                client.get(url + "/health")
                slowest[0] = max(slowest[0], time.perf_counter() - started)

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        status = httpx.post(
            url + "/v1/chat/completions", content=body, timeout=60, headers={"content-type": "application/json"}
        ).status_code
    finally:
        stop.set()
        thread.join(30)
    return status, slowest[0]


def main() -> None:
    port = free_port()  # nothing listens upstream: accepted bodies get a 502
    env = {
        **os.environ,
        "SPECROUTE_SPEC_URLS": f"http://127.0.0.1:{free_port()}",
        "SPECROUTE_BASE_URLS": f"http://127.0.0.1:{free_port()}",
        "SPECROUTE_LOG_LEVEL": "warning",
        "SPECROUTE_REQUEST_LOG": "false",
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--host", "127.0.0.1", "--port", str(port)], env=env
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _up(url), "the proxy to start", timeout=30)
        print("| body | bytes | status | slowest /health during it |\n|---|---|---|---|")
        for name, make in shapes().items():
            body = make()
            status, slowest = min((stall(url, body) for _ in range(3)), key=lambda r: r[1])
            print(f"| {name} | {len(body) / 2**20:.1f} MiB | {status} | {slowest * 1000:.0f} ms |")
    finally:
        server.terminate()
        server.wait(30)


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    main()
