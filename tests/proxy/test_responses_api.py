"""The Responses API through the proxy, with the real openai SDK, on twins that store responses
as SGLang does with --enable-response-store: answers and streams relayed, follow-ups and
lookups sent to the server holding the response (also by a proxy that never saw it made),
failover before the first token, an in-band error after it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from proxy_harness import TIME_SCALE, RunningProxy, aiohttp_upstream, running_proxy, twin_running, wait_for

from sim.testing import RunningTwin, TwinSpec, twin, twins

MODEL = "specroute/twin"
STORE = ("--enable-response-store", "--output-len", "fixed:4096")


@pytest.fixture(scope="module")
def fleet() -> Iterator[list[RunningTwin]]:
    """Two spec servers and one base server, each keeping the responses it makes."""
    with twins(
        TwinSpec("spec", time_scale=TIME_SCALE, seed=11, args=STORE),
        TwinSpec("spec", time_scale=TIME_SCALE, seed=12, args=STORE),
        TwinSpec("base", time_scale=TIME_SCALE, seed=13, args=STORE),
    ) as started:
        yield started


@pytest.fixture(scope="module")
def proxy(fleet: list[RunningTwin]) -> Iterator[RunningProxy]:
    with running_proxy(spec_urls=[fleet[0].url, fleet[1].url], base_urls=[fleet[2].url]) as running:
        yield running


@pytest.fixture
def healed(fleet: list[RunningTwin]) -> Iterator[list[RunningTwin]]:
    yield fleet
    for server in fleet:
        httpx.post(server.url + "/specroute/twin/faults", json={}, timeout=5).raise_for_status()


def client(proxy: RunningProxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)


def output_tokens(proxy: RunningProxy) -> float:
    """The proxy's count of output tokens, from its Prometheus text."""
    text = httpx.get(proxy.url + "/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("specroute_tokens_total") and 'type="output"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_answers_and_streams_are_relayed_and_counted(proxy: RunningProxy) -> None:
    sdk = client(proxy)
    before = output_tokens(proxy)
    raw = sdk.responses.with_raw_response.create(model=MODEL, input="Name a river.", max_output_tokens=14)
    answer = raw.parse()
    assert answer.id.startswith("resp_") and answer.output_text
    assert answer.status == "incomplete" and answer.usage is not None
    assert raw.headers["x-specroute-pool"] in ("spec", "base") and raw.headers["x-specroute-reason"]
    events = list(sdk.responses.create(model=MODEL, input="Name a sea.", max_output_tokens=22, stream=True))
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    assert "error" not in kinds
    last = events[-1].response  # type: ignore[union-attr]
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert text == last.output_text and last.usage is not None
    # What the proxy counted is what the servers reported (the last event's usage, a JSON body's).
    expected = answer.usage.output_tokens + last.usage.output_tokens
    wait_for(lambda: output_tokens(proxy) - before == expected, what=f"{expected} output tokens counted")


def test_a_stream_is_held_until_its_first_token(proxy: RunningProxy, healed: list[RunningTwin]) -> None:
    """SGLang sends response.created before it generates: a server that fails after it, before
    any text, is still failed over (the client never saw its events)."""
    first = healed[0]
    httpx.post(first.url + "/specroute/twin/faults", json={"drop_after_chunks": 2}, timeout=5).raise_for_status()
    sdk = client(proxy)
    backends = set()
    for n in range(4):  # the least-loaded pick rotates: some go to the failing server first
        raw = sdk.responses.with_raw_response.create(
            model=MODEL,
            input=f"Question {n}",
            max_output_tokens=10,
            stream=True,
            extra_headers={"x-specroute-pool": "spec"},
        )
        events = list(raw.parse())
        assert [e.type for e in events][-1] == "response.incomplete"
        assert [e.type for e in events].count("response.created") == 1  # one server's events only
        backends.add(raw.headers["x-specroute-backend"])
    assert backends == {"spec-1"}
    metrics = httpx.get(proxy.url + "/metrics", timeout=5).text
    assert re.search(r"^specroute_retries_total\{[^}]*\} [1-9]", metrics, re.M), "no attempt was failed over"


def test_a_failure_after_the_first_token_ends_the_stream_with_an_error_the_sdk_raises(
    proxy: RunningProxy, healed: list[RunningTwin]
) -> None:
    for server in healed[:2]:
        httpx.post(server.url + "/specroute/twin/faults", json={"drop_after_chunks": 6}, timeout=5).raise_for_status()
    stream = client(proxy).responses.create(
        model=MODEL,
        input="Tell a story.",
        max_output_tokens=200,
        stream=True,
        extra_headers={"x-specroute-pool": "spec"},
    )
    seen = []
    with pytest.raises(openai.APIError, match="upstream failed mid-stream"):
        for event in stream:
            seen.append(event.type)
    assert "response.output_text.delta" in seen


def test_follow_ups_go_to_the_server_holding_their_previous_response(proxy: RunningProxy) -> None:
    sdk = client(proxy)
    for pool in ("spec", "spec", "spec", "base"):
        raw = sdk.responses.with_raw_response.create(
            model=MODEL, input="Start.", max_output_tokens=8, extra_headers={"x-specroute-pool": pool}
        )
        made, where = raw.parse(), raw.headers["x-specroute-backend"]
        previous = made.id
        for turn in range(3):
            # Even pinned to the other pool: only the server holding it can continue it.
            other = "base" if pool == "spec" else "spec"
            follow = sdk.responses.with_raw_response.create(
                model=MODEL,
                input=f"Go on ({turn}).",
                previous_response_id=previous,
                max_output_tokens=8,
                extra_headers={"x-specroute-pool": other},
            )
            assert follow.headers["x-specroute-backend"] == where
            assert follow.headers["x-specroute-reason"] == "response-owner"
            answer = follow.parse()
            assert answer.previous_response_id == previous
            assert answer.usage is not None and answer.usage.input_tokens > made.usage.input_tokens  # type: ignore[union-attr]
            previous = answer.id
        fetched = sdk.responses.with_raw_response.retrieve(previous)
        assert fetched.headers["x-specroute-backend"] == where and fetched.parse().id == previous


def test_a_proxy_that_never_saw_a_response_finds_its_server(proxy: RunningProxy, fleet: list[RunningTwin]) -> None:
    """Another replica (or this one restarted) asks every server which holds the id."""
    made = client(proxy).responses.with_raw_response.create(
        model=MODEL, input="Remember this.", max_output_tokens=8, extra_headers={"x-specroute-pool": "base"}
    )
    first = made.parse()
    with running_proxy(spec_urls=[fleet[0].url, fleet[1].url], base_urls=[fleet[2].url]) as other:
        sdk = client(other)
        fetched = sdk.responses.with_raw_response.retrieve(first.id)
        assert fetched.headers["x-specroute-backend"] == "base-0" and fetched.parse().output_text == first.output_text
        follow = sdk.responses.with_raw_response.create(
            model=MODEL, input="And now?", previous_response_id=first.id, max_output_tokens=8
        )
        assert follow.headers["x-specroute-backend"] == "base-0"
        cancelled = httpx.post(f"{other.url}/v1/responses/{first.id}/cancel", timeout=10)
        direct = httpx.post(f"{fleet[2].url}/v1/responses/{first.id}/cancel", timeout=10)
        assert (cancelled.status_code, cancelled.json()["id"]) == (direct.status_code, direct.json()["id"])
        assert cancelled.headers["x-specroute-backend"] == "base-0"


def metric(proxy: RunningProxy, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(httpx.get(proxy.url + "/metrics", timeout=5).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def test_unknown_and_unstored_ids(proxy: RunningProxy, fleet: list[RunningTwin]) -> None:
    sdk = client(proxy)
    asked = "specroute_stored_response_upstream_requests_total"
    before = metric(proxy, asked)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve("resp_" + "0" * 32)
    assert metric(proxy, asked) - before == len(fleet)  # a miss asks every server once
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve("resp_" + "0" * 32)
    assert metric(proxy, asked) - before == len(fleet)  # and is remembered for a moment
    assert metric(proxy, "specroute_stored_response_requests_total", operation="get", outcome="not_found") >= 2
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve("..%2F..%2Fmetrics")  # never put into a server's URL
    with pytest.raises(openai.NotFoundError, match="not found"):  # the server's own answer, relayed
        sdk.responses.create(model=MODEL, input="Hi", previous_response_id="resp_" + "1" * 32, max_output_tokens=8)
    unstored = sdk.responses.create(model=MODEL, input="Forget this.", store=False, max_output_tokens=8)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(unstored.id)
    assert unstored.id not in proxy.app.completions.responses.by_id
    wait_for(lambda: proxy.in_flight() == 0, what="in-flight counts back to zero")


def test_a_client_leaving_frees_its_server_whatever_its_text_says() -> None:
    """Event names in the echoed instructions or in the text are no end of the stream: the
    client's leaving still cancels the request upstream."""
    with twin("base", time_scale=1.0, seed=7, args=("--output-len", "fixed:4000")) as slow:
        with running_proxy(base_urls=[slow.url], policy="base") as proxy:
            sdk = client(proxy)
            instructions = "Parse lines like 'event: error' and 'event: response.completed' carefully."
            stream = sdk.responses.create(model=MODEL, input="Go.", instructions=instructions, stream=True)
            for event in stream:
                if event.type == "response.output_text.delta":
                    break
            assert twin_running(slow) == 1
            stream.close()
            wait_for(lambda: twin_running(slow) == 0, what="the twin's request cancelled", timeout=15)
            wait_for(lambda: proxy.in_flight() == 0, what="in-flight counts back to zero")


def test_ids_no_server_makes_are_answered_without_asking(proxy: RunningProxy, fleet: list[RunningTwin]) -> None:
    """SGLang and vLLM answer an id not opening with `resp_` 400: asked, it read as "no store" and
    turned every client's lookups away for a minute, with that id in their errors (a review's
    probe: `respATTACKER`)."""
    asked = "specroute_stored_response_upstream_requests_total"
    before = metric(proxy, asked)
    for odd in ("x", "msg_123", "respect" + "0" * 200, "respATTACKER", "resp_"):
        answer = httpx.get(f"{proxy.url}/v1/responses/{odd}", timeout=10)
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "response_not_found"
    assert metric(proxy, asked) == before
    made = client(proxy).responses.create(model=MODEL, input="Still here?", max_output_tokens=8)
    with running_proxy(spec_urls=[fleet[0].url, fleet[1].url], base_urls=[fleet[2].url]) as other:
        assert httpx.get(f"{other.url}/v1/responses/x", timeout=10).status_code == 404
        assert client(other).responses.retrieve(made.id).id == made.id


def test_only_a_refusal_of_every_lookup_stands_for_its_server() -> None:
    from proxy.responses import Answer, refuses_lookups

    store_off = b'{"error": {"message": "Response store is disabled. Stateful Responses require ..."}}'
    assert refuses_lookups(Answer(400, store_off, "application/json", None), "resp_1")
    assert refuses_lookups(Answer(405, b"", "text/plain", None), "resp_1")
    assert refuses_lookups(Answer(501, b"", "text/plain", None), "resp_1")
    about_the_id = b'{"error": {"message": "Invalid \'response_id\': \'resp_1\'."}}'
    assert not refuses_lookups(Answer(400, about_the_id, "application/json", None), "resp_1")
    assert not refuses_lookups(Answer(404, b"", "application/json", None), "resp_1")
    quoting = b'{"error": {"message": "Response with id \'resp_Store_is_Disabled\' not found."}}'  # older vLLM: 400
    assert not refuses_lookups(Answer(400, quoting, "application/json", None), "resp_Store_is_Disabled")
    front = b"<html><head><title>400 Request Header Or Cookie Too Large</title></head></html>"
    assert not refuses_lookups(Answer(400, front, "text/html", None), "resp_1")  # one client's headers


def test_an_id_two_servers_hold_is_refused_not_guessed(proxy: RunningProxy, fleet: list[RunningTwin]) -> None:
    """SGLang takes a client's request_id as the response's id: two servers can hold one id."""
    shared = "resp_" + "ab" * 16
    for server in fleet[:2]:
        direct = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        direct.responses.create(model=MODEL, input="Mine.", max_output_tokens=8, extra_body={"request_id": shared})
    sdk = client(proxy)
    with pytest.raises(openai.ConflictError, match="several servers"):
        sdk.responses.retrieve(shared)
    raw = httpx.post(
        f"{proxy.url}/v1/responses",
        json={"model": MODEL, "input": "Go on.", "previous_response_id": shared, "max_output_tokens": 8},
        timeout=10,
    )
    assert raw.status_code == 409 and raw.headers["x-should-retry"] == "false"
    assert raw.json()["error"]["code"] == "response_id_ambiguous"


def test_a_cancel_with_a_body_keeps_the_connection(proxy: RunningProxy) -> None:
    """A cancel takes no body (OpenAI's and SGLang's), but a client may send one: it is read and
    dropped, so the kept-alive connection carries the next request (unread, it was reset)."""
    made = client(proxy).responses.create(model=MODEL, input="Keep me.", max_output_tokens=8)
    with httpx.Client(timeout=10) as http:
        for size in (10, 2_000_000):
            answer = http.post(
                f"{proxy.url}/v1/responses/{made.id}/cancel",
                content=b'{"x": "' + b"a" * size + b'"}',
                headers={"content-type": "application/json"},
            )
            assert answer.status_code in (200, 400), answer.text  # the twin's word on a finished one
            assert http.get(f"{proxy.url}/health").status_code == 200
        too_big = http.post(
            f"{proxy.url}/v1/responses/{made.id}/cancel",
            content=b"a" * (proxy.app.settings.max_body_bytes + 1),
            headers={"content-type": "application/json"},
        )
        assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"


def test_a_flood_of_lookups_queued_in_the_proxy_does_not_mark_their_server_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A turn not had within the lookup's time is the proxy's queue (a client's flood of lookups),
    not the server's silence: the server, answering each in 0.1 s, was marked down for 5 s and
    other clients' lookups failed with 502 meanwhile (a review's reading). Now those lookups get
    503 `lookups_busy` and the server stays asked."""
    import asyncio
    import types

    import aiohttp
    from aiohttp import web

    from fleet.instance import InstanceSignals
    from proxy import responses as responses_module
    from proxy.pools import Instance

    monkeypatch.setattr(responses_module, "LOOKUP_TIMEOUT_S", 0.5)

    async def slowish(request: web.Request) -> web.Response:
        await asyncio.sleep(0.1)
        return web.json_response({"error": {"message": "not found"}}, status=404)

    async def flood() -> tuple[list[int], dict[str, float]]:
        async with (
            aiohttp_upstream([("GET", "/v1/responses/{id}", slowish)]) as url,
            aiohttp.ClientSession() as session,
        ):
            owners = responses_module.ResponseOwners(None, types.SimpleNamespace(session=session), False)  # type: ignore[arg-type]
            server = Instance(url, "spec", InstanceSignals(url, "spec", 48))
            answers = await asyncio.gather(
                *(owners.send(server, "GET", f"/v1/responses/resp_{i}", {}, "r") for i in range(40))
            )
        return [a.status for a in answers], owners.down

    statuses, down = asyncio.run(flood())
    assert statuses.count(404) >= 8 and 503 in statuses and set(statuses) <= {404, 503}, statuses
    assert down == {}


def test_with_keys_a_stored_response_is_its_key_s_alone(fleet: list[RunningTwin]) -> None:
    """With proxy keys on, the proxy chooses each stored response's id, bound to the key that
    made it: another key cannot read, cancel or continue it (told it does not exist, no server
    asked), through this replica or another one that never saw it made."""
    from proxy.auth import digest
    from proxy.response_ids import ResponseIds

    secret = "replicas-share-this-secret"
    urls = {
        "spec_urls": [fleet[0].url, fleet[1].url],
        "base_urls": [fleet[2].url],
        "api_keys": "sk-alice, sk-bob",
        "response_id_secret": secret,
    }
    with running_proxy(**urls) as proxy, running_proxy(**urls) as replica:
        alice = openai.OpenAI(base_url=proxy.base_url, api_key="sk-alice", max_retries=0)
        made = alice.responses.create(model=MODEL, input="My secret plan.", max_output_tokens=8)
        assert re.fullmatch(r"resp_[0-9a-f]{40}", made.id)
        streamed = list(alice.responses.create(model=MODEL, input="Another.", max_output_tokens=8, stream=True))
        assert streamed[-1].response.id.startswith("resp_")  # type: ignore[union-attr]
        asked = "specroute_stored_response_upstream_requests_total"
        for front in (proxy, replica):
            bob = openai.OpenAI(base_url=front.base_url, api_key="sk-bob", max_retries=0)
            before = metric(front, asked)
            with pytest.raises(openai.NotFoundError):
                bob.responses.retrieve(made.id)
            with pytest.raises(openai.NotFoundError):
                bob.responses.cancel(made.id)
            with pytest.raises(openai.NotFoundError, match="not found") as refused:
                bob.responses.create(model=MODEL, input="Go on.", previous_response_id=made.id, max_output_tokens=8)
            assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]
            assert metric(front, asked) == before  # no server was asked about another key's id
            mine = openai.OpenAI(base_url=front.base_url, api_key="sk-alice", max_retries=0)
            assert mine.responses.retrieve(made.id).output_text == made.output_text
            follow = mine.responses.create(
                model=MODEL, input="Go on.", previous_response_id=made.id, max_output_tokens=8
            )
            assert follow.previous_response_id == made.id and mine.responses.retrieve(follow.id).id == follow.id
        # An id a client chooses must be one of its own: another's would let it make, then read,
        # the response that key's follow-ups expect.
        raw = httpx.post(
            f"{proxy.url}/v1/responses",
            headers={"authorization": "Bearer sk-bob"},
            json={"model": MODEL, "input": "Hi", "max_output_tokens": 8, "request_id": "resp_" + "2" * 40},
            timeout=10,
        )
        assert raw.status_code == 400 and raw.json()["error"]["code"] == "request_id_not_allowed"
        own = ResponseIds(secret.encode()).minted(digest("sk-bob"))
        chosen = openai.OpenAI(base_url=proxy.base_url, api_key="sk-bob", max_retries=0)
        assert (
            chosen.responses.create(model=MODEL, input="Hi", max_output_tokens=8, extra_body={"request_id": own}).id
            == own
        )
        assert chosen.responses.retrieve(own).id == own
        # SGLang's `rid` of a chat is the engine's request id, which a stored response's is too: a
        # duplicate is refused while it runs, which told another key whether it was running.
        raw = httpx.post(
            f"{proxy.url}/v1/chat/completions",
            headers={"authorization": "Bearer sk-bob"},
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "rid": made.id},
            timeout=10,
        )
        assert raw.status_code == 400 and raw.json()["error"]["param"] == "rid"
        # Rids no key's response has, a uuid's length at least (proxy/aborts.py): the client's own business.
        for rid in ("my-own-" + "1" * 32, "resp_myapp_" + "4" * 32):
            mine = chosen.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, extra_body={"rid": rid}
            )
            assert mine.choices
        # Not stored: no id chosen for it, none to find.
        unstored = alice.responses.create(model=MODEL, input="Forget this.", store=False, max_output_tokens=8)
        with pytest.raises(openai.NotFoundError):
            alice.responses.retrieve(unstored.id)


def test_with_keys_each_attempt_asks_for_an_id_of_its_own() -> None:
    """A failed attempt a server stored anyway must not share its id with the one answered: the
    follow-ups naming it would be refused as held by two servers."""
    from proxy_faults import FaultServer

    from proxy.auth import digest
    from proxy.response_ids import ResponseIds

    with (
        FaultServer("status:503") as bad,
        FaultServer("echo") as good,
        running_proxy(spec_urls=[bad.url, good.url], policy="spec", api_keys="sk-alice") as proxy,
    ):
        for n in range(4):  # the first pick rotates: some go to the failing server first
            answer = httpx.post(
                f"{proxy.url}/v1/responses",
                headers={"authorization": "Bearer sk-alice"},
                json={"model": MODEL, "input": f"Hi {n}", "max_output_tokens": 8},
                timeout=10,
            )
            assert answer.status_code == 200
        sent = [
            json.loads(r.body)["request_id"] for server in (bad, good) for r in server.requests if r.method == "POST"
        ]
        assert len(bad.requests) >= 1 and len(sent) == len(set(sent)) >= 5
        assert all(ResponseIds().belongs(sent_id, digest("sk-alice")) for sent_id in sent)
