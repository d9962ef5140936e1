import pytest

from fleet.acceptance import (
    AcceptanceEstimator,
    CounterDelta,
    RequestSpread,
    SmoothedMean,
    accept_length,
    alpha_from_accept_length,
)


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.45, 0.6, 0.75, 0.95])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_alpha_inverts_accept_length(alpha, k):
    assert alpha_from_accept_length(accept_length(alpha, k), k) == pytest.approx(alpha, abs=1e-6)


def test_accept_length_matches_the_table():
    # speculation-facts 2.1: alpha 0.6 -> 2.18 at k=3, alpha 0.8 -> 3.36 at k=4
    assert accept_length(0.6, 3) == pytest.approx(2.176, abs=1e-3)
    assert accept_length(0.8, 4) == pytest.approx(3.3616, abs=1e-3)
    assert alpha_from_accept_length(0.5, 3) == 0.0
    assert alpha_from_accept_length(9.0, 3) == 1.0


def test_smoothing_forgets_at_the_half_life():
    mean = SmoothedMean(half_life_s=2.0)
    mean.observe(0.0, 3.0, weight=100)
    mean.observe(2.0, 1.0, weight=100)  # old evidence now weighs 50: mean = (3*50 + 1*100) / 150
    assert mean.value() == pytest.approx(250 / 150)
    assert mean.weight(4.0) == pytest.approx(75)


def test_estimator_follows_a_drop_within_a_few_half_lives():
    est = AcceptanceEstimator(num_draft_tokens=3, half_life_s=1.0)
    tau_hi, tau_lo = accept_length(0.7, 3), accept_length(0.3, 3)
    t = 0.0
    for _ in range(100):  # 10 s at 0.7, 100 ms polls of 50 verify steps each
        t += 0.1
        est.observe_counters(t, 50 * tau_hi, 50)
    assert est.alpha() == pytest.approx(0.7, abs=1e-3)
    for _ in range(50):  # 5 s (5 half-lives) at 0.3: 1/32 of the old evidence is left
        t += 0.1
        est.observe_counters(t, 50 * tau_lo, 50)
    assert est.alpha() == pytest.approx(0.3, abs=0.03)


def test_request_evidence_drops_the_prefill_token():
    est = AcceptanceEstimator(num_draft_tokens=3)
    est.observe_request(1.0, completion_tokens=101, verify_steps=50)
    assert est.accept_length() == pytest.approx(2.0)
    est2 = AcceptanceEstimator(num_draft_tokens=3)
    est2.observe_request(1.0, completion_tokens=0, verify_steps=0)
    assert est2.accept_length() is None and est2.alpha() is None


def test_counter_delta_survives_a_reset():
    counters = CounterDelta()
    assert counters.add(100, 50) is None
    assert counters.add(300, 130) == (200, 80)
    assert counters.add(10, 5) is None  # server restarted
    assert counters.add(40, 15) == (30, 10)


def test_alpha_is_the_bisection_on_accept_length_bit_for_bit():
    # The inversion writes accept_length out inline for speed: it must give the very floats of
    # the bisection that calls it (routing decisions depend on them).
    def reference(tau, k):
        lo, hi = 0.0, 1.0
        for _ in range(50):
            mid = (lo + hi) / 2
            if accept_length(mid, k) < tau:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    for k in (1, 3, 5):
        for i in range(1, 2000):
            tau = 1.0 + k * i / 2000
            assert alpha_from_accept_length(tau, k) == reference(tau, k)
        assert alpha_from_accept_length(k + 1 - 1e-15, k) == reference(k + 1 - 1e-15, k)


def test_request_spread_is_the_cv_of_the_requests_time_per_token():
    spread = RequestSpread()
    for _ in range(9):
        spread.observe(completion_tokens=41, verify_steps=20)  # 2 tokens per step, first dropped
    assert spread.cv() == 0.0  # too few responses to say
    spread.observe(completion_tokens=1, verify_steps=1)  # a single token says nothing of the step
    assert spread.samples == 9
    for _ in range(5):
        spread.observe(completion_tokens=41, verify_steps=40)  # 1 token per step
    # Nine at 1/2 step per token and five at 1 (a plain mean below SPREAD_MEMORY responses).
    mean, square = (9 * 0.5 + 5) / 14, (9 * 0.25 + 5) / 14
    assert spread.cv() == pytest.approx((square - mean * mean) ** 0.5 / mean, rel=1e-9)
    same = RequestSpread()
    for _ in range(20):
        same.observe(completion_tokens=31, verify_steps=10)
    assert same.cv() == pytest.approx(0.0, abs=1e-6)
