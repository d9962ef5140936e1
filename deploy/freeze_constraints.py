"""Print exact pins for specroute's runtime dependencies, as installed here (deploy/constraints.txt).

    .venv/bin/python deploy/freeze_constraints.py > deploy/constraints.txt

The Docker image installs with these pins, so it runs the versions the tests ran. Test and bench
extras are left out: the image serves, it does not test.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
HEADER = "# Exact runtime pins for deploy/Dockerfile; regenerate with deploy/freeze_constraints.py.\n"


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_closure(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """{package: installed version} for every requirement reachable from pyproject's
    [project] dependencies (pyproject, not the installed metadata, which may be older)."""
    environment = default_environment()
    found: dict[str, str] = {}
    visited: set[tuple[str, tuple[str, ...]]] = set()

    def applies(requirement: Requirement, extras: tuple[str, ...]) -> bool:
        if requirement.marker is None:
            return True
        return any(requirement.marker.evaluate({**environment, "extra": extra}) for extra in ("", *extras))

    def walk(requirement: Requirement, extras: tuple[str, ...] = ()) -> None:
        if not applies(requirement, extras):
            return
        key = (normalise(requirement.name), tuple(sorted(requirement.extras)))
        if key in visited:
            return
        visited.add(key)
        distribution = metadata.distribution(requirement.name)
        found[normalise(requirement.name)] = distribution.version
        for line in distribution.requires or []:
            walk(Requirement(line), key[1])

    for line in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        walk(Requirement(line))
    return found


def render(pins: dict[str, str]) -> str:
    return HEADER + "".join(f"{name}=={version}\n" for name, version in sorted(pins.items()))


if __name__ == "__main__":
    print(render(runtime_closure()), end="")
