"""A policy's declared parameters (policies/base.py PolicyParams) are what the settings, the
registry and the evaluation take: one declaration, no copies."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench.routing_sim import Slo, make_policy
from policies import registry
from policies.goodput import Goodput, GoodputParams
from policies.threshold import Threshold, ThresholdParams
from proxy.settings import Settings, SettingsError, load_settings, policy_setting, variable_name

REPO = Path(__file__).parents[2]


def test_every_declared_parameter_is_a_setting_with_its_type_default_bounds_and_help() -> None:
    declared = registry.declared_params()
    assert set(declared) == {"goodput", "threshold"}
    for policy, params in declared.items():
        for param, info in params.model_fields.items():
            field = Settings.model_fields[policy_setting(policy, param)]
            assert (field.annotation, field.default, field.metadata) == (info.annotation, info.default, info.metadata)
            assert field.description == f"{policy} policy: {info.description}"


def test_the_environment_names_are_those_of_before() -> None:
    names = {
        variable_name(policy_setting(p, f)) for p, ps in registry.declared_params().items() for f in ps.model_fields
    }
    assert names == {
        "SPECROUTE_THRESHOLD_ENTER",
        "SPECROUTE_THRESHOLD_EXIT",
        "SPECROUTE_GOODPUT_OUTPUT_TOKENS",
        "SPECROUTE_GOODPUT_CACHE_CREDIT",
        "SPECROUTE_GOODPUT_DEFAULT_ALPHA",
        "SPECROUTE_GOODPUT_EXTERNALITY",
        "SPECROUTE_GOODPUT_SLO_TTFT_S",
        "SPECROUTE_GOODPUT_SLO_TPOT_MS",
    }


def test_settings_reach_the_policy_the_registry_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECROUTE_GOODPUT_SLO_TTFT_S", "1.5")
    monkeypatch.setenv("SPECROUTE_GOODPUT_OUTPUT_TOKENS", "128")
    settings = load_settings(base_urls="http://a:1", policy="goodput")
    assert settings.policy_params() == {
        "output_tokens": 128,
        "default_alpha": 0.5,
        "externality": 1.0,
        "slo_ttft_s": 1.5,
        "slo_tpot_ms": 0.0,
        "cache_credit": True,
    }
    policy = registry.create(settings.policy, settings.policy_params())
    assert isinstance(policy, Goodput)
    assert (policy.slo_ttft_s, policy.default_output_tokens, policy.default_alpha) == (1.5, 128, 0.5)
    assert settings.admission_limits == (1.5, 0.0)

    threshold = load_settings(base_urls="http://a:1", policy="threshold", threshold_enter=10, threshold_exit=20)
    built = registry.create(threshold.policy, threshold.policy_params())
    assert isinstance(built, Threshold) and (built.enter, built.exit) == (10.0, 20.0)
    assert load_settings(base_urls="http://a:1", policy="round-robin").policy_params() == {}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"goodput_default_alpha": 1.0}, "SPECROUTE_GOODPUT_DEFAULT_ALPHA: Input should be less than 1"),
        ({"goodput_output_tokens": 0}, "SPECROUTE_GOODPUT_OUTPUT_TOKENS: Input should be greater than or equal to 1"),
        ({"threshold_enter": 0}, "SPECROUTE_THRESHOLD_ENTER: Input should be greater than 0"),
        ({"goodput_slo_tpot_ms": "nan"}, "SPECROUTE_GOODPUT_SLO_TPOT_MS: Input should be a finite number"),
        ({"threshold_enter": 50}, r"SPECROUTE_THRESHOLD_ENTER \(50\) must not exceed SPECROUTE_THRESHOLD_EXIT \(40\)"),
    ],
)
def test_a_bad_parameter_stops_the_settings_naming_its_variable(overrides: dict, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings(base_urls="http://a:1", **overrides)


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("goodput", {"no_such_knob": 1}, "no_such_knob: Extra inputs are not permitted"),
        ("goodput", {"default_alpha": 1.5}, "default_alpha: Input should be less than 1"),
        ("goodput", {"slo_ttft_s": float("inf")}, "slo_ttft_s: Input should be a finite number"),
        ("threshold", {"enter": 50, "exit": 10}, r"enter \(50\) must not exceed exit \(10\)"),
        ("threshold", {"enter": -1}, "enter: Input should be greater than 0"),
        ("round-robin", {"enter": 1}, "takes none"),
        ("threshold", GoodputParams(), "GoodputParams, not ThresholdParams"),
    ],
)
def test_the_registry_refuses_parameters_its_policy_does_not_declare_or_bound(
    name: str, params: object, message: str
) -> None:
    with pytest.raises(ValueError, match=f"bad parameters for policy '{name}': .*{message}"):
        registry.create(name, params)  # type: ignore[arg-type]


def test_the_registry_takes_a_params_object_or_its_fields() -> None:
    by_fields = registry.create("threshold", {"enter": 5, "exit": 6})
    by_object = registry.create("threshold", ThresholdParams(enter=5, exit=6))
    assert isinstance(by_fields, Threshold) and isinstance(by_object, Threshold)
    assert (by_fields.enter, by_fields.exit) == (by_object.enter, by_object.exit) == (5.0, 6.0)


def test_the_evaluation_passes_the_slo_to_the_policies_that_declare_it() -> None:
    goodput = make_policy("goodput", Slo(ttft_s=2.0, tpot_s=0.05))
    assert isinstance(goodput, Goodput) and (goodput.slo_ttft_s, goodput.slo_tpot_ms) == (2.0, 50.0)
    threshold = make_policy("threshold", Slo(ttft_s=2.0, tpot_s=0.05), enter=8, exit=9)
    assert isinstance(threshold, Threshold) and (threshold.enter, threshold.exit) == (8.0, 9.0)
    with pytest.raises(ValueError, match="bad parameters"):
        make_policy("goodput", None, nope=1)


NEW_POLICY = '''
"""`coin`: a policy a test adds as one new file."""

from pydantic import Field

from fleet.types import Decision
from policies.base import PolicyParams
from policies.registry import register


class CoinParams(PolicyParams):
    spec_share: float = Field(0.5, ge=0, le=1, description="share of requests sent to spec.")


@register("coin-flip", params=CoinParams)
class Coin:
    name = "coin-flip"

    def __init__(self, params: CoinParams):
        self.spec_share = params.spec_share

    def decide(self, features, snapshot):
        return Decision(pool="spec" if self.spec_share >= 0.5 else "base", reason="coin")
'''

PROBE = """
import sys
import policies

policies.__path__.append(sys.argv[1])  # as if the file were in policies/
from policies import registry
from proxy.settings import Settings, load_settings

settings = load_settings(base_urls="http://a:1")
print(settings.policy, settings.policy_params())
print(registry.create(settings.policy, settings.policy_params()).spec_share)
print(Settings.model_fields["coin_flip_spec_share"].description)
"""


def test_adding_a_policy_is_one_new_file(tmp_path: Path) -> None:
    (tmp_path / "coin.py").write_text(textwrap.dedent(NEW_POLICY))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECROUTE_")}
    env |= {"PYTHONPATH": str(REPO), "SPECROUTE_POLICY": "coin-flip", "SPECROUTE_COIN_FLIP_SPEC_SHARE": "0.25"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "coin-flip {'spec_share': 0.25}",
        "0.25",
        "coin-flip policy: share of requests sent to spec.",
    ]
    env["SPECROUTE_COIN_FLIP_SPEC_SHARE"] = "2"
    refused = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert "SPECROUTE_COIN_FLIP_SPEC_SHARE: Input should be less than or equal to 1" in refused.stderr
