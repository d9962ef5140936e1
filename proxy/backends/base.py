"""What every server kind provides (one subclass per module of proxy/backends/)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from fleet.readings import Reading, ServerDescription

RANK_HEADER = "x-data-parallel-rank"
"""The request header naming the data-parallel rank that serves it (SGLang's and vLLM's)."""


class Backend:
    """One server kind, set up to poll one of its load endpoints (`load_path`; None: the server
    answers none, and the proxy counts its own requests there)."""

    kind: ClassVar[str]
    load_paths: ClassVar[tuple[str, ...]] = ()
    """Its load endpoints, best first."""
    info_path: ClassVar[str | None] = None
    """Where it describes itself (read once per learning), if anywhere."""
    liveness_path: ClassVar[str] = "/health"
    """Polled for life when there is no load endpoint: any answer means the server is up."""

    def __init__(self, load_path: str | None = None) -> None:
        self.load_path = load_path

    @classmethod
    def recognises(cls, path: str, text: str) -> bool:
        """Whether a 200 answer on one of its load endpoints comes from this kind."""
        return True

    @classmethod
    def describe(cls, doc: Mapping[str, Any]) -> tuple[ServerDescription, dict[str, Any]]:
        """The description in its `info_path` answer, and the facts the state endpoint shows."""
        raise NotImplementedError(f"{cls.kind} has no description endpoint")

    def default_description(self) -> ServerDescription | None:
        """What is known of a server of this kind that gave no description."""
        return None

    def read(self, text: str, at: float) -> Reading:
        """A load reading from its `load_path` answer (ValueError, KeyError or TypeError if the
        answer does not read)."""
        raise NotImplementedError(f"{self.kind} has no load endpoint")

    def counters_path(self, poll: int, speculative: bool) -> str | None:
        """A second endpoint to read on poll number `poll` (acceptance counters), if any."""
        return None

    def with_counters(self, reading: Reading, text: str) -> Reading:
        """`reading` with what the `counters_path` answer adds."""
        return reading
