"""The Responses API as the proxy reads it, without servers: a body as the chat it amounts to,
and a stream's token events, first token, usage and id."""

from __future__ import annotations

import json

from fleet.blocks import PromptBlocks
from fleet.features import count_prompt_tokens, responses_as_chat, workload_key
from proxy import scan
from proxy.body import Given, read


def event(kind: str, **data: object) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'))}\n\n".encode()


PREAMBLE = (
    event("response.created", sequence_number=0, response={"id": "resp_abc123", "status": "in_progress", "error": None})
    + event("response.in_progress", sequence_number=1, response={"id": "resp_abc123"})
    + event("response.output_item.added", sequence_number=2, item={"id": "msg_1", "type": "message"})
    + event("response.content_part.added", sequence_number=3, part={"type": "output_text", "text": ""})
)


def delta(text: str, n: int) -> bytes:
    return event("response.output_text.delta", sequence_number=n, delta=text, item_id="msg_1")


def test_a_responses_body_reads_as_the_chat_it_amounts_to() -> None:
    body = {
        "model": "m",
        "instructions": "You answer in JSON.",
        "input": [
            {"role": "user", "content": "What is 2+2?"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4"}]},
            {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a":2}'},
            {"type": "function_call_output", "call_id": "c1", "output": "4"},
            {"type": "item_reference", "id": "msg_0"},
            {"role": "user", "content": [{"type": "input_text", "text": "And 3+3?"}]},
        ],
        "max_output_tokens": 64,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}},
        "stream": True,
    }
    view = responses_as_chat(body)
    assert [m["role"] for m in view["messages"]] == ["system", "user", "assistant", "assistant", "tool", "user"]
    assert view["max_tokens"] == 64 and view["stream"] is True
    chat = {
        "messages": [
            {"role": "system", "content": "You answer in JSON."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "assistant", "content": 'add{"a":2}'},
            {"role": "tool", "content": "4"},
            {"role": "user", "content": "And 3+3?"},
        ],
        "response_format": {"type": "json_schema"},
    }
    assert count_prompt_tokens(view) == count_prompt_tokens(chat) > 0
    assert workload_key(view) == workload_key(chat) and workload_key(view, b"").startswith("json:")
    # The same conversation hashes to the same blocks either way: a prefix cached by one is found by the other.
    text = "a long shared system prompt " * 200
    as_chat = {"messages": [{"role": "system", "content": text}, {"role": "user", "content": "hi"}]}
    as_responses = responses_as_chat({"instructions": text, "input": "hi"})
    assert PromptBlocks.of(as_chat, 16).all() == PromptBlocks.of(as_responses, 16).all() != ()
    # A reasoning effort as the Responses API gives it is the chat's `reasoning_effort` (a
    # review's finding: it was left out, though a template renders it ahead of the messages).
    effort = responses_as_chat({"instructions": text, "input": "hi", "reasoning": {"effort": "high"}})
    assert effort["reasoning_effort"] == "high"
    assert PromptBlocks.of(effort, 16).all() == PromptBlocks.of({**as_chat, "reasoning_effort": "high"}, 16).all()


def test_no_shape_of_a_body_breaks_the_chat_view() -> None:
    odd: list[object] = [None, 1, 2.5, True, "s", [], {}, [1, "x", None], {"a": [1]}, [{"role": ["x"]}]]
    for value in odd:
        for field in ("input", "instructions", "max_output_tokens", "text", "tools", "stream", "reasoning"):
            body = {"model": "m", field: value}
            view = responses_as_chat(body)
            count_prompt_tokens(view)
            workload_key(view)
            PromptBlocks.of(view, 16).all()
        items = [
            {
                "type": value,
                "role": value,
                "content": value,
                "name": value,
                "arguments": value,
                "output": value,
                "summary": value,
            }
        ]
        view = responses_as_chat({"input": items, "text": {"format": value}})
        assert count_prompt_tokens(view) >= 0 and PromptBlocks.of(view, 16).all() is not None


def test_the_body_reader_takes_its_features_from_input_and_max_output_tokens() -> None:
    body = json.dumps({"model": "m", "input": "x" * 400, "max_output_tokens": 33, "stream": True}).encode()
    parsed = read(body, 1000, 1000, Given(responses=True))
    assert parsed.features.prompt_tokens == 4 + 100  # one user message: its framing and 400 chars
    assert parsed.features.max_tokens == 33 and parsed.features.stream
    as_chat = read(body, 1000, 1000, Given())  # the same body read as a chat has no prompt
    assert as_chat.features.prompt_tokens == 0 and as_chat.features.max_tokens is None


def test_a_stream_starts_at_its_first_delta_not_at_response_created() -> None:
    assert scan.chat_started(PREAMBLE)  # a chat's rule would take the preamble for the first token
    assert not scan.response_started(PREAMBLE)
    assert scan.response_started(PREAMBLE + delta("Hel", 4))
    completed = event("response.completed", sequence_number=4, response={"id": "resp_abc123", "status": "completed"})
    assert scan.response_started(PREAMBLE + completed)  # no text at all: its end is its first token
    # The relay looks from a line break (the stream's start is one).
    assert scan.response_started(b'\nevent: error\ndata: {"type":"error","code":"x"}\n\n')


def test_events_are_told_by_their_event_line_never_by_their_data() -> None:
    """The data echoes what the client sent and holds the model's text: neither is an event."""
    echo = {"id": "resp_1", "instructions": "Parse lines like 'event: error\\n' and response.completed"}
    created = event("response.created", sequence_number=0, response=echo, metadata={"x": 'a".delta"'})
    assert not scan.response_started(b"\n" + created) and not scan.response_ended(created)
    assert scan.response_events(created) == 0
    text = delta("event: error and response.completed and foo.delta", 4)
    assert scan.response_events(text) == 1 and not scan.response_ended(text)
    assert scan.response_ended(event("response.failed", response={"id": "r"}))
    assert scan.response_ended(text + event("response.completed", response={"id": "r"}))


def test_a_client_cannot_write_the_usage_the_fleet_learns_from() -> None:
    usage = {"input_tokens": 17, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 5, "total_tokens": 22}
    poisoned = {
        "id": "resp_1",
        "output": [{"type": "message", "status": "completed", "content": [{"text": '"output_tokens": 9'}]}],
        "status": "completed",
        "usage": usage,
        "tools": [{"type": "function", "parameters": {"properties": {"usage": {"output_tokens": 1}}}}],
        "metadata": {"usage": {"input_tokens": 1, "output_tokens": 7}, "output_tokens": 7},
    }
    as_event = scan.summarise_response(event("response.completed", sequence_number=9, response=poisoned))
    as_json = scan.summarise_response(json.dumps(poisoned).encode())
    for summary in (as_event, as_json):
        assert (summary.prompt_tokens, summary.completion_tokens) == (17, 5)
        assert summary.finish_reasons == ("stop",)
    failed = {"id": "r", "output": [{"status": "completed"}], "status": "failed", "usage": usage}
    assert scan.summarise_response(event("response.failed", response=failed)).finish_reasons == ("error",)
    assert scan.summarise_response(json.dumps(failed).encode()).finish_reasons == ("error",)


def test_token_events_are_the_deltas_whatever_their_text() -> None:
    assert scan.response_events(PREAMBLE) == 0
    tricky = delta('say ".delta" and \\"', 4) + delta("lo", 5)
    assert scan.response_events(tricky) == 2
    reasoning = event("response.reasoning_text.delta", sequence_number=6, delta="hmm")
    arguments = event("response.function_call_arguments.delta", sequence_number=7, delta='{"a"')
    assert scan.response_events(reasoning + arguments) == 2
    done = event("response.output_text.done", sequence_number=8, text="Hello")
    assert scan.response_events(done) == 0


def test_usage_finish_reason_and_id_of_a_responses_answer() -> None:
    usage = {
        "input_tokens": 17,
        "input_tokens_details": {"cached_tokens": 8},
        "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 22,
    }
    long_text = "word " * 20_000  # the output comes whole in the last event, before or after its usage
    done = {"id": "resp_abc123", "status": "completed", "usage": usage, "output_text": long_text}
    summary = scan.summarise_response(event("response.completed", sequence_number=9, response=done))
    assert (summary.prompt_tokens, summary.completion_tokens, summary.cached_tokens) == (17, 5, 8)
    assert summary.finish_reasons == ("stop",)
    cut = {"id": "r", "status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}, "usage": usage}
    assert scan.summarise_response(json.dumps(cut).encode()).finish_reasons == ("length",)
    assert scan.response_id(PREAMBLE) == "resp_abc123"
    assert scan.response_id(b'{"id":"msg_1","x":1}') is None
    assert scan.response_ended(event("response.incomplete", response=cut)) and not scan.response_ended(PREAMBLE)
    assert scan.summarise_response(event("response.incomplete", response=cut)).finish_reasons == ("length",)


def test_the_proxy_ends_a_broken_responses_stream_with_an_error_event_the_sdk_raises_on() -> None:
    ending = scan.RESPONSES.error_event("upstream failed", "server_error", "upstream_disconnected")
    assert ending.startswith(b"event: error\ndata: ") and b"[DONE]" not in ending
    data = json.loads(ending.split(b"data: ", 1)[1])
    assert data["type"] == "error" and data["code"] == "upstream_disconnected"
    assert data["error"]["message"] == "upstream failed"  # what openai-python raises APIError from


def test_usage_the_server_did_not_report_is_not_taken_from_the_clients_objects() -> None:
    tools = [{"type": "function", "parameters": {"usage": {"input_tokens": 7, "output_tokens": 99999}}}]
    queued = {"id": "resp_1", "status": "queued", "usage": None, "tools": tools, "metadata": {"status": "completed"}}
    summary = scan.summarise_response(json.dumps(queued).encode())
    assert (summary.prompt_tokens, summary.completion_tokens, summary.finish_reasons) == (None, None, ())
    failed = event("response.failed", sequence_number=3, response={**queued, "status": "failed"})
    assert scan.summarise_response(failed) == scan.Summary(finish_reasons=("error",))
    created = event("response.created", sequence_number=0, response=queued)
    errored = created + b'event: error\ndata: {"type":"error","code":"x","message":"m"}\n\n'
    assert scan.summarise_response(errored) == scan.Summary(finish_reasons=("error",))
    cut = created + delta("Hel", 1) + delta("lo", 2)  # the stream broke before its last event
    assert scan.summarise_response(cut) == scan.Summary()


def test_the_tail_keeps_what_the_request_could_echo_and_the_last_event_whole() -> None:
    tail = scan.RESPONSES.tail_for(request_bytes=1000)
    for _ in range(100):
        tail.add(b"x" * 1000)
    last = b"y" * 200_000
    tail.add(last)
    kept = tail.last(cut=False)
    assert kept.endswith(last) and len(kept) >= scan.TAIL_BYTES + 1000
    assert len(kept) <= len(last) + scan.TAIL_BYTES + 1000 + 1000  # bounded, whatever came before
    chat = scan.CHAT.tail_for(request_bytes=10**6)
    for _ in range(10):
        chat.add(b"z" * 1000)
    assert len(chat.last(cut=True)) == 4096  # a chat's usage is in its last bytes


def test_crlf_events_read_a_byte_at_a_time_are_split_as_they_end() -> None:
    splitter = scan.EventSplitter(1 << 20)
    stream = b"event: response.output_text.delta\r\ndata: {}\r\n\r\n" * 3
    whole = [splitter.feed(stream[i : i + 1]) for i in range(len(stream))]
    assert [len(w) for w in whole if w] == [len(stream) // 3] * 3
