"""The twin's token ids: a tokenizer-free, deterministic text -> ids mapping.

There is no tokenizer in the twin or the proxy: both count about four characters per token plus
four tokens of chat framing per message (`fleet.features.count_prompt_tokens`). The ids follow
the same rule, so `len(prompt_token_ids(body)) == count_prompt_tokens(body)` always:

- text: one id per 4-character chunk, `crc32(chunk) % 128000` (the same chunk is the same id, as
  a tokenizer gives the same text the same tokens);
- a chat message: Llama-3's framing `<|start_header_id|>`, the role's id,
  `<|end_header_id|>`, the content's ids (each text part of a content list in turn), the ids of
  its other fields' JSON text (tool calls: `fleet.features.message_fields_text`), `<|eot_id|>`;
- a chat's tool definitions, first: `TOOLS_ID`, then the ids of their JSON text
  (`fleet.features.json_text`);
- completions: the ids of a string prompt, or the prompt itself when it is a list of token ids.

Two requests whose messages share a prefix therefore share their leading ids, and thus the
prefix cache's pages. CRC-32 is stable across processes (Python's `hash` of a str is not).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

from fleet.features import CHARS_PER_TOKEN, json_text, message_fields_text

TEXT_VOCAB = 128_000  # ids below Llama-3's special tokens
START_HEADER_ID = 128006
END_HEADER_ID = 128007
EOT_ID = 128009
TOOLS_ID = 128010  # a reserved special token of Llama-3's, standing for the tools' framing


def text_token_ids(text: str) -> list[int]:
    crc = zlib.crc32
    return [
        crc(text[i : i + CHARS_PER_TOKEN].encode("utf-8", "surrogatepass")) % TEXT_VOCAB
        for i in range(0, len(text), CHARS_PER_TOKEN)
    ]


def _content_ids(content: Any) -> list[int]:
    if isinstance(content, str):
        return text_token_ids(content)
    ids: list[int] = []
    if isinstance(content, list):
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                ids += text_token_ids(part["text"])
    return ids


def message_token_ids(message: Mapping[str, Any]) -> list[int]:
    role = str(message.get("role", ""))
    role_id = zlib.crc32(role.encode("utf-8", "surrogatepass")) % TEXT_VOCAB
    fields = message_fields_text(message)
    extra = text_token_ids(fields) if fields is not None else []
    return [START_HEADER_ID, role_id, END_HEADER_ID, *_content_ids(message.get("content")), *extra, EOT_ID]


def prompt_token_ids(body: Mapping[str, Any]) -> list[int] | None:
    """The prompt's ids, as many as `count_prompt_tokens(body)` counts; None for shapes the twin
    refuses anyway (batched prompts)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        ids: list[int] = []
        tools = body.get("tools")
        if tools:
            ids += [TOOLS_ID, *text_token_ids(json_text(tools))]
        for message in messages:
            if isinstance(message, Mapping):
                ids += message_token_ids(message)
        return ids
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return text_token_ids(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    return None
