"""The fleet as the proxy holds it: pools of upstream instances, their load kept in the fleet model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fleet.instance import InstanceSignals
from fleet.model import FleetModel
from fleet.types import POOLS, PoolName
from proxy.settings import Settings

DEFAULT_MAX_RUNNING = 48
"""SGLang's max_running_requests default on an EAGLE-3 server, until a poll says otherwise."""
STREAM_OPTIONS_RECHECK_S = 600.0
"""How long a server that refused the `stream_options` the proxy adds gets streams as their
clients sent them before the field is tried on it again (an upgraded server may take it now)."""


@dataclass(eq=False, slots=True)
class Instance:
    """One upstream server: where it is, how to authenticate, and its live signals."""

    url: str
    pool: PoolName
    signals: InstanceSignals
    api_key: str | None = None
    name: str = ""
    """What clients see of this server (x-specroute-backend, /ready): an opaque name such as
    spec-0, or the URL when SPECROUTE_EXPOSE_BACKEND_URLS is set."""
    kind: str = ""
    """The server kind its poller learned (proxy/backends: sglang, vllm, openai); "" until then."""
    streaming: int = 0
    """Requests whose first response byte has arrived (decoding rather than queued/prefilling)."""
    dispatched_total: int = 0
    failed_total: int = 0
    attempts: set[Any] = field(default_factory=set)
    """Its open attempts (proxy.routing.Attempt): when the server stops answering, those it left
    silent fail over, or end if bytes reached their clients."""
    progress_at: float = float("-inf")
    """When (time.monotonic) the server last sent bytes to any of our requests: what
    `Router.check_progress` judges a hung server by."""
    refused_stream_options_at: float | None = None
    """When (time.monotonic) the server last refused the `stream_options` the proxy adds to learn a
    stream's usage (proxy/relay.py, `refuses_stream_options`); None: never, or it was learned
    again since (the poller: the server behind the URL may have changed)."""
    rank_turn: int = 0
    """Whose turn it is among its working data-parallel ranks (`next_rank`)."""
    silent_ranks: dict[int, float] = field(default_factory=dict)
    """Its data-parallel ranks judged hung because a one-token request named to them went
    unanswered (`Router.check_ranks`), with when (time.monotonic): a rank hung in the first
    prefill after it idled shows no work, so its figures alone cannot tell it from an idle one.
    Out until its mark moves or such a request is answered."""
    probing: set[int] = field(default_factory=set)
    """Its ranks with such a request under way."""
    probed_at: dict[int, float] = field(default_factory=dict)
    """When (time.monotonic) each rank was last sent one."""

    def next_rank(self) -> int | None:
        """The rank its next request is sent to by `x-data-parallel-rank`: while some of its
        ranks are judged hung (`InstanceSignals.out_ranks`, `Router.check_ranks`), the others in
        turn; else None, the server's choice."""
        out = self.signals.out_ranks
        if not out:
            return None
        serving = [rank for rank in range(len(self.signals.rank_marks)) if rank not in out]
        if not serving:
            return None
        rank = serving[self.rank_turn % len(serving)]
        self.rank_turn += 1
        return rank

    @property
    def in_flight(self) -> int:
        """Our requests on this instance now, from admission until the response is closed."""
        return self.signals.local_in_flight

    def takes_stream_options(self, now: float) -> bool:
        """Whether a stream is sent with the `stream_options` the proxy adds: not for
        STREAM_OPTIONS_RECHECK_S after the server refused the field."""
        at = self.refused_stream_options_at
        return at is None or now - at >= STREAM_OPTIONS_RECHECK_S

    @property
    def healthy(self) -> bool:
        """Reachable, answering its polls (or none is answered), and not ejected by outlier
        detection."""
        return self.signals.in_rotation


@dataclass(eq=False, slots=True)
class Pool:
    name: PoolName
    instances: list[Instance] = field(default_factory=list)

    @property
    def available(self) -> bool:
        return any(i.healthy for i in self.instances)


def pools_from_settings(settings: Settings, fleet: FleetModel) -> dict[PoolName, Pool]:
    keys = {"spec": settings.spec_api_key, "base": settings.base_api_key}
    urls = {"spec": settings.spec_urls, "base": settings.base_urls}
    pools: dict[PoolName, Pool] = {}
    for name in POOLS:
        secret = keys[name]
        key = (secret.get_secret_value() or None) if secret is not None else None
        instances = [
            Instance(
                url,
                name,
                fleet.add_instance(url, name, DEFAULT_MAX_RUNNING),
                key,
                url if settings.expose_backend_urls else f"{name}-{index}",
            )
            for index, url in enumerate(urls[name])
        ]
        pools[name] = Pool(name, instances)
    return pools


def other_pool(name: PoolName) -> PoolName:
    return POOLS[1] if name == POOLS[0] else POOLS[0]
