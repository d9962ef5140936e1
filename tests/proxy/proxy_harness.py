"""The proxy itself on a real socket on 127.0.0.1, and polling helpers, for tests/proxy.

The proxy runs under uvicorn exactly as `specroute serve` runs it (proxy.server), in a thread
of the test process so that tests can also look at the router's in-flight counts.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import httpx
import uvicorn

from proxy.app import SpecrouteApp
from proxy.server import DrainingServer, build_app, uvicorn_config
from proxy.settings import Settings, load_settings
from sim.testing import RunningTwin, wait_for

TIME_SCALE = 50.0
"""Twins run 50x faster than the H200 they model: a 16-token answer takes a few ms."""


class RunningProxy:
    def __init__(self, app: SpecrouteApp, server: uvicorn.Server, thread: threading.Thread) -> None:
        self.app = app
        self.server = server
        self.thread = thread
        self.port = server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"

    def in_flight(self) -> int:
        return sum(i.in_flight for i in self.app.router.instances())


@contextmanager
def running_proxy(**overrides: Any) -> Iterator[RunningProxy]:
    """The proxy on a free port with these settings (init values win over the environment)."""
    settings: Settings = load_settings(
        **{"host": "127.0.0.1", "port": 0, "request_log": False, "log_level": "warning", **overrides}
    )
    app = build_app(settings)
    config = uvicorn_config(app, settings)
    server = DrainingServer(config, app)
    thread = threading.Thread(target=server.run, daemon=True)  # uvloop, as `specroute serve`
    thread.start()
    wait_for(lambda: server.started or not thread.is_alive(), "the proxy to start", timeout=30)
    if not server.started:
        raise RuntimeError("the proxy did not start")
    try:
        yield RunningProxy(app, server, thread)
    finally:
        server.should_exit = True
        thread.join(30)


def twin_running(twin: RunningTwin) -> int:
    """Requests the twin is running or queueing now, from its /v1/loads."""
    load = httpx.get(twin.url + "/v1/loads", params={"include": "all"}, timeout=5).json()["loads"][0]
    return int(load["num_running_reqs"]) + int(load["num_waiting_reqs"])


UPSTREAM_5XX = "upstream server error"
UPSTREAM_FAILURES = {
    "connect",
    "upstream_disconnected",
    "first_token_timeout",
    "chunk_timeout",
    "total_timeout",
    "upstream_redirect",
    "no_upstream",
    "upstream_event_too_large",
    "upstream_auth",
    "upstream_unresponsive",
    "upstream_no_progress",
}
"""Codes of the gateway errors the proxy answers for an upstream that failed (502/503/504)."""


def assert_upstream_failure(response: httpx.Response) -> None:
    """A 5xx is only ever an upstream's (normalised) or a gateway error about an upstream."""
    error = response.json()["error"]
    assert error["message"].startswith(UPSTREAM_5XX) or error["code"] in UPSTREAM_FAILURES, response.text


def read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the proxy sends until it closes the connection, and how long that took."""
    started, data = time.monotonic(), b""
    while True:
        try:
            part = sock.recv(65536)
        except ConnectionResetError:
            break
        if not part:
            break
        data += part
    return data, time.monotonic() - started


@asynccontextmanager
async def aiohttp_upstream(routes: Sequence[tuple[str, str, Any]]) -> AsyncIterator[str]:
    """A small upstream in this event loop, for what FaultServer cannot do (a handler that sleeps
    on one path): `routes` as (method, path, handler); its URL, on 127.0.0.1 and a free port."""
    from aiohttp import web

    app = web.Application()
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # noqa: SLF001
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
