"""A vLLM base pool: the twin in vLLM's shapes (`specroute sim --mode base --server vllm`), learned,
polled and routed to by the proxy beside an SGLang spec twin, with the real openai SDK."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import openai
import pytest
from proxy_harness import RunningProxy, running_proxy, wait_for

from sim.testing import RunningTwin, TwinSpec, twins

MESSAGES = [{"role": "user", "content": "Say hi."}]
MODEL = "specroute/twin"
"""The twins' served model name: a vLLM server answers 404 for any other."""
VLLM = ("--output-len", "fixed:4096")


@pytest.fixture(scope="module")
def sglang_spec_and_vllm_base() -> Iterator[list[RunningTwin]]:
    with twins(
        TwinSpec("spec", profile="kimi-moe", time_scale=1.0, seed=21, args=("--output-len", "fixed:4096")),
        TwinSpec(
            "base",
            profile="kimi-moe-vllm",
            time_scale=1.0,
            seed=22,
            server="vllm",
            args=VLLM + ("--max-running-requests", "3"),
        ),
    ) as started:
        yield started


@pytest.fixture(scope="module")
def proxy(sglang_spec_and_vllm_base: list[RunningTwin]) -> Iterator[RunningProxy]:
    spec, base = sglang_spec_and_vllm_base
    with running_proxy(spec_urls=[spec.url], base_urls=[base.url], profile="kimi-moe", poll_interval_ms=50) as running:
        yield running


def vllm_gauge(twin: RunningTwin, name: str) -> float:
    text = httpx.get(twin.url + "/metrics", timeout=5).text
    return float(re.search(rf"^vllm:{name}{{[^}}]*}} (\S+)$", text, re.M).group(1))


def base_state(proxy: RunningProxy) -> dict:
    return httpx.get(proxy.url + "/v1/specroute/state", timeout=5).json()["pools"]["base"]["instances"][0]


def test_the_twin_speaks_vllm(sglang_spec_and_vllm_base: list[RunningTwin]) -> None:
    _, base = sglang_spec_and_vllm_base
    assert httpx.get(base.url + "/health").status_code == 200
    card = httpx.get(base.url + "/v1/models").json()["data"][0]
    assert card["owned_by"] == "vllm" and card["max_model_len"] == 32768
    assert httpx.get(base.url + "/version").json()["version"]
    for sglang_only in ("/v1/loads", "/server_info", "/get_load", "/get_model_info"):
        missing = httpx.get(base.url + sglang_only)
        assert missing.status_code == 404 and missing.json() == {"detail": "Not Found"}
    bad = httpx.post(base.url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": -1})
    assert bad.status_code == 400 and set(bad.json()["error"]) == {"message", "type", "param", "code"}
    client = openai.OpenAI(base_url=base.url + "/v1", api_key="none", max_retries=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, stream=True))
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content == ""  # vLLM: the role alone, first
    assert [c.choices[0].delta.content for c in chunks[1:]] and all(c.choices[0].delta.role is None for c in chunks[1:])
    assert vllm_gauge(base, "num_requests_running") == 0.0


def test_the_proxy_learns_a_vllm_server_reads_its_load_and_routes_to_it(
    proxy: RunningProxy,
    sglang_spec_and_vllm_base: list[RunningTwin],
) -> None:
    spec, base = sglang_spec_and_vllm_base
    state = base_state(proxy)
    assert state["probe"] == "/metrics" and state["server_info"] == {"server": "vllm", "speculative": False}
    assert state["max_running"] == 256  # vLLM's --max-num-seqs default, until seen saturated
    client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, extra_headers={"x-specroute-pool": "base"}
    )
    assert raw.headers["x-specroute-pool"] == "base" and raw.parse().usage.completion_tokens == 4
    # Five long streams on a server that runs three at most: 3 running, 2 waiting, as its
    # /metrics says and the proxy reads; its cap is learned from the lasting saturation. The two
    # waiting get no first byte (vLLM's stream opens with the first token), so the proxy holds
    # their headers: each stream is held by a task of its own.
    import asyncio

    async def hold_five() -> None:
        async with httpx.AsyncClient(timeout=30) as client:

            async def hold() -> None:
                async with client.stream(
                    "POST",
                    proxy.base_url + "/chat/completions",
                    headers={"x-specroute-pool": "base"},
                    json={"model": MODEL, "messages": MESSAGES, "max_tokens": 3000, "stream": True},
                ) as response:
                    assert response.status_code == 200
                    async for _ in response.aiter_raw():
                        pass

            tasks = [asyncio.create_task(hold()) for _ in range(5)]
            try:
                await asyncio.to_thread(
                    wait_for,
                    lambda: (
                        (vllm_gauge(base, "num_requests_running"), vllm_gauge(base, "num_requests_waiting")) == (3, 2)
                    ),
                    what="the vLLM twin saturated",
                )
                await asyncio.to_thread(
                    wait_for,
                    lambda: (lambda s: (s["running"], s["waiting"], s["max_running"]) == (3, 2, 3))(base_state(proxy)),
                    what="the proxy reading the vLLM load and cap",
                    timeout=10,
                )
                snapshot = proxy.app.router.snapshot().pools["base"]
                assert snapshot.capacity == 3 and snapshot.instances[0].load == 5
            finally:
                for task in tasks:
                    task.cancel()
                ended = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(isinstance(e, asyncio.CancelledError) for e in ended), ended

    asyncio.run(hold_five())
    wait_for(lambda: vllm_gauge(base, "num_requests_running") == 0, what="the vLLM twin idle again")
    wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")


def test_the_policy_counts_a_vllm_base_like_an_sglang_one_and_errors_come_back_openai_shaped(
    proxy: RunningProxy,
) -> None:
    client = openai.AsyncOpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)

    async def scenario() -> list[str]:
        import asyncio

        async def one() -> str:
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=MESSAGES, max_tokens=2, stream=True, stream_options={"include_usage": True}
            )
            async for _ in raw.parse():
                pass
            return raw.headers["x-specroute-pool"]

        return await asyncio.gather(*(one() for _ in range(6)))

    import asyncio

    pools = asyncio.run(scenario())
    assert set(pools) <= {"spec", "base"} and len(pools) == 6
    sync = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        sync.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=-1, extra_headers={"x-specroute-pool": "base"}
        )
    assert "max_tokens must be at least 1" in refused.value.message  # vLLM's words
    wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")


@pytest.fixture(scope="module")
def roomy_vllm_proxy(sglang_spec_and_vllm_base: list[RunningTwin]) -> Iterator[tuple[RunningTwin, RunningProxy]]:
    """A vLLM base twin with room for 256 (vLLM's default cap), behind its own proxy."""
    spec = sglang_spec_and_vllm_base[0]
    with twins(TwinSpec("base", profile="kimi-moe-vllm", time_scale=1.0, seed=23, server="vllm")) as (base,):
        with running_proxy(
            spec_urls=[spec.url], base_urls=[base.url], profile="kimi-moe", poll_interval_ms=20
        ) as running:
            yield base, running


def test_requests_waiting_for_the_next_step_do_not_lower_a_vllm_servers_cap(
    roomy_vllm_proxy: tuple[RunningTwin, RunningProxy],
) -> None:
    # Requests that arrive during a step wait for the next one on any server (vLLM included),
    # far below the cap: such a reading must not be taken for saturation.
    import asyncio

    base, proxy = roomy_vllm_proxy
    wait_for(lambda: base_state(proxy)["server_info"] == {"server": "vllm", "speculative": False}, what="learned")
    seen: list[tuple[float, float, int]] = []

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=30) as client:

            async def one() -> None:
                body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 20, "stream": True}
                async with client.stream(
                    "POST", proxy.base_url + "/chat/completions", json=body, headers={"x-specroute-pool": "base"}
                ) as response:
                    assert response.status_code == 200
                    async for _ in response.aiter_bytes():
                        pass

            async def watch(stop: asyncio.Event) -> None:
                while not stop.is_set():
                    state = (await client.get(proxy.url + "/v1/specroute/state")).json()["pools"]["base"]["instances"][
                        0
                    ]
                    seen.append((state["running"] or 0.0, state["waiting"] or 0.0, state["max_running"]))
                    await asyncio.sleep(0.005)

            stop = asyncio.Event()
            watcher = asyncio.create_task(watch(stop))
            for _ in range(4):  # bursts spread over steps: some arrive while a step runs
                tasks = []
                for _ in range(8):
                    tasks.append(asyncio.create_task(one()))
                    await asyncio.sleep(0.015)
                await asyncio.gather(*tasks)
            stop.set()
            await watcher

    asyncio.run(scenario())
    assert any(waiting > 0 for _, waiting, _ in seen), "the proxy never read requests waiting: the test did not test"
    assert {cap for _, _, cap in seen} == {256}
    wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")


def test_a_vllm_cap_is_learned_from_lasting_saturation_only() -> None:
    from fleet.readings import Reading
    from proxy.backends.vllm import VLLM_FULL_FOR_S, vllm_cap

    def at(t: float, running: float, waiting: float) -> Reading:
        return Reading(at=t, running=running, waiting=waiting)

    cap, since = vllm_cap(None, at(0.0, 7, 3), 256)  # a burst waiting for the next step
    assert (cap, since) == (256, (0.0, 7))
    cap, since = vllm_cap(since, at(0.3, 9, 1), cap)  # running grew: it was admitting, not full
    assert (cap, since) == (256, (0.3, 9))
    cap, since = vllm_cap(since, at(0.3 + VLLM_FULL_FOR_S / 2, 9, 4), cap)
    assert cap == 256
    cap, since = vllm_cap(since, at(0.3 + VLLM_FULL_FOR_S, 9, 4), cap)  # held at 9 with requests waiting
    assert cap == 9
    assert vllm_cap(since, at(5.0, 2, 0), cap) == (9, None)  # idle again: the cap stays
    assert vllm_cap(None, at(6.0, 40, 0), 9) == (40, None)  # running more than the cap: it is larger


def test_the_role_only_opening_and_the_closing_event_count_as_no_token(
    sglang_spec_and_vllm_base: list[RunningTwin],
) -> None:
    # The relay counts a stream's tokens (and step gaps) by its content events: the opening event
    # (vLLM's, SGLang's) carries the role and no text, SGLang's closing one an empty delta and the
    # finish reason, the usage event (and SGLang's spec_tokens_details) no choice: each must count
    # for none.
    from proxy.scan import content_events

    spec, base = sglang_spec_and_vllm_base
    for twin, n in ((base, 1), (base, 2), (spec, 1)):
        body = {
            "model": MODEL,
            "messages": MESSAGES,
            "max_tokens": 4,
            "n": n,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_spec_tokens_details": twin is spec,
        }
        with httpx.stream("POST", twin.base_url + "/chat/completions", json=body, timeout=30) as response:
            events = [event + b"\n\n" for event in response.read().split(b"\n\n") if event]
        counted = [content_events(event) for event in events]
        no_choice = sum(b'"choices":[]' in event for event in events)
        assert no_choice == (1 if twin is base else 2), (twin.url, events)
        # spec's events carry a verify step's tokens each; SGLang opens and closes each choice
        expected = 4 * n if twin is base else len(events) - 1 - 2 * n - no_choice
        assert sum(counted) == expected, (twin.url, counted)
        if twin is spec:
            # What the fleet model reads of a spec stream without SGLang's details (the proxy
            # does not ask for them): its verify steps, from the events counted. A review found
            # them one short once the usage event was no longer counted.
            from fleet.readings import ResponseEvidence

            details = json.loads(next(e for e in events if b"spec_verify_ct" in e)[len(b"data: ") :])
            verify_ct = details["sglext"]["spec_tokens_details"]["spec_verify_ct"]
            read = ResponseEvidence.from_stream(sum(counted), [], completion_tokens=4)
            assert read.verify_steps == verify_ct, (counted, details)
        assert content_events(b"".join(events)) == sum(counted)
    # A server writing a space after the colon: its usage event is no token either.
    spaced = b'data: {"id": "x", "choices": [], "usage": {"completion_tokens": 4}}\n\n'
    assert content_events(spaced) == 0
    assert content_events(b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n' + spaced) == 1
    # Only a line's start is an event or the end: text reading "data:" or "data: [DONE]" is none.
    from proxy.scan import chat_ended

    said = b'data: {"model": "data: [DONE]", "choices": [{"delta": {"content": "data: x data: [DONE]"}}]}\n\n'
    assert (content_events(said), chat_ended(said)) == (1, False)
    assert (content_events(said + b"data: [DONE]\n\n"), chat_ended(said + b"data: [DONE]\n\n")) == (1, True)
    crlf = said.replace(b"\n", b"\r\n") + b"data: [DONE]\r\n\r\n"
    assert (content_events(crlf), chat_ended(crlf)) == (1, True)


def test_a_model_name_only_sglang_accepts_gets_vllms_404_through_the_proxy(proxy: RunningProxy) -> None:
    # SGLang answers whatever model a request names, vLLM only its served name: a mixed fleet's
    # clients must name the vLLM server's model (docs/twin.md).
    client = openai.OpenAI(base_url=proxy.base_url, api_key="none", max_retries=0)
    assert client.chat.completions.create(
        model="another", messages=MESSAGES, max_tokens=2, extra_headers={"x-specroute-pool": "spec"}
    ).choices
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(
            model="another", messages=MESSAGES, max_tokens=2, extra_headers={"x-specroute-pool": "base"}
        )
    assert "does not exist" in missing.value.message
    wait_for(lambda: proxy.in_flight() == 0, what="in-flight released")


def test_sglang_05_chunks_count_their_tokens_and_no_more() -> None:
    """SGLang 0.5.23's chat chunks, as its own sse_utils.build_sse_content (msgspec) and its
    tool-call path (pydantic) write them: the opening and the closing carry no token, a text or
    a tool call's arguments one step each. The closing's {"reasoning_content":null} counted as a
    step read every spec stream one verify step long (20 tokens in 8 steps as 2.22 a step)."""
    from proxy.scan import content_events

    def chunk(delta: bytes, finish: bytes = b"null", tail: bytes = b"") -> bytes:
        return (
            b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
            b'"delta":'
            + delta
            + b',"logprobs":null,"finish_reason":'
            + finish
            + b',"matched_stop":null}]'
            + tail
            + b"}\n\n"
        )

    opening = chunk(b'{"reasoning_content":null,"role":"assistant","content":""}')
    text = chunk(b'{"reasoning_content":null,"content":"hello"}')
    closing = chunk(b'{"reasoning_content":null}', b'"stop"')
    call = chunk(
        b'{"role":null,"content":null,"reasoning_content":null,"tool_calls":[{"index":0,"function":{"arguments":"{"}}]}',
        tail=b',"usage":null',
    )
    assert [content_events(c) for c in (opening, text, closing, call)] == [0, 1, 0, 1]
    assert content_events(opening + text + call + text + closing + b"data: [DONE]\n\n") == 3
