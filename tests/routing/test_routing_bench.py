"""The virtual-clock evaluation harness stays runnable (the full run is `python -m bench.routing`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.routing import SETUPS, capacity_rps, lengths, poisson  # noqa: E402
from bench.routing_sim import Workload, run  # noqa: E402


def test_goodput_speculates_when_quiet_and_spills_over_when_busy():
    setup = SETUPS["h200-llama8b a=0.60"]
    sample = lengths()
    quiet = Workload(poisson(0.1 * capacity_rps(setup, sample), 120, sample, seed=1))
    busy = Workload(poisson(0.9 * capacity_rps(setup, sample), 300, sample, seed=2))
    on_quiet = {p: run(setup, quiet, p).summary() for p in ("goodput", "base")}
    assert on_quiet["goodput"]["spec_share"] > 0.9
    assert on_quiet["goodput"]["mean_e2e_s"] < on_quiet["base"]["mean_e2e_s"]
    on_busy = run(setup, busy, "goodput")
    assert 0.2 < on_busy.summary()["spec_share"] < 0.9  # both pools working
    reasons = {reason for _, _, reason, _ in on_busy.decisions}
    assert "spec-sooner" in reasons
    assert reasons & {"spec-full", "base-sooner", "slo-base"}  # spilled over to base on purpose


def _record(index, arrival, first, finish, tokens=11):
    from sim.virtual import RequestRecord

    return RequestRecord(
        index=index,
        engine=1,
        engine_name="base",
        arrival=arrival,
        first_token_time=first,
        finish_time=finish,
        prompt_tokens=100,
        output_tokens=tokens,
        finish_reason="stop",
        verify_ct=0,
        alpha=0.0,
        request_class="latency",
    )


def test_rates_are_scored_over_the_window_the_load_is_named_for():
    from bench.routing_sim import RunResult, Slo

    slo = Slo(ttft_s=1.0, tpot_s=0.5)
    # Sent at 0, 0 and 4 s (the last send), finished at 2, 4 and 20 s; all meet the SLO.
    records = [_record(0, 0.0, 0.5, 2.0), _record(1, 0.0, 0.5, 4.0), _record(2, 4.0, 4.5, 20.0, tokens=200)]
    closed = RunResult("p", records, [], [], slo, warmup_s=0.0, closed=True).summary()
    # A closed loop counts what finished while every client was busy (0-4 s), not the drain.
    assert closed["slo_goodput_rps"] == 2 / 4.0
    assert closed["throughput_tok_s"] == 22 / 4.0
    assert closed["slo_attainment"] == 1.0 and closed["mean_e2e_s"] == (2 + 4 + 16) / 3
    # Scored from 1 s (the warm-up): the window is 1-4 s, and a request sent during the warm-up
    # that finishes in it is part of the turnover, as its tokens are of the throughput.
    # The one finishing at 1 s sent the first scored request: it belongs to the warm-up.
    warm = [_record(0, 0.0, 0.5, 2.0), _record(1, 1.0, 1.5, 3.0), _record(2, 4.0, 4.5, 20.0, tokens=200)]
    warm.append(_record(3, 0.0, 0.5, 1.0))
    warmed = RunResult("p", warm, [], [], slo, warmup_s=1.0, closed=True).summary()
    assert warmed["requests"] == 2 and warmed["slo_goodput_rps"] == 2 / 3.0
    assert warmed["throughput_tok_s"] == 22 / 3.0
    # Open arrivals: every measured request that met the SLO counts against the arrival window
    # (the offered load is the same for every policy); throughput is all the work over the time
    # the fleet took to serve it.
    opened = RunResult("p", records, [], [], slo, warmup_s=0.0, closed=False).summary()
    assert opened["slo_goodput_rps"] == 3 / 4.0
    assert opened["throughput_tok_s"] == 222 / 20.0


def test_a_missed_target_is_printed_with_its_seed_spread():
    """A miss by noise shows as such: goodput against the oracle split, seed by seed."""
    from bench.routing import POLICIES, SPLITS, Job, analyse

    def summary(slo: float) -> dict[str, float]:
        return {"slo_goodput_rps": slo, "mean_e2e_s": 1.0, "p99_e2e_s": 2.0, "throughput_tok_s": 100.0}

    seeds = {"goodput": (9.9, 9.7, 10.0), "split-0.5": (10.0, 10.0, 10.0)}
    results = []
    for policy in POLICIES + SPLITS:
        per_seed = seeds.get(policy, (5.0, 5.0, 5.0))
        pooled = summary(sum(per_seed) / 3)
        results.append(
            {"job": Job("fleet", "poisson", 0.7, policy), "summary": pooled, "seeds": [summary(x) for x in per_seed]}
        )
    misses = analyse(results)["misses"]
    assert (
        "fleet poisson 0.7: SLO goodput 0.99x the oracle split (target >= 1.00x) (per seed: 0.99 / 0.97 / 1.00)"
        in misses
    )


def test_trace_and_drop_jobs_run_on_any_fleet_as_it_is():
    from bench.learning import FLEETS
    from bench.routing import DROP, trace_drop_jobs, workload_of

    fleet = "llama3b-a10 a=0.50"
    jobs = trace_drop_jobs([fleet], FLEETS)
    assert {(j.kind, j.trace) for j in jobs if j.kind == "trace"} == {("trace", "azure-conv"), ("trace", "azure-code")}
    drop = next(j for j in jobs if j.kind == "drop")
    setup, workload = workload_of(drop)
    # The fleet's own caps, SLO and profile, at the drop's starting alpha.
    assert setup.base_max_running == 64 and setup.slo == FLEETS[fleet].slo and setup.profile == FLEETS[fleet].profile
    assert setup.alpha == DROP[0] and workload.alpha_changes[0].alpha == DROP[1]
    # bench.routing's own setups are unchanged: looked up by name.
    assert trace_drop_jobs(["kimi-linear a=0.64"])[0].setup is None


def test_the_drops_told_policy_sees_the_served_state_but_for_alpha():
    # The acceptance drop scores routing against the same policy told the delivered alpha on the
    # same state. Told the very alpha it had, it must decide as served, request by request: a
    # told snapshot that lost the learned output length, or one replayed after the run on a cost
    # model that had learned on since, made it disagree for reasons that are not alpha.
    from bench.routing_sim import make_policy, with_alpha

    setup = SETUPS["h200-llama8b a=0.60"]
    sample = lengths()
    workload = Workload(poisson(0.5 * capacity_rps(setup, sample), 150, sample, seed=3))
    shadow = make_policy("goodput", setup.slo)
    seen: list = []

    def told(t, features, snapshot):
        seen.append(snapshot.output_samples)
        return shadow.decide(features, with_alpha(snapshot, snapshot.pools["spec"].alpha))

    result = run(setup, workload, "goodput", replay=told)
    assert len(result.replayed) == len(result.decisions) == 150
    assert max(seen) > 0  # the output length was learned during the run
    reasons = {d.reason for d in result.replayed}
    assert reasons & {"spec-sooner", "base-sooner"}  # decided by predicted costs, not by a rule alone
    assert [d.pool for d in result.replayed] == [pool for _, pool, _, _ in result.decisions]
    assert [d.reason for d in result.replayed] == [reason for _, _, reason, _ in result.decisions]
