"""Hostile input, generated (hypothesis): bodies and headers of every wrong shape, sent to the
proxy over a real socket in front of twins. Whatever comes in, the proxy never answers a 5xx of
its own making, every error it answers is OpenAI-shaped, and it keeps serving.

`make test` runs a few hundred cases; HYPOTHESIS_PROFILE=nightly runs 10,000.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proxy_harness import RunningProxy, assert_upstream_failure, running_proxy, wait_for

settings.register_profile(
    "default",
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.register_profile(
    "nightly",
    max_examples=10_000,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
messages = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                "content": st.one_of(st.text(max_size=50), st.none(), json_values),
            }
        ),
        max_size=3,
    ),
    json_values,
)
chat_bodies = st.fixed_dictionaries(
    {"messages": messages},
    optional={
        "model": st.one_of(st.text(max_size=30), json_scalars),
        "stream": st.one_of(st.booleans(), json_scalars),
        "max_tokens": st.one_of(st.integers(-3, 6), json_scalars),
        "max_completion_tokens": st.one_of(st.integers(0, 6), json_scalars),
        "n": st.one_of(st.integers(-1, 3), json_scalars),
        "temperature": json_scalars,
        "stream_options": json_values,
        "extra": json_values,
    },
)
raw_bodies = st.one_of(
    st.binary(max_size=300),
    st.integers(1, 3000).map(lambda depth: b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"),
    st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")),
)
# What a client's HTTP library lets it send: no control characters, no surrounding whitespace
# (the proxy must cope with the rest, bytes >= 0x80 included).
header_values = st.one_of(
    st.text(max_size=40).filter(lambda t: t == t.strip() and all(ord(c) >= 0x20 and c != "\x7f" for c in t)),
    st.binary(max_size=40).filter(lambda b: b == b.strip() and all(x >= 0x20 and x != 0x7F for x in b)),
)
headers = st.lists(
    st.tuples(
        st.sampled_from(
            ["x-specroute-pool", "x-specroute-class", "x-request-id", "content-type", "authorization", "x-other"]
        ),
        header_values,
    ),
    max_size=4,
)


@pytest.fixture(scope="module")
def proxy(twin_pair) -> Iterator[RunningProxy]:
    spec, base = twin_pair
    with running_proxy(spec_urls=[spec.url], base_urls=[base.url], max_header_bytes=4096) as running:
        yield running


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as c:
        yield c


def check(response: httpx.Response, streamed: bool) -> None:
    if response.status_code == 200:
        if streamed and response.headers.get("content-type", "").startswith("text/event-stream"):
            assert response.content.rstrip().endswith(b"data: [DONE]")
        return
    body = response.json()
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and error["type"]
    if response.status_code >= 500:
        assert_upstream_failure(response)  # never one of the proxy's own


def send(
    client: httpx.Client, proxy: RunningProxy, path: str, content: bytes, extra: list[tuple[Any, Any]]
) -> httpx.Response:
    sent_headers = [("content-type", "application/json")]
    for name, value in extra:
        if isinstance(value, str):
            try:
                value.encode("ascii")
            except UnicodeEncodeError:
                value = value.encode("utf-8")
        sent_headers.append((name, value))
    return client.post(proxy.url + path, content=content, headers=sent_headers)


@given(body=chat_bodies, extra=headers, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_generated_bodies_and_headers_get_answers_never_proxy_errors(proxy, client, body, extra, path) -> None:
    if path == "/v1/completions":
        body = {("prompt" if k == "messages" else k): v for k, v in body.items()}
    body.setdefault("max_tokens", 4)
    response = send(client, proxy, path, json.dumps(body).encode(), extra)
    check(response, streamed=body.get("stream") is True)


@given(content=raw_bodies, extra=headers)
def test_generated_raw_bytes_get_openai_errors(proxy, client, content, extra) -> None:
    response = send(client, proxy, "/v1/chat/completions", content, extra)
    check(response, streamed=False)


def test_after_the_fuzzing_the_proxy_serves_and_holds_nothing(proxy, client) -> None:
    assert client.get(proxy.url + "/health").status_code == 200
    ok = client.post(
        proxy.url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert ok.status_code == 200
    wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")
