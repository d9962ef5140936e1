"""Print exact pins for specroute's runtime dependencies, as installed here (deploy/constraints.txt).

    .venv/bin/python deploy/freeze_constraints.py > deploy/constraints.txt

The Docker image installs with these pins, so it runs the versions the tests ran. Test and bench
extras are left out: the image serves, it does not test.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re

from packaging.markers import default_environment
from packaging.requirements import Requirement

HEADER = "# Exact runtime pins for deploy/Dockerfile; regenerate with deploy/freeze_constraints.py.\n"


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_closure(root: str = "specroute") -> dict[str, str]:
    """{package: installed version} for every runtime requirement reachable from `root`."""
    environment = default_environment()
    found: dict[str, str] = {}
    visited: set[tuple[str, tuple[str, ...]]] = set()

    def applies(requirement: Requirement, extras: tuple[str, ...]) -> bool:
        if requirement.marker is None:
            return True
        return any(requirement.marker.evaluate({**environment, "extra": extra}) for extra in ("", *extras))

    def walk(name: str, extras: tuple[str, ...]) -> None:
        if (normalise(name), extras) in visited:
            return
        visited.add((normalise(name), extras))
        distribution = metadata.distribution(name)
        found[normalise(name)] = distribution.version
        for line in distribution.requires or []:
            requirement = Requirement(line)
            if applies(requirement, extras):
                walk(requirement.name, tuple(sorted(requirement.extras)))

    walk(root, ())
    found.pop(normalise(root))
    return found


def render(pins: dict[str, str]) -> str:
    return HEADER + "".join(f"{name}=={version}\n" for name, version in sorted(pins.items()))


if __name__ == "__main__":
    print(render(runtime_closure()), end="")
