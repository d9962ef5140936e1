"""The SSE writer when its reader is slow: every step queued behind it is still sent, in order."""

import asyncio
import json

from fleet.profile import load_profile
from sim.engine import EngineConfig
from sim.lengths import parse_output_lengths
from sim.protocol import parse_request
from sim.server import Call, Twin, TwinOptions
from sim.shape import ChoiceShape


def run_to_completion(twin, req):
    t = 0.0
    while req.finish_reason is None:
        step = twin.engine.begin_step(t)
        t += step.duration_s
        twin.engine.finish_step(step, t)


def test_a_stream_whose_steps_all_queued_sends_every_token_and_one_finish():
    config = EngineConfig("spec", load_profile("kimi-linear"), output_lengths=parse_output_lengths("fixed:40"))
    twin = Twin(TwinOptions(mode="spec", profile="kimi-linear"), config)
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 100,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    request = parse_request("chat", body)
    req = twin.engine.new_request(5, now=0.0, max_new_tokens=100, stop=())
    call = Call(req, twin.metrics, True, ChoiceShape(request, 0, req.rid))
    twin.engine.add(req)
    run_to_completion(twin, req)  # the reader has not read anything yet: all steps are queued
    assert call.queue.qsize() > 10

    async def read():
        return [chunk async for chunk in twin._stream("chat", request, [call], req.rid)]

    events = [e.removeprefix(b"data: ").strip() for e in asyncio.run(read())]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    events = [c for c in chunks if c["choices"]]
    opening, *content, closing = events  # SGLang's: the role alone, the text, the finish reason
    # SGLang's StreamDelta writes reasoning_content always, first (sse_utils.py)
    assert opening["choices"][0]["delta"] == {"reasoning_content": None, "role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"]["content"] for c in content)
    assert len(text.split()) == 40 == chunks[-1]["usage"]["completion_tokens"]
    assert [c["choices"][0]["finish_reason"] for c in content] == [None] * len(content)
    assert closing["choices"][0]["delta"] == {"reasoning_content": None}
    assert closing["choices"][0]["finish_reason"] == "stop"
    # Cumulative usage grows chunk by chunk, not jumping to the end.
    counts = [c["usage"]["completion_tokens"] for c in content]
    assert counts == sorted(counts) and counts[0] == 1 and counts[-1] == 40
