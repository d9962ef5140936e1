"""Policies by name: SPECROUTE_POLICY picks one, its parameters come from the settings object.

A policy is one module of this package that registers itself (`@register(name)`, and
`params=` its `PolicyParams` subclass if it has tunable parameters). Every module of the package
is imported on first use, so adding a policy is adding its file: the settings, `specroute config`
and the evaluation find it and its parameters here.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from policies.base import Policy, PolicyParams

Factory = Callable[..., Policy]
"""Called with the validated parameters object when the policy declares one, else with none."""
_FACTORIES: dict[str, Factory] = {}
_PARAMS: dict[str, type[PolicyParams]] = {}
_DECISIONS: dict[str, tuple[tuple[str, str], ...]] = {}
_loaded = False


def register(
    name: str, params: type[PolicyParams] | None = None, decisions: tuple[tuple[str, str], ...] = ()
) -> Callable[[Factory], Factory]:
    """Decorator of a policy class or factory: make it constructible by name, with `params` its
    declared parameters (it is then called with one validated `params` object) and `decisions`
    the (reason, pool) pairs it decides with whatever its parameters and requests, both pools
    configured (their decision series exist at 0 from the start; reasons that depend on
    parameters or on a request's class are left out)."""

    def add(factory: Factory) -> Factory:
        if name in _FACTORIES:
            raise ValueError(f"policy {name!r} registered twice")
        _FACTORIES[name] = factory
        if params is not None:
            _PARAMS[name] = params
        _DECISIONS[name] = decisions
        return factory

    return add


def names() -> list[str]:
    _load_all()
    return sorted(_FACTORIES)


def declared_params() -> dict[str, type[PolicyParams]]:
    """Each policy's declared parameters, by policy name (policies without any are left out)."""
    _load_all()
    return {name: _PARAMS[name] for name in sorted(_PARAMS)}


def decisions_of(name: str) -> tuple[tuple[str, str], ...]:
    """The (reason, pool) pairs policy `name` declared it decides with (see `register`)."""
    _load_all()
    return _DECISIONS.get(name, ())


def params_of(name: str) -> type[PolicyParams] | None:
    """The parameters policy `name` declares, or None if it takes none."""
    _load_all()
    return _PARAMS.get(name)


def create(name: str, params: Mapping[str, Any] | PolicyParams | None = None) -> Policy:
    """A fresh policy object; unknown names and bad parameters (unknown, of the wrong type, out of
    bounds, or failing the policy's cross-checks) raise ValueError."""
    _load_all()
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(names())}") from None
    declared = _PARAMS.get(name)
    if declared is None:
        if isinstance(params, PolicyParams) or params:
            raise ValueError(f"bad parameters for policy {name!r}: it takes none")
        return factory()
    if isinstance(params, PolicyParams) and not isinstance(params, declared):
        raise ValueError(f"bad parameters for policy {name!r}: {type(params).__name__}, not {declared.__name__}")
    try:
        valid = params if isinstance(params, declared) else declared.model_validate(dict(params or {}))
    except ValidationError as exc:
        raise ValueError(f"bad parameters for policy {name!r}: {_describe(exc)}") from None
    return factory(valid)


def _describe(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        where = ".".join(str(part) for part in error.get("loc", ()))
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


def _load_all() -> None:
    # Importing the package's modules runs their @register decorators; done on first use rather
    # than at import so that a policy module may import this one.
    global _loaded
    if _loaded:
        return
    _loaded = True
    import policies

    for module in pkgutil.iter_modules(policies.__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"policies.{module.name}")
