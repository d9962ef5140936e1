"""Fixtures for the observability tests: a real Jaeger for the session (see obs_jaeger.py)."""

from __future__ import annotations

from typing import Iterator

import pytest
from obs_jaeger import Jaeger, jaeger_binary


@pytest.fixture(scope="session")
def jaeger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Jaeger]:
    server = Jaeger(jaeger_binary(), tmp_path_factory.mktemp("jaeger"))
    try:
        yield server
    finally:
        server.stop()
