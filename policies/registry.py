"""Policies by name: SPECROUTE_POLICY picks one, its parameters come from the settings object."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from policies.base import Policy

Factory = Callable[..., Policy]
_FACTORIES: dict[str, Factory] = {}


def register(name: str) -> Callable[[Factory], Factory]:
    """Class decorator: make a policy constructible by name."""

    def add(factory: Factory) -> Factory:
        if name in _FACTORIES:
            raise ValueError(f"policy {name!r} registered twice")
        _FACTORIES[name] = factory
        return factory

    return add


def names() -> list[str]:
    _load_builtin()
    return sorted(_FACTORIES)


def create(name: str, params: Mapping[str, Any] | None = None) -> Policy:
    """A fresh policy object; unknown names and bad parameters raise ValueError."""
    _load_builtin()
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(names())}") from None
    try:
        return factory(**dict(params or {}))
    except TypeError as exc:
        raise ValueError(f"bad parameters for policy {name!r}: {exc}") from None


def _load_builtin() -> None:
    # Importing the modules runs their @register decorators; kept lazy to avoid import cycles.
    import policies.goodput  # noqa: F401
    import policies.roundrobin  # noqa: F401
    import policies.static  # noqa: F401
    import policies.threshold  # noqa: F401
