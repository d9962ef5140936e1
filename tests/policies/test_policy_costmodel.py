import pytest

from policies.costmodel import AffineSeed, StepCostModel, seed_from_profile


def test_seed_is_the_twin_profile():
    model = StepCostModel(seed_from_profile("h200-llama8b"), num_draft_tokens=3)
    # base = target(B, 1); spec = 3 * draft(B) + target(B, 4), both at L = 1024 (calibration CSV)
    assert model.decode_step_ms("base", 64, 1) == pytest.approx(7.5865, rel=1e-3)
    assert model.decode_step_ms("spec", 64, 4) == pytest.approx(3 * 0.3112 + 10.6011, rel=1e-3)
    assert model.prefill_ms("spec", 1000) > model.prefill_ms("base", 1000)  # draft extend


def test_learning_corrects_the_seed_where_observed():
    model = StepCostModel(AffineSeed(), num_draft_tokens=3)
    seed_spec_32 = model.decode_step_ms("spec", 32, 4)
    for _ in range(100):
        model.observe("spec", 32, 2.0 * seed_spec_32)
    assert model.decode_step_ms("spec", 32, 4) == pytest.approx(2 * seed_spec_32, rel=0.03)
    # the nearest learned bucket carries the correction outward; the other pool is untouched
    assert model.correction("spec", 256) == pytest.approx(model.correction("spec", 32))
    assert model.correction("base", 32) == 1.0


def test_correction_interpolates_between_buckets_and_forgets():
    model = StepCostModel(AffineSeed(), num_draft_tokens=3, memory=20)
    for _ in range(50):
        model.observe("base", 8, model.seed_step_ms(8, 1) * 1.0)
        model.observe("base", 128, model.seed_step_ms(128, 1) * 2.0)
    middle = model.correction("base", 32)
    assert 1.2 < middle < 1.8
    for _ in range(60):  # the server got faster: a capped memory follows it
        model.observe("base", 128, model.seed_step_ms(128, 1) * 1.0)
    assert model.correction("base", 128) == pytest.approx(1.0, abs=0.05)


def test_bad_observations_are_ignored():
    model = StepCostModel()
    model.observe("base", 0, 5.0)
    model.observe("base", 4, float("nan"))
    model.observe("base", 4, -1.0)
    assert model.correction("base", 4) == 1.0


def test_unknown_profile_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown profile"):
        seed_from_profile("no-such-profile")
