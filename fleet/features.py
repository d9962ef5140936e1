"""What a request looks like to a policy, from its JSON body: sizes and flags, never the text.

Token counts are estimates (no tokenizer in the proxy): about four characters per token, plus a
few tokens of chat framing per message. The twin counts prompt tokens the same way, so routing
decisions on the virtual clock see the same numbers as in the proxy.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any

import orjson

CHARS_PER_TOKEN = 4
MESSAGE_OVERHEAD_TOKENS = 4
"""Role and separator tokens a chat template adds per message (Llama-3-like templates)."""


def count_text_tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def _content_tokens(content: Any) -> int:
    if isinstance(content, str):
        return count_text_tokens(content)
    if isinstance(content, list):
        # OpenAI content parts: text parts count; other parts (images, audio) are not estimated.
        return sum(
            count_text_tokens(part["text"])
            for part in content
            if isinstance(part, Mapping) and isinstance(part.get("text"), str)
        )
    return 0


TOOLS_OVERHEAD_TOKENS = 1
"""The marker ahead of the tool definitions (fleet/blocks.py's 4 bytes, the twin's one id)."""


def json_text(value: Any) -> str:
    """Tool definitions, or a message's other fields, as the text counted for them: their JSON,
    keys sorted (the bytes fleet/blocks.py's `_json` hashes; a chat template renders about as
    much)."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode("utf-8")
    except TypeError:  # orjson.JSONEncodeError: not JSON-shaped (a value parsed elsewhere)
        return repr(value)


def message_fields_text(message: Mapping[str, Any]) -> str | None:
    """A message's fields besides its role and content (an assistant's `tool_calls` with their
    arguments, a tool result's `tool_call_id`, a `name`) as the text counted for them: their
    JSON, keys sorted (what fleet/blocks.py hashes; a template renders the calls' arguments into
    the prompt). None when it has none. Left out of the estimate, a turn carrying a large tool
    call made the blocks' prompt longer than the estimate's, and the credit of its whole cached
    prefix was scaled down with it (`fleet.model.credit_scale`)."""
    if len(message) <= ("role" in message) + ("content" in message):
        return None
    return json_text({k: v for k, v in message.items() if k != "role" and k != "content"})


def count_prompt_tokens(body: Mapping[str, Any]) -> int:
    """Estimated prompt tokens of a chat (`messages`) or completion (`prompt`) request body. A
    chat's tool definitions count: the template renders them into the prompt (ahead of the
    messages), the server prefills and caches them, and the prefix blocks hash them."""
    messages = body.get("messages")
    if isinstance(messages, list):
        total = 0
        tools = body.get("tools")
        if tools:
            total += TOOLS_OVERHEAD_TOKENS + count_text_tokens(json_text(tools))
        for message in messages:
            if isinstance(message, Mapping):
                total += MESSAGE_OVERHEAD_TOKENS + _content_tokens(message.get("content"))
                fields = message_fields_text(message)
                if fields is not None:
                    total += count_text_tokens(fields)
        return total
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return count_text_tokens(prompt)
    if isinstance(prompt, list):
        if all(isinstance(t, int) for t in prompt):
            return len(prompt)  # already token ids
        return sum(count_text_tokens(p) if isinstance(p, str) else len(p) if isinstance(p, list) else 0 for p in prompt)
    return 0


RESPONSES_ROLES = frozenset({"system", "developer", "user", "assistant"})


def _item_message(item: Mapping[str, Any]) -> dict[str, Any] | None:
    """One Responses API input item as the chat message a server's template makes of it."""
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        return {
            "role": role if isinstance(role, str) and role in RESPONSES_ROLES else "user",
            "content": item.get("content"),
        }
    if kind == "function_call":
        name, arguments = item.get("name"), item.get("arguments")
        text = (name if isinstance(name, str) else "") + (arguments if isinstance(arguments, str) else "")
        return {"role": "assistant", "content": text}
    if kind == "function_call_output":
        output = item.get("output")
        return {"role": "tool", "content": output}
    if kind == "reasoning":
        summary = item.get("summary")
        return {"role": "assistant", "content": summary if isinstance(summary, list) else None}
    return None  # item references and other kinds: nothing of their text is in the body


def responses_as_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses API body (`POST /v1/responses`) as the chat body it amounts to: `instructions`
    as the system message, `input` (a string, or a list of items) as the messages after it,
    `max_output_tokens` as `max_tokens`, `reasoning.effort` as `reasoning_effort`, `text.format`
    as `response_format`. Prompt sizes, block
    hashes and workload keys are then read as a chat's are (SGLang renders it with the same chat
    template). What a `previous_response_id` adds is on the server, not in the body: such a
    follow-up has no prefix blocks (`fleet.blocks.prompt_stream`)."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for item in given:
            if isinstance(item, Mapping):
                message = _item_message(item)
                if message is not None:
                    messages.append(message)
    view: dict[str, Any] = {"messages": messages}
    for name in ("model", "stream", "service_tier", "prompt_cache_key", "user", "tools", "previous_response_id"):
        if name in body:
            view[name] = body[name]
    if "max_output_tokens" in body:
        view["max_tokens"] = body["max_output_tokens"]
    reasoning = body.get("reasoning")
    if isinstance(reasoning, Mapping) and reasoning.get("effort") is not None:
        view["reasoning_effort"] = reasoning["effort"]  # rendered into the prompt (gpt-oss: its system message)
    text = body.get("text")
    form = text.get("format") if isinstance(text, Mapping) else None
    if isinstance(form, Mapping) and isinstance(form.get("type"), str):
        view["response_format"] = {"type": form["type"]}
    return view


def default_request_class(body: Mapping[str, Any]) -> str:
    """`batch` when the client asked for OpenAI's flex (cheaper, slower) service tier, else
    `latency`; the x-specroute-class header overrides this."""
    return "batch" if body.get("service_tier") == "flex" else "latency"


SYSTEM_HASH_HEX = 8
"""Hex digits of the system prompt's hash in a derived workload key (32 bits: collisions are
rare among the few thousand keys kept)."""


def _system_prompt(body: Mapping[str, Any]) -> str | None:
    """The text of the first system (or developer) message of a chat request, if any."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    for message in messages:
        if isinstance(message, Mapping) and message.get("role") in ("system", "developer"):
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return "".join(
                    part["text"] for part in content if isinstance(part, Mapping) and isinstance(part.get("text"), str)
                )
            return None
    return None


def workload_key(body: Mapping[str, Any], secret: bytes = b"") -> str | None:
    """A request's workload key when its client sent none: what it asks for (`json` when its
    response_format asks for JSON, `tools` when it offers tools, else `text`) and a short hash of
    its system prompt (`-` without one), e.g. `json:1f0c9a2e`; None for plain text without a
    system prompt (nothing sets it apart: it is routed on the pool-wide estimate, as before).
    The prompt's text is never kept: only 32 bits of its BLAKE2b hash, keyed with `secret` (the
    proxy's is random per process) so that the keys shown by the state endpoint cannot confirm a
    guess at another client's system prompt. The model name is left out (the pools serve one
    model: a speculative server's draft is trained for one target)."""
    response_format = body.get("response_format")
    kind = response_format.get("type") if isinstance(response_format, Mapping) else None
    tools = body.get("tools")
    if kind in ("json_object", "json_schema"):
        mode = "json"
    elif isinstance(tools, list) and tools:
        mode = "tools"
    else:
        mode = "text"
    system = _system_prompt(body)
    if system is None:
        return None if mode == "text" else f"{mode}:-"
    digest = hashlib.blake2b(
        system.encode("utf-8", "surrogatepass"), digest_size=8, key=secret, person=b"specroute-wkld"
    )
    return f"{mode}:{digest.hexdigest()[:SYSTEM_HASH_HEX]}"
