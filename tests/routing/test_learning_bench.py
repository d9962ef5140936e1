"""The learning evaluation's harness stays runnable (the full run is `python -m bench.learning`)."""

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import learning  # noqa: E402
from bench.routing_sim import VirtualRouter, make_policy  # noqa: E402
from fleet.costmodel import AffineSeed, ProfileSeed  # noqa: E402


def test_the_router_is_seeded_with_its_own_profile_none_or_a_wrong_one():
    setup = learning.FLEETS["llama70b-tp4-h100 a=0.60"]
    seeds = {}
    for way in learning.WAYS:
        job = learning.Job("llama70b-tp4-h100 a=0.60", "poisson", 0.5, "goodput", way)
        router = VirtualRouter(make_policy("goodput"), replace(setup, router_profile=learning.router_profile(job)))
        seeds[way] = router.fleet.cost.seed
    assert isinstance(seeds["own"], ProfileSeed) and seeds["own"].profile.name == "llama70b-tp4-h100"
    assert isinstance(seeds["none"], AffineSeed)
    assert isinstance(seeds["wrong"], ProfileSeed) and seeds["wrong"].profile.name == "llama3b-a10"
    # The wrong profile is far off: the 3B's plain step at 256 running is much slower.
    assert seeds["wrong"].target_ms(256, 1) > 1.3 * seeds["own"].target_ms(256, 1)


def test_the_router_learns_for_the_warm_up_before_scoring_starts():
    for kind, level in (("poisson", 0.5), ("closed", 4.0)):
        job = learning.Job("llama3b-a10 a=0.50", kind, level, "goodput", "none")
        setup, workload = learning.workload_of(job, seed=0, warmup_s=20.0, scored=60)
        result = learning.run(setup, workload, "goodput")
        assert result.warmup_s >= 20.0
        assert min(r.arrival for r in result.records) < 20.0  # the router saw warm-up traffic
        assert len(result.measured()) >= 60


def test_quick_cell_scores_every_way_against_shared_static_baselines():
    jobs = [
        j
        for j in learning.jobs_for(quick=True)
        if j.fleet == "h200-llama8b a=0.60" and j.kind == "poisson" and j.level == 0.5
    ]
    assert {j.way for j in jobs if j.policy == "goodput"} == set(learning.WAYS)
    assert {j.way for j in jobs if j.policy != "goodput"} == {"own"}  # static policies run once
    analysis = learning.analyse([learning.execute(j, quick=True) for j in jobs])
    (row,) = analysis["rows"]
    assert set(row["ways"]) == set(learning.WAYS)
    for stats in row["ways"].values():
        assert 0.5 < stats["slo"] < 2.0 and 0.0 < stats["mean"] < 2.0
        assert len(stats["per_seed"]["slo"]) == 1
    text = learning.report(analysis, 1.0, True, 1)
    assert "### Targets" in text and "| own |" in text and "| none |" in text and "| wrong |" in text
