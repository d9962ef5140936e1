"""Start twin servers as real subprocesses on 127.0.0.1, for tests, benchmarks and the demo.

    from sim.testing import twin, twins, TwinSpec

    with twin("spec", profile="kimi-linear", time_scale=10, seed=1) as spec:
        client = openai.OpenAI(base_url=spec.base_url, api_key="none")

    with twins(TwinSpec("spec"), TwinSpec("base")) as (spec, base):
        ...

Each twin listens on a free port chosen by the twin itself (no port races), is ready (its
/health answered 200) when the block starts, and is terminated, then killed if it lingers,
when the block ends, also when the block raises. On Linux the child also gets SIGTERM when the
thread that started it ends (PR_SET_PDEATHSIG), so start twins from a thread that outlives them
(the main thread, as pytest fixtures are).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

READY = re.compile(rb"specroute-twin listening on http://127\.0\.0\.1:(\d+)")


@dataclass(frozen=True)
class TwinSpec:
    """How to start one twin; `args` are any further `python -m sim` flags."""

    mode: str = "spec"
    profile: str = "h200-llama8b"
    time_scale: float = 1.0
    seed: int = 0
    enable_metrics: bool = True
    args: Sequence[str] = ()
    server: str = "sglang"
    """Whose HTTP shapes: "sglang", or "vllm" (a base twin as vLLM's OpenAI server; /metrics always on)."""

    def argv(self) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "sim",
            "--mode",
            self.mode,
            "--profile",
            self.profile,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--time-scale",
            repr(float(self.time_scale)),
            "--seed",
            str(self.seed),
        ]
        if self.enable_metrics and self.server == "sglang":
            argv.append("--enable-metrics")
        if self.server != "sglang":
            argv += ["--server", self.server]
        return argv + list(self.args)


@dataclass
class RunningTwin:
    spec: TwinSpec
    process: subprocess.Popen
    log_path: Path
    port: int = 0
    url: str = ""
    """http://127.0.0.1:PORT"""
    _log: object = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        """The OpenAI SDK's base_url: url + "/v1"."""
        return self.url + "/v1"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


def _die_with_parent() -> None:
    # Linux: SIGTERM the twin if the test process dies, so nothing is orphaned.
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _launch(spec: TwinSpec, env: dict[str, str] | None) -> RunningTwin:
    fd, name = tempfile.mkstemp(prefix=f"twin-{spec.mode}-", suffix=".log")
    log = os.fdopen(fd, "wb")
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    process = subprocess.Popen(
        spec.argv(),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=child_env,
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
    )
    return RunningTwin(spec, process, Path(name), _log=log)


def _wait_ready(t: RunningTwin, deadline: float) -> None:
    while t.port == 0:
        match = READY.search(t.log_path.read_bytes())
        if match:
            t.port = int(match.group(1))
            t.url = f"http://127.0.0.1:{t.port}"
            break
        _check_alive(t)
        if time.monotonic() > deadline:
            raise TimeoutError(f"twin did not announce its port in time; log:\n{t.log()}")
        time.sleep(0.05)
    with httpx.Client(timeout=2.0) as client:
        while True:
            _check_alive(t)
            try:
                if client.get(t.url + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"twin at {t.url} not healthy in time; log:\n{t.log()}")
            time.sleep(0.05)


def _check_alive(t: RunningTwin) -> None:
    if t.process.poll() is not None:
        raise RuntimeError(f"twin exited with code {t.process.returncode}; log:\n{t.log()}")


def _stop(t: RunningTwin) -> None:
    if t.process.poll() is None:
        t.process.send_signal(signal.SIGTERM)
        try:
            t.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            t.process.kill()
            t.process.wait(timeout=5)
    if t._log is not None:
        t._log.close()  # type: ignore[attr-defined]
    with contextlib.suppress(OSError):
        t.log_path.unlink()


def wait_for(condition: Callable[[], Any], what: str, timeout: float = 30.0, interval: float = 0.05) -> Any:
    """Poll `condition` until it returns something truthy (and return that); fail with
    AssertionError after `timeout` seconds. Tests synchronise with this, never with sleeps."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


@contextlib.contextmanager
def twins(
    *specs: TwinSpec, startup_timeout: float = 60.0, env: dict[str, str] | None = None
) -> Iterator[list[RunningTwin]]:
    """Start several twins at once (in parallel), yield them in order, stop them all."""
    started: list[RunningTwin] = []
    try:
        for spec in specs:
            started.append(_launch(spec, env))
        deadline = time.monotonic() + startup_timeout
        for t in started:
            _wait_ready(t, deadline)
        yield started
    finally:
        for t in started:
            _stop(t)


@contextlib.contextmanager
def twin(
    mode: str = "spec",
    profile: str = "h200-llama8b",
    *,
    time_scale: float = 1.0,
    seed: int = 0,
    enable_metrics: bool = True,
    args: Sequence[str] = (),
    startup_timeout: float = 60.0,
    env: dict[str, str] | None = None,
) -> Iterator[RunningTwin]:
    """Start one twin; yields an object with .url, .port and .base_url."""
    spec = TwinSpec(mode, profile, time_scale, seed, enable_metrics, tuple(args))
    with twins(spec, startup_timeout=startup_timeout, env=env) as (running,):
        yield running
