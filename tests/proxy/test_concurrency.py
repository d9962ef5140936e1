"""200 concurrent streams through the proxy all complete, each with its own right token count."""

from __future__ import annotations

import asyncio

import openai
from proxy_harness import RunningProxy, twin_running, wait_for

STREAMS = 200


def test_200_concurrent_streams_complete_with_the_right_token_counts(proxy: RunningProxy, twin_pair) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, int, str | None, str]:
        max_tokens = 8 + i % 25  # every stream has its own length, so crossed streams would show
        stream = await client.chat.completions.create(
            model="specroute/twin",
            messages=[{"role": "user", "content": f"Request {i}"}],
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage, finish, chunks, ids = None, None, 0, set()
        async for chunk in stream:
            ids.add(chunk.id)
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for choice in chunk.choices:
                chunks += bool(choice.delta.content)  # not SGLang's opening and closing events
                finish = choice.finish_reason or finish
        assert len(ids) == 1  # one upstream request's chunks, nobody else's
        return max_tokens, usage or -1, chunks, finish, ids.pop()

    async def all_streams() -> list[tuple[int, int, int, str | None, str]]:
        client = openai.AsyncOpenAI(base_url=proxy.base_url, api_key="none", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(STREAMS)))
        finally:
            await client.close()

    results = asyncio.run(all_streams())
    assert len(results) == STREAMS
    for max_tokens, completion_tokens, chunks, finish, _ in results:
        assert completion_tokens == max_tokens
        assert finish == "length"
        assert 1 <= chunks <= max_tokens  # a speculative step may carry several tokens in one chunk
    assert len({r[4] for r in results}) == STREAMS
    wait_for(lambda: proxy.in_flight() == 0, what="every in-flight count back to zero")
    for twin in twin_pair:
        wait_for(lambda: twin_running(twin) == 0, what="the twins idle again")
