"""/v1/responses on the twin (SGLang 0.5.23's serving_responses.py), through the real openai SDK."""

import json

import httpx
import openai
import pytest

from fleet.features import count_prompt_tokens
from sim.shape import TOKEN
from sim.testing import twin, wait_for

MODEL = "specroute/twin"


def loads(t):
    return httpx.get(t.url + "/v1/loads", timeout=5).json()["loads"][0]


def tokens(text):
    return len(TOKEN.findall(text))


@pytest.fixture(scope="module")
def stored():
    """A twin with the response store on and 20-token answers."""
    with twin("base", time_scale=20, seed=3, args=("--enable-response-store", "--output-len", "fixed:20")) as t:
        yield t


@pytest.fixture(scope="module")
def long():
    """A twin with the store on whose answers run for about a minute (4,000 tokens, real time)."""
    with twin("base", time_scale=1, seed=5, args=("--enable-response-store", "--output-len", "fixed:4000")) as t:
        yield t


@pytest.fixture(scope="module")
def plain():
    """A twin as SGLang starts by default: no response store."""
    with twin("base", time_scale=20, seed=4, args=("--output-len", "fixed:20")) as t:
        yield t


def client(t):
    return openai.OpenAI(base_url=t.base_url, api_key="x", max_retries=0)


def test_a_response_counts_its_prompt_as_the_twin_counts_a_chat(stored):
    r = client(stored).responses.create(model=MODEL, input="Name three rivers.", instructions="Answer briefly.")
    expected = count_prompt_tokens(
        {
            "messages": [
                {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "Name three rivers."},
            ]
        }
    )
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.model == MODEL and r.instructions == "Answer briefly." and r.store is True
    assert r.usage.input_tokens == expected
    assert r.usage.output_tokens == 20 == tokens(r.output_text)
    assert r.usage.total_tokens == expected + 20
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.content[0].type == "output_text" and item.content[0].text == r.output_text


def test_input_items_with_content_parts_count_as_chat_messages(stored):
    items = [
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "First part."}, {"type": "input_text", "text": "Two"}],
        },
        {"role": "assistant", "content": "An earlier answer."},
        {"role": "user", "content": "Go on."},
    ]
    r = client(stored).responses.create(model=MODEL, input=items)
    chat = [
        {"role": "user", "content": [{"type": "text", "text": "First part."}, {"type": "text", "text": "Two"}]},
        {"role": "assistant", "content": "An earlier answer."},
        {"role": "user", "content": "Go on."},
    ]
    assert r.usage.input_tokens == count_prompt_tokens({"messages": chat})


def test_max_output_tokens_cuts_the_answer_and_marks_it_incomplete(stored):
    # SGLang keeps two tokens of headroom: max_new_tokens = max_output_tokens - 2.
    r = client(stored).responses.create(model=MODEL, input="Talk.", max_output_tokens=10)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 8 == tokens(r.output_text)


def test_a_stream_sends_sglangs_events_and_one_delta_per_engine_output(stored):
    prompt = "Stream something."
    with client(stored).responses.create(model=MODEL, input=prompt, stream=True) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas) :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(d.delta for d in deltas)
    assert final.output_text == text == events[-4].text
    assert final.usage.output_tokens == sum(tokens(d.delta) for d in deltas) == 20
    assert final.usage.input_tokens == count_prompt_tokens({"messages": [{"role": "user", "content": prompt}]})
    assert len({d.item_id for d in deltas}) == 1 and deltas[0].item_id == final.output[0].id
    # a base engine commits one token per step: one delta per step
    assert len(deltas) == 20


def test_a_stream_has_named_events_and_no_done_marker(stored):
    body = {"model": MODEL, "input": "Hi.", "stream": True}
    with httpx.stream("POST", stored.url + "/v1/responses", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        raw = r.read().decode()
    blocks = [b for b in raw.split("\n\n") if b]
    assert "[DONE]" not in raw
    for block in blocks:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == name[7:]


def test_retrieve_returns_the_stored_response_and_a_follow_up_carries_the_conversation(stored):
    c = client(stored)
    first = c.responses.create(model=MODEL, input="Remember the number seven.")
    got = c.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.status == "completed"
    follow = c.responses.create(model=MODEL, input="What was the number?", previous_response_id=first.id)
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    history = [
        {"role": "user", "content": "Remember the number seven."},
        {"role": "assistant", "content": [{"type": "text", "text": first.output_text}]},
        {"role": "user", "content": "What was the number?"},
    ]
    assert follow.usage.input_tokens == count_prompt_tokens({"messages": history})
    # the conversation's earlier pages are in the prefix cache
    assert follow.usage.input_tokens_details.cached_tokens > 0


def test_a_streamed_response_is_stored_once_it_completes(stored):
    c = client(stored)
    with c.responses.create(model=MODEL, input="Store me.", stream=True) as stream:
        final = [e for e in stream][-1].response
    assert c.responses.retrieve(final.id).output_text == final.output_text


def test_unknown_ids_answer_404_with_a_nested_error(stored):
    c = client(stored)
    with pytest.raises(openai.NotFoundError) as got:
        c.responses.retrieve("resp_nosuchthing")
    assert got.value.body["param"] == "response_id" and "not found" in got.value.body["message"]
    r = httpx.get(stored.url + "/v1/responses/resp_nosuchthing", timeout=5)
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model=MODEL, input="Hi.", previous_response_id="resp_nosuchthing")
    with pytest.raises(openai.BadRequestError) as bad:
        c.responses.retrieve("nosuchthing")
    assert "Expected an ID that begins with 'resp'" in bad.value.body["message"]


def test_cancelling_a_finished_response_returns_it_as_it_is(stored):
    c = client(stored)
    r = c.responses.create(model=MODEL, input="Done already.")
    cancelled = c.responses.cancel(r.id)
    assert cancelled.id == r.id and cancelled.status == "completed"


def test_a_background_response_can_be_cancelled(long):
    c = client(long)
    r = c.responses.create(model=MODEL, input="Slowly.", background=True)
    assert r.status == "queued" and r.output == []
    wait_for(lambda: loads(long)["num_running_reqs"] == 1, "the background request running")
    assert c.responses.retrieve(r.id).status == "in_progress"
    assert c.responses.cancel(r.id).status == "cancelled"
    wait_for(lambda: loads(long)["num_running_reqs"] == 0, "the slot freed", timeout=5)
    assert c.responses.retrieve(r.id).status == "cancelled"


def test_store_false_is_not_kept(stored):
    c = client(stored)
    r = c.responses.create(model=MODEL, input="Forget me.", store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)


def test_a_client_that_closes_a_stream_frees_the_engine_slot(long):
    stream = client(long).responses.create(model=MODEL, input="Go on for long.", stream=True)
    for e in stream:
        if e.type == "response.output_text.delta":
            break
    assert loads(long)["num_running_reqs"] == 1
    stream.close()
    # the answer has about a minute left: only the abort frees the slot within seconds
    wait_for(lambda: loads(long)["num_running_reqs"] == 0, "the engine slot freed after the client left", timeout=5)


def test_an_unknown_model_is_404(stored):
    with pytest.raises(openai.NotFoundError) as got:
        client(stored).responses.create(model="no-such-model", input="Hi.")
    assert got.value.body["param"] == "model"


def test_without_the_store_stateful_requests_answer_400(plain):
    c = client(plain)
    r = c.responses.create(model=MODEL, input="Hi.")
    assert r.status == "completed" and r.usage.output_tokens == 20
    for call in (
        lambda: c.responses.retrieve(r.id),
        lambda: c.responses.cancel(r.id),
        lambda: c.responses.create(model=MODEL, input="Again.", previous_response_id=r.id),
    ):
        with pytest.raises(openai.BadRequestError) as got:
            call()
        assert "Response store is disabled" in got.value.body["message"]
