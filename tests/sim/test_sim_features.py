"""OpenAI features the twin imitates: n > 1, tools, JSON response formats, logprobs, over HTTP
with the real openai SDK."""

import asyncio
import json

import httpx
import openai
import pytest

from sim.testing import twin, wait_for

DEADLINE_S = 30.0
MESSAGES = [{"role": "user", "content": "What is the weather?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "unit": {"type": "string", "enum": ["C", "F"]},
            },
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
PERSON = {
    "type": "json_schema",
    "json_schema": {
        "name": "person",
        "schema": {
            "type": "object",
            "required": ["name", "age"],
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "score": {"type": "number"},
                "member": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "address": {"type": "object", "properties": {"street": {"type": "string"}}},
            },
        },
    },
}


@pytest.fixture(scope="module")
def spec():
    # Natural lengths of 20 to 200 tokens: a JSON answer given max_tokens 400 always ends on its own.
    with twin("spec", "kimi-linear", time_scale=20, seed=3, args=("--output-len", "uniform:20,200")) as t:
        yield t


def client(t):
    return openai.OpenAI(base_url=t.base_url, api_key="unused", max_retries=0, timeout=60)


def chat(t, **kw):
    kw.setdefault("model", "twin")
    kw.setdefault("messages", MESSAGES)
    return client(t).chat.completions.create(**kw)


def stream(t, **kw):
    """(the chunks with text or a tool call, every chunk): SGLang opens each choice with the role
    alone and closes it with an empty delta and the finish reason."""
    chunks = list(chat(t, stream=True, **kw))
    return [c for c in chunks if c.choices and (c.choices[0].delta.content or c.choices[0].delta.tool_calls)], chunks


def loads(t):
    return httpx.get(t.url + "/v1/loads", timeout=5).json()["loads"][0]


# ---- tools -------------------------------------------------------------------------------------


def test_tools_on_auto_answer_with_text(spec):
    r = chat(spec, tools=[WEATHER], max_tokens=20)
    message = r.choices[0].message
    assert message.tool_calls is None and message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    content, _ = stream(spec, tools=[WEATHER], tool_choice="auto", max_tokens=20)
    assert all(c.choices[0].delta.tool_calls is None for c in content)
    assert "".join(c.choices[0].delta.content for c in content)


def test_required_tool_choice_calls_the_first_function(spec):
    r = chat(spec, tools=[WEATHER, CLOCK], tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "days", "unit"}
    assert isinstance(arguments["city"], str) and arguments["city"]
    assert isinstance(arguments["days"], int) and arguments["unit"] in ("C", "F")
    # The call is short, and its tokens are the completion's tokens.
    assert 0 < r.usage.completion_tokens < 20


def test_a_named_tool_is_called_and_a_function_without_parameters_gets_empty_arguments(spec):
    r = chat(spec, tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {})


def test_a_forced_tool_call_streams_name_then_argument_pieces(spec):
    content, chunks = stream(spec, tools=[WEATHER], tool_choice="required")
    opening, closing = chunks[0].choices[0], [c for c in chunks if c.choices][-1].choices[0]
    assert (opening.delta.role, opening.delta.content, opening.delta.tool_calls) == ("assistant", "", None)
    assert closing.finish_reason == "tool_calls" and closing.delta.tool_calls is None
    deltas = [c.choices[0].delta for c in content]
    first = deltas[0].tool_calls[0]
    assert deltas[0].role is None and deltas[0].content is None
    assert (first.index, first.type, first.function.name) == (0, "function", "get_weather")
    assert first.id.startswith("call_")
    later = [d.tool_calls[0] for d in deltas[1:] if d.tool_calls]
    assert later and all(t.index == 0 and t.id is None and t.function.name is None for t in later)
    arguments = first.function.arguments + "".join(t.function.arguments for t in later)
    assert set(json.loads(arguments)) == {"city", "days", "unit"}
    assert all(c.choices[0].finish_reason is None for c in content)
    assert len(content) > 2  # spread over the engine steps


def test_a_forced_tool_call_cut_by_max_tokens_ends_with_length(spec):
    r = chat(spec, tools=[WEATHER], tool_choice="required", max_tokens=2)
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.tool_calls[0].function.arguments)


# ---- response_format ---------------------------------------------------------------------------


def test_json_object_answers_with_a_json_object(spec):
    r = chat(spec, response_format={"type": "json_object"}, max_tokens=400)
    assert r.choices[0].finish_reason == "stop"
    answer = json.loads(r.choices[0].message.content)
    assert list(answer) == ["answer"] and answer["answer"]
    content, _ = stream(spec, response_format={"type": "json_object"}, max_tokens=400)
    assert len(content) > 2
    assert list(json.loads("".join(c.choices[0].delta.content for c in content))) == ["answer"]


def test_json_schema_fills_every_property_with_its_type(spec):
    for text in (
        chat(spec, response_format=PERSON, max_tokens=400).choices[0].message.content,
        "".join(c.choices[0].delta.content for c in stream(spec, response_format=PERSON, max_tokens=400)[0]),
    ):
        person = json.loads(text)
        assert list(person) == ["name", "age", "score", "member", "tags", "address"]
        assert isinstance(person["name"], str) and isinstance(person["age"], int)
        assert isinstance(person["score"], float) and isinstance(person["member"], bool)
        assert all(isinstance(tag, str) for tag in person["tags"]) and isinstance(person["address"]["street"], str)


def test_json_schema_at_top_level_as_sglang_takes_it(spec):
    schema = PERSON["json_schema"]["schema"]
    r = chat(spec, response_format={"type": "json_schema", "schema": schema}, max_tokens=400)
    assert set(json.loads(r.choices[0].message.content)) == set(schema["properties"])


def test_json_cut_by_max_tokens_ends_with_length_and_is_not_closed(spec):
    kw = dict(response_format={"type": "json_object"}, max_tokens=8, extra_body={"ignore_eos": True})
    r = chat(spec, **kw)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    assert r.choices[0].message.content.startswith('{"answer": "')
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)
    _, chunks = stream(spec, **kw)
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"


def test_a_natural_end_closes_the_json_even_with_a_stop_string(spec):
    r = chat(
        spec,
        response_format={"type": "json_object"},
        max_tokens=3000,
        stop=[" the"],
        seed=5,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].matched_stop == " the"
    assert " the" not in json.loads(r.choices[0].message.content)["answer"]


# ---- logprobs ----------------------------------------------------------------------------------


def check_token_logprobs(entries, k):
    for entry in entries:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode() == entry.token
        assert len(entry.top_logprobs) == k
        top = [t.logprob for t in entry.top_logprobs]
        assert top == sorted(top, reverse=True) and all(lp <= 0 for lp in top)
        assert len({t.token for t in entry.top_logprobs}) == k
        if k:
            assert entry.token in {t.token for t in entry.top_logprobs} and sum(2.718281828**lp for lp in top) <= 1.0001


def test_chat_logprobs_per_token(spec):
    r = chat(spec, logprobs=True, top_logprobs=3, max_tokens=30, extra_body={"ignore_eos": True})
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens == 30
    assert "".join(e.token for e in entries) == r.choices[0].message.content
    check_token_logprobs(entries, 3)
    r = chat(spec, logprobs=True, max_tokens=5, extra_body={"ignore_eos": True})
    check_token_logprobs(r.choices[0].logprobs.content, 0)
    assert chat(spec, max_tokens=3).choices[0].logprobs is None


def test_chat_logprobs_streamed_per_chunk(spec):
    content, _ = stream(spec, logprobs=True, top_logprobs=2, max_tokens=40, extra_body={"ignore_eos": True})
    for chunk in content:
        choice = chunk.choices[0]
        entries = choice.logprobs.content
        assert "".join(e.token for e in entries) == choice.delta.content
        assert len(entries) == len(choice.delta.content.split())
        check_token_logprobs(entries, 2)
    assert sum(len(c.choices[0].logprobs.content) for c in content) == 40


def test_completions_logprobs_in_the_legacy_shape(spec):
    c = client(spec).completions.create(
        model="twin", prompt="Once", max_tokens=12, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text and len(lp.tokens) == 12
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) == 2 and max(top.values()) <= 0 for top in lp.top_logprobs)
    chunks = list(
        client(spec).completions.create(
            model="twin", prompt="Once", max_tokens=20, logprobs=1, stream=True, extra_body={"ignore_eos": True}
        )
    )
    tokens = [t for ch in chunks for t in ch.choices[0].logprobs.tokens]
    offsets = [o for ch in chunks for o in ch.choices[0].logprobs.text_offset]
    assert len(tokens) == 20 and offsets == [sum(len(t) for t in tokens[:i]) for i in range(20)]
    assert client(spec).completions.create(model="twin", prompt="Once", max_tokens=2).choices[0].logprobs is None


# ---- n > 1 -------------------------------------------------------------------------------------


def test_n_choices_each_their_own_sequence(spec):
    r = chat(spec, n=3, max_tokens=25, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and len(c.message.content.split()) == 25 for c in r.choices)
    assert len({c.message.content for c in r.choices}) == 3
    assert r.usage.completion_tokens == 75 and r.usage.prompt_tokens == 4 + 5
    c = client(spec).completions.create(model="twin", prompt="Once", n=2, max_tokens=5, extra_body={"ignore_eos": True})
    assert [ch.index for ch in c.choices] == [0, 1] and c.usage.completion_tokens == 10


def test_n_choices_stream_interleaved_with_their_index(spec):
    content, chunks = stream(
        spec, n=2, max_tokens=30, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
    )
    indexes = [c.choices[0].index for c in content]
    assert set(indexes) == {0, 1}
    assert indexes.index(1) < len(indexes) - indexes[::-1].index(0) - 1  # interleaved, not one after the other
    events = [c.choices[0] for c in chunks if c.choices]
    for i in (0, 1):
        mine = [c.choices[0] for c in content if c.choices[0].index == i]
        assert all(m.delta.role is None and m.finish_reason is None for m in mine)
        assert len("".join(m.delta.content for m in mine).split()) == 30
        # SGLang: the role alone before the choice's text, its finish reason after every choice's
        theirs = [(n, e) for n, e in enumerate(events) if e.index == i and not e.delta.content]
        (opened, opening), (closed, closing) = theirs
        assert opening.delta.role == "assistant" and opening.delta.content == ""
        assert closing.finish_reason == "length" and closed >= len(events) - 2
        assert opened < min(n for n, e in enumerate(events) if e.index == i and e.delta.content)
    assert chunks[-1].usage.completion_tokens == 60


def test_n_features_combine(spec):
    r = chat(spec, n=2, tools=[WEATHER], tool_choice="required", logprobs=True, top_logprobs=1)
    assert all(c.finish_reason == "tool_calls" and c.logprobs.content for c in r.choices)
    assert len({c.message.tool_calls[0].id for c in r.choices}) == 2
    r = chat(spec, n=2, response_format=PERSON, max_tokens=400)
    assert all(json.loads(c.message.content)["name"] for c in r.choices)


def test_n_2_holds_two_slots_and_a_disconnect_frees_both(spec):
    async def scenario():
        aclient = openai.AsyncOpenAI(base_url=spec.base_url, api_key="unused", max_retries=0, timeout=60)
        try:
            s = await aclient.chat.completions.create(
                model="twin",
                messages=MESSAGES,
                n=2,
                max_tokens=20000,
                stream=True,
                extra_body={"ignore_eos": True, "rid": "pair"},
            )
            seen = set()
            async for chunk in s:
                seen.add(chunk.choices[0].index)
                if seen == {0, 1}:
                    break
            await asyncio.to_thread(wait_for, lambda: loads(spec)["num_running_reqs"] == 2, "2 running", DEADLINE_S)
            await s.close()
        finally:
            await aclient.close()

    asyncio.run(scenario())
    wait_for(lambda: loads(spec)["num_running_reqs"] == 0, "both slots free", DEADLINE_S)
