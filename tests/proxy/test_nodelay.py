"""Every server this project runs from its own code sets TCP_NODELAY on the connections it accepts.

Without it, a response written in parts (headers, then each SSE chunk) holds the second part
until the client's delayed ACK, about 40 ms (issue 14: the twin did this). Each server runs in
this process, so the accepted socket can be found (its peer is our client) and asked directly.
The twin runs as its own process; tests/proxy/test_first_token.py measures it instead.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Coroutine
from http.server import ThreadingHTTPServer
from typing import TypeVar

import pytest
import uvloop
from proxy_faults import FaultServer
from proxy_harness import running_proxy

from sim.testing import wait_for

T = TypeVar("T")

# How long a server may take from accepting a connection to setting its TCP_NODELAY: the option
# is set after accept() (by the event loop, or by the handler), and a look in between reads the
# kernel's default (one run of the full suite caught bench.first_token's upstream there).
SETTLE_S = 2.0


def own_tcp_socket(check: Callable[[socket.socket], T | None]) -> T | None:
    """`check` of the first TCP socket of this process for which it is not None (a socket it
    raises OSError for, e.g. not connected, is passed over); None if none."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            copy = os.dup(int(fd))
        except OSError:  # closed meanwhile
            continue
        try:
            sock = socket.socket(fileno=copy)
        except OSError:  # not a socket: socket() leaves the copy open, so close it here
            os.close(copy)
            continue
        try:
            if sock.family == socket.AF_INET and sock.type == socket.SOCK_STREAM:
                value = check(sock)
                if value is not None:
                    return value
        except OSError:
            pass
        finally:
            sock.close()
    return None


def accepted_nodelay(client: socket.socket, expected: int) -> int:
    """TCP_NODELAY of the socket in this process whose peer is `client` (the server's side): the
    first reading equal to `expected`, else the last one after SETTLE_S."""
    ours = client.getsockname()
    found: list[int] = []

    def look() -> bool:
        def nodelay(sock: socket.socket) -> int | None:
            return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) if sock.getpeername() == ours else None

        value = own_tcp_socket(nodelay)
        if value is None:
            return False
        found.append(value)
        return True

    wait_for(look, "the server to accept the connection", timeout=10)

    def settled() -> bool:
        if found[-1] == expected:
            return True
        look()  # read it again
        return found[-1] == expected

    try:
        wait_for(settled, "the option to settle", SETTLE_S, 0.01)
    except AssertionError:
        pass  # the caller judges the last reading
    return found[-1]


def nodelay_of(port: int, expected: int = 1) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        return accepted_nodelay(client, expected)


def serve_in_thread(make: Callable[[], Coroutine[None, None, None]]) -> threading.Thread:
    # Daemon: these serve forever, as their `python -m` entry points do.
    thread = threading.Thread(target=lambda: uvloop.run(make()), daemon=True)
    thread.start()
    return thread


def listening_here(port: int) -> bool:
    """A socket of this process listens on `port` (not another process's, which a port taken
    between free_port() and the bind would be)."""

    def listens(sock: socket.socket) -> bool | None:
        if sock.getsockname()[1] == port and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return True
        return None

    return own_tcp_socket(listens) is not None


@pytest.fixture(scope="module")
def bench_servers() -> dict[str, int]:
    from bench import first_token, otlp_sink, proxy_upstream
    from bench.proxy_bench import free_port

    makers: dict[str, Callable[[int], Coroutine[None, None, None]]] = {
        "proxy_upstream": lambda port: proxy_upstream.serve(port, 4),
        "otlp_sink": otlp_sink.main,
        "first_token": lambda port: first_token.serve_upstream(port, nodelay=True),
        "first_token control": lambda port: first_token.serve_upstream(port, nodelay=False),
    }
    ports = {}
    for name, make in makers.items():
        # A free port can be taken before the server binds it (another process on the machine):
        # its thread then dies, and the port answers for someone else's server. Tried anew then.
        for _ in range(3):
            port = free_port()
            thread = serve_in_thread(lambda make=make, port=port: make(port))
            wait_for(lambda: listening_here(port) or not thread.is_alive(), f"bench.{name} to listen", timeout=10)
            if thread.is_alive():
                ports[name] = port
                break
        else:
            raise AssertionError(f"bench.{name} could not bind a free port")
    return ports


@pytest.mark.parametrize("name", ["proxy_upstream", "otlp_sink", "first_token"])
def test_bench_servers_set_tcp_nodelay(bench_servers: dict[str, int], name: str) -> None:
    assert nodelay_of(bench_servers[name]) == 1


def test_the_first_token_control_upstream_really_turns_tcp_nodelay_off(bench_servers: dict[str, int]) -> None:
    # Proves the check can fail: asyncio would set it, the control clears it on purpose.
    assert nodelay_of(bench_servers["first_token control"], expected=0) == 0


def test_the_proxy_sets_tcp_nodelay() -> None:
    with running_proxy(spec_urls=["http://127.0.0.1:9"], base_urls=[]) as proxy:
        assert nodelay_of(proxy.port) == 1


def test_the_fault_server_sets_tcp_nodelay() -> None:
    with FaultServer("echo") as fault:
        port = int(fault.url.rsplit(":", 1)[1])
        assert nodelay_of(port) == 1
        # The look through every descriptor leaves none behind (it leaked one per non-socket,
        # which exhausted the process's descriptors when a look was retried for long).
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(20):
            nodelay_of(port)
        assert len(os.listdir("/proc/self/fd")) <= before + 2


def test_a_plain_threading_http_server_does_not_unless_told() -> None:
    """Why tests/proxy/test_auth.py's OTLP sink sets disable_nagle_algorithm: http.server binds
    with protocol 0 and leaves Nagle on."""
    from http.server import BaseHTTPRequestHandler

    class Told(BaseHTTPRequestHandler):
        disable_nagle_algorithm = True

    for handler, expected in ((BaseHTTPRequestHandler, 0), (Told, 1)):
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            assert nodelay_of(server.server_address[1], expected) == expected
        finally:
            server.shutdown()
            server.server_close()
