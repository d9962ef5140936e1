"""What every routing policy is: a name and a pure `decide` (see fleet/types.py for what it reads)."""

from __future__ import annotations

from typing import Protocol

from fleet.types import Decision, Features, Snapshot


class Policy(Protocol):
    @property
    def name(self) -> str: ...

    def decide(self, features: Features, snapshot: Snapshot) -> Decision: ...
