"""The fleet model beyond the mission's two pools, and the backend seam's kinds."""

from __future__ import annotations

import math

import pytest

from fleet.model import FleetModel
from fleet.outcomes import OUTCOME_HORIZON_S, OUTCOME_MIN_SAMPLES, TpotOutcomes
from fleet.readings import Reading, ResponseEvidence, ServerDescription
from proxy import backends
from proxy.backends import VLLM, OpenAICompatible, SGLang


def test_pools_are_data_each_speculative_one_with_its_own_acceptance() -> None:
    fleet = FleetModel({"spec-a": 3, "spec-b": 5, "base": 0})
    for url, pool in (("http://a", "spec-a"), ("http://b", "spec-b"), ("http://c", "base")):
        fleet.add_instance(url, pool, 48)
    fleet.on_response("http://a", 1.0, ResponseEvidence(tokens=41, verify_steps=10, decode_s=0.2))
    fleet.on_response("http://b", 1.0, ResponseEvidence(tokens=21, verify_steps=10, decode_s=0.2))
    snap = fleet.snapshot(1.0)
    assert list(snap.pools) == ["spec-a", "spec-b", "base"]
    a, b, base = (snap.pools[name] for name in ("spec-a", "spec-b", "base"))
    assert (a.speculative, a.num_draft_tokens, b.num_draft_tokens, base.speculative) == (True, 3, 5, False)
    assert a.alpha is not None and b.alpha is not None and base.alpha is None
    assert a.alpha > b.alpha  # 4 tokens per verify step with k=3 against 2 with k=5
    assert fleet.cost.tokens_per_seq("spec-b") == 6 and fleet.cost.tokens_per_seq("base") == 1


def test_a_speculative_pool_reports_how_its_requests_time_per_token_spreads() -> None:
    fleet = FleetModel({"spec": 3, "base": 0})
    fleet.add_instance("http://s", "spec", 48)
    fleet.add_instance("http://b", "base", 48)
    for i in range(20):
        # Half the requests accept 3 tokens per verify step, half 1.5: each one's own acceptance.
        steps = 20 if i % 2 else 40
        fleet.on_response("http://s", 1.0 + i, ResponseEvidence(tokens=61, verify_steps=steps, decode_s=0.2))
        fleet.on_response("http://b", 1.0 + i, ResponseEvidence(tokens=61, verify_steps=60, decode_s=0.2))
    snap = fleet.snapshot(21.0)
    # 1/3 and 2/3 step per token: mean 1/2, standard deviation 1/6.
    assert snap.pools["spec"].tpot_cv == pytest.approx(1 / 3, rel=1e-6)
    assert snap.pools["base"].tpot_cv == 0.0


def test_a_server_description_sets_the_cap_and_the_draft_width_and_a_wrong_role_is_reported() -> None:
    fleet = FleetModel({"spec": 3, "base": 0})
    fleet.add_instance("http://s", "spec", 48)
    fleet.add_instance("http://b", "base", 48)
    assert fleet.on_server(
        "http://s", ServerDescription("sglang", speculative=True, num_draft_tokens=4, max_running=32)
    )
    snap = fleet.snapshot(0.0)
    assert (snap.pools["spec"].num_draft_tokens, snap.pools["spec"].instances[0].max_running) == (4, 32)
    assert fleet.cost.tokens_per_seq("spec") == 5
    assert not fleet.on_server("http://b", ServerDescription("sglang", speculative=True, num_draft_tokens=3))
    assert not fleet.snapshot(0.0).pools["base"].speculative  # taken as configured


def test_a_spec_role_learns_its_width_from_the_server_when_none_was_configured() -> None:
    fleet = FleetModel({"spec": 0, "base": 0}, speculative=("spec",))
    fleet.add_instance("http://s", "spec", 48)
    assert not fleet.snapshot(0.0).pools["spec"].speculative
    fleet.on_server("http://s", ServerDescription("sglang", speculative=True, num_draft_tokens=3))
    assert fleet.snapshot(0.0).pools["spec"].speculative


LOADS = '{"loads": [{"num_running_reqs": 2, "num_waiting_reqs": 1, "max_running_requests": 48}]}'
SGLANG_METRICS = "sglang:num_running_reqs 3\nsglang:num_queue_reqs 0\n"
VLLM_METRICS = 'vllm:num_requests_running{model_name="m"} 4\nvllm:num_requests_waiting{model_name="m"} 0\n'


@pytest.mark.parametrize(
    ("path", "text", "kind", "running"),
    [
        ("/v1/loads", LOADS, SGLang, 2),
        ("/metrics", SGLANG_METRICS, SGLang, 3),
        ("/metrics", VLLM_METRICS, VLLM, 4),
        ("/get_load", '[{"num_reqs": 5, "num_waiting_reqs": 1}]', SGLang, 4),
    ],
)
def test_each_kind_recognises_its_answers_and_reads_them(path: str, text: str, kind: type, running: float) -> None:
    backend = backends.recognise(path, text)
    assert isinstance(backend, kind) and backend.load_path == path
    assert backend.read(text, 1.0).running == running


def test_an_answer_no_kind_reads_is_not_taken_for_a_load_endpoint() -> None:
    assert backends.recognise("/metrics", "process_cpu_seconds_total 1\n") is None
    assert backends.load_paths() == ("/v1/loads", "/metrics", "/get_load")
    assert OpenAICompatible().load_path is None and OpenAICompatible.liveness_path == "/health"


def test_vllm_reports_its_default_cap_until_it_is_seen_saturated() -> None:
    backend = VLLM("/metrics")
    assert backend.default_description().max_running == 256
    assert backend.read(VLLM_METRICS, 0.0) == Reading(
        at=0.0, running=4, waiting=0, max_running=256, accept_steps=160, ranks=1
    )


def test_an_instance_prefill_speed_is_measured_from_its_counters():
    """SGLang's /v1/loads prefill counters, parsed by the backend and differenced per reading,
    give the instance's prefill time per token under any load; a restart (counters going back)
    restarts the differencing instead of a negative rate; older servers report none."""
    from proxy.backends.sglang import reading_from_loads

    model = FleetModel()
    model.add_instance("s", "spec", 48)

    def loads(tokens: int, busy_us: int) -> dict:
        entry = {"num_running_reqs": 10, "num_waiting_reqs": 2, "max_running_requests": 48}
        return {"loads": [entry | {"total_prefill_uncached_tokens": tokens, "total_prefill_busy_us": busy_us}]}

    model.on_reading("s", reading_from_loads(loads(1000, 50_000), 0.0))
    assert model.instances["s"].prefill_ms_per_token is None  # one sample: nothing to difference
    model.on_reading("s", reading_from_loads(loads(5000, 250_000), 1.0))  # 4,000 tokens in 200 ms
    assert model.instances["s"].prefill_ms_per_token == pytest.approx(0.05)
    model.on_reading("s", reading_from_loads(loads(100, 90_000), 2.0))  # restarted
    model.on_reading("s", reading_from_loads(loads(4100, 490_000), 3.0))  # 4,000 tokens in 400 ms
    assert model.instances["s"].prefill_ms_per_token == pytest.approx(0.075)
    old = reading_from_loads({"loads": [{"num_running_reqs": 1, "num_waiting_reqs": 0}]}, 4.0)
    assert old.prefill_tokens_total is None and old.prefill_busy_us_total is None


def test_a_never_idle_server_prefilling_twice_as_slow_as_the_seed_is_learned_from_its_counters() -> None:
    """Under sustained load no request finds its instance idle, so no time to first token teaches
    prefill; the server's prefill counters do: their busy time per our mean uncached prompt."""
    from fleet.costmodel import AffineSeed

    seed = AffineSeed()

    def learned(counters: bool) -> tuple[float, float]:
        model = FleetModel(seed=seed)
        model.add_instance("b", "base", 8)
        tokens = busy_us = 0.0
        sent = []
        for i in range(400):  # 20 s: a dispatch every 0.1 s, a reading every 0.05 s
            now = 0.05 * i
            if counters:
                # What the server prefilled by now (each prompt 0.1 s after its dispatch), twice the seed's time.
                done = [p for at, p in sent if at + 0.1 <= now]
                tokens = float(sum(done))
                busy_us = sum(2000 * seed.prefill_ms(p) for p in done)
            model.on_reading(
                "b",
                Reading(
                    now,
                    running=8,
                    waiting=3,
                    prefill_tokens_total=tokens or None,
                    prefill_busy_us_total=busy_us if tokens else None,
                ),
            )
            if i % 2 == 0:
                prompt = 600 if i % 4 == 0 else 1400  # a mean of 1,000
                dispatch = model.on_dispatch("b", now, prompt)
                sent.append((now, prompt))
                # Its first token came after the queue ahead of it: not the prefill alone, not taken.
                model.on_response("b", now + 0.4, ResponseEvidence(ttft_s=0.4, dispatch=dispatch))
        return model.cost.prefill_ms("base", 1000, now), model.cost.evidence("base", 1000, now, prefill=True)

    assert learned(counters=False) == (pytest.approx(seed.prefill_ms(1000)), 0.0)  # nothing else teaches it
    ms, evidence = learned(counters=True)
    assert ms == pytest.approx(2 * seed.prefill_ms(1000), rel=0.05)
    assert evidence > 50


def test_a_queued_server_packs_its_prefill_into_chunks_and_the_counters_are_read_so() -> None:
    """A server with prompts waiting packs each prefill iteration to its chunk budget: several
    short prompts share one iteration's fixed cost. Read as one iteration per prompt, its
    counters would make the right seed look fast; read as full chunks, they confirm it. A server
    with no queue prefills prompt by prompt, and its counters are read that way."""
    from fleet.costmodel import AffineSeed
    from fleet.model import PREFILL_CHUNK_TOKENS

    seed = AffineSeed(c0=30.0)  # a large fixed cost per iteration: packing matters

    def learned(waiting: int) -> float:
        model = FleetModel(seed=seed)
        model.add_instance("b", "base", 64)
        tokens = busy_us = 0.0
        prompt = PREFILL_CHUNK_TOKENS // 4
        for i in range(200):
            now = 0.2 * i
            model.on_reading(
                "b",
                Reading(
                    now,
                    running=32,
                    waiting=waiting,
                    prefill_tokens_total=tokens or None,
                    prefill_busy_us_total=busy_us if tokens else None,
                ),
            )
            for j in range(4):  # further apart than a decode step (31 ms): each prefilled alone
                model.on_dispatch("b", now + 0.04 * j, prompt)
            # What the server did with them by the next reading, exactly as the seed says.
            if waiting:  # one iteration of four prompts
                busy_us += 1000 * seed.prefill_ms(PREFILL_CHUNK_TOKENS)
            else:  # four iterations of one
                busy_us += 4000 * seed.prefill_ms(prompt)
            tokens += PREFILL_CHUNK_TOKENS
        return model.cost.prefill_ms("base", PREFILL_CHUNK_TOKENS, now) / seed.prefill_ms(PREFILL_CHUNK_TOKENS)

    assert learned(waiting=5) == pytest.approx(1.0, rel=0.02)
    assert learned(waiting=0) == pytest.approx(1.0, rel=0.02)


@pytest.mark.parametrize("sent_at", [0.0, 0.199])
def test_prompts_sent_together_to_a_server_with_no_queue_are_read_as_one_prefill_iteration(sent_at: float) -> None:
    """SGLang prefills together the prompts waiting when an iteration starts: a burst sent within
    one decode step shares one. Read as one iteration per prompt, 18 prompts sent at once taught
    spec's prefill at a seventh of the twin's (its routing test then sent chat to spec). A burst
    sent just before a reading (`sent_at` 0.199 s into the 0.2 s between two) is prefilled after
    it, and the next reading's counters hold it: the workload test's burst straddled one so, and
    17 cached tokens were read as 16 iterations of 0.2 ms."""
    from fleet.costmodel import AffineSeed

    seed = AffineSeed(c0=30.0)
    model = FleetModel(seed=seed)
    model.add_instance("b", "base", 64)
    tokens = busy_us = 0.0
    for i in range(100):
        now = 0.2 * i
        model.on_reading(
            "b",
            Reading(
                now, running=4, waiting=0, prefill_tokens_total=tokens or None, prefill_busy_us_total=busy_us or None
            ),
        )
        if i % 2 == 0:
            for _ in range(8):  # a burst, the same instant, every other interval
                model.on_dispatch("b", now + sent_at, 64)
        # Prefilled by the next reading, or (sent late) by the one after, which saw none sent.
        if i % 2 == (0 if sent_at == 0.0 else 1):
            busy_us += 1000 * seed.prefill_ms(8 * 64)  # one iteration, as the seed says
            tokens += 8 * 64
    assert model.cost.evidence("base", 512, now, prefill=True) > 10
    for size in (64, 512):
        assert model.cost.prefill_ms("base", size, now) == pytest.approx(seed.prefill_ms(size), rel=0.05)


@pytest.mark.parametrize(
    ("rate", "prompt", "running"), [(5, 256, 16), (40, 256, 32), (150, 128, 64), (40, 32, 32), (80, 32, 32)]
)
def test_steady_traffic_to_a_server_with_no_queue_teaches_its_prefill(rate: float, prompt: int, running: int) -> None:
    """Poisson arrivals to a server that prefills, whenever it is free, every prompt waiting (one
    iteration, the seed's time for their tokens), else runs a decode step; read every 0.1 s with
    no queue. Learned 0.59-1.15x the truth from 0.15 to 4.9 arrivals a step (under where the
    prefill iterations outlast the decode step, the third case). Read one iteration a prompt:
    0.2-0.96x; grouped whole where each prompt came within a step of the one before: up to 2.2x
    (the 32-token cases: a 30 ms fixed cost); in groups spanning a step from their first: 0.69-1.72x."""
    import bisect
    import random

    from fleet.costmodel import AffineSeed

    rng = random.Random(1)
    seed = AffineSeed(c0=30.0)
    model = FleetModel(seed=seed)
    model.add_instance("b", "base", 256)
    step_s, duration = seed.target_ms(running, 1) / 1000, 120.0
    arrivals = [0.0]
    while arrivals[-1] < duration:
        arrivals.append(arrivals[-1] + rng.expovariate(rate))
    ends, done_tokens, done_us = [0.0], [0.0], [0.0]  # the server's iterations, cumulative
    at, taken = 0.0, 1
    while at < duration:
        waiting = bisect.bisect_right(arrivals, at) - taken
        if waiting > 0:
            taken += waiting
            ms = seed.prefill_ms(waiting * prompt)
            at += ms / 1000
            ends.append(at)
            done_tokens.append(done_tokens[-1] + waiting * prompt)
            done_us.append(done_us[-1] + 1000 * ms)
        else:
            at += step_s
    events = sorted([(t, 0) for t in arrivals[1:]] + [(0.1 * j, 1) for j in range(1, int(duration / 0.1))])
    for t, reading in events:
        if not reading:
            model.on_dispatch("b", t, prompt)
            continue
        i = bisect.bisect_right(ends, t) - 1
        tokens, busy_us = done_tokens[i], done_us[i]
        model.on_reading(
            "b",
            Reading(
                t,
                running=running,
                waiting=0,
                prefill_tokens_total=tokens or None,
                prefill_busy_us_total=busy_us or None,
            ),
        )
    for size in (256, 1024):
        assert 0.55 < model.cost.prefill_ms("base", size, duration) / seed.prefill_ms(size) < 1.25


def test_another_clients_prompts_in_the_counters_teach_no_prefill_and_break_nothing() -> None:
    """A server's counters also count other clients' prompts (a second proxy, `specroute
    profile`): with no queue their iterations were sized by our own mean prompt, so a profiler's
    long prompts became thousands of tiny iterations, one reading outweighed the bucket's memory,
    its ratio overshot below zero and the next log() raised in the poll (a user's probe)."""
    from fleet.costmodel import AffineSeed

    seed = AffineSeed()
    model = FleetModel(seed=seed)
    model.add_instance("b", "base", 64)
    tokens = busy_us = 0.0
    for i in range(40):
        now = 0.1 * i
        if i % 10 == 0:
            model.on_dispatch("b", now, 6)  # ours: a few tiny prompts
            tokens, busy_us = tokens + 6, busy_us + 1000 * seed.prefill_ms(6)
        if i >= 20:  # another client's 4,096-token prompts, one per reading, at the seed's time
            tokens, busy_us = tokens + 4096, busy_us + 1000 * seed.prefill_ms(4096)
        model.on_reading(
            "b", Reading(now, running=1, waiting=0, prefill_tokens_total=tokens, prefill_busy_us_total=busy_us)
        )
    for size in (6, 1024, 4096):
        assert model.cost.prefill_ms("base", size, now) == pytest.approx(seed.prefill_ms(size), rel=0.05)


def test_prompts_the_server_had_cached_unknown_to_the_router_teach_their_true_prefill() -> None:
    """After a restart (or behind another proxy replica) the router credits no cached prefix, but
    the server holds it and prefills only each turn's new tokens: its counters count those. Read
    as iterations of the prompts the router sent, a review saw spec's prefill learned 3-20x too
    slow (~150x the seed per iteration, at tiny weights). Each prompt's prefill is now the share
    the counters prefilled of what was sent."""
    from fleet.costmodel import AffineSeed

    seed = AffineSeed()
    prompt, new = 2048, 64  # what we send each turn; what the server did not have cached

    def learned(cached_on_server: bool) -> float:
        model = FleetModel(seed=seed)
        model.add_instance("b", "base", 64)
        tokens = busy_us = 0.0
        for i in range(300):  # 30 s: a turn every 0.2 s, a reading every 0.1 s, no queue
            now = 0.1 * i
            if i % 2 == 0:
                model.on_dispatch("b", now, prompt)
                prefilled = new if cached_on_server else prompt
                tokens, busy_us = tokens + prefilled, busy_us + 1000 * seed.prefill_ms(prefilled)
            model.on_reading(
                "b", Reading(now, running=1, waiting=0, prefill_tokens_total=tokens, prefill_busy_us_total=busy_us)
            )
        return max(model.cost.prefill_ms("base", size, now) / seed.prefill_ms(size) for size in (new, 1024, prompt))

    assert learned(cached_on_server=False) == pytest.approx(1.0, rel=0.05)
    assert learned(cached_on_server=True) == pytest.approx(1.0, rel=0.1)


def test_no_observation_outweighs_a_buckets_memory() -> None:
    from fleet.costmodel import AffineSeed, StepCostModel

    seed = AffineSeed()
    cost = StepCostModel(seed=seed)
    for i in range(20):
        cost.observe_prefill("base", 64, 2 * seed.prefill_ms(64), now=float(i))
    cost.observe_prefill("base", 64, 0.5 * seed.prefill_ms(64), now=21.0, weight=3000)
    cost.observe_prefill("base", 64, 0.5 * seed.prefill_ms(64), now=22.0)
    assert 0.5 <= cost.prefill_correction("base", 64, now=22.0) <= 2.0


def test_a_pool_learns_how_its_requests_tpot_came_out_against_their_predictions() -> None:
    fleet = FleetModel({"spec": 3, "base": 0})
    fleet.add_instance("http://s", "spec", 48)
    fleet.add_instance("http://b", "base", 48)

    def finish(url: str, at: float, predicted_s: float, decode_s: float) -> None:
        sent = fleet.on_dispatch(url, at - decode_s - 0.1, 100, predicted_tpot_s=predicted_s)
        evidence = ResponseEvidence(tokens=101, verify_steps=50, decode_s=decode_s, ttft_s=0.1, dispatch=sent)
        fleet.on_response(url, at, evidence)
        fleet.on_complete(url, at)

    # Spec's requests take 20 ms per token against 16 predicted (x1.25), one in five 40 ms (x2.5):
    # the median is what is learned, in full once there are OUTCOME_MIN_SAMPLES of them, in
    # proportion to their number before.
    assert fleet.snapshot(9.0).pools["spec"].tpot_bias == 1.0  # none yet
    half = OUTCOME_MIN_SAMPLES // 2
    for i in range(OUTCOME_MIN_SAMPLES - 1):
        finish("http://s", 10.0 + i * 0.1, 0.016, (4.0 if i % 5 == 0 else 2.0))
        if i == half - 1:
            assert fleet.snapshot(12.0).pools["spec"].tpot_bias == pytest.approx(1 + 0.25 * half / OUTCOME_MIN_SAMPLES)
    finish("http://s", 13.0, 0.016, 2.0)
    assert fleet.snapshot(13.0).pools["spec"].tpot_bias == pytest.approx(1.25)
    # A request the policy predicted nothing for (an override), or a non-streamed one (no
    # decode time seen), teaches nothing; nor does the other pool's.
    finish("http://s", 13.1, 0.0, 9.0)
    finish("http://s", 13.2, 0.016, 0.0)
    finish("http://b", 13.3, 0.010, 1.0)
    assert fleet.pools["spec"].outcomes.samples(13.3) == OUTCOME_MIN_SAMPLES
    assert fleet.pools["base"].outcomes.samples(13.3) == 1
    # After the horizon the samples are gone: the bias is back to 1 until new ones come.
    later = 13.0 + OUTCOME_HORIZON_S + 1
    assert fleet.snapshot(later).pools["spec"].tpot_bias == 1.0
    assert fleet.pools["spec"].outcomes.samples(later) == 0


def test_a_streams_decode_time_is_its_first_to_last_event_when_its_gaps_were_cut_short() -> None:
    evidence = ResponseEvidence.from_stream(5, [0.01, 0.01], completion_tokens=5, decode_s=0.04)
    assert evidence.decode_s == 0.04 and evidence.step_ms == pytest.approx(10.0)


def test_the_tpot_outcomes_keep_the_latest_samples_only() -> None:
    outcomes = TpotOutcomes(min_samples=3, max_samples=3)
    for i, ratio in enumerate((5.0, 1.0, 1.2, 1.4)):
        outcomes.observe(float(i), ratio * 0.02, 0.02)
    # The first (5.0) was dropped for the fourth: the median of 1.0, 1.2, 1.4.
    assert outcomes.samples(3.0) == 3 and outcomes.bias(3.0) == pytest.approx(1.2)
    # A ratio that is no number is not kept (it would break the order the median is read from).
    for actual, predicted in ((math.nan, 0.02), (0.02, math.nan), (math.inf, 0.02), (0.02, 0.0)):
        outcomes.observe(3.5, actual, predicted)
    assert outcomes.samples(3.5) == 3 and outcomes.bias(3.5) == pytest.approx(1.2)


def test_an_instance_whose_polls_stopped_while_its_pool_mates_answer_gets_no_new_requests() -> None:
    fleet = FleetModel({"spec": 3, "base": 0}, stale_after_s=1.0)
    for url, pool in (("http://s1", "spec"), ("http://s2", "spec"), ("http://b", "base")):
        fleet.add_instance(url, pool, 48)
        fleet.on_reading(url, Reading(at=0.0, running=0, waiting=0))
    for t in (0.5, 1.0, 1.5, 2.0):  # s1 went silent after its first poll (a stopped process)
        fleet.on_reading("http://s2", Reading(at=t, running=5, waiting=0))
        fleet.on_reading("http://b", Reading(at=t, running=5, waiting=0))
    spec = fleet.snapshot(2.2).pools["spec"]
    silent = spec.instances[0]
    assert silent.lagging and not silent.healthy and not spec.stale
    assert [i.url for i in spec.healthy_instances] == ["http://s2"]
    assert spec.least_loaded() is not None and spec.least_loaded().url == "http://s2"  # idle as it looks
    # Every reading of the pool stale: nobody is singled out (the pool is stale; policies act on that).
    assert not any(i.lagging for i in fleet.snapshot(3.5).pools["spec"].instances)
    # It answers again: back.
    fleet.on_reading("http://s1", Reading(at=2.3, running=0, waiting=0))
    assert fleet.snapshot(2.4).pools["spec"].instances[0].healthy


def test_a_server_is_unresponsive_only_while_another_answers() -> None:
    fleet = FleetModel({"spec": 3, "base": 0}, stale_after_s=1.0)
    fleet.add_instance("http://s", "spec", 48)
    fleet.add_instance("http://b", "base", 48)
    fleet.on_reading("http://s", Reading(at=0.0, running=1, waiting=0))
    fleet.on_reading("http://b", Reading(at=0.0, running=1, waiting=0))
    assert not fleet.unresponsive("http://s", 4.0, after_s=5.0)  # silent 4 s: not yet
    # Both silent 6 s: this process or its network, not the server.
    assert not fleet.unresponsive("http://s", 6.0, after_s=5.0)
    fleet.on_reading("http://b", Reading(at=5.5, running=1, waiting=0))
    assert fleet.unresponsive("http://s", 6.0, after_s=5.0)  # another answers: the server's silence
    fleet.set_health("http://s", False)
    assert not fleet.unresponsive("http://s", 6.0, after_s=5.0)  # unreachable is another matter


def test_a_vllm_server_of_several_engines_is_seen_one_engine_at_a_time() -> None:
    """vLLM says nothing of its engines but in its metrics' `engine` label: the engines its
    reading lists are the server's replicas (each with its own batch and cap), and their
    number follows the reading (a restart with another --data-parallel-size)."""
    fleet = FleetModel({"spec": 3, "base": 0})
    fleet.add_instance("http://b", "base", 256)
    fleet.on_server("http://b", VLLM("/metrics").default_description())
    fleet.on_reading("http://b", Reading(at=1.0, running=40, waiting=6, max_running=512, ranks=2))
    engine = fleet.snapshot(1.0).pools["base"].instances[0]
    assert (engine.running, engine.waiting, engine.max_running, engine.replicas) == (20, 3, 256, 2)
    fleet.on_reading("http://b", Reading(at=2.0, running=40, waiting=6, max_running=256, ranks=1))
    engine = fleet.snapshot(2.0).pools["base"].instances[0]
    assert (engine.running, engine.max_running, engine.replicas) == (40, 256, 1)


def test_a_server_of_several_data_parallel_ranks_is_seen_one_engine_at_a_time() -> None:
    """SGLang with --dp-size 2 runs two engines behind one front, each with its own batch and
    queue and the cap of max_running_requests. A request joins one of them: the policy's
    figures are one engine's (its batch of 20, not 40, sets its step time), the pool's totals
    the server's; a hung rank's frozen requests and cap are no one's to serve."""
    from fleet.costmodel import StepCostModel, seed_from_profile
    from fleet.types import Features
    from policies.goodput import Goodput

    def fleet_with(replicas: int, running: float, waiting: float, cap: int, tokens: float) -> FleetModel:
        fleet = FleetModel({"spec": 3, "base": 0})
        fleet.add_instance("http://s", "spec", 48)
        fleet.add_instance("http://b", "base", 256)
        fleet.on_server("http://s", ServerDescription("sglang", True, 3, max_running=cap, replicas=replicas))
        reading = Reading(at=1.0, running=running, waiting=waiting, max_running=cap, waiting_tokens=tokens)
        fleet.on_reading("http://s", reading)
        return fleet

    two = fleet_with(2, 40, 6, 96, 6000).snapshot(1.0).pools["spec"]
    one = fleet_with(1, 20, 3, 48, 3000).snapshot(1.0).pools["spec"]
    engine = two.instances[0]
    assert (engine.running, engine.waiting, engine.max_running, engine.waiting_tokens, engine.replicas) == (
        20,
        3,
        48,
        3000,
        2,
    )
    assert (two.running, two.waiting, two.capacity) == (40, 6, 96)
    cost = StepCostModel(seed_from_profile("h200-llama8b"), num_draft_tokens=3)
    prompt = Features(prompt_tokens=500)
    assert Goodput().predict(two, engine, prompt, cost, 200) == Goodput().predict(
        one, one.instances[0], prompt, cost, 200
    )

    # A decode step seen on it is one engine's, at its batch (23 here: 46 over two), not 46.
    learning = fleet_with(2, 40, 6, 96, 6000)
    learning.on_step("http://s", 2.0, 30.0)
    assert learning.cost.evidence("spec", 23, 2.0) > learning.cost.evidence("spec", 46, 2.0)

    # Rank 0 hung holding 24 running and 6 queued (6,000 tokens): rank 1 serves its 16, no queue.
    hung = fleet_with(2, 40, 6, 96, 6000)
    ranks = Reading(
        at=1.5,
        running=40,
        waiting=6,
        max_running=96,
        waiting_tokens=6000,
        rank_marks=(1.0, 2.0),
        rank_running=(24.0, 16.0),
        rank_waiting=(6.0, 0.0),
        rank_waiting_tokens=(6000.0, 0.0),
    )
    hung.on_reading("http://s", ranks)
    hung.set_out_ranks("http://s", (0,))
    served = hung.snapshot(1.5).pools["spec"].instances[0]
    assert (served.running, served.waiting, served.waiting_tokens, served.max_running, served.replicas) == (
        16,
        0,
        0,
        48,
        1,
    )
    hung.on_step("http://s", 2.0, 30.0)  # a step of the engine serving: at its batch of 16
    assert hung.cost.evidence("spec", 16, 2.0) > hung.cost.evidence("spec", 40, 2.0)

    # No cap said (SGLang auto-sizes it; /metrics has none): each engine has the configured one.
    auto = FleetModel({"spec": 3, "base": 0})
    auto.add_instance("http://s", "spec", 48)
    auto.on_server("http://s", ServerDescription("sglang", True, 3, max_running=None, replicas=2))
    assert auto.snapshot(1.0).pools["spec"].capacity == 96
    # Restarted with four ranks, then one, before it was learned again: the ranks its load
    # answers list are its engines, each with the configured cap while none is said.
    auto.on_reading("http://s", Reading(at=2.0, running=8, waiting=0, ranks=4))
    engine = auto.snapshot(2.0).pools["spec"].instances[0]
    assert (engine.replicas, engine.max_running, engine.running) == (4, 48, 2)
    auto.on_reading("http://s", Reading(at=3.0, running=8, waiting=0, ranks=1))
    engine = auto.snapshot(3.0).pools["spec"].instances[0]
    assert (engine.replicas, engine.max_running, engine.running) == (1, 48, 8)
    auto.on_server("http://s", ServerDescription("sglang", True, 3, max_running=None, replicas=1))  # learned again
    assert auto.snapshot(3.0).pools["spec"].capacity == 48
