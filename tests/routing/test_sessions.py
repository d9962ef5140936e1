"""Session workloads (bench/sessions.py), several servers per pool on the virtual clock
(bench/routing_sim.py) and the session evaluation's runner (bench/prefix_eval.py)."""

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import prefix_eval  # noqa: E402
from bench.routing import H200_SLO, SETUPS  # noqa: E402
from bench.routing_sim import Setup, VirtualRouter, Workload, make_policy, run  # noqa: E402
from bench.sessions import Mix, generate  # noqa: E402
from sim.mooncake import reuse  # noqa: E402
from sim.virtual import Arrival  # noqa: E402


def test_the_generator_is_deterministic_and_its_turns_extend_the_previous_prompt():
    script = generate(300, seed=3)
    assert script == generate(300, seed=3)
    assert script != generate(300, seed=4)
    assert script.requests >= 300
    b = script.block_tokens
    for session in script.sessions:
        for before, after in zip(session.turns, session.turns[1:]):
            # The next prompt holds the previous prompt, its answer and a new message...
            assert after.prompt_tokens > before.prompt_tokens + before.output_tokens
            # ...so its full blocks extend the previous prompt's full blocks.
            full = before.prompt_tokens // b
            assert after.prefix[:full] == before.prefix[:full]
            assert before.think_s > 0
        assert session.turns[-1].think_s == 0
        assert all(len(t.prefix) == -(-t.prompt_tokens // b) for t in session.turns)


def test_sessions_of_an_app_share_its_system_prompt_and_no_more():
    script = generate(400, seed=1, mix=Mix(agent_share=1.0, agent_apps=1, agent_system=(4096, 4096)))
    firsts = [s.turns[0].prefix for s in script.sessions]
    shared = 4096 // script.block_tokens
    assert len({p[:shared] for p in firsts}) == 1
    assert len({p[shared] for p in firsts}) == len(firsts)  # the tails are each session's own
    assert reuse(script.natural_arrivals()).token_share > 0.5


def test_a_session_turn_is_sent_after_its_predecessor_finished():
    script = generate(120, seed=2)
    setup = Setup("h200-llama8b", 0.6, H200_SLO, page_size=script.block_tokens)
    result = run(setup, script.workload(scale=0.5), "goodput")
    assert len(result.records) == script.requests
    assert sum(r.cached_tokens for r in result.records) > 0  # later turns hit their prefix
    # A turn's prompt length names it (unique here); each next turn arrives exactly its think
    # time after the previous turn's answer finished.
    by_prompt = {r.prompt_tokens: r for r in result.records}
    checked = 0
    for session in script.sessions:
        for before, after in zip(session.turns, session.turns[1:]):
            if before.prompt_tokens in by_prompt and after.prompt_tokens in by_prompt:
                done = by_prompt[before.prompt_tokens].finish_time
                assert by_prompt[after.prompt_tokens].arrival == done + before.think_s
                checked += 1
    assert checked > 50


def test_one_server_per_pool_is_the_old_fleet():
    setup = SETUPS["h200-llama8b a=0.60"]
    assert [e.name for e in setup.engines()] == ["spec", "base"]
    router = VirtualRouter(make_policy("goodput", setup.slo), setup)
    assert router.urls == ("virtual://spec", "virtual://base")


def test_two_servers_per_pool_share_the_load_and_rotate_on_ties():
    setup = replace(SETUPS["h200-llama8b a=0.60"], spec_instances=2, base_instances=2)
    engines = setup.engines()
    assert [e.name for e in engines] == ["spec-0", "spec-1", "base-0", "base-1"]
    assert [e.config.mode for e in engines] == ["spec", "spec", "base", "base"]
    assert engines[0].config.seed != engines[1].config.seed
    router = VirtualRouter(make_policy("round-robin"), setup)
    router.attach(engines)
    # Nothing polled yet: every instance ties at zero load, so each pick rotates.
    picks = [router.route(Arrival(0.0, 100), router._views) for _ in range(8)]
    assert sorted(picks) == [0, 0, 1, 1, 2, 2, 3, 3]
    arrivals = [Arrival(0.05 * i, 800, output_tokens=64) for i in range(200)]
    result = run(setup, Workload(arrivals, warmup_s=1.0), "round-robin", track_running=True)
    assert {r.engine_name for r in result.records} == {"spec-0", "spec-1", "base-0", "base-1"}
    assert len(result.running_mean) == 4 and all(m > 0 for m in result.running_mean)
    assert result.summary()["spec_share"] == 0.5


def test_the_quick_evaluation_runs_and_reports_every_metric():
    job = prefix_eval.Job("h200-llama8b a=0.60", "mooncake", 0.7, "goodput", quick=True)
    out = prefix_eval.execute(job)["summary"]
    assert 0 < out["hit_rate"] < 1
    assert out["imbalance_spec"] >= 1 and out["imbalance_base"] >= 1
    assert out["mean_ttft_s"] > 0 and out["slo_goodput_rps"] > 0
    table = prefix_eval.report([{"job": job, "summary": out}], 1.0, quick=True)
    assert "| h200-llama8b a=0.60 | mooncake | 70% | goodput |" in table


def test_the_cache_credit_keeps_sessions_on_their_instances_without_piling_them_up():
    """On the sessions workload (2 spec + 2 base twins with prefix caches), goodput with the
    cache credit hits the caches more and gets first tokens sooner than without it, and a loaded
    pool's servers stay within 1.5x of each other's load (the peers' failure is every session on
    one)."""
    results = {}
    for policy in ("goodput", "goodput-nocache"):
        job = prefix_eval.Job("h200-llama8b a=0.60", "sessions", 0.7, policy, quick=True)
        results[policy] = prefix_eval.execute(job)["summary"]
    credit, plain = results["goodput"], results["goodput-nocache"]
    assert credit["hit_rate"] > plain["hit_rate"] + 0.03
    assert credit["mean_ttft_s"] < plain["mean_ttft_s"]
    assert credit["running_spec"] >= prefix_eval.LOADED_RUNNING  # the pool the sessions load is judged
    assert prefix_eval.imbalanced(credit) == [], credit
