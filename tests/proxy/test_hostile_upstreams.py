"""Upstreams that misbehave and headers that must not cross: what the client gets is always
OpenAI-shaped, free of upstream internals, and the router's accounting stays right.
Each test runs the proxy in front of a raw-socket upstream (proxy_faults.FaultServer)."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest
from proxy_faults import FaultServer
from proxy_harness import running_proxy, wait_for

from proxy.pools import STREAM_OPTIONS_RECHECK_S

MESSAGES = [{"role": "user", "content": "Say hi."}]
CHAT = {"model": "m", "messages": MESSAGES, "max_tokens": 2}


def test_an_upstream_traceback_never_reaches_the_client() -> None:
    with FaultServer("trace500") as bad, running_proxy(spec_urls=[bad.url], policy="spec") as proxy:
        answer = httpx.post(proxy.base_url + "/chat/completions", json=CHAT)
    assert answer.status_code == 500
    error = answer.json()["error"]
    # Generic, with the id that finds the request in the proxy's and the upstream's logs.
    request_id = answer.headers["x-request-id"]
    assert error["message"] == f"upstream server error (HTTP 500; request id {request_id})"
    assert error["type"] == "server_error"
    for internal in ("Traceback", "/opt/sglang", "10.20.30.40", "Errno"):
        assert internal not in answer.text


def test_an_upstream_redirect_is_neither_followed_nor_passed_on(twin_pair) -> None:
    spec, base = twin_pair
    with (
        FaultServer("redirect") as bad,
        running_proxy(spec_urls=[bad.url], base_urls=[base.url], policy="spec") as proxy,
    ):
        refused = httpx.post(proxy.base_url + "/chat/completions", json=CHAT, headers={"x-specroute-pool": "spec"})
        assert refused.status_code == 502 and refused.json()["error"]["code"] == "upstream_redirect"
        assert "location" not in refused.headers and "10.20.30.40" not in refused.text
        assert len([r for r in bad.requests if r.method == "POST"]) == 1  # not replayed
        served = httpx.post(proxy.base_url + "/chat/completions", json=CHAT)  # fails over to base
        assert served.status_code == 200 and served.headers["x-specroute-pool"] == "base"


def test_a_stream_framed_by_content_length_that_breaks_ends_with_an_error_event(caplog) -> None:
    with FaultServer("ssecl:3") as bad, running_proxy(spec_urls=[bad.url], policy="spec") as proxy:
        with httpx.stream("POST", proxy.base_url + "/chat/completions", json={**CHAT, "stream": True}) as response:
            assert "content-length" not in response.headers
            body = b"".join(response.iter_bytes())
        wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")
    events = [line for line in body.split(b"\n") if line.startswith(b"data: ")]
    assert len(events) == 5 and b'"error"' in events[3] and events[4] == b"data: [DONE]"
    # The proxy's and uvicorn's loggers (the fault server's own loop may log its cancelled tasks).
    assert not [r for r in caplog.records if r.exc_info and r.name.startswith(("uvicorn", "specroute"))], (
        "a traceback was logged"
    )


def test_an_event_that_never_ends_is_cut_off_in_linear_time() -> None:
    with FaultServer("noblank:8") as bad, running_proxy(spec_urls=[bad.url], policy="spec") as proxy:
        started = time.monotonic()
        with httpx.stream(
            "POST", proxy.base_url + "/chat/completions", json={**CHAT, "stream": True}, timeout=60
        ) as response:
            body = b"".join(response.iter_bytes())
        took = time.monotonic() - started
        health = httpx.get(proxy.url + "/health")
        wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")
    assert health.status_code == 200
    assert body.startswith(b"data: {") and b"upstream_event_too_large" in body and body.endswith(b"data: [DONE]\n\n")
    assert b"aaaa" not in body  # no half event reached the client
    assert took < 10, f"{took:.1f} s for 4 MiB"  # quadratic: 7.5 s of loop time for 60 MB


def test_hop_by_hop_and_upstream_routing_headers_stay_on_their_hop() -> None:
    with FaultServer("hopheaders") as upstream, running_proxy(spec_urls=[upstream.url], policy="spec") as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
            body = json.dumps(CHAT).encode()
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: keep-alive, x-secret-hop\r\nx-secret-hop: 1\r\n"
                b"te: trailers\r\nproxy-connection: keep-alive\r\nproxy-authorization: Basic Zm9v\r\n"
                b"x-forwarded-for: 6.6.6.6\r\nforwarded: for=6.6.6.6\r\nx-real-ip: 6.6.6.6\r\n"
                b"true-client-ip: 6.6.6.6\r\ncf-connecting-ip: 6.6.6.6\r\n"
                b"x-specroute-session: s1\r\nx-specroute-class: latency\r\n"
                b"x-note: caf\xc3\xa9\r\nx-keep: yes\r\n\r\n%s" % (len(body), body)
            )
            data = b""
            while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
                part = sock.recv(65536)
                assert part, data
                data += part
    head = data.split(b"\r\n\r\n", 1)[0].lower().split(b"\r\n")
    names = [line.split(b":", 1)[0] for line in head[1:]]
    for hop in (b"x-internal-hop", b"proxy-authenticate", b"proxy-connection", b"te"):
        assert hop not in names, hop
    # The upstream's keep-alive is its own hop's; the proxy's says its own timeout.
    assert [line for line in head if line.startswith(b"keep-alive:")] == [b"keep-alive: timeout=75"]
    assert names.count(b"x-specroute-backend") == 1 and b"x-specroute-backend: spec-0" in head
    assert b"x-upstream-note: caf\xc3\xa9" in head  # non-ASCII bytes pass unchanged
    sent = [r for r in upstream.requests if r.method == "POST"][0].headers
    for hop in ("x-secret-hop", "te", "proxy-connection", "proxy-authorization", "forwarded", "x-real-ip"):
        assert hop not in sent, hop
    for claim in ("true-client-ip", "cf-connecting-ip"):
        assert claim not in sent, claim
    for hint in ("x-specroute-session", "x-specroute-class"):  # the proxy's own
        assert hint not in sent, hint
    assert sent["x-forwarded-for"] == "127.0.0.1"  # the peer, not what the client claimed
    assert sent["x-keep"] == "yes"
    assert sent["x-note"] == "café".encode().decode("latin-1")  # the client's UTF-8 bytes, unchanged


def test_a_header_that_is_not_utf8_is_refused() -> None:
    with FaultServer("echo") as upstream, running_proxy(spec_urls=[upstream.url], policy="spec") as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
            body = json.dumps(CHAT).encode()
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                b"x-bad: \xff\xfe\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
            )
            data = sock.recv(65536)
    assert data.startswith(b"HTTP/1.1 400 ") and b'"param":"x-bad"' in data


def test_behind_a_trusted_proxy_x_forwarded_for_is_appended() -> None:
    with (
        FaultServer("echo") as upstream,
        running_proxy(spec_urls=[upstream.url], policy="spec", forwarded_headers="append") as proxy,
    ):
        httpx.post(proxy.base_url + "/chat/completions", json=CHAT, headers={"x-forwarded-for": "203.0.113.7"})
    sent = [r for r in upstream.requests if r.method == "POST"][0].headers
    assert sent["x-forwarded-for"] == "203.0.113.7, 127.0.0.1"


def test_requests_the_upstream_refuses_leave_no_load_behind(twin_pair) -> None:
    _, base = twin_pair
    with FaultServer("status:400") as refusing, running_proxy(spec_urls=[refusing.url], base_urls=[base.url]) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        huge = [{"role": "user", "content": "x" * 1_000_000}]  # ~250k tokens each
        for _ in range(5):
            with pytest.raises(openai.BadRequestError):
                client.chat.completions.create(
                    model="m", messages=huge, max_tokens=2, extra_headers={"x-specroute-pool": "spec"}
                )
        spec = proxy.app.router.snapshot().pools["spec"].instances[0]
        assert spec.prompt_tokens_per_s < 1.0 and spec.dispatches_per_s < 0.01
        assert proxy.in_flight() == 0


def test_an_upstream_usage_past_any_count_is_not_taken() -> None:
    with FaultServer("hugeusage") as upstream, running_proxy(spec_urls=[upstream.url], policy="spec") as proxy:
        for _ in range(2):
            answer = httpx.post(
                proxy.base_url + "/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                timeout=10,
            )
            assert answer.status_code == 200 and "1" + "0" * 400 in answer.text  # relayed as it came
        # Taken, the count overflowed the fleet model's float means and the request was never
        # released; the fleet learned no output length from it.
        wait_for(lambda: proxy.in_flight() == 0, "the requests to be released", timeout=10)
        assert proxy.app.router.fleet.output_samples == 0


def test_a_server_that_refuses_stream_options_gets_streams_as_their_clients_sent_them() -> None:
    # A strict OpenAI-compatible server (FastAPI refusing fields its schema lacks, usage included
    # by default) behind a proxy that asks every stream for its usage: the first stream is refused
    # for the field the proxy added and sent again unchanged, later ones go unchanged at once; the
    # clients see none of it, and get the server's own usage chunk as they would without the proxy.
    with FaultServer("strict:3") as upstream, running_proxy(spec_urls=[upstream.url], policy="spec") as proxy:
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        for _ in range(2):
            chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3, stream=True))
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "t0 t1 t2 "
            assert [c.usage.completion_tokens for c in chunks if c.usage] == [2]
        posted = [r.body for r in upstream.requests if r.method == "POST"]
        assert [b'"stream_options"' in body for body in posted] == [True, False, False]
        assert json.loads(posted[1]) == json.loads(posted[2])  # as the client sent it
        state = httpx.get(proxy.url + "/v1/specroute/state", timeout=5).json()
        assert state["pools"]["spec"]["instances"][0]["takes_stream_options"] is False
        assert 'specroute_retries_total{pool="spec"} 0.0' in httpx.get(proxy.url + "/metrics").text  # no retry
        # A client that names stream_options itself gets the server's answer, its request sent once.
        with pytest.raises(openai.UnprocessableEntityError, match="stream_options"):
            client.chat.completions.create(
                model="m", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
            )
        assert sum(1 for r in upstream.requests if r.method == "POST") == 4
        wait_for(lambda: proxy.in_flight() == 0, "the requests to be released", timeout=10)


def test_a_client_error_that_quotes_the_added_stream_options_keeps_the_server_asked_for_usage() -> None:
    # The server takes stream_options, but its 400 for a wrong request quotes the request's start,
    # where the proxy put the field: sent again without it, the request is refused again, so the
    # client gets that 400 and the server keeps being asked for usage.
    with FaultServer("quoting:2") as upstream, running_proxy(spec_urls=[upstream.url], policy="spec") as proxy:
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="logprobs"):
            client.chat.completions.create(model="m", messages=MESSAGES, stream=True, top_logprobs=2)
        chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, stream=True))
        assert all(c.choices for c in chunks) and not any(c.usage for c in chunks)  # its usage kept from it
        posted = [r.body for r in upstream.requests if r.method == "POST"]
        assert [b'"stream_options"' in body for body in posted] == [True, False, True]
        state = httpx.get(proxy.url + "/v1/specroute/state", timeout=5).json()
        assert state["pools"]["spec"]["instances"][0]["takes_stream_options"] is True
        wait_for(lambda: proxy.in_flight() == 0, "the requests to be released", timeout=10)


def _spec_instance_state(proxy) -> dict:
    return httpx.get(proxy.url + "/v1/specroute/state", timeout=5).json()["pools"]["spec"]["instances"][0]


def test_a_server_that_refused_stream_options_is_asked_again_after_a_while() -> None:
    # The mark lasts STREAM_OPTIONS_RECHECK_S (aged here by moving its time back, not by waiting):
    # still strict, the server refuses the field again and the stream is sent again without it;
    # upgraded in place to one that takes it, the next stream carries it and the mark is gone.
    with FaultServer("strict:3") as upstream, running_proxy(spec_urls=[upstream.url], policy="spec") as proxy:
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        instance = proxy.app.router.pools["spec"].instances[0]

        def stream() -> list:
            return list(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3, stream=True))

        def posted() -> list[bool]:
            return [b'"stream_options"' in r.body for r in upstream.requests if r.method == "POST"]

        stream()
        assert posted() == [True, False] and _spec_instance_state(proxy)["takes_stream_options"] is False
        instance.refused_stream_options_at -= STREAM_OPTIONS_RECHECK_S
        assert _spec_instance_state(proxy)["takes_stream_options"] is True
        stream()  # still strict: refused, sent again, marked again
        assert posted() == [True, False, True, False] and _spec_instance_state(proxy)["takes_stream_options"] is False
        upstream.behaviour = "quoting:3"  # takes stream_options now
        stream()
        assert posted()[-1] is False  # the mark holds until it is aged
        instance.refused_stream_options_at -= STREAM_OPTIONS_RECHECK_S
        chunks = stream()
        assert posted()[-1] is True and _spec_instance_state(proxy)["takes_stream_options"] is True
        assert all(c.choices for c in chunks) and not any(c.usage for c in chunks)  # the usage kept from it
        assert instance.refused_stream_options_at is not None  # aged, not cleared: served with the field
        stream()
        assert posted()[-1] is True
        wait_for(lambda: proxy.in_flight() == 0, "the requests to be released", timeout=10)


def test_a_server_learned_again_is_asked_for_stream_options_again() -> None:
    # The server behind the URL went away and another answers there now: the poller learns it
    # again, and it gets the field at once.
    with (
        FaultServer("strict:3") as strict,
        running_proxy(spec_urls=[strict.url], policy="spec", poll_interval_ms=20) as proxy,
    ):
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        list(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3, stream=True))
        assert _spec_instance_state(proxy)["takes_stream_options"] is False
        port = strict.port
        strict.__exit__()
        wait_for(lambda: not _spec_instance_state(proxy)["healthy"], "the server to be seen gone", timeout=20)
        assert _spec_instance_state(proxy)["takes_stream_options"] is False
        with FaultServer("quoting:3", port=port) as upgraded:
            wait_for(
                lambda: _spec_instance_state(proxy)["takes_stream_options"],
                "the server to be learned again",
                timeout=20,
            )
            list(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3, stream=True))
            assert [b'"stream_options"' in r.body for r in upgraded.requests if r.method == "POST"] == [True]
            wait_for(lambda: proxy.in_flight() == 0, "the requests to be released", timeout=10)


@pytest.mark.parametrize("status", [999, 204, 206])
def test_an_answer_status_no_client_can_use_fails_over_as_a_502(twin_pair, status: int) -> None:
    # A status outside HTTP's dropped the client's connection (uvicorn cannot send it); a 204
    # reached the SDK as an empty body. SGLang and vLLM answer completions with 200 alone.
    spec, base = twin_pair
    with (
        FaultServer(f"rawstatus:{status}") as bad,
        running_proxy(spec_urls=[bad.url], base_urls=[base.url], policy="spec") as proxy,
    ):
        pinned = httpx.post(proxy.base_url + "/chat/completions", json=CHAT, headers={"x-specroute-pool": "spec"})
        assert pinned.status_code == 502, pinned.text
        assert pinned.json()["error"]["code"] == "upstream_bad_status"
        served = httpx.post(proxy.base_url + "/chat/completions", json=CHAT)
        assert served.status_code == 200 and served.headers["x-specroute-pool"] == "base"


def test_an_upstream_header_with_a_control_byte_is_not_relayed() -> None:
    # uvicorn refuses to send one: the client's connection dropped without an answer.
    with FaultServer("ctlheader") as bad, running_proxy(spec_urls=[bad.url], policy="spec") as proxy:
        answer = httpx.post(proxy.base_url + "/chat/completions", json=CHAT)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "ok"
    assert "x-note" not in answer.headers and "retry-after" not in answer.headers


def test_a_stream_answered_as_json_reaches_the_client_whole() -> None:
    # The usage filter is for SSE events: run over a JSON answer with no choices, it sent none
    # of the body's bytes under the upstream's content-length (httpx: "received 0 bytes").
    with FaultServer("usagejson") as bad, running_proxy(spec_urls=[bad.url], policy="spec") as proxy:
        answer = httpx.post(proxy.base_url + "/chat/completions", json=CHAT | {"stream": True})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2


def test_a_stream_in_an_encoding_nobody_asked_for_fails_over_as_a_502() -> None:
    # Its events cannot be read: it reached the client only at its end, the added usage in it.
    with FaultServer("gzipsse") as bad, running_proxy(spec_urls=[bad.url], policy="spec") as proxy:
        answer = httpx.post(proxy.base_url + "/chat/completions", json=CHAT | {"stream": True})
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "upstream_encoding"


def test_keep_alive_comments_hold_a_stream_no_longer_than_its_timeouts() -> None:
    # Comments kept the socket busy: the first-token and chunk timeouts never fired, and the
    # request was held for the whole total timeout (600 s by default).
    limits = {"first_token_timeout_s": 0.5, "chunk_timeout_s": 0.5, "total_timeout_s": 60}
    with FaultServer("keepalive:0") as silent, running_proxy(spec_urls=[silent.url], policy="spec", **limits) as proxy:
        started = time.monotonic()
        answer = httpx.post(proxy.base_url + "/chat/completions", json=CHAT | {"stream": True}, timeout=30)
        assert answer.status_code == 504 and answer.json()["error"]["code"] == "first_token_timeout"
        assert time.monotonic() - started < 10
    with FaultServer("keepalive:2") as quiet, running_proxy(spec_urls=[quiet.url], policy="spec", **limits) as proxy:
        started = time.monotonic()
        answer = httpx.post(proxy.base_url + "/chat/completions", json=CHAT | {"stream": True}, timeout=30)
        events = [line for line in answer.text.splitlines() if line.startswith("data: ")]
        assert answer.status_code == 200 and len(events) == 4, answer.text  # 2 events, the error, [DONE]
        assert '"chunk_timeout"' in events[2] and events[3] == "data: [DONE]"
        assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    "gauges",
    [
        "sglang:num_running_reqs NaN\nsglang:num_queue_reqs 0\n",
        "sglang:num_running_reqs +Inf\nsglang:num_queue_reqs 0\n",
        "sglang:num_running_reqs 1e400\nsglang:num_queue_reqs 0\n",
        "sglang:num_running_reqs -4\nsglang:num_queue_reqs 0\n",
        "sglang:num_running_reqs 1\nsglang:num_queue_reqs -4\n",
    ],
    ids=["nan", "inf", "overflow", "negative", "negative-queue"],
)
def test_a_load_no_server_means_is_not_taken(twin_pair, gauges: str) -> None:
    # One NaN in a poll answer made every unpinned request a 500 (the policy's arithmetic), and a
    # negative count (a cap, then) drew all traffic to the server that wrote it.
    spec, _ = twin_pair
    with (
        FaultServer("echo", probe="/metrics", load_text=gauges) as odd,
        running_proxy(spec_urls=[spec.url], base_urls=[odd.url], poll_interval_ms=50) as proxy,
    ):
        wait_for(lambda: sum(r.path == "/metrics" for r in odd.requests) >= 3, "three polls of the odd server")
        answers = [httpx.post(proxy.base_url + "/chat/completions", json=CHAT) for _ in range(4)]
        assert [a.status_code for a in answers] == [200] * 4
        state = httpx.get(proxy.url + "/v1/specroute/state").text
        assert "NaN" not in state and "Infinity" not in state and '"max_running": -4' not in state
