"""Clients that hold connections: deadlines for headers and bodies, a header size limit, and a
connection closed after refusing a body the client was told to wait with (Expect: 100-continue).
Over real sockets; the proxy keeps serving others throughout."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from proxy_harness import RunningProxy, read_until_closed, running_proxy

DEADLINE_S = 0.5
WAIT_S = 10.0
"""How long a test waits for the proxy to act: far above the deadlines, never reached when it works."""


@pytest.fixture(scope="module")
def guarded(twin_pair) -> Iterator[RunningProxy]:
    spec, base = twin_pair
    with running_proxy(
        spec_urls=[spec.url],
        base_urls=[base.url],
        header_timeout_s=DEADLINE_S,
        body_timeout_s=DEADLINE_S,
        keep_alive_timeout_s=DEADLINE_S,
        max_header_bytes=8192,
    ) as proxy:
        yield proxy


def connect(proxy: RunningProxy) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=WAIT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def still_serving(proxy: RunningProxy) -> None:
    assert httpx.get(proxy.url + "/health", timeout=5).status_code == 200


def test_a_connection_that_sends_nothing_is_closed_without_an_answer(guarded: RunningProxy) -> None:
    with connect(guarded) as sock:
        data, took = read_until_closed(sock)
    assert data == b""  # as nginx: a 408 nobody asked for could be read as another request's answer
    assert took < WAIT_S
    still_serving(guarded)


def test_a_kept_alive_connection_idle_past_the_header_deadline_gets_no_408(twin_pair) -> None:
    """Idle between requests, a connection is the keep-alive timeout's: a 408 written there is
    taken by a keep-alive client as the answer to the request it sends at that moment."""
    spec, base = twin_pair
    with (
        running_proxy(
            spec_urls=[spec.url], base_urls=[base.url], header_timeout_s=DEADLINE_S, keep_alive_timeout_s=4 * DEADLINE_S
        ) as proxy,
        connect(proxy) as sock,
    ):
        for _ in range(2):
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200 "), answer
            assert b"\r\nkeep-alive: timeout=2\r\n" in answer  # when the proxy will close it
            sock.settimeout(2 * DEADLINE_S)  # past the header deadline, short of the keep-alive one
            with pytest.raises(TimeoutError):
                sock.recv(65536)
            sock.settimeout(WAIT_S)
        data, took = read_until_closed(sock)  # then closed by the keep-alive timeout, silently
        assert data == b"" and took < WAIT_S


def test_headers_sent_half_or_a_byte_at_a_time_are_cut_at_the_header_deadline(guarded: RunningProxy) -> None:
    with connect(guarded) as half:
        half.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        data, _ = read_until_closed(half)
    assert data.startswith(b"HTTP/1.1 408 ")
    request = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n" * 10
    with connect(guarded) as slow:
        started = time.monotonic()
        try:
            for byte in request:  # a byte every 20 ms: the headers would take 16 s
                slow.sendall(bytes([byte]))
                time.sleep(0.02)
                if time.monotonic() - started > WAIT_S:
                    break
        except (BrokenPipeError, ConnectionResetError):
            pass
        data, _ = read_until_closed(slow)
        assert time.monotonic() - started < WAIT_S
    assert data.startswith(b"HTTP/1.1 408 ") or data == b""
    still_serving(guarded)


def test_a_body_that_stops_half_way_is_cut_at_the_body_deadline(guarded: RunningProxy) -> None:
    with connect(guarded) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 1000\r\n\r\n" + b'{"model": "'
        )
        data, took = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 408 ") and b'"code":"body_timeout"' in data
    assert took < WAIT_S
    still_serving(guarded)


def test_oversized_headers_get_431_and_the_rest_is_never_read(guarded: RunningProxy) -> None:
    with connect(guarded) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-big: ")
        sent = 0
        try:
            while sent < 100 * 1024 * 1024:  # a 100 MB header value
                sock.sendall(b"a" * 65536)
                sent += 65536
        except (BrokenPipeError, ConnectionResetError):
            pass
        data, _ = read_until_closed(sock)
    assert sent < 8 * 1024 * 1024, f"the proxy read {sent} bytes of one header"
    assert data.startswith(b"HTTP/1.1 431 ") or data == b""  # the 431 may be lost to the reset
    still_serving(guarded)


@pytest.mark.parametrize("pipelined", [False, True], ids=["alone", "after-another-request"])
def test_oversized_headers_in_one_write_get_431(guarded: RunningProxy, pipelined: bool) -> None:
    # The whole header block in one read is parsed, and its request started, within that read:
    # it must be measured before (a 70 KB header in one write went upstream).
    big = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-big: " + b"a" * 20_000 + b"\r\ncontent-length: 2\r\n\r\n{}"
    )
    first = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" if pipelined else b""
    with connect(guarded) as sock:
        sock.sendall(first + big)
        data, _ = read_until_closed(sock)
    # Pipelined, the 431 goes out at once and the connection closes, the earlier request's
    # answer unsent (as uvicorn answers a request it cannot parse).
    assert data.startswith(b"HTTP/1.1 431 ") and b'"code":"headers_too_large"' in data, data[:300]
    still_serving(guarded)


def test_a_connection_pipelining_past_the_bound_is_closed(guarded: RunningProxy) -> None:
    # uvicorn parses a whole read before it pauses: 256 KB of pipelined GETs queued 7,900 requests
    # (about 2 KB each) on one connection.
    from proxy.connection import MAX_PIPELINED

    with connect(guarded) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 200)
        data, took = read_until_closed(sock)
    # closed at once: what was queued is not answered (no client pipelines; this one floods)
    assert data.count(b"HTTP/1.1 200 ") <= MAX_PIPELINED + 1 and took < WAIT_S
    still_serving(guarded)


def test_an_early_refusal_of_an_expected_body_closes_the_connection(guarded: RunningProxy) -> None:
    with connect(guarded) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: text/plain\r\n"
            b"content-length: 20\r\nexpect: 100-continue\r\n\r\n"
        )
        data, took = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 415 ") and b"connection: close" in data.lower()
    assert b"100 Continue" not in data and took < WAIT_S
    # A client that sends its body at once (no Expect) may keep the connection after a refusal.
    with connect(guarded) as sock:
        body = b'{"model": "m"}'
        refused = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: text/plain\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        sock.sendall(refused + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while data.count(b"HTTP/1.1 ") < 2 or not data.endswith(b"}"):
            part = sock.recv(65536)
            assert part, data
            data += part
        assert data.startswith(b"HTTP/1.1 415 ") and b"HTTP/1.1 200 " in data


def test_an_idle_keep_alive_connection_is_closed(guarded: RunningProxy) -> None:
    with connect(guarded) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        data, took = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 200 ") and took < WAIT_S


def test_a_slow_upload_is_not_counted_as_the_proxys_overhead(twin_pair) -> None:
    """x-specroute-overhead-ms and specroute_overhead_seconds are the proxy's own time: a body
    that took the client a second and a half to send read as 1,500 ms of overhead, and a client
    on a slow link paged someone about the proxy."""
    spec, base = twin_pair

    def slowly() -> Iterator[bytes]:
        body = b'{"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}'
        for i in range(0, len(body), 16):
            yield body[i : i + 16]
            time.sleep(0.25)  # the client's pace, not a synchronisation

    with running_proxy(spec_urls=[spec.url], base_urls=[base.url]) as proxy:
        began = time.monotonic()
        answer = httpx.post(
            proxy.base_url + "/chat/completions",
            content=slowly(),
            headers={"content-type": "application/json"},
            timeout=WAIT_S,
        )
        took_s = time.monotonic() - began
        assert answer.status_code == 200, answer.text
        assert took_s > 1.2
        overhead_s = float(answer.headers["x-specroute-overhead-ms"]) / 1000
        assert overhead_s < took_s / 4, (overhead_s, took_s)
