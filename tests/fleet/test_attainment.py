"""fleet/attainment.py: a pool's requests finished within the SLO targets, per second and their share."""

from fleet.attainment import SloAttainment
from fleet.model import FleetModel
from fleet.readings import ResponseEvidence
from proxy.settings import load_settings


def test_counts_the_requests_within_both_targets_once_half_a_minute_is_measured():
    slo = SloAttainment(ttft_s=1.0, tpot_s=0.05)
    for t in range(0, 30):
        slo.observe(float(t), 0.5, 0.04)  # met
        slo.observe(float(t), 2.0, 0.04)  # first token too late
        slo.observe(float(t), 0.5, 0.08)  # tokens too slow
    assert slo.rate(29.0) is None and slo.share(29.0) is None  # under 30 s: mostly noise
    slo.observe(30.0, 0.5, None)  # a single token: no TPOT to miss
    assert slo.rate(30.0) == 31 / 30 and slo.share(30.0) == 31 / 91
    # Over the last minute only: the requests finished since all missed their first token.
    for t in range(31, 120):
        slo.observe(float(t), 5.0, 0.04)
    assert slo.rate(119.0) == 0.0 and slo.share(119.0) == 0.0
    assert slo.rate(200.0) == 0.0 and slo.share(200.0) is None  # none finished in the last minute


def test_every_request_that_left_counts_toward_the_rate_however_it_ended():
    """Flow control's fair share of a wait (Little's law) needs every departure: a request
    answered without a stream, failed or left by its client freed its slot as well."""
    slo = SloAttainment(ttft_s=1.0, tpot_s=0.05)
    for t in range(0, 30):
        slo.left(float(t))
        slo.left(float(t) + 0.5)
    assert slo.finished_rate(29.5) is None  # under 30 s
    assert slo.finished_rate(30.0) == 60 / 30 and slo.rate(30.0) is None  # none measured against the targets
    assert slo.finished_rate(89.0) == 1 / 60  # the last minute's (after 29.0): 29.5
    assert slo.finished_rate(200.0) == 0.0
    assert SloAttainment().finished_rate(0.0) is None


def test_no_targets_count_nothing():
    slo = SloAttainment()
    for t in range(0, 100):
        slo.observe(float(t), 0.1, 0.01)
    assert not slo.enabled and slo.rate(100.0) is None and slo.share(100.0) is None


def test_the_fleet_model_counts_each_pools_streams_against_the_proxys_targets():
    targets = load_settings(goodput_slo_ttft_s=1.0, goodput_slo_tpot_ms=50.0).slo_targets
    assert targets == (1.0, 0.05)
    model = FleetModel({"spec": 3, "base": 0}, slo_ttft_s=targets[0], slo_tpot_s=targets[1])
    model.add_instance("s", "spec", 48)
    model.add_instance("b", "base", 256)
    for t in range(0, 40):
        model.on_response("s", float(t), ResponseEvidence(tokens=11, decode_s=0.4, ttft_s=0.3))  # 40 ms a token
        model.on_response("b", float(t), ResponseEvidence(tokens=11, decode_s=0.9, ttft_s=0.3))  # 90 ms
        model.on_response("b", float(t), ResponseEvidence(tokens=11, decode_s=0.4))  # no first token seen
    spec, base = model.pools["spec"].attainment, model.pools["base"].attainment
    assert spec.rate(39.0) == 40 / 39 and spec.share(39.0) == 1.0
    assert base.rate(39.0) == 0.0 and base.share(39.0) == 0.0
    assert model.snapshot(39.0).pools["spec"].finished_per_s is None  # none has left yet
    for t in range(0, 40):
        model.on_complete("s", float(t))
    pools = model.snapshot(39.0).pools  # as flow control reads them (its fair share of a wait)
    assert pools["spec"].finished_per_s == 40 / 39 and pools["spec"].slo_share == 1.0
    assert not FleetModel({"spec": 3, "base": 0}).pools["spec"].attainment.enabled


def test_the_proxy_counts_against_the_goodput_targets_it_was_given():
    from proxy.routing import Router

    settings = load_settings(
        spec_urls="http://127.0.0.1:9",
        base_urls="http://127.0.0.1:10",
        goodput_slo_ttft_s=2.0,
        goodput_slo_tpot_ms=80.0,
    )
    router = Router.from_settings(settings)
    attainment = router.fleet.pools["base"].attainment
    assert (attainment.ttft_s, attainment.tpot_s) == (2.0, 0.08)
    assert (
        not Router.from_settings(load_settings(spec_urls="http://127.0.0.1:9")).fleet.pools["spec"].attainment.enabled
    )
