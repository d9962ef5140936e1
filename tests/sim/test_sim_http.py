"""The twin through its HTTP API, with the real openai SDK, against real twin subprocesses."""

import asyncio
import concurrent.futures
import json
import re
import statistics
import time

import httpx
import openai
import pytest

from fleet.profile import load_profile, tokens_per_verify_step
from sim.testing import TwinSpec, twin, twins, wait_for

KIMI = load_profile("kimi-linear")
DEADLINE_S = 30.0


def loads(t):
    return httpx.get(t.url + "/v1/loads", timeout=5).json()["loads"][0]


def metric(t, name):
    """The sum of a metric over its label sets (e.g. is_streaming true and false); None if absent."""
    text = httpx.get(t.url + "/metrics", timeout=5).text
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return sum(float(v) for v in values) if values else None


def words(text):
    return len(text.split())


def with_text(chunks):
    """A chat stream's chunks that carry text: SGLang opens each choice with the role alone and
    closes it with an empty delta and the finish reason."""
    return [c for c in chunks if c.choices and c.choices[0].delta.content]


@pytest.fixture(scope="module")
def fleet():
    with twins(
        TwinSpec("spec", "kimi-linear", time_scale=20, seed=1),
        TwinSpec("base", "kimi-linear", time_scale=20, seed=2, args=("--output-len", "fixed:12")),
    ) as running:
        yield running


@pytest.fixture(scope="module")
def spec(fleet):
    return fleet[0]


@pytest.fixture(scope="module")
def base(fleet):
    return fleet[1]


def client(t):
    return openai.OpenAI(base_url=t.base_url, api_key="unused", max_retries=0, timeout=60)


def chat(t, **kw):
    kw.setdefault("model", "twin")
    kw.setdefault("messages", [{"role": "user", "content": "Say something."}])
    return client(t).chat.completions.create(**kw)


# ---- responses ---------------------------------------------------------------------------------


def test_max_tokens_ends_with_length_and_usage_counts_tokens(spec):
    r = chat(spec, max_tokens=25, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 25 == words(r.choices[0].message.content)
    # Prompt tokens by the documented rule: 4 per message + ceil(chars / 4).
    assert r.usage.prompt_tokens == 4 + 4
    assert r.usage.total_tokens == r.usage.prompt_tokens + 25


def test_max_completion_tokens_is_honoured(spec):
    r = chat(spec, max_completion_tokens=7, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 7


def test_a_stream_ends_on_its_own_with_stop(base):
    r = chat(base, max_tokens=100)
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 12  # --output-len fixed:12
    r = chat(base, max_tokens=100, extra_body={"ignore_eos": True})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 100)


def test_stop_strings_cut_the_text_stream_and_plain_alike(spec):
    kw = dict(max_tokens=3000, stop=["fox"], seed=42, extra_body={"ignore_eos": True})
    plain = chat(spec, **kw)
    assert plain.choices[0].finish_reason == "stop"
    text = plain.choices[0].message.content
    assert "fox" not in text and 0 < plain.usage.completion_tokens < 3000
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(spec, stream=True, **kw) if c.choices)
    assert streamed == text


def test_stream_one_chunk_per_step_with_usage_and_spec_details(spec):
    chunks = list(
        chat(
            spec,
            max_tokens=200,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_spec_tokens_details": True},
        )
    )
    events = [c for c in chunks if c.choices]
    content = with_text(chunks)
    assert (events[0].choices[0].delta.role, events[0].choices[0].delta.content) == ("assistant", "")
    assert events[-1].choices[0].finish_reason == "length" and events[-1].choices[0].delta.content is None
    assert len(events) == len(content) + 2 and all(c.choices[0].finish_reason is None for c in content)
    details_chunk, usage_chunk = chunks[-2], chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 200
    details = details_chunk.model_extra["sglext"]["spec_tokens_details"]
    # First token from prefill, then one chunk per verify step carrying 1..k+1 tokens.
    per_chunk = [words(c.choices[0].delta.content) for c in content]
    assert per_chunk[0] == 1 and all(1 <= n <= 4 for n in per_chunk)
    assert sum(per_chunk) == 200
    assert details["spec_verify_ct"] == len(content) - 1
    assert details["spec_accept_length"] == pytest.approx(200 / details["spec_verify_ct"])


def test_non_stream_spec_details_on_request(spec):
    r = chat(spec, max_tokens=50, extra_body={"ignore_eos": True, "return_spec_tokens_details": True})
    details = r.model_extra["sglext"]["spec_tokens_details"]
    assert details["spec_verify_ct"] >= 50 / 4
    assert "sglext" not in chat(spec, max_tokens=5).model_extra
    assert r.to_dict()["metadata"] == {"weight_version": "default"}  # SGLang adds it to every answer


def test_completions_endpoint(base):
    c = client(base).completions.create(model="twin", prompt="Once upon a time")
    assert c.object == "text_completion"
    assert c.usage.prompt_tokens == 4 and c.usage.completion_tokens == 12  # natural length 12 < default 16
    chunks = list(
        client(base).completions.create(
            model="twin", prompt=[1, 2, 3], max_tokens=5, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert sum(words(c.choices[0].text) for c in chunks) == 5
    assert chunks[-1].choices[0].finish_reason == "length"


def test_same_seed_same_text(base):
    a = chat(base, max_tokens=30, seed=7).choices[0].message.content
    b = chat(base, max_tokens=30, seed=7).choices[0].message.content
    assert a == b and words(a) == 12


def test_same_seed_same_answer_where_it_stops_too(fleet):
    # The text was seeded but its length drawn from the twin's shared state: the same request
    # stopped at 12 tokens once and at 20 the next.
    spec = fleet[0]  # its lengths drawn from the profile's distribution
    for seed in range(4):
        a, b = (chat(spec, max_tokens=300, seed=seed) for _ in range(2))
        assert a.choices[0].message.content == b.choices[0].message.content
        assert (a.choices[0].finish_reason, a.usage.completion_tokens) == (
            b.choices[0].finish_reason,
            b.usage.completion_tokens,
        )


# ---- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body,fragment",
    [
        ({"model": "twin"}, "messages"),
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n must be at least 1"),
        ({"messages": [{"role": "user", "content": "x"}], "n": "x"}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice requires tools"),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "tool_choice": "sometimes",
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
            "tool_choice",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
            "Tool 'g' not found",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format"),
        ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}, "json_schema"),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "array"}}},
            },
            "top-level type is not object",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "at least 0"),
        ({"messages": []}, "Messages cannot be empty."),
        (
            {"messages": [{"role": "user", "content": "x"}], "stream": True, "return_meta_info": True},
            "return_meta_info is not supported with streaming",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, "max_completion_tokens is too large"),
    ],
)
def test_bad_requests_get_sglang_400(spec, body, fragment):
    r = httpx.post(spec.url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 400
    error = r.json()
    assert error["object"] == "error" and error["code"] == 400 and fragment in error["message"]


def test_sdk_raises_bad_request(spec):
    with pytest.raises(openai.BadRequestError, match="n must be at least 1"):
        chat(spec, n=0)


@pytest.mark.parametrize(
    "body,fragment",
    [
        ({"prompt": "x", "logprobs": -1}, "logprobs must be between"),
        ({"prompt": "x", "echo": True}, "does not support echo"),
        ({"prompt": "x", "best_of": 2}, "does not support best_of"),
        ({"prompt": "x", "suffix": "y"}, "does not support suffix"),
        ({"prompt": ["x", "y"]}, "does not support batched prompts"),
        ({"prompt": "x", "n": 0}, "n must be at least 1"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens must be positive"),
    ],
)
def test_bad_completions_get_sglang_400(spec, body, fragment):
    r = httpx.post(spec.url + "/v1/completions", json=body, timeout=10)
    assert r.status_code == 400 and fragment in r.json()["message"]


def test_wrong_content_type_and_bad_json(spec):
    r = httpx.post(spec.url + "/v1/chat/completions", content=b"{}", headers={"content-type": "text/plain"})
    assert r.status_code == 400 and "application/json" in r.json()["message"]
    r = httpx.post(
        spec.url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["object"] == "error"


def test_prompt_longer_than_context_is_refused(spec):
    with pytest.raises(openai.BadRequestError, match="longer than the model's context length"):
        chat(spec, messages=[{"role": "user", "content": "x" * 200_000}])
    with pytest.raises(openai.BadRequestError, match="You requested a total of 32772 tokens"):
        chat(spec, max_tokens=32768 - 4)


# ---- server surface ------------------------------------------------------------------------


def test_models_health_and_server_info(spec, base):
    models = client(spec).models.list()
    assert [m.id for m in models.data] == ["specroute/twin"]
    assert models.data[0].model_extra["max_model_len"] == 32768
    assert httpx.get(spec.url + "/v1/models/nope").status_code == 404
    assert httpx.get(spec.url + "/health").status_code == 200
    assert httpx.get(spec.url + "/health_generate", timeout=30).status_code == 200
    info = httpx.get(spec.url + "/server_info").json()
    assert (
        info["speculative_algorithm"],
        info["speculative_num_steps"],
        info["speculative_eagle_topk"],
        info["speculative_num_draft_tokens"],
        info["max_running_requests"],
    ) == ("EAGLE3", 3, 1, 4, 48)
    assert info["internal_states"][0]["avg_spec_accept_length"] > 1.0
    assert (info["profile"], info["time_scale"]) == ("kimi-linear", 20.0)
    info = httpx.get(base.url + "/server_info").json()
    assert info["speculative_algorithm"] is None and info["max_running_requests"] == 256
    assert "avg_spec_accept_length" not in info["internal_states"][0]


def test_a_base_server_has_no_verify_counter(base):
    # SGLang counts verify calls only when a request had some: a plain server never shows the series
    chat(base, max_tokens=3)
    assert metric(base, "sglang:spec_verify_calls_total") is None
    assert metric(base, "sglang:num_aborted_requests_total") is None  # none aborted yet


def test_metrics_and_loads_count_finished_work(spec):
    before = metric(spec, "sglang:generation_tokens_total") or 0.0  # no series before the first request
    chat(spec, max_tokens=40, extra_body={"ignore_eos": True})
    list(chat(spec, max_tokens=2, stream=True, extra_body={"ignore_eos": True}))
    assert metric(spec, "sglang:generation_tokens_total") == before + 42
    assert metric(spec, "sglang:spec_verify_calls_total") > 0
    assert metric(spec, "sglang:time_to_first_token_seconds_count") > 0
    assert metric(spec, "sglang:inter_token_latency_seconds_count") > 0
    assert metric(spec, "sglang:e2e_request_latency_seconds_count") > 0
    load = loads(spec)
    assert load["max_running_requests"] == 48 and load["speculative"]["accept_length"] > 1.0
    text = httpx.get(spec.url + "/metrics").text
    assert re.search(r'^sglang:generation_tokens_total\{.*is_streaming="false".*\} \d', text, re.M)
    assert re.search(r'^sglang:time_to_first_token_seconds_count\{.*is_streaming="true".*\} \d', text, re.M)


def test_alpha_admin_endpoint(spec, base):
    try:
        r = httpx.post(spec.url + "/specroute/twin/alpha", json={"alpha": 0.0})
        assert r.status_code == 200 and r.json() == {"alpha": 0.0}
        chunks = with_text(chat(spec, max_tokens=30, stream=True, extra_body={"ignore_eos": True}))
        assert all(words(c.choices[0].delta.content) == 1 for c in chunks)  # nothing accepted: 1 token per step
        assert httpx.get(spec.url + "/server_info").json()["mean_alpha"] == 0.0
    finally:
        httpx.post(spec.url + "/specroute/twin/alpha", json={"alpha": 0.64})
    assert httpx.post(spec.url + "/specroute/twin/alpha", json={"alpha": 1.5}).status_code == 400
    assert httpx.post(spec.url + "/specroute/twin/alpha", json={}).status_code == 400
    assert httpx.post(base.url + "/specroute/twin/alpha", json={"alpha": 0.3}).status_code == 400


# ---- fidelity: speed and acceptance over HTTP ------------------------------------------------


async def chunk_times(t, n_streams, max_tokens, **extra):
    """Wall time of every chunk with text of `n_streams` concurrent streams, and its words."""
    aclient = openai.AsyncOpenAI(base_url=t.base_url, api_key="unused", max_retries=0, timeout=120)

    async def one():
        times = []
        stream = await aclient.chat.completions.create(
            model="twin",
            messages=[{"role": "user", "content": "Go."}],
            max_tokens=max_tokens,
            stream=True,
            extra_body={"ignore_eos": True, **extra},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                times.append((time.monotonic(), words(chunk.choices[0].delta.content)))
        return times

    try:
        return await asyncio.gather(*(one() for _ in range(n_streams)))
    finally:
        await aclient.close()


def step_interval(times, scale):
    """Seconds (simulated) per chunk: the median over every window of half the chunks of its
    span per chunk. A late read bunches a few chunks; it moves the few windows that end or start
    there, not the median. (A least-squares slope over all chunks came out 5.8 % short once, in
    a fresh clone's compiled run: a slow start tilts the whole line; single gaps alternate about
    15 % early and late, so their median is short too.)"""
    stamps = [t for t, _ in times]
    half = len(stamps) // 2
    return statistics.median((stamps[i + half] - stamps[i]) / half for i in range(len(stamps) - half)) * scale


def test_single_stream_decode_speed_matches_profile_over_http():
    scale = 4.0
    with twin("base", "kimi-linear", time_scale=scale) as t:
        (times,) = asyncio.run(chunk_times(t, 1, 300))
    assert len(times) == 300
    assert step_interval(times[1:], scale) == pytest.approx(KIMI.base_step_ms(1, 0) / 1000, rel=0.05)


def test_single_stream_spec_step_time_matches_profile_over_http():
    scale = 4.0
    with twin("spec", "kimi-linear", time_scale=scale) as t:
        (times,) = asyncio.run(chunk_times(t, 1, 400))
    assert step_interval(times[1:], scale) == pytest.approx(KIMI.spec_step_ms(1, 3, 0) / 1000, rel=0.05)
    tokens_per_chunk = sum(n for _, n in times[1:]) / (len(times) - 1)
    assert 1.5 < tokens_per_chunk < 3.0  # 0.64 mean alpha, spread per request: tau(0.64) = 2.32


def test_batched_decode_speed_matches_profile_over_http():
    # Real time: 16 streams of one chunk per 20 ms keep the client's CPU (it times the chunks) low.
    scale, n = 1.0, 16
    with twin("base", "kimi-linear", time_scale=scale) as t:
        streams = asyncio.run(chunk_times(t, n, 150))
    expected = KIMI.base_step_ms(n, 0) / 1000
    # Steady state: from chunk 20 (every stream has been prefilled) to the last. All streams see
    # the same steps; the median over them discounts one stream read late by a busy client.
    intervals = [step_interval(times[20:], scale) for times in streams]
    assert statistics.median(intervals) == pytest.approx(expected, rel=0.05)
    assert all(i == pytest.approx(expected, rel=0.10) for i in intervals)


def test_tokens_per_verify_step_match_formula_over_http():
    alpha = 0.6
    with twin(
        "spec", "kimi-linear", time_scale=40, seed=3, args=("--mean-alpha", str(alpha), "--alpha-concentration", "1e7")
    ) as t:
        streams = asyncio.run(chunk_times(t, 2, 3000))
    per_step = [n for times in streams for _, n in times[1:-1]]  # drop the prefill token and the capped last step
    assert len(per_step) > 2000
    assert statistics.mean(per_step) == pytest.approx(tokens_per_verify_step(alpha, 3), rel=0.05)


# ---- the cap, the queue and disconnects ------------------------------------------------------


def test_49th_request_waits_and_a_disconnect_frees_its_slot():
    args = ("--decode-log-interval", "10", "--load-snapshot-publish-interval", "5")
    with twin("spec", "kimi-linear", time_scale=2, args=args) as t:
        asyncio.run(_cap_scenario(t))


async def _cap_scenario(t):
    aclient = openai.AsyncOpenAI(base_url=t.base_url, api_key="unused", max_retries=0, timeout=120)
    body = dict(
        model="twin",
        messages=[{"role": "user", "content": "Go."}],
        max_tokens=20000,
        stream=True,
        extra_body={"ignore_eos": True},
    )

    async def until(condition, what):
        # The polls block, so they run in a thread while this loop keeps the streams open.
        await asyncio.to_thread(wait_for, condition, what, DEADLINE_S)

    streams = [await aclient.chat.completions.create(**body) for _ in range(48)]
    try:
        await until(lambda: loads(t)["num_running_reqs"] == 48, "48 running")
        # SGLang answers a stream's status with its first chunk: the queued 49th's client has
        # no response yet, not even its headers (serving_chat.py awaits the first chunk).
        opening = asyncio.ensure_future(aclient.chat.completions.create(**body))
        await until(lambda: (loads(t)["num_running_reqs"], loads(t)["num_waiting_reqs"]) == (48, 1), "49th waiting")
        await until(
            lambda: (metric(t, "sglang:num_running_reqs"), metric(t, "sglang:num_queue_reqs")) == (48, 1),
            "metrics showing the queue",
        )
        assert not opening.done()
        # One of the first 48 leaves: the 49th takes its slot, and its response begins.
        await streams[0].close()
        last = await asyncio.wait_for(opening, DEADLINE_S)
        streams.append(last)
        chunk = await asyncio.wait_for(last.__anext__(), DEADLINE_S)
        assert chunk.choices[0].delta.role == "assistant"  # the opening comes with the first token
        await until(lambda: metric(t, "sglang:num_aborted_requests_total") == 1, "the abort counted")
        await until(lambda: (loads(t)["num_running_reqs"], loads(t)["num_waiting_reqs"]) == (48, 0), "slot reused")
    finally:
        for s in streams:
            await s.close()
        await aclient.close()
    await until(lambda: loads(t)["num_running_reqs"] == 0, "all slots free after disconnects")


def test_a_client_that_leaves_keeps_its_slot_as_long_as_on_sglang():
    """SGLang aborts a started stream whose client left 2 s later (create_abort_task's sleep), and
    a request with nothing sent yet at its next 4 s check for the client
    (SGLANG_REQUEST_STATE_WAIT_TIMEOUT): until then the request keeps its slot."""
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 30000, "ignore_eos": True}
    with twin("spec", "kimi-linear", time_scale=1) as t:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(t.url + "/v1/chat/completions", timeout=httpx.Timeout(10, read=1.0), json=body)
        left = time.monotonic()
        assert loads(t)["num_running_reqs"] == 1  # still decoding for its gone client
        wait_for(lambda: metric(t, "sglang:num_aborted_requests_total") == 1, "the abort")
        assert time.monotonic() - left > 2.5  # at 4 s from its start, not at once (1 s)
        wait_for(lambda: loads(t)["num_running_reqs"] == 0, "the slot freed")
        assert json.loads(httpx.get(t.url + "/v1/loads").text)["loads"][0]["num_waiting_reqs"] == 0
        with httpx.stream("POST", t.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=10) as r:
            next(r.iter_lines())  # started
        left = time.monotonic()
        wait_for(lambda: metric(t, "sglang:num_aborted_requests_total") == 2, "the stream's abort")
        assert time.monotonic() - left > 1.5


@pytest.mark.parametrize(
    "body,fragment",
    [
        ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
        (
            {"messages": [{"role": "user", "content": "x"}], "temperature": -1},
            "temperature must be a non-negative finite",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p must be in (0, 1]"),
        # the rest of SGLang 0.5.23's SamplingParams.verify
        ({"messages": [{"role": "user", "content": "x"}], "top_k": 0}, "top_k must be -1 (disable) or at least 1"),
        ({"messages": [{"role": "user", "content": "x"}], "min_p": 1.5}, "min_p must be in [0, 1]"),
        (
            {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 3},
            "frequency_penalty must be in [-2, 2]",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "presence_penalty": -2.5},
            "presence_penalty must be in [-2, 2]",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 0},
            "repetition_penalty must be in (0, 2]",
        ),
    ],
)
def test_sampling_and_message_validation(spec, body, fragment):
    r = httpx.post(spec.url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 400 and fragment in r.json()["message"]


def test_loads_in_prometheus_format(spec):
    chat(spec, max_tokens=3)
    text = httpx.get(spec.url + "/v1/loads", params={"format": "prometheus"}).text
    assert 'sglang_max_running_requests{dp_rank="0"} 48.0' in text
    assert re.search(r'^sglang_spec_accept_length\{dp_rank="0"\} \d', text, re.M)


def test_http_and_virtual_clock_run_the_same_engine():
    """Same seed, same request: the HTTP twin's chunks carry exactly the tokens per step that the
    virtual clock's steps commit (one engine model, two drivers)."""
    from sim.engine import Engine, EngineConfig
    from sim.virtual import Arrival, simulate

    steps = []
    engine = Engine(EngineConfig("spec", KIMI, seed=7), "spec")
    simulate([engine], [Arrival(0.0, 8, max_tokens=150, ignore_eos=True)], lambda a, f: 0, on_step=steps.append)
    virtual = [s.tokens for s in steps]
    with twin("spec", "kimi-linear", time_scale=20, seed=7) as t:
        (times,) = asyncio.run(chunk_times(t, 1, 150))
    assert [n for _, n in times] == virtual
    assert virtual[0] == 1 and sum(virtual) == 150


def test_request_id_is_the_response_id_and_must_be_unique_while_running(spec):
    r = chat(spec, max_tokens=3, extra_body={"rid": "my-request-1"})
    assert r.id == "my-request-1"

    async def clash():
        aclient = openai.AsyncOpenAI(base_url=spec.base_url, api_key="unused", max_retries=0)
        stream = await aclient.chat.completions.create(
            model="twin",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=20000,
            stream=True,
            extra_body={"ignore_eos": True, "rid": "busy-rid"},
        )
        try:
            with pytest.raises(openai.BadRequestError, match="Duplicate request id"):
                await aclient.chat.completions.create(
                    model="twin",
                    messages=[{"role": "user", "content": "x"}],
                    max_tokens=3,
                    extra_body={"rid": "busy-rid"},
                )
        finally:
            await stream.close()
            await aclient.close()

    asyncio.run(clash())


def test_a_storm_of_clients_that_leave_leaks_no_slot():
    """120 streams against a 48-slot spec server leave after 0-5 chunks (many while queued), and
    20 non-streaming clients give up: every request is aborted and every slot comes back."""
    with twin("spec", "kimi-linear", time_scale=5, seed=8) as t:
        asyncio.run(_storm(t))
        wait_for(lambda: (loads(t)["num_running_reqs"], loads(t)["num_waiting_reqs"]) == (0, 0), "all slots free")
        wait_for(lambda: metric(t, "sglang:num_aborted_requests_total") == 140, "every request aborted")
        assert (metric(t, "sglang:num_requests_total") or 0) == 0  # none finished on its own
        assert chat(t, max_tokens=3).usage.completion_tokens == 3  # and the server still serves


def test_a_wedged_twin_takes_requests_and_answers_its_polls_but_sends_nothing_until_healed(spec):
    """Twin only: an engine hung in a forward pass behind a live HTTP front. SGLang's /v1/loads
    reads the snapshot its scheduler last published to shared memory, so it answers, unchanged."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    assert httpx.post(spec.url + "/specroute/twin/faults", json={"wedged": "yes"}, timeout=5).status_code == 400
    before = loads(spec)
    with httpx.Client(base_url=spec.url, timeout=httpx.Timeout(10, read=1.0)) as http:
        try:
            assert http.post("/specroute/twin/faults", json={"wedged": True}).json()["wedged"] is True
            # Taken, but no status while wedged: SGLang answers a stream's status with its first
            # chunk (the twin runs 20x: a token takes ms).
            with pytest.raises(httpx.ReadTimeout), http.stream("POST", "/v1/chat/completions", json=body):
                pass
            assert loads(spec) == before  # the load snapshot is not republished
            assert http.get("/health").status_code == 200 and metric(spec, "sglang:num_running_reqs") is not None
        finally:
            http.post("/specroute/twin/faults", json={})
        with http.stream("POST", "/v1/chat/completions", json=body) as response:  # healed: served again
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3


async def _storm(t):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 20000, "ignore_eos": True}
    limits = httpx.Limits(max_connections=200)
    async with httpx.AsyncClient(base_url=t.url, limits=limits, timeout=httpx.Timeout(30, read=2.0)) as client:

        async def stream(keep: int):
            async with client.stream("POST", "/v1/chat/completions", json=dict(body, stream=True)) as response:
                if keep == 0:
                    return  # leave before the first chunk (queued or in prefill)
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        keep -= 1
                        if keep == 0:
                            return

        async def plain():
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/chat/completions", json=body)

        await asyncio.gather(*(stream(i % 6) for i in range(120)), *(plain() for _ in range(20)))


def test_faults_make_a_twin_sick_on_purpose_and_heal_it(spec):
    """Twin only: the reliability tests' sick server. Polls stay healthy while completions fail."""
    bad = httpx.post(spec.url + "/specroute/twin/faults", json={"error_rate": 2}, timeout=5)
    assert bad.status_code == 400 and bad.json()["object"] == "error"
    assert httpx.post(spec.url + "/specroute/twin/faults", json={"lag": 1}, timeout=5).status_code == 400
    try:
        assert httpx.post(spec.url + "/specroute/twin/faults", json={"error_rate": 1.0}, timeout=5).status_code == 200
        refused = httpx.post(
            spec.url + "/v1/chat/completions",
            timeout=10,
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert refused.status_code == 500 and refused.json()["type"] == "InternalServerError"
        assert httpx.get(spec.url + "/health", timeout=5).status_code == 200
        assert "num_running_reqs" in loads(spec)
        httpx.post(spec.url + "/specroute/twin/faults", json={"drop_after_chunks": 1}, timeout=5)
        with pytest.raises(httpx.RemoteProtocolError):
            with httpx.stream(
                "POST",
                spec.url + "/v1/chat/completions",
                timeout=10,
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True},
            ) as stream:
                for _ in stream.iter_bytes():
                    pass
    finally:
        healed = httpx.post(spec.url + "/specroute/twin/faults", json={}, timeout=5)
    assert healed.json() == {
        "error_rate": 0.0,
        "first_token_delay_ms": 0.0,
        "hang_after_chunks": None,
        "drop_after_chunks": None,
        "load_delay_ms": 0.0,
        "wedged": False,
        "wedged_rank": None,
    }
    ok = httpx.post(
        spec.url + "/v1/chat/completions",
        timeout=10,
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert ok.status_code == 200


def test_a_data_parallel_twin_deals_requests_to_its_ranks_and_one_rank_can_hang():
    """--dp-size 2: two replicas behind one front, as SGLang without DP attention. Requests go to
    the ranks in turn (or to the one `x-data-parallel-rank` names); /v1/loads, /metrics and
    /server_info describe each rank. With one rank wedged, requests dealt to it wait while the
    other rank serves, /health_generate passes (another rank's output counts, as SGLang's
    check), and the wedged rank's snapshot stops moving."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with twin("base", time_scale=5.0, args=("--dp-size", "2")) as t:
        info = httpx.get(t.url + "/server_info", timeout=5).json()
        assert info["dp_size"] == 2 and len(info["internal_states"]) == 2
        ranks = httpx.get(t.url + "/v1/loads", timeout=5).json()["loads"]
        assert [r["dp_rank"] for r in ranks] == [0, 1]
        assert [r["dp_rank"] for r in httpx.get(t.url + "/v1/loads?dp_rank=1", timeout=5).json()["loads"]] == [1]
        with httpx.Client(base_url=t.url, timeout=httpx.Timeout(10, read=2.0)) as http:
            bad = http.post("/v1/chat/completions", json=body, headers={"x-data-parallel-rank": "2"})
            assert bad.status_code == 400
            for _ in range(4):
                assert http.post("/v1/chat/completions", json=body).status_code == 200
            pinned = http.post("/v1/chat/completions", json=body, headers={"x-data-parallel-rank": "1"})
            assert pinned.status_code == 200
        text = httpx.get(t.url + "/metrics", timeout=5).text
        assert 'dp_rank="0"' in text and 'dp_rank="1"' in text
        counts = [loads_rank["timestamp"] for loads_rank in httpx.get(t.url + "/v1/loads", timeout=5).json()["loads"]]
        assert all(c > 0 for c in counts)
        assert metric(t, "sglang:num_requests_total") == 5

        bad_rank = httpx.post(t.url + "/specroute/twin/faults", json={"wedged_rank": 2}, timeout=5)
        assert bad_rank.status_code == 400
        assert httpx.post(t.url + "/specroute/twin/faults", json={"wedged_rank": 1}, timeout=5).status_code == 200
        stream = dict(body, stream=True, max_tokens=20000, ignore_eos=True)  # ~25 s at 5x: outlives the test
        with httpx.Client(base_url=t.url, timeout=httpx.Timeout(10, read=1.0)) as http:
            try:
                with http.stream(
                    "POST", "/v1/chat/completions", json=stream, headers={"x-data-parallel-rank": "0"}
                ) as busy:
                    assert busy.status_code == 200
                    texts = (line for line in busy.iter_lines() if '"content":"' in line and '"content":""' not in line)
                    assert next(texts)  # rank 0 streams (each read bounded by the 1 s timeout)
                    frozen = http.get("/v1/loads?dp_rank=1").json()["loads"][0]
                    # No token from the wedged rank, so no status either (SGLang answers a
                    # stream's status with its first chunk).
                    with (
                        pytest.raises(httpx.ReadTimeout),
                        http.stream("POST", "/v1/chat/completions", json=stream, headers={"x-data-parallel-rank": "1"}),
                    ):
                        pass
                    assert http.get("/health_generate").status_code == 200  # rank 0's output counts
                    assert http.get("/v1/loads?dp_rank=1").json()["loads"][0]["timestamp"] == frozen["timestamp"]
                    moving = http.get("/v1/loads?dp_rank=0").json()["loads"][0]["timestamp"]
                    wait_for(
                        lambda: http.get("/v1/loads?dp_rank=0").json()["loads"][0]["timestamp"] > moving,
                        "rank 0's snapshot moving",
                        timeout=10,
                    )
            finally:
                http.post("/specroute/twin/faults", json={})
            assert (
                http.post("/v1/chat/completions", json=body, headers={"x-data-parallel-rank": "1"}).status_code == 200
            )


def test_readiness_and_ping_answer_as_sglangs(spec):
    """SGLang after 0.5.15 serves GET /ready (its tokenizer manager's readiness) and /ping
    (SageMaker's); the twin reported 0.5.23 and answered both 404 (a fidelity review)."""
    for path in ("/ready", "/ping"):
        assert httpx.get(spec.url + path, timeout=5).status_code == 200, path


def test_an_abort_request_ends_the_answer_with_finish_reason_abort(base):
    """A fidelity review's finding: the twin ended an aborted request with a 400 or an error
    event; SGLang's FINISH_ABORT carries no status, so `_handle_abort_finish_reason` lets it
    through and the answer ends as any other, its finish reason `abort`."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20000, "ignore_eos": True}
    with httpx.Client(base_url=base.url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as stream:
            lines = stream.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
            assert http.post("/abort_request", json={"rid": first["id"]}).status_code == 200
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]" and not any('"error"' in event for event in rest)
        reasons = [c["finish_reason"] for e in rest[:-1] for c in json.loads(e)["choices"] if c.get("finish_reason")]
        assert reasons == ["abort"]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(http.post, "/v1/chat/completions", json={**body, "rid": "to-abort"})
            wait_for(lambda: loads(base)["num_running_reqs"] >= 1, "the request running")
            assert http.post("/abort_request", json={"rid": "to-abort"}).status_code == 200
            done = answer.result(timeout=30)
        assert done.status_code == 200 and done.json()["choices"][0]["finish_reason"] == "abort"
        # n = 2, one choice aborted: both end (a review found the other cut off unfinished, its
        # finish reason null, and left running on its engine).
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(http.post, "/v1/chat/completions", json={**body, "rid": "pair", "n": 2})
            wait_for(lambda: loads(base)["num_running_reqs"] >= 2, "both choices running")
            assert http.post("/abort_request", json={"rid": "pair-0"}).status_code == 200
            done = answer.result(timeout=30)
        assert [c["finish_reason"] for c in done.json()["choices"]] == ["abort", "abort"]
        wait_for(lambda: loads(base)["num_running_reqs"] == 0, "no choice left running")


def test_a_full_queue_refuses_a_stream_in_band_and_a_json_request_with_503():
    """SGLang's --max-queued-requests: its scheduler aborts a newcomer to a full waiting queue with
    a 503 status. A stream has its 200 by then (SGLang awaits the first output before answering,
    and the abort is it): an error event, then [DONE]. A JSON request gets the 503."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20000, "ignore_eos": True}
    args = ("--max-running-requests", "1", "--max-queued-requests", "1")
    with twin("base", time_scale=1.0, args=args) as t, httpx.Client(base_url=t.url, timeout=30) as http:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            # One at a time: two arriving in one scheduler step would find the queue full between them.
            held = [pool.submit(http.post, "/v1/chat/completions", json={**body, "rid": "held-0"})]
            wait_for(lambda: loads(t)["num_running_reqs"] == 1, "one running")
            held.append(pool.submit(http.post, "/v1/chat/completions", json={**body, "rid": "held-1"}))
            wait_for(lambda: loads(t)["num_waiting_reqs"] == 1, "one running, one queued")
            with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as stream:
                assert stream.status_code == 200
                events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
            refused = http.post("/v1/chat/completions", json=body)
            for i in range(2):
                http.post("/abort_request", json={"rid": f"held-{i}"})
            for answer in held:
                answer.result(timeout=30)
    assert events[-1] == "[DONE]" and len(events) == 2
    assert json.loads(events[0]) == {
        "error": {
            "object": "error",
            "message": "The request queue is full.",
            "type": "SERVICE_UNAVAILABLE",
            "param": None,
            "code": 503,
        }
    }
    assert events[0].startswith('{"error": {"object": "error", ')  # json.dumps's spacing, as SGLang's
    assert refused.status_code == 503
    assert refused.json() == {
        "object": "error",
        "message": "The request queue is full.",
        "type": "503",
        "param": None,
        "code": 503,
    }


def test_an_abort_ends_every_request_whose_rid_begins_with_it(base):
    """SGLang's tokenizer manager sends an abort on only for a running rid, and its scheduler
    then aborts every request whose rid begins with it (`req.rid.startswith(recv_req.rid)`):
    a client's short rid, aborted when it leaves, takes other clients' requests with it."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20000, "ignore_eos": True}
    with httpx.Client(base_url=base.url, timeout=30) as http, concurrent.futures.ThreadPoolExecutor(2) as pool:
        before = metric(base, "sglang:num_aborted_requests_total") or 0
        answers = [pool.submit(http.post, "/v1/chat/completions", json={**body, "rid": rid}) for rid in ("ab", "abc9")]
        wait_for(lambda: loads(base)["num_running_reqs"] >= 2, "both running")
        assert http.post("/abort_request", json={"rid": "a"}).status_code == 200  # no request named "a"
        assert (metric(base, "sglang:num_aborted_requests_total") or 0) == before
        assert http.post("/abort_request", json={"rid": "ab"}).status_code == 200
        done = [answer.result(timeout=30).json() for answer in answers]
    assert [d["id"] for d in done] == ["ab", "abc9"]
    assert [d["choices"][0]["finish_reason"] for d in done] == ["abort", "abort"]


def test_the_drop_fault_before_any_chunk_cuts_the_connection_not_a_500(spec):
    """A review's finding: with the status sent only with the first chunk, a stream dropped
    before it was answered 500 in plain text, a server error where the fault promises a cut."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    try:
        assert (
            httpx.post(spec.url + "/specroute/twin/faults", json={"drop_after_chunks": 0}, timeout=5).status_code == 200
        )
        with httpx.stream("POST", spec.url + "/v1/chat/completions", json=body, timeout=10) as response:
            assert response.status_code == 200
            with pytest.raises(httpx.RemoteProtocolError):
                response.read()
    finally:
        httpx.post(spec.url + "/specroute/twin/faults", json={}, timeout=5)


def test_stream_chunks_have_sglang_05s_fields(spec):
    """SGLang 0.5.23 writes chat chunks with msgspec (sse_utils: reasoning_content always, a None
    usage left out) and a completions stream's usage chunk without its null fields."""

    def events(path: str, body: dict) -> list[dict]:
        body = {**body, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
        r = httpx.post(spec.url + path, json=body, timeout=30)
        return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]

    chat = events("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    *content, usage = chat
    assert all(next(iter(c["choices"][0]["delta"])) == "reasoning_content" for c in content)
    assert all("usage" not in c for c in content) and usage["usage"]["completion_tokens_details"] is None
    *_, usage = events("/v1/completions", {"prompt": "x"})
    assert usage["choices"] == [] and None not in usage["usage"].values()
    assert "prompt_tokens_details" not in usage["usage"]


def test_a_request_filling_the_context_exactly_is_served(spec):
    """SGLang refuses a prompt plus max_tokens past the context (tokenizer_manager: `>`), not one
    that fills it."""
    context = httpx.get(spec.url + "/server_info", timeout=5).json()["context_length"]
    body = {"prompt": [1, 2, 3, 4, 5], "max_tokens": context - 5, "ignore_eos": False}
    assert httpx.post(spec.url + "/v1/completions", json={**body, "max_tokens": context - 4}).status_code == 400
    assert httpx.post(spec.url + "/v1/completions", json=body, timeout=60).status_code == 200
