"""Failure semantics: failover before the first byte only, in-band errors after it, timeouts,
client disconnects that free the upstream slot, and OpenAI-shaped errors for bad input."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import socket
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest
from proxy_faults import FaultServer
from proxy_harness import TIME_SCALE, RunningProxy, running_proxy, twin_running, wait_for

from sim.testing import RunningTwin, twin

MESSAGES = [{"role": "user", "content": "Hello"}]


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def posts(server: FaultServer) -> int:
    return sum(1 for r in server.requests if r.method == "POST")


def dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"  # closed again: connections are refused


def test_a_server_down_at_start_is_skipped_without_an_attempt(twin_pair) -> None:
    _, base = twin_pair
    with running_proxy(spec_urls=[dead_url()], base_urls=[base.url], policy="spec") as proxy:
        assert not proxy.app.router.pools["spec"].instances[0].healthy
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, max_tokens=3)
        assert raw.parse().usage.completion_tokens == 3
        assert (raw.headers["x-specroute-pool"], raw.headers["x-specroute-reason"]) == ("base", "unavailable")
        assert proxy.app.router.pools["spec"].instances[0].dispatched_total == 0
        assert httpx.get(proxy.url + "/ready").status_code == 200  # base takes work
        metrics = httpx.get(proxy.url + "/metrics").text
        dead = proxy.app.router.pools["spec"].instances[0].url
        assert f'specroute_upstream_healthy{{instance="{dead}",pool="spec"}} 0.0' in metrics
        assert f'specroute_upstream_healthy{{instance="{base.url}",pool="base"}} 1.0' in metrics
        assert 'specroute_snapshot_age_seconds{pool="spec"} +Inf' in metrics  # never read: an age alert fires


@pytest.mark.parametrize("close", ["rst", "fin"])
def test_a_request_on_a_pooled_connection_its_server_closed_is_sent_again_on_a_new_one(close: str) -> None:
    """A server's keep-alive close can cross a request sent on the pooled connection (uvicorn's
    timer runs late after a stall, and closes with the request unread: a reset). The request is
    sent again on a new connection, to the same server: it got a 502 before (nowhere else to go
    in a pool of one) and counted against a healthy server."""
    with (
        FaultServer(f"staleconn:{close}") as server,
        running_proxy(spec_urls=[server.url], policy="spec") as proxy,
    ):
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        for _ in range(2):  # the first opens the connection and leaves it pooled; the next meets it closed
            raw = client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, max_tokens=2)
            assert raw.parse().choices[0].message.content == "ok"
            assert raw.headers["x-specroute-backend"] == "spec-0"
        assert posts(server) == 3  # the first; the second on the closed connection, then on a new one
        instance = proxy.app.router.pools["spec"].instances[0]
        assert instance.failed_total == 0
        assert proxy.app.upstream.resent == 1
        state = httpx.get(proxy.url + "/v1/specroute/state").json()["pools"]["spec"]["instances"][0]
        assert state["outlier"]["state"] == "ok"


def test_a_pooled_connection_closed_long_after_the_request_went_is_not_resent() -> None:
    """A close that comes seconds after the request (a balancer's idle timeout between) may end
    a request the server ran: it is a failure, not resent."""
    with FaultServer("staleconn:late") as server, running_proxy(spec_urls=[server.url], policy="spec") as proxy:
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0, timeout=30)
        assert client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2).choices
        with pytest.raises(openai.APIStatusError) as failed:
            client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
        assert failed.value.status_code == 502 and failed.value.code == "upstream_disconnected"
        assert posts(server) == 2 and proxy.app.upstream.resent == 0


def test_a_request_whose_new_connection_is_closed_unanswered_is_not_sent_there_again() -> None:
    """Only a pooled connection's close is the keep-alive race: a server that drops a request on a
    new connection may have crashed on it (a query of death), and gets it once."""
    with FaultServer("drop") as dropping, running_proxy(spec_urls=[dropping.url], policy="spec") as proxy:
        answer = httpx.post(proxy.base_url + "/chat/completions", json={"model": "m", "messages": MESSAGES})
        assert answer.status_code == 502 and error_of(answer)["code"] == "upstream_disconnected"
        assert posts(dropping) == 1 and proxy.app.upstream.resent == 0


def test_ready_is_503_when_no_upstream_can_be_reached() -> None:
    with running_proxy(spec_urls=[dead_url()], base_urls=[dead_url()]) as proxy:
        ready = httpx.get(proxy.url + "/ready")
        assert ready.status_code == 503
        response = httpx.post(proxy.base_url + "/chat/completions", json={"model": "m", "messages": MESSAGES})
        assert response.status_code == 503 and error_of(response)["code"] == "no_upstream"


@pytest.mark.parametrize(("poll_interval_ms", "retry_after"), [(100, "1"), (250, "3")])
def test_no_upstream_says_when_to_retry(poll_interval_ms: int, retry_after: str) -> None:
    # As the proxy's 429s do: the SDKs wait that long. A server that cannot be reached is tried
    # again every 10 polls, so sooner than that nothing has changed.
    with running_proxy(spec_urls=[dead_url()], base_urls=[dead_url()], poll_interval_ms=poll_interval_ms) as proxy:
        chat = httpx.post(proxy.base_url + "/chat/completions", json={"model": "m", "messages": MESSAGES}, timeout=30)
        models = httpx.get(proxy.base_url + "/models", timeout=30)
        for response in (chat, models):
            assert response.status_code == 503 and error_of(response)["code"] == "no_upstream", response.text
            assert response.headers.get_list("retry-after") == [retry_after]


def test_a_server_that_dies_fails_over_then_is_skipped(twin_pair) -> None:
    _, base = twin_pair
    with twin("spec", time_scale=TIME_SCALE) as doomed:
        # Polls far apart: the first request meets the dead server before any poll does.
        with running_proxy(
            spec_urls=[doomed.url], base_urls=[base.url], policy="spec", poll_interval_ms=60_000, stale_ms=120_000
        ) as proxy:
            doomed.process.terminate()
            doomed.process.wait(10)
            client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
            raw = client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, max_tokens=3)
            assert raw.parse().usage.completion_tokens == 3
            assert raw.headers["x-specroute-backend"] == "base-0"
            assert raw.headers["x-specroute-pool"] == "base"  # where it ran, not where it was first sent
            assert raw.headers["x-specroute-reason"] == "static+failover"
            spec = proxy.app.router.pools["spec"].instances[0]
            assert (spec.failed_total, spec.healthy) == (1, False)
            raw = client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, max_tokens=3)
            assert raw.headers["x-specroute-reason"] == "unavailable" and spec.dispatched_total == 1  # skipped
            wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")


def test_a_blackholed_server_costs_no_connect_timeout_per_request(twin_pair) -> None:
    """A server whose accept queue is full drops new SYNs: connecting hangs until the timeout.
    Found unreachable by the poller, it is skipped instead of costing each request the wait."""
    _, base = twin_pair
    with socket.socket() as blackhole:
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(0)
        url = f"http://127.0.0.1:{blackhole.getsockname()[1]}"
        fillers = []
        for _ in range(3):  # fill the accept queue; nobody ever accepts
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(blackhole.getsockname())
            fillers.append(filler)
        try:
            with running_proxy(spec_urls=[url], base_urls=[base.url], policy="spec", connect_timeout_s=0.5) as proxy:
                state = httpx.get(proxy.url + "/v1/specroute/state").json()["pools"]["spec"]["instances"][0]
                assert not state["healthy"] and "ConnectTimeout" in state["error"]
                client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
                for _ in range(3):
                    raw = client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, max_tokens=2)
                    assert raw.headers["x-specroute-backend"] == "base-0"
                assert proxy.app.router.pools["spec"].instances[0].dispatched_total == 0
                wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")
        finally:
            for filler in fillers:
                filler.close()


def test_5xx_retried_on_another_instance_of_the_same_pool_first(twin_pair) -> None:
    spec, base = twin_pair
    with (
        FaultServer("status:503") as bad,
        running_proxy(spec_urls=[bad.url, spec.url], base_urls=[base.url], policy="spec") as proxy,
    ):
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        for _ in range(4):
            raw = client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, max_tokens=2)
            assert raw.status_code == 200
            assert raw.headers["x-specroute-backend"] == "spec-1"  # the second listed
        assert posts(bad) >= 1  # some requests went there first and were retried on the spec twin


def test_gives_up_after_failover_and_tells_the_sdk_not_to_retry() -> None:
    with (
        FaultServer("status:503") as first,
        FaultServer("status:502") as second,
        running_proxy(spec_urls=[first.url], base_urls=[second.url], policy="spec") as proxy,
    ):
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=2)
        with pytest.raises(openai.InternalServerError) as caught:
            client.chat.completions.create(model="m", messages=MESSAGES)
        response = caught.value.response
        assert response.headers["x-should-retry"] == "false"
        assert response.status_code == 502  # the last upstream's answer, normalised
        error = error_of(response)
        request_id = response.headers["x-request-id"]  # no upstream internals, the id to find them
        assert error["message"] == f"upstream server error (HTTP 502; request id {request_id})"
        assert error["type"] == "server_error"
        assert (posts(first), posts(second)) == (1, 1)  # the SDK's 2 retries were not spent
        assert proxy.in_flight() == 0


def test_upstream_429_reaches_the_sdk_with_its_retry_after() -> None:
    with FaultServer("status:429") as limited, running_proxy(spec_urls=[limited.url], policy="spec") as proxy:
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model="m", messages=MESSAGES)
        assert caught.value.response.headers["retry-after"] == "1"
        # An OpenAI-compatible upstream's rate-limit headers too; its other headers stay behind.
        assert caught.value.response.headers["x-ratelimit-remaining-requests"] == "0"
        assert "x-internal" not in caught.value.response.headers
        assert "x-should-retry" not in caught.value.response.headers  # the SDK's own retry applies
        assert error_of(caught.value.response)["type"] == "rate_limit_error"
        assert posts(limited) == 1  # a 4xx is the client's answer, not a reason to fail over


def test_mid_stream_failure_ends_with_an_error_event_not_a_clean_end() -> None:
    with FaultServer("cut:3") as cut, running_proxy(spec_urls=[cut.url], policy="spec") as proxy:
        with httpx.stream(
            "POST", proxy.base_url + "/chat/completions", json={"model": "m", "messages": MESSAGES, "stream": True}
        ) as response:
            assert response.status_code == 200
            body = response.read()
        events = [e for e in body.split(b"\n\n") if e]
        assert len(events) == 5  # 3 relayed chunks, the error, [DONE]
        assert events[3].startswith(b'data: {"error":') and b"upstream_disconnected" in events[3]
        assert events[4] == b"data: [DONE]"
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        with pytest.raises(openai.APIError, match="mid-stream"):
            for _ in stream:
                pass
        assert posts(cut) == 2  # never retried once bytes reached the client
        wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")


def test_an_event_cut_in_half_upstream_never_reaches_the_client() -> None:
    with FaultServer("cutmid:3") as cut, running_proxy(spec_urls=[cut.url], policy="spec") as proxy:
        with httpx.stream(
            "POST", proxy.base_url + "/chat/completions", json={"model": "m", "messages": MESSAGES, "stream": True}
        ) as response:
            body = response.read()
        events = [e for e in body.split(b"\n\n") if e]
        assert len(events) == 5, body  # 3 whole events, the error, [DONE]: no half of the 4th
        assert all(e.startswith(b"data: {") for e in events[:4]) and events[4] == b"data: [DONE]"
        assert b"upstream_disconnected" in events[3] and b"t3 " not in body
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        with pytest.raises(openai.APIError, match="mid-stream"):  # our error, not a JSON decode error
            for _ in client.chat.completions.create(model="m", messages=MESSAGES, stream=True):
                pass
        wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")


def test_events_split_across_reads_are_relayed_whole() -> None:
    with FaultServer("split:3") as split, running_proxy(spec_urls=[split.url], policy="spec") as proxy:
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream) == "t0 t1 t2 "
        wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")


def test_json_body_cut_upstream_breaks_the_client_connection() -> None:
    errors: list[logging.LogRecord] = []
    catch = logging.Handler(logging.ERROR)
    catch.emit = errors.append  # type: ignore[method-assign]
    with FaultServer("cutjson") as cut, running_proxy(spec_urls=[cut.url], policy="spec") as proxy:
        logging.getLogger("uvicorn.error").addHandler(catch)  # after the server set its loggers up
        try:
            with pytest.raises(httpx.RemoteProtocolError):
                httpx.post(proxy.base_url + "/chat/completions", json={"model": "m", "messages": MESSAGES})
            assert posts(cut) == 1
            wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")
            assert httpx.get(proxy.url + "/health").status_code == 200
        finally:
            logging.getLogger("uvicorn.error").removeHandler(catch)
    # closed as the proxy's own decision, not logged by uvicorn as an application error ("ASGI
    # callable returned without completing response": a client or upstream could write them at will)
    assert not errors, [r.getMessage() for r in errors]


def test_first_token_timeout_is_504_and_closes_the_upstream_request() -> None:
    with (
        FaultServer("hang") as hang,
        running_proxy(spec_urls=[hang.url], policy="spec", first_token_timeout_s=0.5) as proxy,
    ):
        response = httpx.post(
            proxy.base_url + "/chat/completions", timeout=30, json={"model": "m", "messages": MESSAGES, "stream": True}
        )
        assert response.status_code == 504
        assert error_of(response)["code"] == "first_token_timeout"
        assert response.headers["x-should-retry"] == "false"  # the SDK would only wait as long again
        assert posts(hang) == 1  # a timeout is not retried: the next server would wait as long
        wait_for(lambda: hang.open_connections == 0, what="the proxy to drop its upstream connection")
        assert proxy.in_flight() == 0


def test_a_json_answer_may_take_longer_than_the_first_token_timeout(slow_twin) -> None:
    # A non-streamed answer's headers come when it is complete: only the total timeout bounds it.
    with running_proxy(base_urls=[slow_twin.url], policy="base", first_token_timeout_s=0.3) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        reply = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=100)
        assert reply.usage.completion_tokens == 100  # about 0.7 s in real time


@pytest.mark.parametrize("setting", [{"chunk_timeout_s": 0.5}, {"total_timeout_s": 1.0, "connect_timeout_s": 0.5}])
def test_stalled_stream_times_out_with_an_error_event(setting) -> None:
    with FaultServer("stall:2") as stall, running_proxy(spec_urls=[stall.url], policy="spec", **setting) as proxy:
        response = httpx.post(
            proxy.base_url + "/chat/completions", json={"model": "m", "messages": MESSAGES, "stream": True}, timeout=30
        )
        events = [e for e in response.content.split(b"\n\n") if e]
        assert len(events) == 4 and events[-1] == b"data: [DONE]"
        expected = b"chunk_timeout" if "chunk_timeout_s" in setting else b"total_timeout"
        assert events[2].startswith(b'data: {"error":') and expected in events[2]
        wait_for(lambda: stall.open_connections == 0, what="the proxy to drop its upstream connection")
        assert proxy.in_flight() == 0


@pytest.fixture(scope="module")
def slow_twin() -> Iterator[RunningTwin]:
    """Real-time twin: 4,000 tokens take seconds, so a cancel is visible in /v1/loads."""
    with twin("base", time_scale=1.0, seed=3, args=("--output-len", "fixed:4096")) as running:
        yield running


@pytest.fixture(scope="module")
def slow_proxy(slow_twin: RunningTwin) -> Iterator[RunningProxy]:
    with running_proxy(base_urls=[slow_twin.url], policy="base") as proxy:
        yield proxy


@pytest.fixture(scope="module")
def patient_twin() -> Iterator[RunningTwin]:
    """A twin at a twentieth of real time: SGLang's own abort of a gone client's request (2 s
    after a started stream's last write, at its 4 s checks before) comes only after 40-80 s,
    so a slot freed within seconds was freed by the proxy's `/abort_request`."""
    with twin("base", time_scale=0.05, seed=3, args=("--output-len", "fixed:4096")) as running:
        yield running


@pytest.fixture(scope="module")
def patient_proxy(patient_twin: RunningTwin) -> Iterator[RunningProxy]:
    with running_proxy(base_urls=[patient_twin.url], policy="base") as proxy:
        yield proxy


def aborts_sent(proxy: RunningProxy) -> float:
    found = re.search(
        rb'specroute_upstream_aborts_total\{outcome="sent",pool="base"\} (\S+)',
        httpx.get(proxy.url + "/metrics").content,
    )
    assert found is not None
    return float(found.group(1))


@pytest.mark.parametrize("model", ["m", "x data: [DONE] y"])
def test_client_disconnect_mid_stream_frees_the_upstream_slot(patient_twin, patient_proxy, model: str) -> None:
    """Whatever the events' text reads: SGLang echoes any model name in every chunk, and a model
    may write "data: [DONE]" (a review saw such a stream taken as ended at its first chunk, its
    client's leaving no longer cancelling it: 20,000 tokens made for no one). The proxy aborts
    the request on SGLang at once rather than leave it to SGLang's next look (seconds later)."""
    slow_twin, slow_proxy = patient_twin, patient_proxy
    sent = aborts_sent(slow_proxy)
    with httpx.stream(
        "POST",
        slow_proxy.base_url + "/chat/completions",
        timeout=30,
        json={"model": model, "messages": MESSAGES, "max_tokens": 4000, "stream": True},
    ) as response:
        chunks = response.iter_raw()  # kept: a dropped iterator would close the response itself
        assert next(chunks).startswith(b"data: ")
        wait_for(lambda: twin_running(slow_twin) == 1, timeout=10, what="the twin to show the request")
    # Leaving the block closed the connection: the twin's slot must free long before 4,000 tokens.
    wait_for(lambda: twin_running(slow_twin) == 0, timeout=10, what="the twin to drop the request")
    wait_for(lambda: slow_proxy.in_flight() == 0, timeout=5, what="in-flight released")
    assert aborts_sent(slow_proxy) == sent + 1


def test_client_disconnect_before_the_first_byte_frees_the_upstream_slot(patient_twin, patient_proxy) -> None:
    """A JSON answer's headers come when it is done: its client leaving while it runs is seen by
    SGLang only at its next 4 s check; the proxy aborts it at once."""
    slow_twin, slow_proxy = patient_twin, patient_proxy
    sent = aborts_sent(slow_proxy)
    body = b'{"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4000}'
    with socket.create_connection(("127.0.0.1", slow_proxy.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        wait_for(lambda: twin_running(slow_twin) == 1, timeout=10, what="the request to reach the twin")
    wait_for(lambda: twin_running(slow_twin) == 0, timeout=10, what="the twin to drop the request")
    wait_for(lambda: slow_proxy.in_flight() == 0, timeout=5, what="in-flight released")
    assert aborts_sent(slow_proxy) == sent + 1


def test_a_client_rid_is_refused_short_and_aborted_by_when_long(patient_twin, patient_proxy) -> None:
    """SGLang aborts every request whose rid begins with an aborted one's, its own abort of a gone
    client's included: a client's rid "a" would end every other request whose id begins with
    "a" when that client left. A short one is refused; one of a uuid's length is the request's,
    its response's id, and what the proxy aborts it by."""
    chat = {"model": "m", "messages": MESSAGES, "max_tokens": 4000}
    for path, field in (("/chat/completions", "rid"), ("/completions", "rid"), ("/responses", "request_id")):
        body = (
            {"model": "m", "input": "Hi"}
            if path == "/responses"
            else chat | ({"prompt": "Hi"} if path == "/completions" else {})
        )
        refused = httpx.post(patient_proxy.base_url + path, json={**body, field: "a"}, timeout=30)
        assert refused.status_code == 400, path
        assert error_of(refused)["param"] == field and error_of(refused)["code"] == "invalid_value"
    rid = "client-chosen-" + "7" * 24
    sent = aborts_sent(patient_proxy)
    with httpx.stream(
        "POST", patient_proxy.base_url + "/chat/completions", timeout=30, json={**chat, "stream": True, "rid": rid}
    ) as response:
        chunks = response.iter_raw()
        first = next(chunks)
        assert json.loads(first.split(b"\n", 1)[0][len(b"data: ") :])["id"] == rid
        wait_for(lambda: twin_running(patient_twin) == 1, timeout=10, what="the twin to show the request")
    wait_for(lambda: twin_running(patient_twin) == 0, timeout=10, what="the twin to drop the request")
    assert aborts_sent(patient_proxy) == sent + 1


def test_the_proxy_names_an_sglang_request_only_where_sglang_runs_it_under_that_name() -> None:
    """The rid the proxy adds (proxy/aborts.py) goes only where SGLang makes one engine request
    named by it, and never beside an id field of the client's (a second key: the client's, last,
    would win, and the abort would name nothing). SGLang names each request of a completions
    batch (even of one prompt: `<rid>_0`) and each choice of n > 1 itself."""
    with (
        FaultServer("echo", probe="/get_load") as sglang,
        running_proxy(base_urls=[sglang.url], policy="base") as proxy,
    ):
        wait_for(lambda: all(i.kind == "sglang" for i in proxy.app.router.instances()), what="the server learned")

        def sent(path: str, body: dict) -> bytes:
            assert httpx.post(proxy.base_url + path, json=body, timeout=10).status_code == 200
            return sglang.requests[-1].body

        chat = {"model": "m", "messages": MESSAGES, "max_tokens": 4}
        assert re.match(rb'\{"rid":"[0-9a-f]{32}",', sent("/chat/completions", chat))
        assert re.match(rb'\{"request_id":"resp_[0-9a-f]{32}",', sent("/responses", {"model": "m", "input": "Hi"}))
        for path, body in (
            ("/chat/completions", chat | {"rid": None}),
            ("/chat/completions", chat | {"n": 2}),
            ("/completions", {"model": "m", "prompt": ["Hi"], "max_tokens": 4}),
            ("/completions", {"model": "m", "prompt": ["Hi", "Ho"], "max_tokens": 4}),
            ("/responses", {"model": "m", "input": "Hi", "request_id": None}),
        ):
            forwarded = sent(path, body)
            assert forwarded.count(b'"rid"') + forwarded.count(b'"request_id"') == int(
                "rid" in body or "request_id" in body
            ), body
        assert re.match(
            rb'\{"rid":"[0-9a-f]{32}",', sent("/completions", {"model": "m", "prompt": [1, 2], "max_tokens": 4})
        )


def test_a_stream_refused_in_band_gets_its_status_and_fails_over() -> None:
    """SGLang answers a stream its scheduler refuses (--max-queued-requests: a full queue) with a
    200 whose first event is an error (503), then [DONE]; the proxy holds a stream's headers
    until its first event, so it answers the status instead (a 503 the SDK may retry), and
    with another server tries that one: the request never ran."""
    long = {"model": "m", "messages": MESSAGES, "max_tokens": 20000, "ignore_eos": True}
    stream = {"model": "m", "messages": MESSAGES, "max_tokens": 8, "stream": True}
    args = ("--max-running-requests", "1", "--max-queued-requests", "1")
    with (
        twin("base", time_scale=1.0, seed=5, args=args) as full,
        twin("spec", time_scale=1.0, seed=6) as free,
        httpx.Client(base_url=full.url, timeout=60) as direct,
        concurrent.futures.ThreadPoolExecutor(2) as pool,
    ):
        # One at a time: two arriving in one scheduler step would find the queue full between them.
        held = [pool.submit(direct.post, "/v1/chat/completions", json={**long, "rid": "held-0"})]
        try:
            wait_for(lambda: twin_running(full) == 1, timeout=10, what="one running")
            held.append(pool.submit(direct.post, "/v1/chat/completions", json={**long, "rid": "held-1"}))
            wait_for(lambda: twin_running(full) == 2, timeout=10, what="one running, one queued")
            with running_proxy(base_urls=[full.url], policy="base") as alone:
                refused = httpx.post(alone.base_url + "/chat/completions", json=stream, timeout=30)
                assert refused.status_code == 503
                assert error_of(refused)["code"] == "503"
            with running_proxy(base_urls=[full.url], spec_urls=[free.url], policy="base") as proxy:
                served = httpx.post(proxy.base_url + "/chat/completions", json=stream, timeout=30)
                assert served.status_code == 200
                assert served.headers["x-specroute-reason"] == "static+failover"
                assert served.text.rstrip().endswith("data: [DONE]") and '"error"' not in served.text
        finally:
            for i in range(2):
                direct.post("/abort_request", json={"rid": f"held-{i}"})
            for answer in held:
                answer.result(timeout=30)


@pytest.mark.parametrize("split", [8, 20, 100])
def test_a_refusal_split_across_reads_is_read_whole(split: int) -> None:
    """A review's finding: the first event judged as far as the first read went, so a refusal
    whose first bytes came alone reached the client as a 200 (8 bytes) or read as a 502 (its
    code not yet there)."""
    with FaultServer(f"refusal:{split}") as bad, running_proxy(base_urls=[bad.url], policy="base") as proxy:
        answer = httpx.post(
            proxy.base_url + "/chat/completions", json={"model": "m", "messages": MESSAGES, "stream": True}, timeout=10
        )
    assert answer.status_code == 503 and error_of(answer)["code"] == "503"


def test_a_stream_ended_by_an_in_band_error_is_relayed_and_counted_an_error() -> None:
    """An error event after the stream started (SGLang: a running request's timeout, 503) reaches
    the client as it came, and the request counts as an error, not a success."""
    with FaultServer("errorevent:2") as bad, running_proxy(base_urls=[bad.url], policy="base") as proxy:
        sdk = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        with pytest.raises(openai.APIError, match="Request running timeout reached"):
            for _ in sdk.chat.completions.create(model="m", messages=MESSAGES, stream=True):
                pass
        metrics = httpx.get(proxy.url + "/metrics", timeout=5).text
        assert re.search(r'specroute_requests_total\{outcome="error",policy="base",pool="base"\} 1\.0', metrics)
        assert re.search(r'specroute_requests_total\{outcome="ok",policy="base",pool="base"\} 0\.0', metrics)


def test_requests_still_running_when_the_drain_ends_are_told_so(slow_twin, capfd) -> None:
    """SIGTERM's drain (here 0.5 s) ends: a stream gets an error event, a request still waiting
    for its first byte a 503 the SDK can retry elsewhere; neither connection is just dropped."""
    drain_cut_requests(slow_twin)
    logged = capfd.readouterr().err
    # uvicorn's line, in the proxy's words and at warning level: the cut happened, as designed.
    assert "drain timeout (SPECROUTE_DRAIN_TIMEOUT_S) reached: 2 running request(s) cut" in logged
    assert "Exception in ASGI application" not in logged  # an expected cut is not an app error


def drain_cut_requests(slow_twin: RunningTwin) -> None:
    with (
        FaultServer("hang") as hang,
        running_proxy(spec_urls=[hang.url], base_urls=[slow_twin.url], drain_timeout_s=0.5) as proxy,
    ):
        stream = httpx.stream(
            "POST",
            proxy.base_url + "/chat/completions",
            timeout=30,
            headers={"x-specroute-pool": "base"},
            json={"model": "m", "messages": MESSAGES, "max_tokens": 4000, "stream": True},
        )
        response = stream.__enter__()
        chunks = response.iter_raw()
        assert next(chunks).startswith(b"data: ")
        waiting: list[httpx.Response] = []
        waiter = threading.Thread(
            target=lambda: waiting.append(
                httpx.post(
                    proxy.base_url + "/chat/completions",
                    json={"model": "m", "messages": MESSAGES},
                    headers={"x-specroute-pool": "spec"},
                    timeout=30,
                )
            )
        )
        waiter.start()
        wait_for(lambda: posts(hang) == 1, what="the second request to reach its upstream")
        proxy.app.draining = True
        proxy.server.should_exit = True
        rest = b"".join(chunks)
        stream.__exit__(None, None, None)
        assert rest.endswith(b"data: [DONE]\n\n") and b'"code":"shutting_down"' in rest
        waiter.join(30)
        assert waiting[0].status_code == 503 and error_of(waiting[0])["code"] == "shutting_down"
    wait_for(lambda: twin_running(slow_twin) == 0, timeout=5, what="the twin to drop the cut stream")


def test_sglang_flat_error_is_normalised(proxy: RunningProxy) -> None:
    response = httpx.post(proxy.base_url + "/chat/completions", json={"model": "m", "messages": 3})
    assert response.status_code == 400
    error = error_of(response)
    # SGLang's numeric code (the status) comes as a string, as OpenAI's codes are.
    assert error["type"] == "invalid_request_error" and error["message"] and error["code"] == "400"
    client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=-1)
    assert refused.value.code == "400" and refused.value.body["code"] == "400"


def test_bad_input_gets_openai_errors_while_others_are_served(twin_pair) -> None:
    spec, base = twin_pair
    with running_proxy(spec_urls=[spec.url], base_urls=[base.url], max_body_bytes=4096) as proxy:
        url = proxy.base_url + "/chat/completions"
        stream_done = threading.Event()

        def long_stream() -> None:
            client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
            chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=300, stream=True))
            assert chunks[-1].choices[0].finish_reason == "length"
            stream_done.set()

        other = threading.Thread(target=long_stream)
        other.start()
        cases = [
            (
                httpx.post(url, content=b'{"model": "m", "messages": [', headers={"content-type": "application/json"}),
                400,
                "invalid_json",
            ),
            (httpx.post(url, content=b"[1, 2]", headers={"content-type": "application/json"}), 400, "invalid_json"),
            (
                httpx.post(url, content=b"model=m", headers={"content-type": "application/x-www-form-urlencoded"}),
                415,
                "unsupported_media_type",
            ),
            (httpx.post(url, content=b"{}"), 415, "unsupported_media_type"),
            (
                httpx.post(url, content=b"{" + b" " * 5000 + b"}", headers={"content-type": "application/json"}),
                413,
                "request_too_large",
            ),
            (
                httpx.post(
                    url,
                    content=iter([b"{", b" " * 3000, b" " * 3000, b"}"]),
                    headers={"content-type": "application/json"},
                ),
                413,
                "request_too_large",
            ),
            (httpx.post(url, json={"messages": MESSAGES}, headers={"x-specroute-pool": "gpu"}), 400, "invalid_header"),
            (httpx.get(url), 405, "method_not_allowed"),
        ]
        for response, status, code in cases:
            assert response.status_code == status, response.text
            assert error_of(response)["code"] == code
            assert response.headers["x-request-id"]
        assert httpx.head(url).headers["allow"] == "POST"  # RFC 9110: a 405 says what is allowed
        # The management API's refusals say the same: an endpoint the proxy does not forward is
        # named as such (OpenAI's type for an unknown URL), a wrong method by its code.
        client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
        with pytest.raises(openai.NotFoundError) as unknown:
            client.embeddings.create(model="m", input="hi")
        error = unknown.value.body
        assert isinstance(error, dict) and (error["type"], error["code"]) == ("invalid_request_error", "unknown_url")
        assert "/v1/embeddings" in error["message"] and "/v1/chat/completions" in error["message"]
        assert unknown.value.response.headers["x-request-id"]  # as its log line says (an operator's probe)
        assert "specroute_unknown_path_requests_total 1.0" in httpx.get(proxy.url + "/metrics").text
        assert error_of(httpx.post(proxy.base_url + "/models"))["code"] == "method_not_allowed"
        other.join(60)
        assert stream_done.is_set()
        assert client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2).choices
        wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")


def test_a_client_that_stops_reading_is_cut_at_the_total_timeout() -> None:
    """A stalled reader blocks the relay in its send to the client, where no upstream read timer
    runs: the total deadline must still end the request and close its upstream request."""
    body = b'{"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": true}'
    with (
        FaultServer("flood") as flood,
        running_proxy(spec_urls=[flood.url], policy="spec", total_timeout_s=2.0, connect_timeout_s=0.5) as proxy,
    ):
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills fast: the relay blocks
            sock.settimeout(10)
            sock.connect(("127.0.0.1", proxy.port))
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            assert sock.recv(64).startswith(b"HTTP/1.1 200")
            # The client keeps its connection open and reads nothing more.
            wait_for(lambda: flood.open_connections == 0, timeout=30, what="the proxy to drop its upstream connection")
            wait_for(lambda: proxy.in_flight() == 0, timeout=5, what="in-flight released")


def test_a_rejected_request_is_logged_under_the_request_id_it_was_answered_with(twin_pair, capfd) -> None:
    """405/415/413 answers carry x-request-id; their log line must carry it too, or a user
    holding the id from the response cannot find the line."""
    spec, base = twin_pair
    with running_proxy(spec_urls=[spec.url], base_urls=[base.url], request_log=True) as proxy:
        url = proxy.base_url + "/chat/completions"
        assert httpx.get(url, headers={"x-request-id": "rejected-405"}).status_code == 405
        assert httpx.post(url, content=b"{}", headers={"x-request-id": "rejected-415"}).status_code == 415
        seen: list[str] = []

        def logged() -> bool:
            seen.append(capfd.readouterr().out)
            lines = [json.loads(line) for line in "".join(seen).splitlines() if line.startswith("{")]
            return {"rejected-405", "rejected-415"} <= {line["request_id"] for line in lines}

        wait_for(logged, timeout=10, what="log lines with the request ids")


def test_a_huge_model_name_stays_out_of_the_log_line(capfd) -> None:
    """The client chooses the model string: it goes upstream whole, but the log line and the
    spans carry at most 256 characters of it (a 5 MB name made a 5 MB line)."""
    with (
        FaultServer("echo") as upstream,
        running_proxy(spec_urls=[upstream.url], policy="spec", request_log=True) as proxy,
    ):
        name = "m" * 1_000_000
        response = httpx.post(
            proxy.base_url + "/chat/completions",
            timeout=30,
            json={"model": name, "messages": MESSAGES},
            headers={"x-request-id": "huge-model"},
        )
        assert response.status_code == 200
        assert json.loads([r for r in upstream.requests if r.method == "POST"][-1].body)["model"] == name
        seen: list[str] = []

        def logged() -> list[dict]:
            seen.append(capfd.readouterr().out)
            return [
                json.loads(line)
                for line in "".join(seen).splitlines()
                if line.startswith("{") and '"huge-model"' in line
            ]

        line = wait_for(logged, timeout=10, what="the request's log line")[0]
        assert len(json.dumps(line)) < 4096 and line["model"] == "m" * 256


class SilentServer:
    """Accepts connections and reads what comes, never answers: a stopped process (its kernel
    still accepts). `requests` holds the request lines it was sent."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests: list[bytes] = []
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        try:
            while data := conn.recv(65536):
                self.requests.extend(line for line in data.split(b"\r\n") if line.startswith((b"GET ", b"POST ")))
        except OSError:
            return

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


def test_models_are_asked_of_the_servers_that_take_requests(twin_pair) -> None:
    """A stopped server (connections accepted, nothing answered) held every GET /v1/models for
    the timeout once the cache expired; once it is out of rotation it is not asked."""
    spec, base = twin_pair
    silent = SilentServer()
    try:
        with running_proxy(spec_urls=[silent.url, spec.url], base_urls=[base.url], models_cache_s=0) as proxy:
            stopped = proxy.app.router.pools["spec"].instances[0]
            wait_for(lambda: not stopped.healthy, timeout=30, what="the silent server out of rotation")
            ready = httpx.get(proxy.url + "/ready").json()
            assert ready["ready"] and [i["healthy"] for i in ready["pools"]["spec"]] == [False, True]
            asked = sum(1 for line in silent.requests if b"/v1/models" in line)
            client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
            for _ in range(3):
                assert [m.id for m in client.models.list()] == ["specroute/twin"]
            assert sum(1 for line in silent.requests if b"/v1/models" in line) == asked
    finally:
        silent.close()


def test_ready_shows_a_lagging_server_unhealthy_as_the_state_endpoint_does() -> None:
    """A server silent while its pool-mate answers gets no requests (lagging) before it is
    judged unresponsive: /ready said healthy where the state endpoint and the metrics did not."""
    import time

    from fleet.readings import Reading
    from proxy.app import create_app
    from proxy.settings import load_settings

    urls = ["http://127.0.0.1:9", "http://127.0.0.1:10"]
    app = create_app(load_settings(spec_urls=",".join(urls), base_urls="http://127.0.0.1:11"))
    now = time.monotonic()
    app.router.fleet.on_reading(urls[0], Reading(at=now - 2.0, running=0.0, waiting=0.0))  # 2 s silent
    for url in urls[1:] + ["http://127.0.0.1:11"]:
        app.router.fleet.on_reading(url, Reading(at=now, running=0.0, waiting=0.0))
    assert app.router.pools["spec"].instances[0].healthy  # neither unreachable, ejected nor unresponsive
    assert [i["healthy"] for i in app.readiness()["pools"]["spec"]] == [False, True]
    assert [i["healthy"] for i in app.router.state()["pools"]["spec"]["instances"]] == [False, True]
