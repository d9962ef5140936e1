"""Ways a twin can be sick on purpose, for reliability tests: a server that answers its load
endpoint (so a poller thinks it is fine) but serves completions badly.

Set at start-up (`specroute sim --fault-error-rate 1.0 ...`) or at run time with the twin-only
admin endpoint `POST /specroute/twin/faults` and a JSON object of the same names; an empty
object heals the twin.

- `error_rate`: that share of completion requests is answered 500 with SGLang's error body;
- `first_token_delay_ms`: every completion waits this long (wall time) before it starts;
- `hang_after_chunks`: a stream stops after that many chunks and never ends (until the client
  leaves);
- `drop_after_chunks`: a stream's connection is cut after that many chunks;
- `load_delay_ms`: its load endpoint (`/v1/loads`) answers this late while completions run on
  (a scheduler too busy to answer polls, or a slow tokenizer process in front of a live engine);
- `wedged`: the engine stops stepping (a scheduler hung inside a forward pass, an NCCL hang):
  requests are taken and queued but no token comes, while `/v1/loads` answers the snapshot last
  published (SGLang's is read from shared memory, never from the scheduler) and `/metrics`
  answers too. Healed, the engine goes on where it stopped.
- `wedged_rank`: the same for one data-parallel rank of a server started with --dp-size (a
  scheduler process hung while the others serve): requests dealt to it wait, the rest are
  served, and `/health_generate` passes while another rank works.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields
from typing import Any


class DroppedOnPurpose(ConnectionError):
    """Ends a stream without its end: the HTTP server then closes the connection mid-response."""


@dataclass
class Faults:
    error_rate: float = 0.0
    first_token_delay_ms: float = 0.0
    hang_after_chunks: int | None = None
    drop_after_chunks: int | None = None
    load_delay_ms: float = 0.0
    wedged: bool = False
    wedged_rank: int | None = None

    @classmethod
    def parse(cls, doc: Any) -> Faults:
        if not isinstance(doc, dict):
            raise ValueError("send a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = set(doc) - known
        if unknown:
            raise ValueError(f"unknown fault(s) {sorted(unknown)}; known: {sorted(known)}")
        faults = cls(**doc)
        faults.check()
        return faults

    def check(self) -> None:
        if not 0.0 <= float(self.error_rate) <= 1.0:
            raise ValueError("error_rate must be in [0, 1]")
        for name in ("first_token_delay_ms", "load_delay_ms"):
            if float(getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("hang_after_chunks", "drop_after_chunks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{name} must be a whole number >= 0 or null")
        if not isinstance(self.wedged, bool):
            raise ValueError("wedged must be true or false")
        rank = self.wedged_rank
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
            raise ValueError("wedged_rank must be a whole number >= 0 or null")

    def check_ranks(self, dp_size: int) -> None:
        if self.wedged_rank is not None and self.wedged_rank >= dp_size:
            raise ValueError(f"wedged_rank {self.wedged_rank}: the server has {dp_size} data-parallel rank(s)")

    def fails(self, rng: random.Random) -> bool:
        return self.error_rate > 0 and rng.random() < self.error_rate

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
