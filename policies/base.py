"""What every routing policy is: a name and a pure `decide` (see fleet/types.py for what it reads),
and, when it has tunable parameters, their declaration (`PolicyParams`)."""

from __future__ import annotations

from typing import Protocol, Self

from pydantic import BaseModel, ConfigDict, model_validator

from fleet.types import Decision, Features, Snapshot


class Policy(Protocol):
    @property
    def name(self) -> str: ...

    def decide(self, features: Features, snapshot: Snapshot) -> Decision: ...


class PolicyParams(BaseModel):
    """A policy's tunable parameters, declared once: one field each, with its type, default,
    bounds (`Field(ge=..., lt=...)`) and help (`Field(description=...)`). A subclass registered
    with its policy (`@register(name, params=...)`) becomes, for policy `name`, the settings
    `SPECROUTE_<NAME>_<FIELD>` (README, `specroute config`), the keywords `registry.create`
    accepts, and what the evaluation passes; the policy's constructor receives the validated
    object. Cross-parameter rules go in `problems`."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, validate_default=True)

    def problems(self) -> list[str]:
        """What is wrong across parameters, one message each, naming a parameter as `{field}`
        (filled with the parameter's name here, with its environment variable in Settings)."""
        return []

    def describe_problems(self, names: dict[str, str] | None = None) -> list[str]:
        """`problems()` with each `{field}` replaced by `names[field]` (default: the field's name)."""
        names = names or {}
        return [
            problem.format_map({f: names.get(f, f) for f in type(self).model_fields}) for problem in self.problems()
        ]

    @model_validator(mode="after")
    def _check_across(self) -> Self:
        problems = self.describe_problems()
        if problems:
            raise ValueError("; ".join(problems))
        return self


def one_pool_left(snapshot: Snapshot) -> Decision | None:
    """Where a request goes when a pool cannot take it, else None: a pool with no healthy
    instance gets nothing (`spec-down`, `base-down`; `none-healthy` when neither has one, and
    base is named), and a fleet of one pool sends everything there (`spec-only`, `base-only`:
    the other pool has no instance at all, which is no outage)."""
    spec, base = snapshot.pool("spec"), snapshot.pool("base")
    spec_up = spec is not None and spec.available
    base_up = base is not None and base.available
    if not spec_up:
        if spec is None and base_up:
            return Decision(pool="base", reason="base-only")
        return Decision(pool="base", reason="spec-down" if base_up else "none-healthy")
    if not base_up:
        return Decision(pool="spec", reason="spec-only" if base is None else "base-down")
    return None
