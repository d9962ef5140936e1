"""proxy/poller.py and proxy/backends/ against real twin servers on 127.0.0.1: learning, polling, acceptance."""

import asyncio
import contextlib
import signal
import socket
import time

import httpx
import pytest

from fleet.acceptance import accept_length, alpha_from_accept_length
from fleet.types import Features
from proxy.backends import VLLM, SGLang
from proxy.backends.prometheus import parse_prometheus
from proxy.backends.sglang import reading_from_get_load, reading_from_loads, reading_from_metrics
from proxy.routing import Router
from proxy.settings import load_settings
from sim.testing import TwinSpec, twin, twins

TIME_SCALE = 10.0


async def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def stream_one(client: httpx.AsyncClient, url: str, max_tokens: int) -> None:
    body = {
        "model": "twin",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for _ in response.aiter_bytes():
            pass


def test_signals_learn_poll_and_estimate_acceptance():
    # Real time (scale 2) here: the streams must outlast a few polls of the counters.
    specs = (
        TwinSpec("spec", time_scale=2.0, seed=3, args=("--mean-alpha", "0.7")),
        TwinSpec("base", time_scale=TIME_SCALE, seed=4),
    )
    with twins(*specs) as (spec, base):
        settings = load_settings(
            spec_urls=spec.url,
            base_urls=base.url,
            poll_interval_ms=20,
            stale_ms=2000,
            acceptance_half_life_s=60,
            profile="h200-llama8b",
        )
        router = Router.from_settings(settings)

        async def scenario():
            await router.start()
            try:
                state = router.state()
                spec_info = state["pools"]["spec"]["instances"][0]
                base_info = state["pools"]["base"]["instances"][0]
                assert spec_info["probe"] == "/v1/loads" and spec_info["server_info"]["speculative"]
                assert (spec_info["max_running"], base_info["max_running"]) == (48, 256)
                assert not base_info["server_info"]["speculative"]
                assert state["pools"]["spec"]["num_draft_tokens"] == 3
                # 24 streams sent straight to the spec twin, behind the proxy's back: the polls see them.
                async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
                    load = [asyncio.create_task(stream_one(client, spec.url, 400)) for _ in range(24)]
                    await wait_for(lambda: router.snapshot().pool("spec").running >= 20, 20, "polled spec load")
                    assert not router.snapshot().pool("spec").stale
                    await asyncio.gather(*load)
                    reading = reading_from_metrics((await client.get(spec.url + "/metrics")).text, 0)
                # The server's own ratio over every stream (per-request alphas vary around 0.7).
                served = alpha_from_accept_length(reading.tokens_total / reading.verify_total, 3)
                assert 0.55 < served < 0.75
                # The accept-length gauge and the counters on /metrics (every fifth poll) are the
                # evidence; the counters count finished streams, so the estimate agrees once the
                # polls after the last stream have read them (an early gauge alone may be off).
                acceptance = router.fleet.acceptance("spec")
                assert acceptance is not None
                await wait_for(lambda: acceptance.evidence(time.monotonic()) > 500, 20, "acceptance evidence")
                await wait_for(
                    lambda: abs(router.snapshot().pool("spec").alpha - served) <= 0.05,
                    20,
                    f"the alpha estimate to come within 0.05 of the served {served:.3f}",
                )
            finally:
                await router.stop()

        asyncio.run(scenario())


def test_a_hung_instance_turns_stale_and_a_dead_one_unhealthy():
    with twins(TwinSpec("spec", time_scale=TIME_SCALE), TwinSpec("base", time_scale=TIME_SCALE)) as (spec, base):
        settings = load_settings(spec_urls=spec.url, base_urls=base.url, poll_interval_ms=20, stale_ms=300)
        router = Router.from_settings(settings)

        async def scenario():
            await router.start()
            try:
                assert not router.snapshot().pool("spec").stale
                # Hung (SIGSTOP): the kernel still accepts connections, nothing answers.
                spec.process.send_signal(signal.SIGSTOP)
                try:
                    await wait_for(lambda: router.snapshot().pool("spec").stale, 10, "the spec pool to turn stale")
                    await wait_for(
                        lambda: router.state()["pools"]["spec"]["instances"][0]["error"], 10, "a poll to time out"
                    )
                    assert router.snapshot().pool("spec").available  # slow is not dead
                    assert not router.snapshot().pool("base").stale
                    # The policy acts conservatively on a stale spec pool, and says why.
                    decision = router.choose(Features(prompt_tokens=100), None)
                    assert (decision.pool, decision.reason) == ("base", "stale")
                    assert decision.scores["spec.stale"] == 1.0 and decision.scores["spec.age_s"] > 0.3
                    # Silent for longer, while base answers: out of rotation, and shown so (a pool
                    # of one stayed "healthy" and took requests that each waited seconds).
                    await wait_for(
                        lambda: not router.snapshot().pool("spec").available, 20, "the silent server out of rotation"
                    )
                    shown = router.state()["pools"]["spec"]["instances"][0]
                    assert (shown["healthy"], shown["unresponsive"]) == (False, True)
                    assert not router.pools["spec"].available and router.ready
                    decision = router.choose(Features(prompt_tokens=100), None)
                    assert (decision.pool, decision.reason) == ("base", "spec-down")
                finally:
                    spec.process.send_signal(signal.SIGCONT)
                await wait_for(lambda: router.pools["spec"].available, 10, "the server answering again")
                shown = router.state()["pools"]["spec"]["instances"][0]
                assert (shown["healthy"], shown["unresponsive"]) == (True, False)
                assert not router.snapshot().pool("spec").stale
                # Dead: connections are refused; after a few polls it is skipped.
                spec.process.terminate()
                await asyncio.to_thread(spec.process.wait, 10)
                await wait_for(
                    lambda: not router.snapshot().pool("spec").available, 10, "the spec pool to turn unhealthy"
                )
                assert router.ready  # base still takes work
                decision = router.choose(Features(prompt_tokens=100), None)
                assert (decision.pool, decision.reason) == ("base", "spec-down")
            finally:
                await router.stop()

        asyncio.run(scenario())


def test_an_instance_down_at_start_is_skipped_then_learned_once_it_answers(caplog):
    """...and the log says so once, then says when it answers (a user whose requests get 503
    no_upstream learns why without reading the state endpoint)."""
    caplog.set_level("INFO", logger="specroute.poller")

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "specroute.poller"]

    # A port bound but not listening refuses connections: the spec server is not up yet.
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    with twins(TwinSpec("base", time_scale=TIME_SCALE)) as (base,), contextlib.ExitStack() as later:
        spec_url = f"http://127.0.0.1:{port}"
        settings = load_settings(spec_urls=spec_url, base_urls=base.url, poll_interval_ms=20)
        router = Router.from_settings(settings)

        async def scenario():
            await router.start()
            try:
                spec_state = router.state()["pools"]["spec"]["instances"][0]
                assert (spec_state["healthy"], spec_state["reached"]) == (False, False)
                assert (router.choose(Features(prompt_tokens=100), None).reason) == "spec-down"
                await wait_for(lambda: router.pollers.by_url[spec_url].polls >= 10, 10, "ten polls")
                assert said() == [
                    f"spec server {spec_url} cannot be reached (server_info: ConnectError): "
                    "no requests go to it until it answers"
                ], said()
                holder.close()
                await asyncio.to_thread(
                    later.enter_context, twin("spec", time_scale=TIME_SCALE, args=("--port", str(port)))
                )
                await wait_for(
                    lambda: router.state()["pools"]["spec"]["instances"][0]["healthy"],
                    10,
                    "the spec server to be reached",
                )
                await wait_for(lambda: not router.snapshot().pool("spec").stale, 10, "its first reading")
                spec_state = router.state()["pools"]["spec"]["instances"][0]
                assert spec_state["probe"] == "/v1/loads" and spec_state["server_info"]["speculative"]
                assert router.choose(Features(prompt_tokens=100), None).pool == "spec"
                assert said()[1:] == [f"spec server {spec_url} answers"]
            finally:
                await router.stop()

        try:
            asyncio.run(scenario())
        finally:
            holder.close()


def test_parsers_cover_each_probe():
    loads = {
        "loads": [
            {
                "num_running_reqs": 3,
                "num_waiting_reqs": 1,
                "max_running_requests": 48,
                "speculative": {"accept_length": 2.5},
            },
            {"num_running_reqs": 2, "num_waiting_reqs": 0, "max_running_requests": 48},
        ]
    }
    reading = reading_from_loads(loads, 1.0)
    # /v1/loads' accept_length is cumulative since start: too slow to route on, so not read
    assert (reading.running, reading.waiting, reading.max_running, reading.accept_length) == (5, 1, 96, None)
    text = (
        '# HELP sglang:num_running_reqs x\nsglang:num_running_reqs{tp_rank="0"} 7\n'
        'sglang:num_queue_reqs{tp_rank="0"} 2\nsglang:generation_tokens_total{is_streaming="true"} 100\n'
        'sglang:generation_tokens_total{is_streaming="false"} 20\nsglang:spec_verify_calls_total 50\n'
        'sglang:spec_accept_length{tp_rank="0"} 2.4\n'
    )
    reading = reading_from_metrics(text, 2.0)
    assert (reading.running, reading.waiting, reading.tokens_total, reading.verify_total) == (7, 2, 120, 50)
    assert (reading.accept_length, reading.accept_steps) == (2.4, 40 * 7)
    # Two data-parallel ranks: their loads add up, their accept lengths are averaged.
    ranks = (
        'sglang:num_running_reqs{dp_rank="0"} 3\nsglang:num_running_reqs{dp_rank="1"} 4\n'
        'sglang:spec_accept_length{dp_rank="0"} 2.0\nsglang:spec_accept_length{dp_rank="1"} 3.0\n'
    )
    reading = reading_from_metrics(ranks, 2.0)
    assert (reading.running, reading.accept_length) == (7, 2.5)
    vllm = 'vllm:num_requests_running{model_name="m"} 4.0\nvllm:num_requests_waiting{model_name="m"} 1.0\n'
    assert VLLM("/metrics").read(vllm, 0).running == 4
    assert parse_prometheus("garbage line\nsglang:num_running_reqs NaN\n", frozenset({"sglang:num_running_reqs"})) == {}
    reading = reading_from_get_load([{"num_reqs": 9, "num_waiting_reqs": 4}], 3.0)
    assert (reading.running, reading.waiting) == (5, 4)
    with pytest.raises(ValueError):
        reading_from_loads({"loads": []}, 0)
    with pytest.raises(ValueError):
        reading_from_metrics("up 1\n", 0)
    assert accept_length(0.7, 3) > 2.5


def test_each_server_kind_reports_an_engine_mark_that_moves_only_with_its_engine():
    """The no-progress rule's evidence (proxy/routing.py `stalled`): SGLang's snapshot times to
    the fraction (republished within a second), vLLM's token counters (iteration stats); kept
    across the acceptance counters' extra read; none where a rank reports no time."""
    entry = {"num_running_reqs": 1, "num_waiting_reqs": 0, "max_running_requests": 8}
    ranks = {"loads": [dict(entry, timestamp=1_700_000_000.25), dict(entry, timestamp=1_700_000_000.5)]}
    assert reading_from_loads(ranks, 1.0).engine_mark == 3_400_000_000.75
    assert reading_from_loads({"loads": [entry]}, 1.0).engine_mark is None
    assert reading_from_loads({"loads": [dict(entry, timestamp="soon")]}, 1.0).engine_mark is None
    reading = reading_from_loads({"loads": [dict(entry, timestamp=5.5)]}, 1.0)
    counted = SGLang("/v1/loads").with_counters(reading, "sglang:generation_tokens_total 10\n")
    assert (counted.engine_mark, counted.tokens_total) == (5.5, 10)
    # SGLang's token counters are its front's, counted as requests finish: no mark.
    assert reading_from_metrics("sglang:num_running_reqs 1\nsglang:prompt_tokens_total 30\n", 0).engine_mark is None
    vllm = (
        'vllm:num_requests_running{model_name="m"} 1.0\nvllm:prompt_tokens_total{model_name="m"} 40.0\n'
        'vllm:generation_tokens_total{model_name="m"} 2.0\n'
    )
    marked = VLLM("/metrics").read(vllm, 0).engine_mark
    assert marked is not None and marked == VLLM("/metrics").read(vllm, 5).engine_mark
    # A long prefill alone: its counters hold still, its KV usage grows with each chunk.
    prefilling = VLLM("/metrics").read(vllm + 'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n', 0).engine_mark
    assert prefilling != marked
    assert VLLM("/metrics").read('vllm:num_requests_running{model_name="m"} 1.0\n', 0).engine_mark is None


def test_an_engine_mark_counts_as_still_only_once_it_has_been_seen_to_move():
    from fleet.instance import InstanceSignals

    signals = InstanceSignals("http://s", "spec", 8)
    signals.on_engine_mark(7.0, at=10.0)
    assert signals.engine_still_s(100.0) is None  # never moved: vLLM with its stats off looks the same
    signals.on_engine_mark(7.0, at=11.0)
    signals.on_engine_mark(None, at=12.0)  # not read this time: the last one stands
    signals.on_engine_mark(8.0, at=13.0)
    assert signals.engine_still_s(20.0) == 7.0
    signals.on_engine_mark(8.0, at=19.0)
    assert signals.engine_still_s(20.0) == 7.0


def test_each_data_parallel_rank_reports_its_own_mark_and_work_and_caps_add_up():
    """With --dp-size N, /v1/loads has one snapshot per rank: the reading keeps each rank's time
    running and waiting requests and queued tokens, in rank order (none for one rank, or for
    ranks that are not 0..N-1 or carry no time); /server_info's max_running_requests is each
    rank's cap."""
    entry = {"num_running_reqs": 2, "num_waiting_reqs": 1, "max_running_requests": 8, "num_waiting_uncached_tokens": 90}
    two = {
        "loads": [dict(entry, dp_rank=1, timestamp=20.0, num_waiting_reqs=0), dict(entry, dp_rank=0, timestamp=10.0)]
    }
    reading = reading_from_loads(two, 1.0)
    assert (reading.rank_marks, reading.rank_running, reading.rank_waiting) == ((10.0, 20.0), (2.0, 2.0), (1.0, 0.0))
    assert (reading.rank_waiting_tokens, reading.max_running) == ((90.0, 90.0), 16)
    assert reading_from_loads({"loads": [dict(entry, dp_rank=0, timestamp=1.0)]}, 1.0).rank_marks == ()
    gap = {"loads": [dict(entry, dp_rank=0, timestamp=1.0), dict(entry, dp_rank=2, timestamp=1.0)]}
    assert reading_from_loads(gap, 1.0).rank_marks == ()
    untimed = {"loads": [dict(entry, dp_rank=0, timestamp=1.0), dict(entry, dp_rank=1)]}
    assert reading_from_loads(untimed, 1.0).rank_marks == ()
    info = {"speculative_algorithm": None, "max_running_requests": 48}
    assert SGLang.describe(dict(info, dp_size=4))[0].max_running == 192
    assert SGLang.describe(dict(info, dp_size=4, enable_dp_attention=True))[0].max_running == 48
    assert SGLang.describe(dict(info, dp_size="four"))[0].max_running == 48


def test_each_vllm_engine_reports_its_own_figures_marks_and_learned_cap():
    """vLLM with --data-parallel-size N labels each engine's series `engine` 0..N-1: the reading
    keeps each engine's running and waiting requests and its mark (its own counters and KV
    usage); the cap is learned per engine (--max-num-seqs is per rank), the server's their sum.
    Series not numbered 0..N-1 read as one engine, as do engines without their counters' marks
    (no rank could be judged by them)."""

    def engines(*figures: tuple[float, float, float]) -> str:
        lines = []
        for rank, (running, waiting, generated) in enumerate(figures):
            labels = f'engine="{rank}",model_name="m"'
            lines += [
                f"vllm:num_requests_running{{{labels}}} {running}",
                f"vllm:num_requests_waiting{{{labels}}} {waiting}",
                f"vllm:prompt_tokens_total{{{labels}}} 100.0",
                f"vllm:generation_tokens_total{{{labels}}} {generated}",
            ]
        return "\n".join(lines) + "\n"

    backend = VLLM("/metrics")
    assert backend.default_description().ranks_separate
    first = backend.read(engines((8, 0, 10), (3, 0, 20)), 0.0)
    assert (first.running, first.waiting, first.ranks, first.max_running) == (11, 0, 2, 512)
    assert (first.rank_running, first.rank_waiting, first.rank_waiting_tokens) == ((8, 3), (0, 0), (0, 0))
    moved = backend.read(engines((8, 0, 10), (3, 0, 25)), 0.5)
    assert moved.rank_marks[0] == first.rank_marks[0] and moved.rank_marks[1] != first.rank_marks[1]
    assert moved.engine_mark != first.engine_mark  # the server's mark moves with any engine's
    # Engine 0 keeps requests waiting at 8 running for a second, stepping: its cap is 8. Engine
    # 1 shows the same, its counters frozen (a hung core's last gauges): no cap learned from it.
    backend.read(engines((8, 2, 12), (3, 2, 30)), 0.6)
    assert backend.read(engines((8, 2, 14), (3, 2, 30)), 1.2).max_running == 512
    assert backend.read(engines((8, 2, 16), (3, 2, 30)), 1.7).max_running == 8 + 256
    one = VLLM("/metrics").read(engines((4, 1, 5)), 0.0)
    assert (one.ranks, one.rank_marks, one.max_running) == (1, (), 256)
    skipped = engines((1, 0, 1), (1, 0, 1)).replace('engine="1"', 'engine="2"')
    assert (VLLM("/metrics").read(skipped, 0.0).running, VLLM("/metrics").read(skipped, 0.0).ranks) == (2, 1)
    unmarked = "".join(line + "\n" for line in engines((1, 0, 1), (2, 0, 1)).splitlines() if "tokens" not in line)
    reading = VLLM("/metrics").read(unmarked, 0.0)
    assert (reading.ranks, reading.rank_marks, reading.engine_mark) == (2, (), None)


def test_a_rank_is_hung_only_while_it_shows_work_and_another_rank_does_not_hold_still_with_it():
    from fleet.instance import InstanceSignals
    from fleet.readings import Reading

    def ranks(marks: tuple[float, ...], running: tuple[float, ...], at: float) -> Reading:
        zeros = (0.0,) * len(marks)
        return Reading(
            at, sum(running), 0, rank_marks=marks, rank_running=running, rank_waiting=zeros, rank_waiting_tokens=zeros
        )

    signals = InstanceSignals("http://s", "spec", 8)
    signals.on_ranks(ranks((1.0, 1.0), (1.0, 1.0), at=0.0))
    signals.on_ranks(ranks((2.0, 1.0), (1.0, 1.0), at=5.0))  # rank 0 moves, rank 1 holds
    assert signals.hung_ranks(6.0, still_s=3.0) == (1,)
    assert signals.hung_ranks(6.0, still_s=7.0) == ()  # not still for that long yet
    assert signals.hung_ranks(9.0, still_s=3.0) == ()  # both still: the whole engine (engine_still_s)
    signals.on_ranks(ranks((3.0, 1.0), (0.0, 1.0), at=9.0))
    assert signals.hung_ranks(20.0, still_s=3.0) == (1,)  # rank 0 idle: it holds still without work
    signals.on_ranks(ranks((3.0, 1.0), (0.0, 0.0), at=21.0))
    assert signals.hung_ranks(30.0, still_s=3.0) == ()  # no work on rank 1 either
    signals.on_ranks(ranks((3.0, 4.0, 5.0), (1.0, 1.0, 1.0), at=31.0))  # restarted with three ranks
    assert signals.hung_ranks(32.0, still_s=3.0) == ()
    assert InstanceSignals("http://one", "spec", 8).hung_ranks(100.0, still_s=1.0) == ()


def test_a_twins_prefill_busy_time_is_learned_in_wall_clock_units():
    """A twin at time scale X counts its prefill busy time in its GPU's units (X times the wall
    clock's) and says its scale in /server_info: the router divides it out, or it predicted
    prefills X times too slow (a review's probe at scale 4: 429s for first tokens predicted
    past the TTFT target that came in time)."""
    from fleet.profile import load_profile

    specs = (TwinSpec("spec", time_scale=TIME_SCALE, seed=5), TwinSpec("base", time_scale=TIME_SCALE, seed=6))
    with twins(*specs) as (spec, base):
        router = Router.from_settings(load_settings(spec_urls=spec.url, base_urls=base.url, poll_interval_ms=20))
        signals = router.fleet.instances[base.url]

        async def scenario():
            await router.start()
            try:
                await wait_for(lambda: signals.reading is not None, 10, "a first reading of base")
                words = " ".join(f"w{i}" for i in range(3000))[: 4 * 3000]  # 3,000 tokens of 4 characters
                body = {"model": "twin", "messages": [{"role": "user", "content": words}], "max_tokens": 1}
                async with httpx.AsyncClient(timeout=30) as client:
                    assert (await client.post(base.url + "/v1/chat/completions", json=body)).status_code == 200
                await wait_for(lambda: signals.prefill_ms_per_token is not None, 10, "the prefill counters to move")
            finally:
                await router.stop()

        asyncio.run(scenario())
        assert signals.reading is not None and signals.reading.prefill_tokens_total is not None
        tokens = int(signals.reading.prefill_tokens_total)  # all of it this one prompt's (about 3,000)
        assert 2900 < tokens < 3100
        gpu_ms_per_token = load_profile("h200-llama8b").prefill_ms(tokens) / tokens
        assert signals.time_scale == TIME_SCALE
        assert signals.prefill_ms_per_token == pytest.approx(gpu_ms_per_token / TIME_SCALE, rel=0.05)


def test_a_server_marked_unresponsive_then_learned_again_without_a_load_endpoint_is_back_in_rotation():
    """The flag is judged from load readings: a server relearned as one with none (its load
    paths now refused, its liveness answered) is not left out of rotation for good."""
    from fleet.readings import Reading

    silent_url, other_url = "http://127.0.0.1:9", "http://127.0.0.1:10"
    router = Router.from_settings(load_settings(spec_urls=silent_url, base_urls=other_url))
    poller = router.pollers.by_url[silent_url]
    loads = '{"loads": [{"num_running_reqs": 0, "num_waiting_reqs": 0, "timestamp": 1.0}]}'
    answers: dict[str, httpx.Response | type[Exception]] = {
        "/server_info": httpx.Response(404),
        "/v1/loads": httpx.Response(200, text=loads),
    }

    async def get(url: str, path: str) -> httpx.Response:
        answer = answers.get(path, httpx.Response(404))
        if isinstance(answer, httpx.Response):
            return answer
        raise answer("no answer")

    poller.get = get

    async def scenario():
        await poller.learn()
        assert poller.probe == "/v1/loads"
        now = time.monotonic()
        router.fleet.on_reading(silent_url, Reading(at=now - 60.0, running=0.0, waiting=0.0))  # long silent
        router.fleet.on_reading(other_url, Reading(at=now, running=0.0, waiting=0.0))  # another answers
        answers["/v1/loads"] = httpx.ReadTimeout
        await poller.tick()
        assert router.fleet.instances[silent_url].unresponsive and not router.by_url[silent_url].healthy
        # It answers again, but no longer on a load endpoint: learned as a server with none.
        answers.update({path: httpx.Response(503) for path in ("/v1/loads", "/metrics", "/get_load")})
        answers["/health"] = httpx.Response(200)
        for _ in range(50):
            await poller.tick()
            if poller.reached and poller.probe is None:
                break
        assert poller.reached and poller.probe is None, poller.error
        await poller.tick()
        assert not router.fleet.instances[silent_url].unresponsive and router.by_url[silent_url].healthy

    asyncio.run(scenario())
