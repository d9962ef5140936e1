"""Several specroute replicas share the spec pool's cap without talking to each other.

Each proxy polls the spec server's GET /v1/loads, which counts every proxy's requests, and adds
only its own dispatches since the last reading. Two proxies, requests alternating between them,
a spec twin capped at 3: the spec pool fills to exactly its cap and never queues, though neither
proxy has 3 requests of its own there, and the rest goes to the base pool. A control run with
readings frozen shows what the shared signal prevents: each proxy then fills the cap alone.

The routing policy is `threshold` with thresholds above the cap, i.e. "speculate until the spec
server is full": the cap, as the backends report it, is then the only limit, which is what is
tested. Each request is sent once the previous one is on a server and both proxies have read
the servers since: the test checks the shared signal, not a race between two polls.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from deploy_tools import Service, Stream, poll, start_proxy, stopped_cleanly

from sim.testing import RunningTwin, TwinSpec, twins

CAP = 3
REQUESTS = 2 * CAP
TOKENS = 200


def seen_spec_load(proxy: Service) -> float | None:
    """The spec instance's load (running + waiting) as the proxy's router sees it now; None
    before the proxy has read the server once."""
    (instance,) = httpx.get(proxy.url + "/v1/specroute/state", timeout=2).json()["pools"]["spec"]["instances"]
    if instance["age_s"] is None:
        return None
    return instance["running"] + instance["waiting"]


def spec_load(server: RunningTwin) -> int:
    """Running + waiting requests, as the server reports them (GET /v1/loads)."""
    (entry,) = httpx.get(server.url + "/v1/loads", timeout=2).json()["loads"]
    return entry["num_running_reqs"] + entry["num_waiting_reqs"]


def decisions(proxy: Service) -> int:
    return len(httpx.get(proxy.url + "/v1/specroute/state", timeout=2).json()["decisions"])


class Sampler(threading.Thread):
    """Reads the spec server's load every 20 ms; keeps the largest seen (running + waiting: a
    request waits briefly for its prefill even under the cap, so waiting alone is no overflow)."""

    def __init__(self, server: RunningTwin) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.stop = threading.Event()
        self.max_load = 0

    def run(self) -> None:
        while not self.stop.wait(0.02):
            self.max_load = max(self.max_load, spec_load(self.server))

    def __enter__(self) -> Sampler:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        self.join(5)


@pytest.fixture
def fleet() -> Iterator[tuple[RunningTwin, RunningTwin]]:
    # Slowed down so that 200-token streams (about 10 s) outlast the whole dispatch phase even
    # on a busy CPU; the load snapshot is published every decode step (SGLang: every 15) so that
    # the dispatch phase is short.
    fast_snapshots = ("--load-snapshot-publish-interval", "1")
    specs = (
        TwinSpec("spec", time_scale=0.05, seed=5, args=("--max-running-requests", str(CAP), *fast_snapshots)),
        TwinSpec("base", time_scale=0.15, seed=6, args=fast_snapshots),
    )
    with twins(*specs) as (spec, base):
        yield spec, base


@contextlib.contextmanager
def two_proxies(spec: RunningTwin, base: RunningTwin, workdir: Path, **settings: str) -> Iterator[list[Service]]:
    """Two proxies in front of the same twins, policy "speculate until the spec server is full";
    both have read the servers once when the block starts. Stopped (SIGTERM) at its end."""
    settings = {
        "SPECROUTE_SPEC_URLS": spec.url,
        "SPECROUTE_BASE_URLS": base.url,
        "SPECROUTE_POLICY": "threshold",
        "SPECROUTE_THRESHOLD_ENTER": "1000",
        "SPECROUTE_THRESHOLD_EXIT": "1000",
        **settings,
    }
    proxies: list[Service] = []
    try:
        proxies += [start_proxy(workdir, f"specroute-{n}", **settings) for n in (1, 2)]
        poll(lambda: all(seen_spec_load(p) == 0 for p in proxies), 10, "both proxies to read the spec server")
        yield proxies
    finally:
        for proxy in proxies:
            proxy.stop()


def spec_counts(streams: list[Stream]) -> list[int]:
    """Requests each proxy sent to the spec pool (streams alternate: even ones via the first)."""
    return [sum(s.pool == "spec" for s in streams[n::2]) for n in (0, 1)]


def test_two_proxies_keep_the_spec_pool_under_its_cap_together(fleet, tmp_path: Path) -> None:
    spec, base = fleet
    streams: list[Stream] = []
    with Sampler(spec) as sampler, two_proxies(spec, base, tmp_path, SPECROUTE_POLL_INTERVAL_MS="50") as proxies:
        for n in range(REQUESTS):
            streams.append(Stream(proxies[n % 2], TOKENS))
            streams[-1].start()
            # The first chunk comes after the prefill: the request runs on its server, whose
            # load report now includes it. Then both proxies read that report.
            assert streams[-1].first_chunk.wait(30) and streams[-1].error is None, streams[-1].error
            poll(
                lambda: all(seen_spec_load(p) == spec_load(spec) for p in proxies),
                10,
                "both proxies to read the spec server",
            )
        dispatched_at = time.monotonic()
        for stream in streams:
            stream.join(120)
        for proxy in proxies:
            assert stopped_cleanly(proxy.stop(), proxy.log()), proxy.log()

    assert all(s.error is None and s.finish_reason == "length" for s in streams), [s.error for s in streams]
    assert min(s.finished_at for s in streams) > dispatched_at, "a stream ended too early: slow the twins down"
    assert sampler.max_load == CAP, "the spec server was not filled to its cap, or queued beyond it"
    # Together they filled the spec server, though neither had the cap's worth there alone.
    assert sum(spec_counts(streams)) == CAP and max(spec_counts(streams)) < CAP, spec_counts(streams)
    assert sum(s.pool == "base" for s in streams) == REQUESTS - CAP


def test_without_fresh_backend_readings_each_proxy_fills_the_cap_alone(fleet, tmp_path: Path) -> None:
    """The control: polls a minute apart (and never called stale) leave each proxy with only its
    own count, and together they overfill the spec server. So the shared reading is what works."""
    spec, base = fleet
    streams: list[Stream] = []
    frozen = {
        "SPECROUTE_POLL_INTERVAL_MS": "60000",
        "SPECROUTE_STALE_MS": "600000",
        "SPECROUTE_DRAIN_TIMEOUT_S": "0",
    }  # no need to wait for the queued streams
    with Sampler(spec) as sampler, two_proxies(spec, base, tmp_path, **frozen) as proxies:
        for n in range(REQUESTS):
            streams.append(Stream(proxies[n % 2], TOKENS))
            streams[-1].start()
            # Only until the proxy has routed it: the spec server may queue it.
            poll(lambda: decisions(proxies[n % 2]) == n // 2 + 1, 10, "the proxy to route the request")
        poll(lambda: sampler.max_load > CAP, 10, "the spec server to be overfilled")
        decided = [recent_pools(proxy) for proxy in proxies]
    assert [pools.count("spec") for pools in decided] == [CAP, CAP], decided


def recent_pools(proxy: Service) -> list[str]:
    return [d["pool"] for d in httpx.get(proxy.url + "/v1/specroute/state", timeout=2).json()["decisions"]]
