"""The engine on the virtual clock: scheduling, speed and acceptance match the model they claim."""

import statistics

import pytest

from fleet.profile import load_profile, tokens_per_verify_step
from sim.engine import Engine, EngineConfig
from sim.lengths import parse_output_lengths
from sim.virtual import AlphaChange, Arrival, simulate

KIMI = load_profile("kimi-linear")
H200 = load_profile("h200-llama8b")


def engine(mode="spec", profile=H200, name=None, **kw):
    return Engine(EngineConfig(mode, profile, **kw), name or mode)


def to_first(arrival, fleet):
    return 0


def steps_of(records_and_steps):
    return records_and_steps


def run(engines, arrivals, **kw):
    steps = []
    records = simulate(engines, arrivals, kw.pop("router", to_first), on_step=steps.append, **kw)
    return records, steps


@pytest.mark.parametrize("profile", [H200, KIMI, load_profile("kimi-moe")], ids=lambda p: p.name)
def test_single_stream_decode_speed_matches_profile(profile):
    records, steps = run([engine("base", profile)], [Arrival(0.0, 1000, max_tokens=500, ignore_eos=True)])
    (r,) = records
    decode = [s for s in steps if s.kind == "decode"]
    assert r.output_tokens == 500 and len(decode) == 499
    # Context grows from 1001 to 1499 tokens over the stream; the profile at the mean context.
    expected = profile.base_step_ms(1, 1250) / 1000
    assert r.tpot == pytest.approx(expected, rel=0.05)
    assert r.ttft == pytest.approx(profile.prefill_ms(1000) / 1000, rel=1e-9)


def test_batched_decode_speed_matches_profile():
    n = 32
    arrivals = [Arrival(0.0, 1000, max_tokens=300, ignore_eos=True) for _ in range(n)]
    records, steps = run([engine("base", H200)], arrivals)
    # 32,000 prompt tokens > 8192: chunked over four prefill iterations, before any decode.
    prefill = [s for s in steps if s.kind == "prefill"]
    assert [s.tokens_per_seq for s in prefill] == [8192, 8192, 8192, 32000 - 3 * 8192]
    decode = [s for s in steps if s.kind == "decode"]
    assert all(s.batch == n for s in decode)
    expected = H200.base_step_ms(n, 1150) / 1000
    assert statistics.mean(s.duration_s for s in decode) == pytest.approx(expected, rel=0.05)
    last_prefill_end = prefill[-1].start + prefill[-1].duration_s
    late = [r for r in records if r.first_token_time == pytest.approx(last_prefill_end)]
    assert late
    for r in late:  # streams that did not sit through later prefill iterations
        assert r.tpot == pytest.approx(expected, rel=0.05)


@pytest.mark.parametrize("alpha,k", [(0.3, 3), (0.64, 3), (0.8, 5)])
def test_tokens_per_verify_step_match_formula(alpha, k):
    # A large concentration makes every request's alpha the mean: the i.i.d. formula applies.
    spec = engine("spec", KIMI, mean_alpha=alpha, num_steps=k, alpha_concentration=1e7, seed=3)
    arrivals = [Arrival(0.0, 100, max_tokens=4000, ignore_eos=True) for _ in range(8)]
    records, steps = run([spec], arrivals)
    decode = [s for s in steps if s.kind == "decode"]
    verifies = sum(s.batch for s in decode)
    tokens = sum(s.tokens for s in decode)
    assert verifies > 5000
    assert tokens / verifies == pytest.approx(tokens_per_verify_step(alpha, k), rel=0.05)
    assert spec.accept_length == pytest.approx(tokens_per_verify_step(alpha, k), rel=0.05)


def test_spec_decode_speed_is_step_time_over_tau():
    spec = engine("spec", KIMI, mean_alpha=0.64, alpha_concentration=1e7, seed=5)
    records, steps = run([spec], [Arrival(0.0, 200, max_tokens=3000, ignore_eos=True)])
    (r,) = records
    tau = tokens_per_verify_step(0.64, 3)
    expected_tpot = KIMI.spec_step_ms(1, 3, 1700) / 1000 / tau
    assert r.tpot == pytest.approx(expected_tpot, rel=0.05)


def test_per_request_alpha_spreads_around_the_mean():
    spec = engine("spec", KIMI, mean_alpha=0.6, alpha_concentration=20, seed=11)
    arrivals = [Arrival(i * 0.01, 100, max_tokens=50, ignore_eos=True) for i in range(400)]
    records, _ = run([spec], arrivals)
    alphas = [r.alpha for r in records]
    assert statistics.mean(alphas) == pytest.approx(0.6, abs=0.03)
    assert 0.05 < statistics.stdev(alphas) < 0.2  # Beta(12, 8): sd about 0.107


def test_each_workload_draws_its_own_alpha():
    spec = engine("spec", KIMI, mean_alpha=0.6, workload_alpha={"code": 0.85, "chat": 0.3}, seed=11)
    workloads = ("code", "chat", None, "unlisted")
    arrivals = [Arrival(i * 0.01, 100, max_tokens=50, ignore_eos=True, workload=workloads[i % 4]) for i in range(800)]
    records, _ = run([spec], arrivals)
    mean = {w: statistics.mean(r.alpha for r in records if r.workload == w) for w in workloads}
    assert mean["code"] == pytest.approx(0.85, abs=0.03)
    assert mean["chat"] == pytest.approx(0.3, abs=0.03)
    assert mean[None] == pytest.approx(0.6, abs=0.04) and mean["unlisted"] == pytest.approx(0.6, abs=0.04)
    with pytest.raises(ValueError):
        EngineConfig("spec", KIMI, workload_alpha={"code": 1.2})


def test_the_twin_flag_reads_a_workload_alpha_table():
    from sim.cli import build_parser, parse_workload_alpha

    assert parse_workload_alpha("code=0.8, chat=0.45") == {"code": 0.8, "chat": 0.45}
    assert parse_workload_alpha("") == {}
    for bad in ("code", "code=1.5", "=0.3", "code=x"):
        with pytest.raises(Exception, match="workload-alpha"):
            parse_workload_alpha(bad)
    args = build_parser().parse_args(["--mode", "spec", "--workload-alpha", "code=0.8"])
    assert args.workload_alpha == {"code": 0.8}


def test_the_49th_request_on_a_spec_server_waits():
    spec = engine("spec", KIMI)
    seen = []

    def router(arrival, fleet):
        seen.append((fleet[0].running, fleet[0].waiting))
        return 0

    arrivals = [Arrival(i * 0.001, 100, max_tokens=2000, ignore_eos=True) for i in range(49)]
    records, _ = run([spec], arrivals, router=router, until=1.0)
    assert spec.config.max_running_requests == 48
    assert spec.num_running == 48 and spec.num_waiting == 1
    assert records == []
    # Base mode has a larger default cap.
    assert engine("base", KIMI).config.max_running_requests > 48


def test_waiting_request_starts_when_a_slot_frees():
    spec = engine("spec", KIMI, max_running_requests=2)
    arrivals = [
        Arrival(0.0, 100, max_tokens=20, ignore_eos=True),
        Arrival(0.0, 100, max_tokens=200, ignore_eos=True),
        Arrival(0.0, 100, max_tokens=20, ignore_eos=True),
    ]
    records, _ = run([spec], arrivals)
    by_index = {r.index: r for r in records}
    # The third waits for the first to finish, then its prefill is the very next iteration.
    assert by_index[2].ttft > by_index[0].e2e
    assert by_index[2].first_token_time == pytest.approx(by_index[0].finish_time + KIMI.prefill_ms(100, True) / 1000)


def test_prefill_runs_before_decode_and_stalls_it():
    base = engine("base", KIMI)
    arrivals = [Arrival(0.0, 100, max_tokens=400, ignore_eos=True), Arrival(1.0, 20000, max_tokens=5, ignore_eos=True)]
    _, steps = run([base], arrivals)
    kinds = [s.kind for s in steps if 1.0 <= s.start]
    # 20,000 prompt tokens at 8,192 per iteration: three prefill iterations back to back.
    first = kinds.index("prefill")
    assert kinds[first : first + 3] == ["prefill"] * 3
    chunk_sizes = [s.tokens_per_seq for s in steps if s.kind == "prefill" and s.start >= 1.0]
    assert chunk_sizes == [8192, 8192, 20000 - 2 * 8192]


def test_finish_reasons_and_lengths():
    base = engine("base", KIMI, output_lengths=parse_output_lengths("fixed:30"))
    arrivals = [
        Arrival(0.0, 10),  # natural length 30, no cap: stop
        Arrival(0.0, 10, max_tokens=10),  # cap binds: length
        Arrival(0.0, 10, max_tokens=100, ignore_eos=True),  # runs to the cap
        Arrival(0.0, 10, max_tokens=100),  # natural 30 < 100: stop
    ]
    records = {r.index: r for r in run([base], arrivals)[0]}
    assert (records[0].finish_reason, records[0].output_tokens) == ("stop", 30)
    assert (records[1].finish_reason, records[1].output_tokens) == ("length", 10)
    assert (records[2].finish_reason, records[2].output_tokens) == ("length", 100)
    assert (records[3].finish_reason, records[3].output_tokens) == ("stop", 30)


def test_default_output_lengths_follow_the_azure_conversation_trace():
    base = engine("base", KIMI, seed=2)
    records, _ = run([base], [Arrival(i * 0.05, 50) for i in range(600)])
    mean = statistics.mean(r.output_tokens for r in records)
    assert mean == pytest.approx(211, rel=0.15)
    assert all(r.finish_reason == "stop" for r in records)


def test_alpha_change_at_a_given_time_drops_acceptance():
    spec = engine("spec", KIMI, mean_alpha=0.7, seed=4)
    arrivals = [Arrival(i * 0.05, 100, max_tokens=200, ignore_eos=True) for i in range(400)]
    records, _ = run([spec], arrivals, alpha_changes=[AlphaChange(time=10.0, engine=0, alpha=0.2)])
    before = [r.accept_length for r in records if r.finish_time < 10.0]
    after = [r.accept_length for r in records if r.arrival > 10.5]
    assert statistics.mean(before) == pytest.approx(tokens_per_verify_step(0.7, 3), rel=0.1)
    assert statistics.mean(after) == pytest.approx(tokens_per_verify_step(0.2, 3), rel=0.1)


def test_router_sees_every_engine_and_can_pick_by_name():
    fleet_seen = []

    def router(arrival, fleet):
        fleet_seen.append([(v.name, v.mode, v.max_running_requests, v.num_draft_tokens) for v in fleet])
        return "base" if arrival.prompt_tokens > 500 else "spec"

    records, _ = run(
        [engine("spec", KIMI), engine("base", KIMI)],
        [Arrival(0.0, 100, max_tokens=5), Arrival(0.0, 1000, max_tokens=5)],
        router=router,
    )
    assert fleet_seen[0] == [("spec", "spec", 48, 3), ("base", "base", 256, 0)]
    assert {r.index: r.engine_name for r in records} == {0: "spec", 1: "base"}


def test_same_seed_same_run():
    def once():
        spec = engine("spec", KIMI, seed=9)
        arrivals = [Arrival(i * 0.02, 100 + i) for i in range(100)]
        return [(r.index, r.finish_time, r.output_tokens) for r in run([spec], arrivals)[0]]

    assert once() == once()


@pytest.mark.parametrize("where", ["waiting", "prefill step", "chunked between steps", "decoding"])
def test_abort_frees_the_slot_wherever_the_request_is(where):
    spec = engine("spec", KIMI, max_running_requests=1)
    prompt = 20000 if where == "chunked between steps" else 100
    victim = spec.new_request(prompt, now=0.0, max_new_tokens=50, ignore_eos=True)
    spec.add(victim)
    other = spec.new_request(100, now=0.0, max_new_tokens=5, ignore_eos=True)
    step = spec.begin_step(0.0)
    if where == "waiting":
        spec.add(other)
        spec.add(spec.new_request(100, now=0.0, max_new_tokens=5, ignore_eos=True))
        victim, other = other, None  # the second request is queued behind the first
        spec.finish_step(step, step.duration_s)
        assert spec.num_waiting == 2
    elif where == "prefill step":
        assert spec.num_running == 1 and victim.rid in spec.in_prefill
    elif where == "chunked between steps":
        spec.finish_step(step, step.duration_s)
        assert spec.prefilling is victim and spec.num_running == 1
    else:
        spec.finish_step(step, step.duration_s)
        step = spec.begin_step(step.duration_s)
        assert step.kind == "decode"
    assert spec.abort(victim.rid, 0.1)
    assert victim.finish_reason == "abort" and spec.aborted_requests == 1
    assert not spec.abort(victim.rid, 0.1)  # once only
    if step is not None and where in ("prefill step", "decoding"):
        touched = spec.finish_step(step, 0.2)
        assert victim not in touched  # the step in flight discards its tokens
    assert victim.rid not in spec.running and victim.rid not in spec.waiting and spec.prefilling is not victim
    if where != "waiting":
        assert spec.num_running == 0
        spec.add(other)
        nxt = spec.begin_step(0.3)
        assert nxt.kind == "prefill" and nxt.requests == [other]  # the freed slot is taken at once


def test_gauges_refresh_on_sglang_cadence():
    spec = engine("spec", KIMI, seed=6)
    seen = []

    def observe(step):
        seen.append(
            (
                step.kind,
                spec.decode_iterations,
                spec.gauges["spec_accept_length"],
                spec.gauges["num_running_reqs"],
                spec.num_running,
                spec.load_snapshot["num_running_reqs"],
            )
        )

    arrivals = [Arrival(i * 0.2, 100, max_tokens=100, ignore_eos=True) for i in range(40)]
    simulate([spec], arrivals, to_first, on_step=observe)
    previous = 0.0
    for kind, iteration, accept, gauge_running, running, published in seen:
        if kind == "prefill":
            assert gauge_running == running == published  # every prefill batch reports at once
        if accept != previous:  # the accept-length gauge moves only every 40 decode iterations
            assert kind == "decode" and iteration % 40 == 0
            assert 1.0 <= accept <= 4.0
            previous = accept
        if kind == "decode" and iteration % 15 == 0:
            assert published == running  # /v1/loads republished every 15 decode iterations
    assert previous > 1.0
    assert spec.gauges["num_running_reqs"] == 0 and spec.gauges["gen_throughput"] == 0.0  # idle at the end
