"""The real openai SDK (sync and async, streaming and not, chat and completions) through the proxy."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from proxy_faults import FaultServer
from proxy_harness import RunningProxy, running_proxy, wait_for

MESSAGES = [{"role": "user", "content": "Explain speculative decoding in one line."}]


def test_sync_chat_non_streaming(proxy: RunningProxy) -> None:
    client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="specroute/twin", messages=MESSAGES, max_tokens=12)
    completion = raw.parse()
    assert completion.usage is not None and completion.usage.completion_tokens == 12
    assert completion.choices[0].finish_reason == "length"
    assert completion.choices[0].message.content
    assert raw.headers["x-specroute-pool"] in ("spec", "base")
    assert raw.headers["x-specroute-backend"] in ("spec-0", "base-0")  # a name: no internal address
    assert raw.headers["x-specroute-reason"]
    assert len(raw.headers["x-request-id"]) >= 16


def test_sync_chat_streaming_with_usage(proxy: RunningProxy) -> None:
    client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
    stream = client.chat.completions.create(
        model="specroute/twin", messages=MESSAGES, max_tokens=20, stream=True, stream_options={"include_usage": True}
    )
    text, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert usage is not None and usage.completion_tokens == 20
    assert finish == "length"
    assert "".join(text).strip()


def test_sync_completions_both_ways(proxy: RunningProxy) -> None:
    client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
    completion = client.completions.create(model="specroute/twin", prompt="Once upon a time", max_tokens=9)
    assert completion.usage is not None and completion.usage.completion_tokens == 9
    assert completion.choices[0].text
    chunks = list(client.completions.create(model="specroute/twin", prompt="Once", max_tokens=7, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices).strip()
    assert chunks[-1].choices[0].finish_reason == "length"


def test_async_chat_and_completions(proxy: RunningProxy) -> None:
    async def scenario() -> None:
        client = openai.AsyncOpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        chat = await client.chat.completions.create(model="specroute/twin", messages=MESSAGES, max_tokens=5)
        assert chat.usage is not None and chat.usage.completion_tokens == 5
        stream = await client.chat.completions.create(
            model="specroute/twin", messages=MESSAGES, max_tokens=6, stream=True, stream_options={"include_usage": True}
        )
        usage = [chunk.usage async for chunk in stream if chunk.usage is not None]
        assert usage and usage[-1].completion_tokens == 6
        text = await client.completions.create(model="specroute/twin", prompt="Hi", max_tokens=4)
        assert text.usage is not None and text.usage.completion_tokens == 4
        streamed = await client.completions.create(model="specroute/twin", prompt="Hi", max_tokens=4, stream=True)
        assert [c async for c in streamed]
        await client.close()

    asyncio.run(scenario())
    wait_for(lambda: proxy.in_flight() == 0, what="in-flight counts back to zero")


def test_request_id_passes_through_and_pool_override(proxy: RunningProxy, twin_pair) -> None:
    spec, base = twin_pair
    client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
    for pool in ("base", "spec"):
        raw = client.chat.completions.with_raw_response.create(
            model="specroute/twin",
            messages=MESSAGES,
            max_tokens=2,
            extra_headers={"x-request-id": f"req-{pool}-1", "x-specroute-pool": pool},
        )
        assert raw.headers["x-request-id"] == f"req-{pool}-1"
        assert raw.headers["x-specroute-pool"] == pool
        assert raw.headers["x-specroute-backend"] == f"{pool}-0"
        assert raw.headers["x-specroute-reason"] == "override"


def test_models_health_ready(proxy: RunningProxy) -> None:
    client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
    ids = [model.id for model in client.models.list()]
    assert ids == ["specroute/twin"]  # both pools serve it: one entry
    assert client.models.retrieve("specroute/twin").id == "specroute/twin"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.body == {
        "message": "The model 'no-such-model' does not exist",
        "type": "invalid_request_error",  # OpenAI's (and SGLang's) type for it
        "param": "model",
        "code": "model_not_found",
    }
    assert httpx.get(proxy.url + "/health").json() == {"status": "ok"}
    ready = httpx.get(proxy.url + "/ready")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    # Load balancers and uptime checks probe with HEAD: the read-only endpoints answer it as GET,
    # headers only.
    for path in ("/health", "/ready", "/v1/models", "/v1/models/specroute/twin", "/metrics", "/v1/specroute/state"):
        head = httpx.head(proxy.url + path)
        assert head.status_code == 200 and head.content == b"", (path, head.status_code, head.headers)
        assert head.headers["content-type"].startswith(httpx.get(proxy.url + path).headers["content-type"][:10])


def test_body_and_headers_reach_the_backend_unchanged() -> None:
    body = (
        b'{"model": "m", "messages": [{"role": "user", "content": "caf\\u00e9"}], "tools": [{"type": "function",'
        b' "function": {"name": "f", "parameters": {"type": "object"}}}], "response_format": {"type": "json_object"},'
        b' "logprobs": true, "top_logprobs": 2, "n": 2, "seed": 7, "stop": ["\\n\\n"], "x_unknown": {"deep": [1, 2.50]}}'
    )
    with FaultServer("echo") as upstream, running_proxy(spec_urls=[upstream.url], policy="spec") as proxy:
        answer = httpx.post(
            proxy.base_url + "/chat/completions",
            content=body,
            headers={"content-type": "application/json", "authorization": "Bearer client-key", "x-custom": "1"},
        )
        assert answer.status_code == 200
        sent = [r for r in upstream.requests if r.method == "POST"][-1]
        assert sent.body == body  # byte for byte: key order, spacing, escapes, unknown fields
        assert sent.path == "/v1/chat/completions"
        assert sent.headers["authorization"] == "Bearer client-key"
        assert sent.headers["x-custom"] == "1"
        assert sent.headers["x-request-id"] == answer.headers["x-request-id"]


def test_repeated_headers_are_joined_not_dropped() -> None:
    with FaultServer("echo") as upstream, running_proxy(spec_urls=[upstream.url], policy="spec") as proxy:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        answer = httpx.post(
            proxy.base_url + "/chat/completions", json=body, headers=[("x-custom", "a"), ("x-custom", "b")]
        )
        assert answer.status_code == 200
        assert [r for r in upstream.requests if r.method == "POST"][-1].headers["x-custom"] == "a, b"
        twice = httpx.post(
            proxy.base_url + "/chat/completions",
            json=body,
            headers=[("x-specroute-pool", "spec"), ("x-specroute-pool", "base")],
        )
        assert twice.status_code == 400 and twice.json()["error"]["param"] == "x-specroute-pool"


def test_the_query_string_reaches_the_backend_as_sent() -> None:
    with FaultServer("echo") as upstream, running_proxy(spec_urls=[upstream.url], policy="spec") as proxy:
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            extra_query={"api-version": "2024-10-21", "tag": "a b&c"},
        )
        sent = [r for r in upstream.requests if r.method == "POST"][-1]
        assert sent.path == "/v1/chat/completions?api-version=2024-10-21&tag=a+b%26c"


def test_pool_api_key_replaces_the_client_key() -> None:
    with (
        FaultServer("echo") as upstream,
        running_proxy(spec_urls=[upstream.url], policy="spec", spec_api_key="pool-secret") as proxy,
    ):
        client = openai.OpenAI(base_url=proxy.base_url, api_key="client-key", max_retries=0)
        client.chat.completions.create(model="m", messages=MESSAGES)
        sent = [r for r in upstream.requests if r.method == "POST"][-1]
        assert sent.headers["authorization"] == "Bearer pool-secret"


def test_client_sockets_have_nagle_off(proxy: RunningProxy) -> None:
    """With Nagle on, a stream's small first chunk waits for the client's delayed ACK (~40 ms)."""
    import socket

    with httpx.stream(
        "POST",
        proxy.base_url + "/chat/completions",
        timeout=30,
        json={"model": "m", "messages": MESSAGES, "max_tokens": 50, "stream": True},
    ) as response:
        chunks = response.iter_raw()
        first = next(chunks)
        sockets = [c.transport.get_extra_info("socket") for c in list(proxy.server.server_state.connections)]
        assert sockets and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets)
        # The rest of the stream (on a busy machine the first read may hold all of it).
        assert b"[DONE]" in first + b"".join(chunks)


def test_expect_100_continue_is_answered_by_the_proxy_not_forwarded() -> None:
    """curl sends `Expect: 100-continue` with bodies over 1 KB; the upstream must not see it."""
    import socket

    body = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 2000 + b'"}]}'
    with FaultServer("echo") as upstream, running_proxy(spec_urls=[upstream.url], policy="spec") as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"expect: 100-continue\r\ncontent-length: %d\r\n\r\n" % len(body)
            )
            assert sock.recv(1024).startswith(b"HTTP/1.1 100 Continue")
            sock.sendall(body)
            answer = b""
            while b'"usage"' not in answer:
                part = sock.recv(65536)
                assert part, answer
                answer += part
        assert answer.startswith(b"HTTP/1.1 200 OK")
        sent = [r for r in upstream.requests if r.method == "POST"][-1]
        assert sent.body == body and "expect" not in sent.headers


def _events(body: bytes) -> list[dict]:
    lines = [line.removeprefix(b"data: ") for line in body.split(b"\n") if line.startswith(b"data: {")]
    return [json.loads(line) for line in lines]


def test_a_stream_is_asked_for_its_usage_which_only_a_client_that_asked_gets(proxy: RunningProxy) -> None:
    def stream(extra: dict) -> tuple[str, list[dict]]:
        body = {"model": "specroute/twin", "messages": MESSAGES, "max_tokens": 8, "stream": True, **extra}
        with httpx.stream("POST", proxy.base_url + "/chat/completions", json=body, timeout=30) as answer:
            assert answer.status_code == 200
            return answer.headers["x-specroute-pool"], _events(answer.read())

    def output_tokens(pool: str) -> float:
        metrics = httpx.get(proxy.url + "/metrics", timeout=5).text
        line = f'specroute_tokens_total{{pool="{pool}",type="output"}} '
        found = [row for row in metrics.splitlines() if row.startswith(line)]
        return float(found[0].removeprefix(line)) if found else 0.0

    wait_for(lambda: proxy.in_flight() == 0, what="the earlier requests to end")
    before = {pool: output_tokens(pool) for pool in ("spec", "base")}
    pool, events = stream({})
    # The client named no stream_options: the stream it gets carries no usage chunk (nor any
    # choice-less event), as without the proxy, yet the proxy read one (its 8 tokens counted).
    assert events and all(event["choices"] for event in events) and not any(e.get("usage") for e in events)
    wait_for(lambda: output_tokens(pool) == before[pool] + 8, what="the stream's usage read")
    pool, events = stream({"stream_options": {"include_usage": True}})
    usage = [event["usage"] for event in events if event.get("usage")]
    assert len(usage) == 1 and usage[0]["completion_tokens"] == 8 and events[-1]["choices"] == []


def test_only_a_stream_that_names_no_stream_options_is_asked_for_its_usage() -> None:
    base = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true}'
    named = b'{"model": "m", "stream": true, "stream_options": {"include_usage": false}, "messages": []}'
    plain = b'{"model": "m", "messages": [], "stream": false}'
    with FaultServer("echo") as upstream:
        for settings, body, expected in (
            ({}, base, b'{"stream_options":{"include_usage":true},' + base[1:]),
            ({}, named, named),
            ({}, plain, plain),
            ({"stream_usage": False}, base, base),
        ):
            with running_proxy(spec_urls=[upstream.url], policy="spec", **settings) as proxy:
                httpx.post(
                    proxy.base_url + "/chat/completions", content=body, headers={"content-type": "application/json"}
                )
            sent = [r for r in upstream.requests if r.method == "POST"][-1]
            assert sent.body == expected, (settings, body)


def test_an_event_may_end_its_line_one_way_and_its_blank_line_another() -> None:
    # LF then a CRLF blank line ends an event: unseen, the usage event and [DONE] after it were
    # held as one unterminated piece, and the usage filter dropped both.
    from proxy.scan import EventSplitter, without_usage_events

    content = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}],"usage":null}\n\r\n'
    usage = b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5}}\n\r\n'
    done = b"data: [DONE]\r\n\n"
    splitter = EventSplitter(1 << 20)
    assert splitter.feed(content + usage[:9]) == content and splitter.rest() == usage[:9]
    assert splitter.feed(usage[9:] + done) == usage + done
    assert without_usage_events(content + usage + done) == content + done


def test_only_the_usage_event_is_kept_from_a_client_that_did_not_ask() -> None:
    from proxy.scan import without_usage_events

    content = b'data: {"choices":[{"index":0,"delta":{"content":"a \\"usage\\": {"}}],"usage":null}\n\n'
    details = b'data: {"choices":[],"sglext":{"spec_tokens_details":{"spec_verify_ct":3}}}\r\n\r\n'
    usage = b'data: {"id":"x","choices": [ ],"usage": {"prompt_tokens":3,"completion_tokens":5}}\n\n'
    done = b"data: [DONE]\n\n"
    assert without_usage_events(content) is content  # no usage object: one scan, as it came
    assert without_usage_events(content + details + usage + done) == content + details + done
    assert without_usage_events(usage) == b""


def test_a_null_stream_is_not_set_as_openai_reads_it(proxy: RunningProxy) -> None:
    # The SDK sends `"stream": null` for stream=None; SGLang (and the twin, as faithful) refuse
    # null for its `stream: bool` with a 400, OpenAI and vLLM read it as not set.
    client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0, timeout=60)
    raw = client.chat.completions.with_raw_response.create(
        model="specroute/twin", messages=MESSAGES, max_tokens=5, stream=None, stream_options=None
    )
    assert raw.http_response.status_code == 200
    assert raw.headers["content-type"].startswith("application/json")  # not streamed
    completion = raw.parse()
    assert completion.usage is not None and completion.usage.completion_tokens == 5
    completion = client.completions.create(model="specroute/twin", prompt="Once", max_tokens=3, stream=None)
    assert completion.usage is not None and completion.usage.completion_tokens == 3


def test_only_the_null_stream_members_are_cut_from_the_body() -> None:
    kept = b'"messages": [{"role": "user", "content": "\\"stream\\": null"}], "x": {"stream": null}'
    with FaultServer("echo") as upstream, running_proxy(spec_urls=[upstream.url], policy="spec") as proxy:
        for body, expected in (
            (b'{"model": "m", "stream": null, ' + kept + b"}", b'{"model": "m", ' + kept + b"}"),
            (b'{"model": "m", ' + kept + b', "stream_options": null}', b'{"model": "m", ' + kept + b"}"),
            # Over 256 KiB: parsed, and so cut, in the worker process.
            (
                b'{"prompt": "' + b"a " * 150_000 + b'", "stream": null, "model": "m"}',
                b'{"prompt": "' + b"a " * 150_000 + b'", "model": "m"}',
            ),
            # A stream whose stream_options is null is asked for its usage as one that names none.
            (
                b'{"stream": true, "stream_options": null, "model": "m"}',
                b'{"stream_options": {"include_usage": true}, "stream": true, "model": "m"}',
            ),
            # An integer past 64 bits stays exact (orjson would read it as a float).
            (
                b'{"model": "m", "stream": null, "seed": 123456789012345678901234567890}',
                b'{"model": "m", "seed": 123456789012345678901234567890}',
            ),
            # Nothing null: the body goes byte for byte, spacing and all.
            (b'{ "model" :"m",  "stream": false,"x":[1.0, 1e2]}', None),
        ):
            answer = httpx.post(
                proxy.base_url + "/chat/completions",
                content=body,
                headers={"content-type": "application/json"},
                timeout=30,
            )
            assert answer.status_code == 200, answer.text
            sent = [r for r in upstream.requests if r.method == "POST"][-1]
            if expected is None:
                assert sent.body == body
            else:  # serialised again without the null members: the same JSON, its order kept
                assert json.loads(sent.body) == json.loads(expected), body
                assert list(json.loads(sent.body)) == list(json.loads(expected))
