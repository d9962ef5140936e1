"""Fixtures: twin backends (subprocesses) and the proxy in front of them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from proxy_harness import TIME_SCALE, RunningProxy, running_proxy

from sim.testing import RunningTwin, TwinSpec, twins


@pytest.fixture(scope="session")
def twin_pair() -> Iterator[tuple[RunningTwin, RunningTwin]]:
    """A spec and a base twin; answers run to max_tokens (long natural lengths)."""
    common = ("--output-len", "fixed:4096")
    with twins(
        TwinSpec("spec", time_scale=TIME_SCALE, seed=1, args=common),
        TwinSpec("base", time_scale=TIME_SCALE, seed=2, args=common),
    ) as (spec, base):
        yield spec, base


@pytest.fixture(scope="session")
def proxy(twin_pair: tuple[RunningTwin, RunningTwin]) -> Iterator[RunningProxy]:
    spec, base = twin_pair
    with running_proxy(spec_urls=[spec.url], base_urls=[base.url]) as running:
        yield running
