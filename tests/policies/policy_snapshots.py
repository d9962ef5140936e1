"""Hand-built snapshots for policy tests."""

from __future__ import annotations

from fleet.types import InstanceState, PoolState, Snapshot, StepCost


def pool(
    name: str,
    load: float,
    cap: int = 48,
    *,
    alpha: float | None = 0.6,
    k: int = 3,
    stale: bool = False,
    healthy: bool = True,
    age_s: float = 0.05,
) -> PoolState:
    running = min(load, cap)
    instance = InstanceState(
        url=f"http://{name}", running=running, waiting=load - running, max_running=cap, healthy=healthy, age_s=age_s
    )
    speculative = name == "spec"
    return PoolState(
        name=name,
        instances=(instance,),
        speculative=speculative,  # type: ignore[arg-type]
        num_draft_tokens=k if speculative else 0,
        alpha=alpha if speculative else None,
        stale=stale,
    )


def snapshot(
    spec_load: float,
    base_load: float,
    cost: StepCost | None = None,
    *,
    spec_cap: int = 48,
    base_cap: int = 256,
    **spec_kwargs,
) -> Snapshot:
    return Snapshot(
        pools={"spec": pool("spec", spec_load, spec_cap, **spec_kwargs), "base": pool("base", base_load, base_cap)},
        cost=cost,
    )
