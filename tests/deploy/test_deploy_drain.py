"""Graceful shutdown, as Kubernetes and `docker stop` use it: SIGTERM, then the drain timeout.

On SIGTERM the proxy turns not-ready at once (its readiness probe fails: 503, or the connection
is refused once the listener closed) and takes no new connection, while a running stream goes on
to its last token; a stream longer than SPECROUTE_DRAIN_TIMEOUT_S is cut when the drain ends and
its client gets an error event (`shutting_down`), its upstream request is cancelled, and the
process still exits within the timeout.
"""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path
from typing import Iterator

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
    proxy = start_proxy(workdir, SPECROUTE_SPEC_URLS=twin_url, SPECROUTE_POLICY="spec",
                        SPECROUTE_DRAIN_TIMEOUT_S=drain_s)
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
        # The cancelled request left the twin: its GPU slot is free again.
        poll(lambda: httpx.get(slow_twin.url + "/v1/loads", timeout=2).json()["loads"][0]["num_running_reqs"] == 0,
             10, "the twin to drop the cancelled request")
