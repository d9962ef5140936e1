"""The twin as vLLM's OpenAI server (`--server vllm`): vLLM's shapes over real sockets, read with
the real openai SDK and Prometheus' own parser, and the Kimi vLLM presets' speeds."""

import concurrent.futures
import contextlib
import subprocess
import sys

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleet.profile import load_profile
from sim.testing import TwinSpec, twins, wait_for

MESSAGES = [{"role": "user", "content": "Say hi."}]
MODEL = "specroute/twin"
"""The twins' served model name: a vLLM server answers 404 for any other."""


@pytest.mark.parametrize("name", ["kimi-moe", "kimi-linear"])
def test_the_vllm_presets_give_the_deployments_vllm_speeds_beside_sglangs(name):
    sglang, vllm = load_profile(name), load_profile(f"{name}-vllm")
    alone, crowd = (lambda p: 1000 / p.base_step_ms(1, 1000)), (lambda p: 128 * 1000 / p.base_step_ms(128, 1000))
    # The seed deployment: vLLM 82.5 tok/s single stream and 1,536 at 128; SGLang 63.6 and 2,370.
    assert alone(vllm) == pytest.approx(82.5, rel=0.005)
    assert crowd(vllm) == pytest.approx(1536, rel=0.005)
    assert alone(sglang) == pytest.approx(63.6, rel=0.005)
    assert crowd(sglang) == pytest.approx(2370, rel=0.01)


def test_server_vllm_is_refused_for_a_spec_twin():
    done = subprocess.run(
        [sys.executable, "-m", "sim", "--mode", "spec", "--server", "vllm", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--mode base" in done.stderr


@pytest.fixture(scope="module")
def vllm_twin():
    with twins(
        TwinSpec(
            "base",
            "kimi-moe-vllm",
            time_scale=20,
            seed=5,
            server="vllm",
            args=("--max-running-requests", "2", "--output-len", "fixed:4096"),
        )
    ) as (running,):
        yield running


def families(t) -> dict:
    return {f.name: f for f in text_string_to_metric_families(httpx.get(t.url + "/metrics", timeout=5).text)}


def gauge(t, name: str) -> float:
    (sample,) = families(t)[name].samples
    return sample.value


def finished_requests(t) -> float:
    return sum(s.value for s in families(t)["vllm:request_success"].samples if s.name == "vllm:request_success_total")


def test_metrics_have_vllms_names_types_and_labels(vllm_twin):
    client = openai.OpenAI(base_url=vllm_twin.base_url, api_key="none", max_retries=0)
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    got = families(vllm_twin)
    model_id = httpx.get(vllm_twin.url + "/v1/models", timeout=5).json()["data"][0]["id"]
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:num_requests_waiting_by_reason": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        # the parser names counters without their _total suffix
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:num_preemptions": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
    }
    assert {name: got[name].type for name in expected if name in got} == expected
    assert not [name for name in got if name.startswith("sglang:")]
    for family in (got[name] for name in expected):
        for sample in family.samples:
            assert sample.labels["model_name"] == model_id and sample.labels["engine"] == "0"
    success = {
        s.labels["finished_reason"]: s.value
        for s in got["vllm:request_success"].samples
        if s.name == "vllm:request_success_total"
    }
    assert success.get("length", 0) >= 1
    assert [s.value for s in got["vllm:generation_tokens"].samples if s.name.endswith("_total")][0] >= 3


def counter(t, name: str) -> float:
    return sum(s.value for s in families(t)[name].samples if s.name == name + "_total")


def test_token_counters_move_with_every_step_not_at_a_request_s_end(vllm_twin):
    """vLLM counts prompt and generation tokens from each engine iteration's stats: a long
    request under way moves them (what a router reads to see the engine is working)."""
    finished = finished_requests(vllm_twin)
    before = counter(vllm_twin, "vllm:generation_tokens"), counter(vllm_twin, "vllm:prompt_tokens")
    client = openai.OpenAI(base_url=vllm_twin.base_url, api_key="none", max_retries=0, timeout=30)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3000, stream=True)
    try:
        chunks = iter(stream)
        for _ in range(20):
            next(chunks)
        generated = counter(vllm_twin, "vllm:generation_tokens") - before[0]
        assert generated >= 18  # the opening chunk carries no token
        assert counter(vllm_twin, "vllm:prompt_tokens") > before[1]
        assert finished_requests(vllm_twin) == finished  # still running
    finally:
        stream.close()


def test_running_and_waiting_are_live_on_metrics(vllm_twin):
    # Three long streams on a server that runs two at a time: 2 running, 1 waiting, while held open.
    streams = [
        httpx.stream(
            "POST",
            vllm_twin.base_url + "/chat/completions",
            timeout=30,
            json={"model": MODEL, "messages": MESSAGES, "max_tokens": 3000, "stream": True},
        )
        for _ in range(3)
    ]
    try:
        for s in streams:
            assert s.__enter__().status_code == 200
        wait_for(
            lambda: (
                (gauge(vllm_twin, "vllm:num_requests_running"), gauge(vllm_twin, "vllm:num_requests_waiting"))
                == (2.0, 1.0)
            ),
            what="2 running and 1 waiting on the vLLM twin's /metrics",
        )
        by_reason = {
            s.labels["reason"]: s.value for s in families(vllm_twin)["vllm:num_requests_waiting_by_reason"].samples
        }
        assert by_reason == {"capacity": 1.0, "deferred": 0.0}
        assert 0 < gauge(vllm_twin, "vllm:kv_cache_usage_perc") <= 1
    finally:
        for s in streams:
            s.__exit__(None, None, None)
    wait_for(
        lambda: gauge(vllm_twin, "vllm:num_requests_running") + gauge(vllm_twin, "vllm:num_requests_waiting") == 0,
        what="the vLLM twin idle again",
    )


def test_endpoints_are_vllms_and_sglangs_own_are_missing(vllm_twin):
    health = httpx.get(vllm_twin.url + "/health", timeout=5)
    assert health.status_code == 200 and health.content == b""
    assert httpx.get(vllm_twin.url + "/ping", timeout=5).status_code == 200
    assert httpx.get(vllm_twin.url + "/version", timeout=5).json() == {"version": "0.33.0"}
    assert httpx.get(vllm_twin.url + "/load", timeout=5).json() == {"server_load": 0}
    card = httpx.get(vllm_twin.url + "/v1/models", timeout=5).json()["data"][0]
    assert (
        card["owned_by"] == "vllm"
        and card["max_model_len"] == 32768
        and card["permission"][0]["object"] == "model_permission"
    )
    for sglang_only in ("/v1/loads", "/server_info", "/get_load", "/get_model_info", "/health_generate", "/metrics/x"):
        missing = httpx.get(vllm_twin.url + sglang_only, timeout=5)
        assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"}), sglang_only


def test_errors_are_nested_with_the_status_as_code(vllm_twin):
    bad = httpx.post(
        vllm_twin.base_url + "/chat/completions",
        timeout=5,
        json={"model": MODEL, "messages": MESSAGES, "max_tokens": -1},
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "BadRequestError" and bad.json()["error"]["code"] == 400
    assert set(bad.json()) == {"error"} and set(bad.json()["error"]) == {"message", "type", "param", "code"}
    client = openai.OpenAI(base_url=vllm_twin.base_url, api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    assert refused.value.message and refused.value.body["code"] == 400


def test_a_chat_stream_opens_with_the_role_then_one_token_per_chunk(vllm_twin):
    client = openai.OpenAI(base_url=vllm_twin.base_url, api_key="none", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=5, stream=True, stream_options={"include_usage": True}
        )
    )
    opening, *content, final = chunks
    assert opening.choices[0].delta.role == "assistant" and opening.choices[0].delta.content == ""
    assert len(content) == 5 and all(c.choices[0].delta.role is None and c.choices[0].delta.content for c in content)
    assert [c.choices[0].finish_reason for c in content] == [None] * 4 + ["length"]
    last = content[-1].choices[0].model_dump()
    assert "stop_reason" in last and "matched_stop" not in last
    assert final.choices == [] and final.usage.completion_tokens == 5
    assert "reasoning_tokens" not in final.usage.model_dump(exclude_unset=True)


def test_plain_answers_carry_vllms_fields(vllm_twin):
    client = openai.OpenAI(base_url=vllm_twin.base_url, api_key="none", max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3).model_dump(exclude_unset=True)
    choice = chat["choices"][0]
    assert "stop_reason" in choice and "matched_stop" not in choice
    assert "reasoning" in choice["message"] and "reasoning_content" not in choice["message"]
    assert chat["usage"]["completion_tokens"] == 3 and "reasoning_tokens" not in chat["usage"]
    # A completions stream has no opening role chunk: its first chunk carries text.
    chunks = list(client.completions.create(model=MODEL, prompt="hi", max_tokens=3, stream=True))
    assert len(chunks) == 3 and all(c.choices[0].text for c in chunks)


def test_nothing_of_a_chat_stream_goes_out_while_the_request_waits(vllm_twin):
    # vLLM sends its opening role chunk with the engine's first output, after prefill: a stream
    # still queued has its headers and no body yet (a router timing first bytes relies on it).
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3000, "stream": True}
    streams = [httpx.stream("POST", vllm_twin.base_url + "/chat/completions", timeout=30, json=body) for _ in range(2)]
    queued = httpx.stream(
        "POST", vllm_twin.base_url + "/chat/completions", json=body, timeout=httpx.Timeout(30, read=0.5)
    )
    try:
        for s in streams:
            assert s.__enter__().status_code == 200
        wait_for(lambda: gauge(vllm_twin, "vllm:num_requests_running") == 2.0, what="two running")
        response = queued.__enter__()
        wait_for(lambda: gauge(vllm_twin, "vllm:num_requests_waiting") == 1.0, what="the third waiting")
        finished = finished_requests(vllm_twin)
        with pytest.raises(httpx.ReadTimeout):
            next(response.iter_raw())
        assert finished_requests(vllm_twin) == finished  # no slot freed: it was queued all along
    finally:
        for s in (*streams, queued):
            s.__exit__(None, None, None)
    wait_for(
        lambda: gauge(vllm_twin, "vllm:num_requests_running") + gauge(vllm_twin, "vllm:num_requests_waiting") == 0,
        what="the vLLM twin idle again",
    )


def test_a_model_it_does_not_serve_is_not_found(vllm_twin):
    client = openai.OpenAI(base_url=vllm_twin.base_url, api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=3)
    assert missing.value.body == {
        "message": "The model `gpt-4o` does not exist.",
        "type": "NotFoundError",
        "param": None,
        "code": 404,
    }


def test_vllm_ids_model_stop_reason_and_validation_are_vllms(vllm_twin):
    url = vllm_twin.url + "/v1/chat/completions"
    chat = {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 3}
    # the response id: chatcmpl- (cmpl- for completions) and the client's X-Request-Id
    named = httpx.post(url, json=chat | {"model": MODEL}, headers={"x-request-id": "abc123"}, timeout=30).json()
    assert named["id"] == "chatcmpl-abc123"
    legacy = httpx.post(
        vllm_twin.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=30
    )
    assert legacy.json()["id"].startswith("cmpl-")
    # no model named: served with the served one
    unnamed = httpx.post(url, json=chat, timeout=30)
    assert unnamed.status_code == 200 and unnamed.json()["model"] == MODEL
    # an EOS stop leaves stop_reason null (vLLM sets it for stop strings and stop_token_ids)
    natural = httpx.post(url, json=chat | {"model": MODEL, "max_tokens": 5000}, timeout=60).json()["choices"][0]
    assert natural["finish_reason"] == "stop" and natural["stop_reason"] is None
    # continuous usage only with include_usage
    body = chat | {"model": MODEL, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    text = httpx.post(url, json=body, timeout=30).text
    assert '"usage":{' not in text.replace(" ", "")
    for bad, words in (
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0."),
        ({"stream_options": {"include_usage": True}}, "Stream options can only be defined when `stream=True`."),
    ):
        refused = httpx.post(url, json=chat | {"model": MODEL} | bad, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["message"] == words


def engine_series(text: str, name: str) -> dict[str, float]:
    """One metric's value per `engine` label."""
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == name]
    return {s.labels["engine"]: s.value for s in family.samples if s.name in (name, name + "_total")}


def test_a_data_parallel_vllm_twin_balances_by_load_and_labels_each_engine_and_one_can_hang():
    """--data-parallel-size 2 as vLLM's internal load balancing runs it: each request to the
    engine with the least waiting x 4 + running (as its front end last heard, counting what it
    sent since), or to the one `X-data-parallel-rank` names (400 out of range, ignored when no
    integer); /metrics has each engine's series under `engine`. A hung engine's series hold what
    they showed (its core sends no more stats) while the other serves."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 20000, "ignore_eos": True, "stream": True}
    with twins(TwinSpec("base", time_scale=5.0, seed=9, server="vllm", args=("--data-parallel-size", "2"))) as (t,):
        with httpx.Client(base_url=t.url, timeout=httpx.Timeout(10, read=2.0)) as http:
            bad = http.post("/v1/chat/completions", json=body, headers={"x-data-parallel-rank": "2"})
            assert bad.status_code == 400
            assert bad.json()["error"]["message"] == "data_parallel_rank 2 is out of range [0, 2)."
            with contextlib.ExitStack() as streams:
                lines = []  # each stream's line iterator, kept: one dropped closes its stream

                def first_token(headers: dict[str, str]) -> None:
                    opened = streams.enter_context(
                        http.stream("POST", "/v1/chat/completions", json=body, headers=headers)
                    )
                    assert opened.status_code == 200
                    lines.append(opened.iter_lines())
                    while '"content":"' not in (line := next(lines[-1])) or '"content":""' in line:
                        pass

                # Two long streams named to engine 0; then two to engine 1, the less loaded (in
                # turn they would go to 0 and 1); then, at a tie, engine 0.
                for headers in ({"x-data-parallel-rank": "0"},) * 2 + ({},) * 2 + ({"x-data-parallel-rank": "zero"},):
                    first_token(headers)
                running = engine_series(http.get("/metrics").text, "vllm:num_requests_running")
                assert running == {"0": 3.0, "1": 2.0}
                first_token({"x-data-parallel-rank": "1"})
                assert engine_series(http.get("/metrics").text, "vllm:num_requests_running") == {"0": 3.0, "1": 3.0}

                assert http.post("/specroute/twin/faults", json={"wedged_rank": 1}).status_code == 200
                try:
                    frozen = engine_series(http.get("/metrics").text, "vllm:generation_tokens")
                    short = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
                    # Engine 1's frozen counts (3 running) tie engine 0's: the lowest rank takes it.
                    assert http.post("/v1/chat/completions", json=short).status_code == 200
                    with concurrent.futures.ThreadPoolExecutor(1) as pool:
                        stuck = pool.submit(
                            http.post, "/v1/chat/completions", json=short, headers={"x-data-parallel-rank": "1"}
                        )
                        while not stuck.done():  # its 2 s read timeout bounds the loop
                            waiting = engine_series(http.get("/metrics").text, "vllm:num_requests_waiting")
                            assert waiting["1"] == 0.0  # as it hung, not the request it holds now
                        assert isinstance(stuck.exception(), httpx.ReadTimeout)
                    later = http.get("/metrics").text
                    assert engine_series(later, "vllm:generation_tokens")["1"] == frozen["1"]
                    assert engine_series(later, "vllm:generation_tokens")["0"] > frozen["0"]
                finally:
                    http.post("/specroute/twin/faults", json={})
            done = http.post("/v1/chat/completions", json=short, headers={"x-data-parallel-rank": "1"})
            assert done.status_code == 200


def test_a_responses_max_output_tokens_is_taken_whole(vllm_twin):
    """A review's finding: the vLLM twin kept SGLang's two tokens of headroom; vLLM's
    ResponsesRequest.to_sampling_params takes max_output_tokens as it is."""
    body = {"model": MODEL, "input": "Talk.", "max_output_tokens": 6}
    answer = httpx.post(vllm_twin.base_url + "/responses", json=body, timeout=30).json()
    assert answer["status"] == "incomplete" and answer["usage"]["output_tokens"] == 6
