"""Profiles: the measured table is reproduced where measured, the presets match their formulas."""

import csv
import json
from importlib import resources

import pytest

from fleet.profile import builtin_names, load_profile, tokens_per_verify_step


def measured_rows():
    with (resources.files("fleet") / "profiles" / "h200-llama8b-step-ms.csv").open() as f:
        lines = [line for line in f if not line.startswith("#")]
    return list(csv.DictReader(lines))


def test_builtin_profiles_are_listed():
    assert {"h200-llama8b", "kimi-linear", "kimi-moe"} <= set(builtin_names())


def test_table_profile_reproduces_every_measured_point():
    profile = load_profile("h200-llama8b")
    rows = measured_rows()
    assert len(rows) > 100
    for row in rows:
        b, t, length, ms = int(row["B"]), int(row["T"]), int(row["L"]), float(row["ms"])
        got = profile.target_ms(b, t, length) if row["kind"] == "target" else profile.draft_ms(b, length)
        assert got == pytest.approx(ms, rel=1e-9), row


def test_table_profile_interpolates_between_and_extrapolates_beyond():
    profile = load_profile("h200-llama8b")
    # Between B=64 (7.5865) and B=128 (10.0258) at T=1, L=1024: linear in B.
    assert profile.target_ms(96, 1, 1024) == pytest.approx((7.5865 + 10.0258) / 2, rel=1e-6)
    # Past B=256 the step keeps growing linearly (compute-bound), never flattens.
    assert profile.target_ms(320, 1, 1024) > profile.target_ms(256, 1, 1024) > profile.target_ms(192, 1, 1024)
    # The L=4096 rows stop at B=128: extrapolated along B, still above L=1024 at the same B.
    assert profile.target_ms(256, 4, 4096) > profile.target_ms(256, 4, 1024)
    # Longer context costs more; context between the rows is interpolated.
    mid = profile.target_ms(32, 1, 2560)
    assert profile.target_ms(32, 1, 1024) < mid < profile.target_ms(32, 1, 4096)


def test_spec_step_is_k_drafts_plus_one_verify():
    profile = load_profile("h200-llama8b")
    assert profile.spec_step_ms(16, 3, 1024) == pytest.approx(3 * 0.2473 + 6.3226, rel=1e-9)


def test_kimi_presets_follow_their_formulas():
    linear = load_profile("kimi-linear")
    moe = load_profile("kimi-moe")
    assert linear.base_step_ms(1, 1000) == pytest.approx(15.42 + 0.30)
    assert linear.spec_step_ms(8, 3, 1000) == pytest.approx(3 * 1.0 + 15.42 + 0.30 * 8 * 4)
    u = lambda n: 1 - (1 - 8 / 384) ** n  # noqa: E731
    assert moe.base_step_ms(1, 1000) == pytest.approx(14.94 + 35 * u(1) + 0.05)
    assert moe.spec_step_ms(32, 3, 1000) == pytest.approx(3.0 + 14.94 + 35 * u(128) + 0.05 * 128)
    # The seed deployment: about 63.6 tok/s single stream and about 2,370 tok/s at 128 on SGLang base.
    assert 1000 / linear.base_step_ms(1, 1000) == pytest.approx(63.6, rel=0.01)
    assert 128 * 1000 / moe.base_step_ms(128, 1000) == pytest.approx(2370, rel=0.02)
    assert linear.prefill_ms(1000) == pytest.approx(15.42 + 0.05 * 1000)


def test_user_profile_from_a_file(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(
        json.dumps(
            {
                "name": "mine",
                "step": {"kind": "affine", "fixed_ms": 10, "per_token_ms": 1},
                "draft_step_ms": 0.5,
                "prefill": {"fixed_ms": 1, "per_token_ms": 0.1},
            }
        )
    )
    profile = load_profile(str(path))
    assert profile.spec_step_ms(2, 3, 100) == pytest.approx(3 * 0.5 + 10 + 8)
    with pytest.raises(ValueError, match="unknown profile"):
        load_profile("no-such-profile")
    with pytest.raises(ValueError, match="profile file 'missing.json' not found"):
        load_profile("missing.json")


def test_tau_formula():
    assert tokens_per_verify_step(0.0, 3) == 1.0
    assert tokens_per_verify_step(0.6, 3) == pytest.approx(2.176)


def test_engine_overheads_add_to_each_step_and_seed_the_cost_model_alike():
    from fleet.costmodel import StepCostModel, seed_from_profile
    from sim.engine import Engine, EngineConfig

    gpu, sglang = load_profile("h200-llama8b"), load_profile("h200-llama8b-sglang")
    for batch in (1, 16, 48, 200):
        assert sglang.spec_step_ms(batch, 3, 1024) == pytest.approx(
            gpu.spec_step_ms(batch, 3, 1024) + 0.48 + 0.025 * batch
        )
        assert sglang.base_step_ms(batch, 1024) == gpu.base_step_ms(batch, 1024)  # the overlap scheduler hides its own
    # The router's cost model, seeded with the profile, predicts the same steps.
    seeded = StepCostModel(seed_from_profile("h200-llama8b-sglang"), num_draft_tokens=3)
    assert seeded.decode_step_ms("spec", 16, 4) == pytest.approx(sglang.spec_step_ms(16, 3, 1024))
    # And the twin's engine runs them: a spec decode step of one request lasts the profile's step.
    engine = Engine(EngineConfig(mode="spec", profile=sglang, num_steps=3, mean_alpha=0.6), "spec")
    engine.add(engine.new_request(10, now=0.0, max_new_tokens=50, output_len=50, rid="r"))
    prefill = engine.begin_step(0.0)
    engine.finish_step(prefill, prefill.duration_s)
    decode = engine.begin_step(prefill.duration_s)
    assert decode.kind == "decode"
    context = decode.duration_s * 1000
    assert sglang.spec_step_ms(1, 3, 11) <= context <= sglang.spec_step_ms(1, 3, 12)


def test_a_profile_without_overheads_is_unchanged_and_bad_overheads_are_refused(tmp_path):
    from fleet.profile import NO_OVERHEADS, parse_profile

    assert load_profile("h200-llama8b").spec_overheads == NO_OVERHEADS
    doc = {
        "name": "x",
        "step": {"kind": "affine", "fixed_ms": 5, "per_token_ms": 0.1},
        "prefill": {"fixed_ms": 1, "per_token_ms": 0.01},
    }
    plain = parse_profile(doc, tmp_path)
    assert plain.spec_step_ms(8, 3, 100) == 3 * 1.0 + 5 + 0.1 * 8 * 4  # k drafts (1.0 ms default) + verify
    with_overheads = parse_profile(
        {
            **doc,
            "overheads": {"spec": {"per_draft_step_ms": 0.5, "per_step_ms": 1.0}, "base": {"per_request_ms": 0.01}},
        },
        tmp_path,
    )
    assert with_overheads.spec_step_ms(8, 3, 100) == pytest.approx(plain.spec_step_ms(8, 3, 100) + 3 * 0.5 + 1.0)
    assert with_overheads.base_step_ms(8, 100) == pytest.approx(plain.base_step_ms(8, 100) + 0.08)
    for bad in ({"spec": {"per_token_ms": 1}}, {"spec": {"per_step_ms": -1}}):
        with pytest.raises(ValueError):
            parse_profile({**doc, "overheads": bad}, tmp_path)


GOOD = {
    "name": "x",
    "step": {"kind": "affine", "fixed_ms": 5, "per_token_ms": 0.1},
    "prefill": {"fixed_ms": 1, "per_token_ms": 0.01},
}
MOE = {"kind": "moe", "fixed_ms": 1, "expert_ms": 3, "experts": 8, "active_experts": 2, "per_token_ms": 0.1}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        # From an operator's probe: started cleanly, every prediction negative.
        (
            {"step": {"kind": "affine", "fixed_ms": -5, "per_token_ms": -1}, "prefill": {"kind": "step"}},
            "step.fixed_ms",
        ),
        ({"step": {"kind": "affine", "fixed_ms": 5, "per_token_ms": float("nan")}}, "step.per_token_ms"),
        ({"step": {"kind": "affine", "fixed_ms": 0, "per_token_ms": 0}}, "one token costs 0 ms"),
        ({"step": {**MOE, "expert_ms": float("inf")}}, "step.expert_ms"),
        ({"step": {**MOE, "experts": 0}}, "step.experts"),
        ({"step": {**MOE, "active_experts": 9}}, "step.active_experts"),
        ({"prefill": {"fixed_ms": -1, "per_token_ms": 0.01}}, "prefill.fixed_ms"),
        ({"prefill": {"fixed_ms": 1, "per_token_ms": float("inf")}}, "prefill.per_token_ms"),
        ({"draft_step_ms": -0.5}, "draft_step_ms"),
        ({"spec_prefill_factor": 0}, "spec_prefill_factor"),
        ({"spec_prefill_factor": float("nan")}, "spec_prefill_factor"),
        ({"overheads": {"base": {"per_request_ms": float("nan")}}}, "overheads.base.per_request_ms"),
        # From a review: refused with Python's words and no field, or taken silently.
        ({"defaults": "abc"}, "defaults is str"),
        ({"overheads": [1]}, "overheads is list"),
        ({"overheads": {"spec": [1]}}, "overheads.spec is list"),
        ({"prefill": [1, 2]}, "prefill is list"),
        ({"prefill": {"per_token_ms": 0.01}}, "prefill.fixed_ms is missing"),
        ({"step": {"kind": "affine", "fixed_ms": 5}}, "step.per_token_ms is missing"),
        ({"step": {"fixed_ms": 5}}, "step.kind is missing"),
        ({"step": {"kind": "linear"}}, "unknown step.kind 'linear'"),
        ({"measured": {"alpha": "abc"}}, "measured.alpha"),
        ({"measured": {"alpha": 1.5}}, "measured.alpha"),
        ({"measured": [1, 2]}, "measured is list"),
        ({"defaults": {"num_steps": -3}}, "defaults.num_steps"),
        ({"defaults": {"num_steps": 1.5}}, "defaults.num_steps"),
        ({"defaults": {"mean_alpha": -0.5}}, "defaults.mean_alpha"),
        ({"defaults": {"mean_alpha": 2}}, "defaults.mean_alpha"),
    ],
)
def test_a_profile_with_nonsense_numbers_is_refused_naming_the_field(tmp_path, change, named):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**GOOD, **change}))  # json writes NaN and Infinity, as Python reads them
    with pytest.raises(ValueError, match="bad profile file") as refused:
        load_profile(str(path))
    assert named in str(refused.value)


@pytest.mark.parametrize("ms", ["-1.0", "nan", "0"])
def test_a_step_table_with_nonsense_times_is_refused_naming_the_row(tmp_path, ms):
    (tmp_path / "t.csv").write_text(f"kind,B,T,L,ms\ntarget,1,1,1024,5.0\ntarget,8,1,1024,{ms}\ndraft,1,1,1024,0.0\n")
    (tmp_path / "t.json").write_text(json.dumps({**GOOD, "step": {"kind": "table", "file": "t.csv"}}))
    with pytest.raises(ValueError, match=f"row target,8,1,1024,{ms}"):
        load_profile(str(tmp_path / "t.json"))


def test_every_shipped_profile_still_loads_and_the_twin_takes_it(tmp_path):
    from pathlib import Path

    from sim.cli import build_parser, engine_config

    # What specroute profile writes for a table: draft rows of 0 ms (the spec step measured
    # whole), no draft time, a zero prefill when none was measured.
    (tmp_path / "m-step-ms.csv").write_text(
        "kind,B,T,L,ms\ntarget,1,1,1024,6.0\ntarget,8,4,1024,9.0\ndraft,1,1,1024,0.0\n"
    )
    measured = {
        "name": "m",
        "step": {"kind": "table", "file": "m-step-ms.csv"},
        "draft_step_ms": 0.0,
        "prefill": {"fixed_ms": 0.0, "per_token_ms": 0.0},
        "spec_prefill_factor": 1.0,
        "overheads": {"spec": {"per_verify_step_ms": 0.0, "per_request_ms": 0.0}, "base": {}},
    }
    (tmp_path / "m.json").write_text(json.dumps(measured))
    fleets = sorted(str(p) for p in (Path(__file__).parents[2] / "bench" / "fleets").glob("*.json"))
    assert len(fleets) >= 2
    for profile in [*builtin_names(), *fleets, str(tmp_path / "m.json")]:
        loaded = load_profile(profile)
        assert loaded.base_step_ms(1, 1024) > 0
        for mode in ("spec", "base"):
            config = engine_config(build_parser().parse_args(["--mode", mode, "--profile", profile]))
            assert config.profile.name == loaded.name
