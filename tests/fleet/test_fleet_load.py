import math

import pytest

from fleet.acceptance import accept_length
from fleet.model import FleetModel
from fleet.readings import Reading, ResponseEvidence


def fleet(stale_after_s=0.5):
    state = FleetModel({"spec": 3, "base": 0}, stale_after_s=stale_after_s, half_life_s=1.0)
    state.add_instance("http://spec", "spec", 48)
    state.add_instance("http://base", "base", 256)
    return state


def spec_load(state, now):
    return state.snapshot(now).pool("spec").instances[0]


def test_dispatches_since_the_poll_are_seen_at_once():
    state = fleet()
    state.on_reading("http://spec", Reading(at=1.0, running=10, waiting=0))
    for i in range(5):
        state.on_dispatch("http://spec", 1.01 + i * 0.001)
    state.on_complete("http://spec", 1.02)
    assert spec_load(state, 1.05).load == 14
    # The next poll (sent at 1.1) already counts them: earlier events are dropped, later ones kept.
    state.on_dispatch("http://spec", 1.15)
    state.on_reading("http://spec", Reading(at=1.1, running=16, waiting=0))  # another replica added 2
    assert spec_load(state, 1.2).load == 17


def test_load_past_the_cap_is_waiting_and_never_negative():
    state = fleet()
    state.on_reading("http://spec", Reading(at=0.0, running=47, waiting=0))
    for _ in range(3):
        state.on_dispatch("http://spec", 0.01)
    inst = spec_load(state, 0.02)
    assert (inst.running, inst.waiting) == (47, 3)  # sent since the poll: queued for prefill
    state.on_reading("http://spec", Reading(at=1.0, running=1, waiting=0))
    for _ in range(4):
        state.on_complete("http://spec", 1.01)
    assert spec_load(state, 1.02).load == 0


def test_a_completion_the_reading_already_missed_does_not_hide_a_dispatch():
    # The server freed the slot and answered a poll before our stream saw its last chunk:
    # the reading says 0 and the completion that follows must not cancel a new dispatch.
    state = fleet()
    state.on_dispatch("http://spec", 0.5)
    state.on_reading("http://spec", Reading(at=1.0, running=0, waiting=0))
    state.on_complete("http://spec", 1.01)
    for i in range(9):
        state.on_dispatch("http://spec", 1.02 + i * 0.001)
    assert spec_load(state, 1.05).load == 9  # not 8: all nine of ours are open


def test_a_reading_overtaken_by_a_newer_one_is_ignored():
    state = fleet()
    state.on_reading("http://spec", Reading(at=2.0, running=5, waiting=0))
    state.on_reading("http://spec", Reading(at=1.0, running=30, waiting=0))
    assert spec_load(state, 2.1).load == 5


def test_staleness():
    state = fleet(stale_after_s=0.5)
    assert state.snapshot(0.0).pool("spec").stale  # never polled
    state.on_reading("http://spec", Reading(at=1.0, running=0, waiting=0))
    assert not state.snapshot(1.4).pool("spec").stale
    snap = state.snapshot(1.6)
    assert snap.pool("spec").stale and snap.pool("spec").age_s == pytest.approx(0.6)
    state.on_unpolled("http://base")  # no load endpoint: our own count, never stale
    state.on_dispatch("http://base", 2.0)
    base = state.snapshot(9.0).pool("base")
    assert not base.stale and base.instances[0].load == 1


def test_counters_feed_alpha():
    state = fleet()
    assert state.snapshot(0).pool("spec").alpha is None
    tau = accept_length(0.65, 3)
    for i in range(20):
        state.on_reading(
            "http://spec", Reading(at=i * 0.1, running=8, waiting=0, tokens_total=i * 100 * tau, verify_total=i * 100)
        )
    assert state.snapshot(2.0).pool("spec").alpha == pytest.approx(0.65, abs=1e-3)
    assert state.snapshot(2.0).pool("base").alpha is None


def test_responses_do_not_count_twice_what_the_servers_counters_already_report():
    """A spec server's token/verify counters count every request it finishes, ours too: while
    they are read, our own responses (as old as the counters' evidence) must not be taken a
    second time by the pool's estimate, which would weigh them twice against the fresh gauge and
    depend on how many requests we send there. After a drop to alpha 0.3, the gauge and the
    counters say 0.3 while our finished requests, which ran mostly before it, still say 0.7: the
    estimate is the counters' and the gauge's. Our responses still teach their workload, and a
    server whose counters are not read (or fell silent) is learned from our responses."""
    tau_old, tau_new = accept_length(0.7, 3), accept_length(0.3, 3)
    state = fleet()
    for i in range(40):
        now = 0.5 * i
        state.on_reading(
            "http://spec",
            Reading(
                at=now,
                running=8,
                waiting=0,
                accept_length=tau_new + 1e-6 * i,  # a fresh gauge value each time
                accept_steps=320,
                tokens_total=i * 200 * tau_new,
                verify_total=i * 200,
            ),
        )
        evidence = ResponseEvidence(tokens=round(300 * tau_old) + 1, verify_steps=300, decode_s=0.2, workload="chat")
        state.on_response("http://spec", now + 0.1, evidence)
    assert state.snapshot(20.0).pool("spec").alpha == pytest.approx(0.3, abs=0.005)
    chat = state.snapshot(20.0, "chat").pool("spec").alpha
    assert chat is not None and chat > 0.5  # the workload's own evidence is ours alone

    silent = fleet()
    silent.on_reading("http://spec", Reading(at=0.0, running=8, waiting=0, tokens_total=0.0, verify_total=0.0))
    for i in range(20):
        evidence = ResponseEvidence(tokens=round(300 * tau_old) + 1, verify_steps=300, decode_s=0.2)
        silent.on_response("http://spec", 10.0 + 0.5 * i, evidence)  # counters silent for 10 s and more
    assert silent.snapshot(20.0).pool("spec").alpha == pytest.approx(0.7, abs=0.005)


def test_queued_prompt_tokens_and_learned_output_length():
    state = fleet()
    state.on_reading("http://base", Reading(at=1.0, running=4, waiting=2, waiting_tokens=3000))
    state.on_dispatch("http://base", 1.05, prompt_tokens=500)
    base = state.snapshot(1.1).pool("base").instances[0]
    assert (base.waiting, base.waiting_tokens) == (3, 3500)
    assert state.snapshot(1.1).mean_output_tokens is None
    for tokens in (100, 300):
        state.on_response("http://base", 1.1, ResponseEvidence(tokens=tokens))
    snap = state.snapshot(1.1)
    assert (snap.mean_output_tokens, snap.output_samples) == (200, 2)  # a plain mean at first
    for _ in range(500):
        state.on_response("http://base", 1.1, ResponseEvidence(tokens=1000))
    snap = state.snapshot(1.1)
    assert snap.output_samples == 50 and snap.mean_output_tokens == pytest.approx(1000, abs=1)  # then it moves


def test_an_idle_servers_gauge_is_not_evidence():
    state = fleet()
    state.on_reading("http://spec", Reading(at=1.0, running=0, waiting=0, accept_length=1.2, accept_steps=0))
    assert state.snapshot(1.0).pool("spec").alpha is None  # an old interval's value, kept while idle
    state.on_reading("http://spec", Reading(at=1.1, running=8, waiting=0, accept_length=1.2, accept_steps=320))
    assert state.snapshot(1.1).pool("spec").alpha is None  # the same value again adds nothing
    state.on_reading("http://spec", Reading(at=1.2, running=8, waiting=0, accept_length=2.5, accept_steps=320))
    assert state.snapshot(1.2).pool("spec").alpha == pytest.approx(0.70, abs=0.02)


def test_dispatch_rates_follow_what_was_sent_and_fade():
    from fleet.instance import RATE_WINDOW_S

    state = fleet()
    for i in range(40):  # 20 requests/s of 1,000 prompt tokens for 2 s
        state.on_dispatch("http://base", i * 0.05, prompt_tokens=1000)
    base = state.snapshot(2.0).pool("base").instances[0]
    spec = state.snapshot(2.0).pool("spec").instances[0]
    assert base.prompt_tokens_per_s / base.dispatches_per_s == pytest.approx(1000)
    # An exponentially weighted rate over a 2 s window, after 2 s of a steady 20/s: 1 - 1/e of it.
    assert base.dispatches_per_s == pytest.approx(20 * (1 - math.exp(-2.0 / RATE_WINDOW_S)), rel=0.05)
    assert (spec.dispatches_per_s, spec.prompt_tokens_per_s) == (0.0, 0.0)
    later = state.snapshot(2.0 + 3 * RATE_WINDOW_S).pool("base").instances[0]
    assert later.dispatches_per_s < 0.06 * base.dispatches_per_s  # nothing sent since: it fades
