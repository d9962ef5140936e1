"""Chaos and soak runs against `specroute serve` in front of real twin processes (docs/reliability.md).

    python -m bench.chaos kill      # kill -9 a spec server under 64 live streams and 200 req/s, then restart it
    python -m bench.chaos soak      # 100,000 requests, 10 % of clients leaving mid-stream: leaks?
    python -m bench.chaos sigterm   # SIGTERM under load: is any admitted request lost?
    python -m bench.chaos hang      # a spec engine hangs behind its live HTTP front under load
    python -m bench.chaos rank      # one data-parallel rank of spec hangs while the other serves
    python -m bench.chaos idlerank  # one data-parallel rank hangs in its first prefill after idling
    python -m bench.chaos all [--quick]

Every process is its own on 127.0.0.1; the clients are httpx (async) in this process. Each run
prints what it measured and whether the issue's target holds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.proxy_bench import free_port, wait_ready
from sim.testing import TwinSpec, twins

MESSAGES = [{"role": "user", "content": "Tell me about speculative decoding."}]


@contextmanager
def proxy_process(
    spec_urls: Sequence[str], base_urls: Sequence[str], log: Path, **env: str
) -> Iterator[tuple[subprocess.Popen, str]]:
    port = free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SPECROUTE_", "OTEL_"))}
    settings = {
        "SPECROUTE_SPEC_URLS": ",".join(spec_urls),
        "SPECROUTE_BASE_URLS": ",".join(base_urls),
        "SPECROUTE_PORT": str(port),
        "SPECROUTE_LOG_LEVEL": "warning",
        **env,
    }
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy.cli", "serve"],
            env={**clean, **settings},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_ready(port)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while httpx.get(url + "/ready", timeout=2).status_code != 200:
            assert time.monotonic() < deadline, "the proxy never became ready"
            time.sleep(0.05)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


@dataclass
class Outcome:
    started: float
    backend: str = ""
    reason: str = ""
    status: int = 0
    first_at: float | None = None
    ended_at: float | None = None
    done: bool = False
    """Ended with [DONE] and no error event."""
    error_code: str | None = None
    """The code of an error event, or of an error answer."""
    transport_error: str | None = None


async def stream(
    client: httpx.AsyncClient,
    url: str,
    max_tokens: int,
    leave_after: int | None = None,
    headers: dict[str, str] | None = None,
) -> Outcome:
    outcome = Outcome(started=time.monotonic())
    body = {"model": "m", "messages": MESSAGES, "max_tokens": max_tokens, "stream": True}
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as response:
            outcome.status = response.status_code
            outcome.backend = response.headers.get("x-specroute-backend", "")
            outcome.reason = response.headers.get("x-specroute-reason", "")
            if response.status_code != 200:
                await response.aread()
                outcome.error_code = response.json()["error"]["code"]
                return outcome
            events = 0
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if outcome.first_at is None:
                    outcome.first_at = time.monotonic()
                if line == "data: [DONE]":
                    outcome.done = outcome.error_code is None
                    break
                if '"error"' in line[:20]:
                    outcome.error_code = json.loads(line[6:])["error"]["code"]
                events += 1
                if leave_after is not None and events >= leave_after:
                    return outcome  # the client leaves mid-stream
    except httpx.HTTPError as exc:
        outcome.transport_error = type(exc).__name__
    finally:
        outcome.ended_at = time.monotonic()
    return outcome


async def complete(client: httpx.AsyncClient, url: str, max_tokens: int) -> Outcome:
    """A JSON (non-streamed) request."""
    outcome = Outcome(started=time.monotonic())
    body = {"model": "m", "messages": MESSAGES, "max_tokens": max_tokens}
    try:
        response = await client.post(url + "/v1/chat/completions", json=body)
        outcome.status = response.status_code
        outcome.backend = response.headers.get("x-specroute-backend", "")
        outcome.reason = response.headers.get("x-specroute-reason", "")
        if response.status_code == 200:
            outcome.done = bool(response.json()["choices"])
        else:
            outcome.error_code = response.json()["error"]["code"]
    except httpx.HTTPError as exc:
        outcome.transport_error = type(exc).__name__
    finally:
        outcome.ended_at = time.monotonic()
    return outcome


def state(url: str) -> dict[str, Any]:
    return httpx.get(url + "/v1/specroute/state", timeout=5).json()


# -- kill -9 a spec server ------------------------------------------------------------------------------


async def kill_run(quick: bool) -> dict[str, Any]:
    streams_n, rate = (16, 50) if quick else (64, 200)
    spec_port = free_port()
    log = Path("/tmp/specroute-chaos-kill.log")
    common = ("--output-len", "fixed:4096")
    with twins(
        TwinSpec("spec", seed=1, args=common + ("--port", str(spec_port))),
        TwinSpec("spec", seed=2, args=common),
        TwinSpec("base", seed=3, args=common),
    ) as (doomed, spec, base):
        # Ejections of 5 s instead of 30 s: the restarted server's return fits in the run.
        with proxy_process(
            [doomed.url, spec.url], [base.url], log, SPECROUTE_REQUEST_LOG="true", SPECROUTE_OUTLIER_EJECTION_S="5"
        ) as (proc, url):
            limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
            async with httpx.AsyncClient(timeout=httpx.Timeout(60), limits=limits) as client:
                long = [asyncio.create_task(stream(client, url, 3000)) for _ in range(streams_n)]
                short: list[asyncio.Task[Outcome]] = []
                started = time.monotonic()
                kill_at = restart_at = None
                restarted: subprocess.Popen | None = None
                back_on_restarted = False
                sent = 0
                while time.monotonic() - started < (
                    40 if restart_at is not None and not back_on_restarted else 10
                ) and not (back_on_restarted and time.monotonic() - started >= 10):
                    back_on_restarted = (
                        any(
                            t.done() and t.result().backend == "spec-0" and t.result().started > restart_at
                            for t in short[-50:]
                        )
                        if restart_at is not None
                        else False
                    )
                    sent += 1
                    # Pinned to spec: the two spec servers share them, so the dead one is met.
                    short.append(asyncio.create_task(stream(client, url, 4, headers={"x-specroute-pool": "spec"})))
                    now = time.monotonic() - started
                    if kill_at is None and now >= 2:
                        doomed.process.send_signal(signal.SIGKILL)
                        kill_at = time.monotonic()
                    if restart_at is None and now >= 5:
                        restarted = subprocess.Popen(
                            TwinSpec("spec", seed=1, args=common + ("--port", str(spec_port))).argv(),
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                        )
                        restart_at = time.monotonic()
                    await asyncio.sleep(max(0.0, started + sent / rate - time.monotonic()))  # the arrival schedule
                outcomes_long = await asyncio.wait_for(asyncio.gather(*long), 120)
                outcomes_short = await asyncio.wait_for(asyncio.gather(*short), 120)
            assert kill_at is not None and restart_at is not None
            on_doomed = [o for o in outcomes_long if o.backend == "spec-0"]
            # Short streams that were running on the killed server end like the long ones.
            cut_short = [
                o
                for o in outcomes_short
                if o.backend == "spec-0" and o.error_code == "upstream_disconnected" and o.started <= kill_at
            ]
            others = [o for o in outcomes_long if o.backend != "spec-0"]
            cut_after = [o.ended_at - kill_at for o in on_doomed if o.ended_at is not None]
            # The request log (ts is when a request ended): requests sent to the dead server after
            # the kill and before its restart, first attempt or failover alike.
            records = [json.loads(line) for line in log.read_bytes().splitlines() if line.startswith(b"{")]
            wall_kill = time.time() - (time.monotonic() - kill_at)
            wall_restart = time.time() - (time.monotonic() - restart_at)
            sent_to_dead = [
                r["ts"] - r["duration_ms"] / 1000 - wall_kill
                for r in records
                if wall_kill < r["ts"] - r["duration_ms"] / 1000 < wall_restart
                and (r.get("instance") == doomed.url or r.get("attempts", 1) > 1)
            ]
            back = [o.started - restart_at for o in outcomes_short if o.backend == "spec-0" and o.started > restart_at]
            if restarted is not None:
                restarted.terminate()
                restarted.wait(10)
    cut_within_s = max(cut_after) if cut_after else None
    latest_after_kill_s = round(max(sent_to_dead), 3) if sent_to_dead else None
    result = {
        "streams": streams_n,
        "short_rps_target": rate,
        "short_sent": len(outcomes_short),
        "short_rate_rps": round(
            len(outcomes_short) / (max(o.started for o in outcomes_short) - min(o.started for o in outcomes_short)), 1
        ),
        "streams_on_killed": len(on_doomed),
        "killed_streams_ended_with_error_event": sum(1 for o in on_doomed if o.error_code == "upstream_disconnected"),
        "killed_streams_cut_within_s": cut_within_s,
        "other_streams_completed": f"{sum(o.done for o in others)}/{len(others)}",
        "short_streams_running_on_it_when_killed": len(cut_short),
        "short_failed_otherwise": sum(1 for o in outcomes_short if not o.done) - len(cut_short),
        "requests_sent_to_the_dead_server_after_the_kill": len(sent_to_dead),
        "latest_of_them_after_kill_s": latest_after_kill_s,
        "back_on_restarted_after_s": round(min(back), 2) if back else None,
        "clients_hung": 0,  # every task above finished inside its bounded wait
    }
    result["met"] = bool(
        result["killed_streams_ended_with_error_event"] == len(on_doomed)
        and on_doomed
        and (cut_within_s or 0) <= 1.0
        and result["other_streams_completed"] == f"{len(others)}/{len(others)}"
        and result["short_failed_otherwise"] == 0
        and result["back_on_restarted_after_s"] is not None
        and (latest_after_kill_s or 0) <= 0.1
    )
    return result


# -- soak: many requests, some clients leaving ---------------------------------------------------------


async def soak_run(quick: bool) -> dict[str, Any]:
    total, concurrency = (10_000, 32) if quick else (100_000, 32)
    common = ("--output-len", "fixed:64")
    log = Path("/tmp/specroute-chaos-soak.log")
    with twins(
        TwinSpec("spec", time_scale=50, seed=4, args=common), TwinSpec("base", time_scale=50, seed=5, args=common)
    ) as (spec, base):
        with proxy_process([spec.url], [base.url], log) as (proc, url):
            limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
            async with httpx.AsyncClient(timeout=httpx.Timeout(60), limits=limits) as client:
                counter = iter(range(total))
                failures = 0
                samples: list[dict[str, Any]] = []

                async def worker() -> None:
                    nonlocal failures
                    for i in counter:
                        outcome = await stream(client, url, 16, leave_after=2 if i % 10 == 0 else None)
                        if i % 10 != 0 and not outcome.done:
                            failures += 1
                        if i in (total // 10, total - 1):
                            samples.append(state(url)["process"])

                started = time.monotonic()
                await asyncio.gather(*(worker() for _ in range(concurrency)))
                elapsed = time.monotonic() - started
            await asyncio.sleep(1.0)  # let the last disconnects settle (then measured, not assumed)
            idle = state(url)["process"]
            loads = [httpx.get(t.url + "/v1/loads", timeout=5).json()["loads"][0] for t in (spec, base)]
    warm, end = samples[0], samples[-1]
    growth = (idle["rss_mb"] - warm["rss_mb"]) / warm["rss_mb"]
    result = {
        "requests": total,
        "concurrency": concurrency,
        "left_mid_stream": total // 10,
        "rate_rps": round(total / elapsed),
        "failed_complete_requests": failures,
        "rss_mb_after_warmup": warm["rss_mb"],
        "rss_mb_at_end": end["rss_mb"],
        "rss_mb_idle_after": idle["rss_mb"],
        "rss_growth_after_warmup": f"{growth:+.1%}",
        "open_fds_warm/idle": f"{warm['open_fds']}/{idle['open_fds']}",
        "asyncio_tasks_warm/idle": f"{warm['asyncio_tasks']}/{idle['asyncio_tasks']}",
        "upstream_running_after": [int(entry["num_running_reqs"]) + int(entry["num_waiting_reqs"]) for entry in loads],
    }
    result["met"] = bool(
        growth < 0.05
        and failures == 0
        and idle["open_fds"] <= warm["open_fds"]
        and idle["asyncio_tasks"] <= warm["asyncio_tasks"]
        and result["upstream_running_after"] == [0, 0]
    )
    return result


# -- SIGTERM under load ------------------------------------------------------------------------------------


async def sigterm_run(quick: bool) -> dict[str, Any]:
    concurrency = 16 if quick else 48
    common = ("--output-len", "fixed:4096")
    log = Path("/tmp/specroute-chaos-sigterm.log")
    with twins(TwinSpec("spec", seed=6, args=common), TwinSpec("base", seed=7, args=common)) as (spec, base):
        with proxy_process([spec.url], [base.url], log, SPECROUTE_DRAIN_TIMEOUT_S="3") as (proc, url):
            async with httpx.AsyncClient(timeout=httpx.Timeout(60)) as client:
                outcomes: list[Outcome] = []
                stop = asyncio.Event()

                async def worker(i: int) -> None:
                    while not stop.is_set():
                        # 0.3 to about 7 s at real speed: some finish within the 3 s drain, some do not.
                        outcomes.append(await stream(client, url, 100 + (i * 37) % 2000))

                workers = [asyncio.create_task(worker(i)) for i in range(concurrency)]
                await asyncio.sleep(4)  # load running (a timed phase of the run, not a synchronisation)
                proc.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                await asyncio.to_thread(proc.wait, 60)
                stop.set()
                await asyncio.wait_for(asyncio.gather(*workers), 60)
    admitted = [o for o in outcomes if o.status == 200]
    told = [o for o in admitted if not o.done and o.error_code == "shutting_down"]
    lost = [o for o in admitted if not o.done and o.error_code != "shutting_down"]
    refused = [o for o in outcomes if o.status != 200]
    result = {
        "concurrency": concurrency,
        "requests": len(outcomes),
        "admitted": len(admitted),
        "completed": sum(o.done for o in admitted),
        "told_shutting_down": len(told),
        "lost": len(lost),
        "not_admitted (refused or 503)": len(refused),
        "exit_after_sigterm_s": round(time.monotonic() - signalled, 2),
        "exit_status": proc.returncode,
    }
    result["met"] = not lost
    return result


# -- a spec engine hangs behind its live front ------------------------------------------------------------


async def hang_run(quick: bool) -> dict[str, Any]:
    """One spec and one base twin behind the proxy (the static spec policy: every request goes
    to spec and may fail over to base). Long streams run and short requests (JSON and streams,
    alternately) arrive; 5 s in, spec's engine hangs (the twin's `wedged` fault: its HTTP front,
    /v1/loads and /metrics answer on); it is healed once judged hung, plus 5 s. What was waiting
    on it must fail over (or, under way, end with an error event) at SPECROUTE_NO_PROGRESS_S
    (the default, 30 s; 5 s with --quick), not at the first-token timeout (120 s) or a JSON
    request's total one (600 s); nothing is judged hung before the hang."""
    return await _hang(quick, rank=False)


async def rank_run(quick: bool) -> dict[str, Any]:
    """As `hang`, with spec a server of two data-parallel ranks (the twin's --dp-size 2, dealt
    requests in turn) of which one hangs (its `wedged_rank` fault) while the other serves: the
    server's mark moves and bytes keep coming, so before the hung-rank rule every other request
    waited the first-token timeout (120 s), a JSON one its total timeout. What waits on the rank
    must fail over (a stream under way ends with `upstream_rank_hung`) at the same limit, the
    server is never ejected, and once the rank is judged hung no request waits on it."""
    return await _hang(quick, rank=True)


async def _hang(quick: bool, rank: bool) -> dict[str, Any]:
    limit_s = 5.0 if quick else 30.0
    streams_n, rate = (4, 5) if quick else (16, 20)
    log = Path(f"/tmp/specroute-chaos-{'rank' if rank else 'hang'}.log")
    common = ("--output-len", "fixed:4096")
    spec_args = ("--dp-size", "2", *common) if rank else common
    fault: dict[str, Any] = {"wedged_rank": 1} if rank else {"wedged": True}
    code = "upstream_rank_hung" if rank else "upstream_no_progress"
    with twins(TwinSpec("spec", seed=1, args=spec_args), TwinSpec("base", seed=3, args=common)) as (spec, base):
        with proxy_process(
            [spec.url], [base.url], log, SPECROUTE_POLICY="spec", SPECROUTE_NO_PROGRESS_S=f"{limit_s:g}"
        ) as (proc, url):
            limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
            async with httpx.AsyncClient(timeout=httpx.Timeout(limit_s + 60), limits=limits) as client:
                long = [asyncio.create_task(stream(client, url, 3000)) for _ in range(streams_n)]
                short: list[asyncio.Task[Outcome]] = []
                started = time.monotonic()
                wedged_at = judged_at = healed_at = None
                ejected_before_hang = ejections = 0
                sent = 0
                while healed_at is None or time.monotonic() < healed_at + 5:
                    now = time.monotonic()
                    assert now - started < limit_s + 60, "never judged hung"
                    sent += 1
                    make = stream(client, url, 32) if sent % 2 else complete(client, url, 32)
                    short.append(asyncio.create_task(make))
                    if sent % rate == 0:  # once a second: the proxy's view of spec
                        shown = (await asyncio.to_thread(state, url))["pools"]["spec"]["instances"][0]
                        ejections = shown["outlier"]["ejections"]
                        if wedged_at is None:
                            ejected_before_hang = ejections
                        elif judged_at is None and (
                            shown["hung_ranks"] == [1] if rank else shown["outlier"]["reason"] == "no-progress"
                        ):
                            judged_at = time.monotonic()
                    if wedged_at is None and now - started >= 5:
                        await client.post(spec.url + "/specroute/twin/faults", json=fault)
                        wedged_at = time.monotonic()
                    if judged_at is not None and healed_at is None and now >= judged_at + 5:
                        await client.post(spec.url + "/specroute/twin/faults", json={})
                        healed_at = time.monotonic()
                    await asyncio.sleep(max(0.0, started + sent / rate - time.monotonic()))  # the arrival schedule
                outcomes_long = await asyncio.wait_for(asyncio.gather(*long), 120)
                outcomes_short = await asyncio.wait_for(asyncio.gather(*short), limit_s + 120)
                ejections = (await asyncio.to_thread(state, url))["pools"]["spec"]["instances"][0]["outlier"][
                    "ejections"
                ]
    assert wedged_at is not None and judged_at is not None
    # Waiting on the hung engine (or rank) when it was judged: sent on to base.
    failed_over = [o for o in outcomes_short if o.reason.endswith("+failover")]
    cut = [o for o in outcomes_long if o.error_code == code]
    # A short stream under way on spec at the hang ends like the long ones (bytes reached its client).
    cut_short = [o for o in outcomes_short if o.error_code == code and o.first_at is not None]
    lost = [o for o in outcomes_short if not o.done and o not in cut_short]
    waits = [o.ended_at - o.started for o in failed_over if o.ended_at is not None]
    # Sent once the rank was judged (a poll later: the proxy's view is a second old at most) and
    # still left waiting on it.
    late = [o for o in failed_over if o.started > judged_at + 1.0] if rank else []
    result: dict[str, Any] = {
        "no_progress_s": limit_s,
        "long_streams": streams_n,
        "short_sent": len(outcomes_short),
        "ejected_before_the_hang": ejected_before_hang,
        "judged_hung_after_s": round(judged_at - wedged_at, 1),
        "short_failed_over_to_base": len(failed_over),
        "of_them_json": sum(1 for o in failed_over if o.first_at is None),
        "longest_wait_of_a_failed_over_request_s": round(max(waits), 1) if waits else None,
        f"long_streams_ended_with_{code}": f"{len(cut)}/{streams_n}",
        "long_streams_cut_after_the_hang_s": round(max(o.ended_at - wedged_at for o in cut if o.ended_at), 1)
        if cut
        else None,
        "short_streams_under_way_cut": len(cut_short),
        "short_requests_failed_otherwise": len(lost),
        "their_errors": sorted({o.error_code or o.transport_error or str(o.status) for o in lost}),
        "clients_hung": 0,  # every task above finished inside its bounded wait
    }
    if rank:
        result["long_streams_completed"] = sum(1 for o in outcomes_long if o.done)
        result["ejections_of_the_server"] = ejections
        result["short_failed_over_though_sent_after_the_judgement"] = len(late)
    # The limit, the poll, and base taking the burst of what piled up on spec meanwhile (20 a
    # second for 30 s land on it at once): well inside the 120 s first-token timeout.
    timely = bool(waits) and max(waits) <= limit_s + 15
    if rank:
        # Half the long streams were dealt to the hung rank; the others finish.
        whole = 0 < len(cut) < streams_n and len(cut) + result["long_streams_completed"] == streams_n
        kept = ejections == 0 and not late
    else:
        whole, kept = len(cut) == streams_n, True
    result["met"] = bool(
        ejected_before_hang == 0 and judged_at - wedged_at <= limit_s + 3 and whole and kept and not lost and timely
    )
    return result


async def idle_rank_run(quick: bool) -> dict[str, Any]:
    """Spec a server of two data-parallel ranks (the twin's --dp-size 2, dealt requests in turn),
    light traffic (two short requests a second, JSON and streams alternately), and rank 1 hung
    from the start: it hangs in the first prefill it takes, and its snapshot, last published as
    it went idle, shows no work. The work rule cannot judge it; the proxy asks it (a one-token
    completion named to it) once a request of ours has waited the limit without a byte, and
    judges it hung when it does not answer within the limit. What waits on it must fail over
    within two limits (not the first-token timeout, 120 s, or a JSON request's total one), the
    server is never ejected, nothing sent after the judgement waits on the rank, and once it is
    healed (5 s after the judgement) a probe answered lets it back."""
    limit_s = 5.0 if quick else 30.0
    rate = 2
    log = Path("/tmp/specroute-chaos-idlerank.log")
    common = ("--output-len", "fixed:64")
    spec_args = ("--dp-size", "2", "--fault-wedged-rank", "1", *common)
    with twins(TwinSpec("spec", seed=1, args=spec_args), TwinSpec("base", seed=3, args=common)) as (spec, base):
        with proxy_process(
            [spec.url], [base.url], log, SPECROUTE_POLICY="spec", SPECROUTE_NO_PROGRESS_S=f"{limit_s:g}"
        ) as (proc, url):
            async with httpx.AsyncClient(timeout=httpx.Timeout(limit_s * 2 + 60)) as client:
                short: list[asyncio.Task[Outcome]] = []
                started = time.monotonic()
                judged_at = healed_at = back_at = None
                ejections = sent = 0
                while back_at is None or time.monotonic() < back_at + 5:
                    now = time.monotonic()
                    assert now - started < 2 * limit_s + 60, "never judged hung, or never let back"
                    sent += 1
                    make = stream(client, url, 16) if sent % 2 else complete(client, url, 16)
                    short.append(asyncio.create_task(make))
                    shown = (await asyncio.to_thread(state, url))["pools"]["spec"]["instances"][0]
                    ejections = max(ejections, shown["outlier"]["ejections"])
                    if judged_at is None and shown["hung_ranks"] == [1]:
                        judged_at = time.monotonic()
                    if healed_at is not None and back_at is None and shown["hung_ranks"] == []:
                        back_at = time.monotonic()
                    if judged_at is not None and healed_at is None and now >= judged_at + 5:
                        await client.post(spec.url + "/specroute/twin/faults", json={})
                        healed_at = time.monotonic()
                    await asyncio.sleep(max(0.0, started + sent / rate - time.monotonic()))
                outcomes = await asyncio.wait_for(asyncio.gather(*short), 2 * limit_s + 120)
    assert judged_at is not None and healed_at is not None and back_at is not None
    failed_over = [o for o in outcomes if o.reason.endswith("+failover")]
    waits = [o.ended_at - o.started for o in failed_over if o.ended_at is not None]
    late = [o for o in failed_over if o.started > judged_at + 1.0]
    lost = [o for o in outcomes if not o.done]
    result: dict[str, Any] = {
        "no_progress_s": limit_s,
        "short_sent": len(outcomes),
        "judged_hung_after_s": round(judged_at - started, 1),
        "short_failed_over_to_base": len(failed_over),
        "of_them_json": sum(1 for o in failed_over if o.first_at is None),
        "longest_wait_of_a_failed_over_request_s": round(max(waits), 1) if waits else None,
        "short_failed_over_though_sent_after_the_judgement": len(late),
        "short_requests_failed": len(lost),
        "their_errors": sorted({o.error_code or o.transport_error or str(o.status) for o in lost}),
        "ejections_of_the_server": ejections,
        "let_back_after_healing_s": round(back_at - healed_at, 1),
    }
    # The first request dealt to the rank waits a limit, then its probe a limit, then a poll.
    result["met"] = bool(
        failed_over
        and max(waits) <= 2 * limit_s + 5
        and not late
        and not lost
        and ejections == 0
        and back_at - healed_at <= limit_s + 5
    )
    return result


RUNS = {
    "kill": kill_run,
    "soak": soak_run,
    "sigterm": sigterm_run,
    "hang": hang_run,
    "rank": rank_run,
    "idlerank": idle_rank_run,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.splitlines()[0])
    parser.add_argument("run", choices=[*RUNS, "all"])
    parser.add_argument("--quick", action="store_true", help="smaller runs (a smoke test)")
    args = parser.parse_args(argv)
    for name in RUNS if args.run == "all" else [args.run]:
        started = time.monotonic()
        result = asyncio.run(RUNS[name](args.quick))
        print(
            f"## bench.chaos {name}{' --quick' if args.quick else ''} ({time.strftime('%Y-%m-%d %H:%M')}, "
            f"{time.monotonic() - started:.0f} s)"
        )
        for key, value in result.items():
            print(f"- {key}: {value}")
        print(flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
