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
