"""Fixtures shared across test folders: one real Jaeger per session (tests/observability/obs_jaeger.py),
used by the trace tests and by the deploy tests' twin stack."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "observability"))
from obs_jaeger import Jaeger, jaeger_binary  # noqa: E402


@pytest.fixture(scope="session")
def jaeger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Jaeger]:
    server = Jaeger(jaeger_binary(), tmp_path_factory.mktemp("jaeger"))
    try:
        yield server
    finally:
        server.stop()
