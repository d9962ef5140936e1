"""Bodies that cost work rather than bytes, and fields of the wrong type: a clear 400 each, and
the event loop keeps serving everyone else meanwhile (over real sockets)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from proxy_harness import RunningProxy, running_proxy, wait_for

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


class HealthProbe:
    """GET /health over and over on its own connection; the slowest answer is the loop's stall."""

    def __init__(self, proxy: RunningProxy) -> None:
        self.proxy = proxy
        self.slowest = 0.0
        self.answers = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                started = time.perf_counter()
                assert client.get(self.proxy.url + "/health").status_code == 200
                self.slowest = max(self.slowest, time.perf_counter() - started)
                self.answers += 1

    def __enter__(self) -> HealthProbe:
        self.thread.start()
        wait_for(lambda: self.answers > 3, what="the probe answering")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


@pytest.fixture(scope="module")
def proxy(twin_pair) -> Iterator[RunningProxy]:
    spec, base = twin_pair
    with running_proxy(spec_urls=[spec.url], base_urls=[base.url]) as running:
        yield running


def post(proxy: RunningProxy, body: bytes) -> httpx.Response:
    return httpx.post(
        proxy.base_url + "/chat/completions", content=body, timeout=60, headers={"content-type": "application/json"}
    )


def test_millions_of_empty_objects_are_refused_without_stalling_the_loop(proxy: RunningProxy) -> None:
    body = b'{"messages":[' + b",".join([b"{}"] * 5_500_000) + b"]}"
    assert len(body) < 16 * 1024 * 1024  # under the byte limit: only the work is too much
    before = rss_mb()
    with HealthProbe(proxy) as probe:
        refused = post(proxy, body)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "request_too_complex"
    assert probe.slowest < 0.5, f"/health waited {probe.slowest:.2f} s"  # it took 3.4 s before
    assert rss_mb() - before < 200  # it grew by ~530 MB before (and kept it)


def test_a_big_legitimate_body_is_served_while_the_loop_keeps_answering(proxy: RunningProxy) -> None:
    long_prompt = {**CHAT, "messages": [{"role": "user", "content": "word " * 2_000_000}]}  # 10 MB
    with HealthProbe(proxy) as probe:
        served = post(proxy, json.dumps(long_prompt).encode())
    assert served.status_code in (200, 400), served.text  # the twin may refuse its context length
    if served.status_code == 400:
        assert "context length" in served.json()["error"]["message"]
    assert probe.slowest < 0.5, f"/health waited {probe.slowest:.2f} s"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stream", "true"),
        ("stream", 1),
        ("model", 5),
        ("max_tokens", "10"),
        ("max_tokens", True),
        ("max_completion_tokens", 2.5),
        ("n", "2"),
        ("n", 1.5),
        ("model", None),  # OpenAI's model is a string, never null (the others may be null)
    ],
)
def test_fields_the_proxy_acts_on_must_have_their_openai_types(proxy: RunningProxy, field: str, value: object) -> None:
    refused = post(proxy, json.dumps({**CHAT, field: value}).encode())
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == field and error["code"] == "invalid_type" and error["type"] == "invalid_request_error"


def test_nulls_and_right_types_pass(proxy: RunningProxy) -> None:
    ok = post(
        proxy,
        json.dumps(
            {**CHAT, "stream": False, "max_tokens": 2, "n": 1, "model": "m", "max_completion_tokens": None}
        ).encode(),
    )
    assert ok.status_code == 200


def test_deep_nesting_is_a_clear_400(proxy: RunningProxy) -> None:
    deep = b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    refused = post(proxy, deep)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_json"


@pytest.mark.parametrize(("depth", "served"), [(120, True), (129, False), (1000, False)])
def test_nesting_a_python_server_cannot_parse_is_refused_before_it_fails_the_fleet(
    proxy: RunningProxy, depth: int, served: bool
) -> None:
    # About 1,000 levels pass orjson and fail the twin (FastAPI, as SGLang) with a 500 on every
    # server; 128 is the bound, past anything a request needs.
    nested = b'{"x": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"
    body = json.dumps({**CHAT, "metadata_probe": 0}).encode().replace(b'"metadata_probe": 0', b'"probe": ' + nested)
    answer = post(proxy, body)
    if served:
        assert answer.status_code == 200, answer.text
    else:
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["code"] == "request_too_complex"
        assert "deeper than 128" in answer.json()["error"]["message"]


def test_a_compressed_body_is_refused_as_such(proxy: RunningProxy) -> None:
    import gzip

    body = gzip.compress(json.dumps(CHAT).encode())
    refused = httpx.post(
        proxy.base_url + "/chat/completions",
        content=body,
        timeout=30,
        headers={"content-type": "application/json", "content-encoding": "gzip"},
    )
    assert refused.status_code == 415, refused.text
    assert refused.json()["error"]["code"] == "unsupported_content_encoding"
    plain = httpx.post(
        proxy.base_url + "/chat/completions",
        content=json.dumps(CHAT).encode(),
        timeout=30,
        headers={"content-type": "Application/JSON", "content-encoding": "identity"},
    )
    assert plain.status_code == 200, plain.text  # media types are case-insensitive, for SGLang too


@pytest.mark.parametrize("shape", ["numbers", "unique keys"])
def test_millions_of_scalars_are_refused_without_stalling_the_loop(proxy: RunningProxy, shape: str) -> None:
    # Few brackets, millions of values: counting objects and arrays alone let these through to
    # a parse that holds the GIL (and so the event loop) for 0.15-0.35 s and keeps ~100 MB.
    if shape == "numbers":
        body = b'{"messages":[' + b",".join([b"0"] * 7_000_000) + b"]}"
    else:
        body = b'{"messages":[{' + b",".join(b'"k%d":0' % i for i in range(1_200_000)) + b"}]}"
    assert len(body) < 16 * 1024 * 1024
    with HealthProbe(proxy) as probe:
        refused = post(proxy, body)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "request_too_complex" and "values" in error["message"]
    assert probe.slowest < 0.25, f"/health waited {probe.slowest:.2f} s"


def test_commas_and_colons_inside_strings_are_not_counted(proxy: RunningProxy) -> None:
    text = 'a, b: "c", ' * 150_000  # 1.65 MB of prose-like punctuation in one string: 300,000 of each
    ok = post(proxy, json.dumps({**CHAT, "messages": [{"role": "user", "content": text}]}).encode())
    assert ok.status_code in (200, 400), ok.text
    if ok.status_code == 400:  # the twin may refuse its context length, the proxy must not
        assert "context length" in ok.json()["error"]["message"]


def test_a_dead_body_worker_costs_no_request(proxy: RunningProxy) -> None:
    """Bodies over 256 KiB are parsed in a worker process; if it dies, the body in hand is parsed
    in a thread and the next big one starts a new worker."""
    import os
    import signal

    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "word " * 100_000}]}).encode()  # 0.5 MB

    def served() -> bool:  # parsed, routed and answered by the twin (which finds it too long)
        answer = post(proxy, big)
        return answer.status_code == 400 and "context length" in answer.json()["error"]["message"]

    assert served()
    pool = proxy.app.completions.bodies.pool
    assert pool is not None
    for pid in list(pool._processes):  # noqa: SLF001 (the test reaches in to kill it)
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: all(not p.is_alive() for p in pool._processes.values()), what="the worker to die")
    assert served() and served()
    assert proxy.app.completions.bodies.pool not in (None, pool)


def test_the_body_worker_starts_with_the_proxy_not_with_the_first_large_body(twin_pair) -> None:  # type: ignore[no-untyped-def]
    """From a review: the first body over 256 KiB paid ~300 ms (the worker spawned and imported
    on its request path). The worker now starts with the proxy and the first large body finds it
    up."""
    spec, base = twin_pair
    with running_proxy(spec_urls=[spec.url], base_urls=[base.url]) as fresh:
        bodies = fresh.app.completions.bodies
        pool = bodies.pool
        assert pool is not None and bodies.warming is not None
        wait_for(lambda: bodies.warming.done(), timeout=30, what="the body worker up")
        assert bodies.warming.exception() is None
        big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "word " * 100_000}]}).encode()
        assert post(fresh, big).status_code == 400  # parsed, routed, refused by the twin as too long
        assert bodies.pool is pool and len(pool._processes) == 1  # noqa: SLF001


def test_the_body_worker_ends_with_a_proxy_that_was_killed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """From a review: started with the proxy, the worker outlived a SIGKILLed (or OOM-killed)
    proxy, waiting for work on a queue it holds open itself, and ignored TERM and INT."""
    import os
    import subprocess
    import sys

    script = tmp_path / "killed.py"
    script.write_text(
        "import asyncio, os, signal\n"
        "from proxy.body import BodyReader\n"
        "async def main():\n"
        "    reader = BodyReader(10, 10)\n"
        "    reader.start()\n"
        "    await reader.warming\n"
        "    print(*reader.pool._processes, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "if __name__ == '__main__':\n"
        "    asyncio.run(main())\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert done.returncode == -9, done.stderr
    (worker,) = (int(pid) for pid in done.stdout.split())

    def gone() -> bool:
        try:
            return "Z" in Path(f"/proc/{worker}/stat").read_text().split()[2]
        except FileNotFoundError:
            return True

    try:
        wait_for(gone, timeout=20, what="the orphaned body worker to end")
    finally:
        if not gone():
            os.kill(worker, 9)


def test_a_small_body_of_many_objects_is_read_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """What routing reads of each message is Python work: 87,000 empty messages in 256 KB held
    the loop 125-450 ms a body (a review: another client's call took 1.2-1.9 s while one client
    sent eight a second). A body of more than OFF_LOOP_ITEMS objects and arrays is read in the
    worker process however small; a plain small one stays on the loop (cheaper there)."""
    import asyncio

    from proxy import body as body_module

    on_loop: list[int] = []
    read = body_module.read

    def spied(data: bytes, *args: object) -> object:
        on_loop.append(len(data))
        return read(data, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(body_module, "read", spied)  # the worker process imports its own
    many = b'{"model":"x","max_tokens":4,"messages":[' + b"{}," * 87_300 + b'{"role":"user","content":"hi"}]}'
    plain = json.dumps(CHAT).encode()
    assert len(many) < body_module.OFF_LOOP_BYTES

    async def parse_both() -> tuple[object, object]:
        reader = body_module.BodyReader(100_000, 250_000)
        reader.start()
        try:
            return await reader.parse(many), await reader.parse(plain)
        finally:
            await reader.close()

    parsed_many, parsed_plain = asyncio.run(parse_both())
    assert on_loop == [len(plain)]
    assert parsed_many.features.max_tokens == 4 and parsed_plain.features.max_tokens == 2  # type: ignore[attr-defined]
