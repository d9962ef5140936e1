"""A keep-alive client gets its first token when the server has it, directly and through the proxy.

The twin writes a stream's response headers, then each chunk, as separate writes. Without
TCP_NODELAY on the connection the server accepted, the first chunk after the headers waits for
the client's delayed ACK (about 40 ms on Linux) on every request but a connection's first. The
expected time comes from the twin's own profile (a prompt's prefill produces its first token),
so the comparison is between figures of one run, not absolute times.
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
import time
from collections.abc import Iterator

import pytest
from proxy_harness import RunningProxy, running_proxy

from fleet.profile import load_profile
from sim.testing import RunningTwin, TwinSpec, twins

REQUESTS = 20
PROFILE = "h200-llama8b"
SLACK_MS = 15.0
"""Generous for a loaded 2-core machine (the twin's Python adds 1-2 ms), far below the 40 ms stall."""


class KeepAliveClient:
    """One raw TCP connection with TCP_NODELAY, one write per request, chunked responses read by hand."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = b""

    def close(self) -> None:
        self.sock.close()

    def _more(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the keep-alive connection")
        self.buffer += data

    def _take_until(self, marker: bytes) -> bytes:
        while marker not in self.buffer:
            self._more()
        head, self.buffer = self.buffer.split(marker, 1)
        return head

    def _take(self, size: int) -> bytes:
        while len(self.buffer) < size:
            self._more()
        data, self.buffer = self.buffer[:size], self.buffer[size:]
        return data

    def stream(self, request: bytes) -> tuple[float, list[dict]]:
        """Seconds to the first chunk with content, and every event of the stream."""
        start = time.perf_counter()
        self.sock.sendall(request)
        head = self._take_until(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
        assert b"transfer-encoding: chunked" in head.lower(), head
        first: float | None = None
        events: list[dict] = []
        while True:
            size = int(self._take_until(b"\r\n").split(b";")[0], 16)
            chunk = self._take(size + 2)[:size]
            if size == 0:
                break
            for line in chunk.split(b"\n"):
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                events.append(event)
                if first is None and any(c["delta"].get("content") for c in event["choices"]):
                    first = time.perf_counter() - start
        assert first is not None, events
        return first, events


def chat_request(port: int, pool: str) -> bytes:
    body = json.dumps(
        {
            "model": "specroute/twin",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nx-specroute-pool: {pool}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def first_token_ms(port: int) -> tuple[float, int]:
    """Median ms to the first content chunk over REQUESTS keep-alive requests (the connection's
    first request, which the stall spares, is left out), and the prompt's token count."""
    client = KeepAliveClient(port)
    try:
        request = chat_request(port, "spec")
        _, events = client.stream(request)
        prompt_tokens = int(events[-1]["usage"]["prompt_tokens"])
        times = [client.stream(request)[0] for _ in range(REQUESTS)]
    finally:
        client.close()
    return statistics.median(times) * 1000.0, prompt_tokens


@pytest.fixture(scope="module")
def realtime_spec_twin() -> Iterator[tuple[RunningTwin, RunningTwin]]:
    """Twins in real time (time scale 1), so the prefill is milliseconds, as on the GPU."""
    with twins(TwinSpec("spec", profile=PROFILE, seed=3), TwinSpec("base", profile=PROFILE, seed=4)) as pair:
        yield pair


@pytest.fixture(scope="module")
def realtime_proxy(realtime_spec_twin: tuple[RunningTwin, RunningTwin]) -> Iterator[RunningProxy]:
    spec, base = realtime_spec_twin
    with running_proxy(spec_urls=[spec.url], base_urls=[base.url]) as running:
        yield running


def test_keep_alive_first_token_comes_at_the_twins_prefill_time_directly_and_through_the_proxy(
    realtime_spec_twin: tuple[RunningTwin, RunningTwin],
    realtime_proxy: RunningProxy,
) -> None:
    spec, _ = realtime_spec_twin
    direct_ms, prompt_tokens = first_token_ms(int(spec.url.rsplit(":", 1)[1]))
    proxied_ms, proxied_prompt_tokens = first_token_ms(realtime_proxy.port)
    assert proxied_prompt_tokens == prompt_tokens
    # A prompt's prefill produces its first token (sim/engine.py); a spec server's prefill also
    # runs the draft model over the prompt.
    prefill_ms = load_profile(PROFILE).prefill_ms(prompt_tokens, speculative=True)
    assert prefill_ms <= direct_ms < prefill_ms + SLACK_MS, (direct_ms, prefill_ms)
    assert proxied_ms < direct_ms + SLACK_MS, (proxied_ms, direct_ms)


@pytest.mark.parametrize("nodelay", [True, False])
def test_the_benchmark_upstream_writes_like_a_server_and_its_control_shows_the_stall(nodelay: bool) -> None:
    """bench.first_token's upstream sends headers, then each chunk, as separate writes with gaps:
    with TCP_NODELAY the first chunk comes at its prefill time; without it (the control) a
    keep-alive client waits for its own delayed ACK, which the benchmark must be able to see."""
    import uvloop

    from bench.first_token import CLIENTS, PREFILL_MS, measure
    from bench.proxy_bench import free_port, process

    port = free_port()
    args = [sys.executable, "-m", "bench.first_token", "upstream", str(port)] + ([] if nodelay else ["--no-nodelay"])
    with process(args, port):
        times = uvloop.run(measure(port, CLIENTS["raw, TCP_NODELAY"], 1, 10))
    median_ms = statistics.median(times) * 1000
    if nodelay:
        assert PREFILL_MS <= median_ms < PREFILL_MS + SLACK_MS, median_ms
    else:
        assert median_ms > PREFILL_MS + 25, median_ms


def test_the_benchmark_upstream_sends_headers_and_each_chunk_as_separate_writes() -> None:
    """What the old upstream did not do: with gaps of 1-30 ms between writes and TCP_NODELAY,
    a client's reads see the headers alone and the chunks apart. Counted over several streams,
    and only most of them, since a descheduled client may find two chunks waiting at once."""
    from bench.first_token import CHUNKS, request_bytes
    from bench.proxy_bench import free_port, process

    port = free_port()
    streams = 5
    headers_alone = 0
    reads_with_content = 0
    with process([sys.executable, "-m", "bench.first_token", "upstream", str(port)], port):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(streams):
                sock.sendall(request_bytes(port))
                received = b""
                first = True
                while not received.endswith(b"0\r\n\r\n"):
                    data = sock.recv(65536)
                    assert data, "the upstream closed the keep-alive connection"
                    if first:
                        headers_alone += data.endswith(b"\r\n\r\n") and b"data: " not in data
                        first = False
                    reads_with_content += data.count(b'"content"') > 0
                    received += data
                assert received.count(b'"content"') == CHUNKS
    assert headers_alone >= streams - 1, headers_alone
    assert reads_with_content >= streams * CHUNKS // 2, reads_with_content
