"""Graceful shutdown, as Kubernetes and `docker stop` use it: SIGTERM, then the drain timeout.

On SIGTERM the proxy turns not-ready at once (its readiness probe fails: 503, or the connection
is refused once the listener closed) and takes no new connection, while a running stream goes on
to its last token; a stream longer than SPECROUTE_DRAIN_TIMEOUT_S is cut when the drain ends and
its client gets an error event (`shutting_down`), its upstream request is cancelled, and the
process still exits within the timeout.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from deploy_tools import Service, Stream, poll, ready_status, start_proxy, stopped_cleanly

from sim.testing import RunningTwin, twin

TOKENS = 60


@pytest.fixture(scope="module")
def slow_twin() -> Iterator[RunningTwin]:
    # A tenth of real speed: a 60-token stream lasts a few seconds, long enough to stop a proxy
    # in the middle of it even on a loaded CPU.
    with twin("spec", time_scale=0.1, seed=3) as running:
        yield running


@contextlib.contextmanager
def stream_in_flight(twin_url: str, drain_s: str, workdir: Path) -> Iterator[tuple[Service, Stream]]:
    """A proxy with this drain timeout, and a stream through it that has begun to arrive."""
    proxy = start_proxy(
        workdir, SPECROUTE_SPEC_URLS=twin_url, SPECROUTE_POLICY="spec", SPECROUTE_DRAIN_TIMEOUT_S=drain_s
    )
    try:
        stream = Stream(proxy, TOKENS)
        stream.start()
        assert stream.first_chunk.wait(30) and stream.error is None, stream.error
        yield proxy, stream
    finally:
        proxy.stop()


def test_sigterm_drains_a_running_stream_to_completion(slow_twin: RunningTwin, tmp_path: Path) -> None:
    with stream_in_flight(slow_twin.url, "30", tmp_path) as (proxy, stream):
        proxy.process.send_signal(signal.SIGTERM)
        # Not ready at once; then the listener closes (uvicorn checks for the signal every
        # 0.1 s) while the stream still runs.
        poll(lambda: ready_status(proxy) != 200, 2, "/ready to turn false after SIGTERM")
        poll(lambda: ready_status(proxy) is None, 5, "the proxy to stop accepting connections")
        assert stream.is_alive(), "the stream ended before the check: slow the twin down"
        stream.join(60)
        assert stream.error is None and stream.finish_reason == "length"
        assert proxy.process.wait(30) is not None
        assert stopped_cleanly(proxy.process.returncode, proxy.log()), proxy.log()
        # The proxy's own info lines are written, not only its warnings.
        assert re.search(r"^\S+ INFO specroute: stop signal \d+: draining for up to 30 s$", proxy.log(), re.M), (
            proxy.log()
        )


def test_a_stream_longer_than_the_drain_is_cut_and_freed(slow_twin: RunningTwin, tmp_path: Path) -> None:
    with stream_in_flight(slow_twin.url, "0.5", tmp_path) as (proxy, stream):
        stopped_at = time.monotonic()
        proxy.process.send_signal(signal.SIGTERM)
        proxy.process.wait(15)  # 0.5 s of drain, then cancellation and exit
        exited_after = time.monotonic() - stopped_at
        stream.join(30)
        assert not stream.is_alive()
        # The client is told, with an OpenAI-style error event, not left with a silent end.
        assert stream.finish_reason != "length", "a cut stream must not end like a complete one"
        assert isinstance(stream.error, openai.APIError) and not isinstance(stream.error, openai.APIConnectionError)
        assert stream.error.code == "shutting_down", stream.error
        assert exited_after < 10, exited_after
        # The cut is the drain doing its job: a warning (uvicorn's own line said ERROR).
        # Each line says when, how bad and who (uvicorn's own format said neither time nor logger).
        assert re.search(
            r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z WARNING uvicorn.error: "
            r"drain timeout \(SPECROUTE_DRAIN_TIMEOUT_S\) reached: 1 running",
            proxy.log(),
            re.M,
        ), proxy.log()
        assert not re.search(r"^\S+ ERROR ", proxy.log(), re.M), proxy.log()
        # The cancelled request left the twin: its GPU slot is free again.
        poll(
            lambda: httpx.get(slow_twin.url + "/v1/loads", timeout=2).json()["loads"][0]["num_running_reqs"] == 0,
            10,
            "the twin to drop the cancelled request",
        )


def test_sigterm_turns_ready_503_while_the_listener_stays_open(slow_twin: RunningTwin, tmp_path: Path) -> None:
    """With SPECROUTE_DRAIN_DELAY_S, a load balancer sees /ready answer 503 (not a refused
    connection) after SIGTERM, and only then the listener closes. With SPECROUTE_LOG_FORMAT=json
    every line the proxy writes after start-up is a JSON object (stdout's request log and
    stderr's lines)."""
    proxy = start_proxy(
        tmp_path,
        SPECROUTE_SPEC_URLS=slow_twin.url,
        SPECROUTE_POLICY="spec",
        SPECROUTE_DRAIN_DELAY_S="3",
        SPECROUTE_LOG_FORMAT="json",
    )
    try:
        proxy.process.send_signal(signal.SIGTERM)
        poll(lambda: ready_status(proxy) == 503, 2, "/ready to answer 503 after SIGTERM")
        assert ready_status(proxy) == 503  # still listening: a 503, not a refused connection
        # Every answer closes its connection: a kept-alive client's next request would meet the
        # listener's close.
        with httpx.Client(timeout=2) as client:
            answer = client.get(proxy.url + "/health")
            assert answer.headers["connection"] == "close" and "keep-alive" not in answer.headers
        poll(lambda: ready_status(proxy) is None, 10, "the listener to close after the delay")
        assert proxy.process.wait(30) is not None
        assert stopped_cleanly(proxy.process.returncode, proxy.log()), proxy.log()
        lines = [json.loads(line) for line in proxy.log().splitlines()]
        said = [(line["level"], line["logger"], line["message"]) for line in lines if "logger" in line]
        # The delay said first (it read as if draining began at the signal).
        assert (
            "INFO",
            "specroute",
            "stop signal 15: still listening for 3 s (ready: false), then draining for up to 30 s",
        ) in said, said
        # What seeds the router is said at start (a review found it only in the state endpoint).
        assert any(who == "specroute" and "generic prior (no SPECROUTE_PROFILE)" in what for _, who, what in said)
        assert all(isinstance(line["ts"], float) and line["ts"] > 1.6e9 for line in lines), lines
    finally:
        proxy.stop()


def test_sigterm_tells_a_request_still_waiting_for_its_first_byte_503(tmp_path: Path) -> None:
    """A real SIGTERM (not flags set in-process): the drain ends while a request waits on an
    upstream that has not answered; its client gets 503 `shutting_down`, not a dropped connection."""
    with twin("spec", seed=4, args=("--fault-first-token-delay-ms", "60000")) as stuck:
        proxy = start_proxy(
            tmp_path, SPECROUTE_SPEC_URLS=stuck.url, SPECROUTE_POLICY="spec", SPECROUTE_DRAIN_TIMEOUT_S="0.5"
        )
        try:
            answers: list[httpx.Response] = []
            waiter = threading.Thread(
                target=lambda: answers.append(
                    httpx.post(
                        proxy.url + "/v1/chat/completions",
                        timeout=30,
                        json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                    )
                )
            )
            waiter.start()
            poll(
                lambda: (
                    re.search(
                        r"^specroute_in_flight_requests\{[^}]*\} 1\.0$",
                        httpx.get(proxy.url + "/metrics", timeout=2).text,
                        re.M,
                    )
                    is not None
                ),
                10,
                "the request to reach its upstream",
            )
            proxy.process.send_signal(signal.SIGTERM)
            waiter.join(30)
            assert answers and answers[0].status_code == 503
            assert answers[0].json()["error"]["code"] == "shutting_down"
            assert proxy.process.wait(30) is not None
        finally:
            proxy.stop()
