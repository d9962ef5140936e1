"""Cheap looks into relayed bytes: SSE events per chunk, and usage/finish reasons at the end.

Chunks are never parsed or re-encoded on the way through; these are byte counts and regular
expressions over small slices, run once per chunk (count) or once per response (summary).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

EVENT = b"data:"
DONE = b"data: [DONE]"

_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_FINISH_REASON = re.compile(rb'"finish_reason"\s*:\s*"([A-Za-z_]+)"')
_SPEC_VERIFY_CT = re.compile(rb'"spec_verify_ct"\s*:\s*(\d+)')


def content_events(chunk: bytes) -> int:
    """SSE data events in a chunk, the closing [DONE] not counted."""
    events = chunk.count(EVENT)
    if events and DONE in chunk:
        events -= 1
    return events


# What ends an SSE event (a blank line), by line ending.
EVENT_ENDS = (b"\n\n", b"\r\n\r\n", b"\r\r")


def split_at_event_end(chunk: bytes) -> tuple[bytes, bytes]:
    """(the whole SSE events at the start of `chunk`, the unterminated rest)."""
    end = 0
    for boundary in EVENT_ENDS:
        at = chunk.rfind(boundary)
        if at >= 0:
            end = max(end, at + len(boundary))
    return chunk[:end], chunk[end:]


@dataclass(frozen=True, slots=True)
class Summary:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reasons: tuple[str, ...] = ()
    spec_verify_ct: int | None = None
    """SGLang's verify steps for the request (sglext.spec_tokens_details), when it sent them."""


def summarise(tail: bytes) -> Summary:
    """Usage and finish reasons found in the last bytes of a response (JSON body or SSE tail)."""
    prompt = _PROMPT_TOKENS.findall(tail)
    completion = _COMPLETION_TOKENS.findall(tail)
    verify = _SPEC_VERIFY_CT.findall(tail)
    return Summary(
        prompt_tokens=int(prompt[-1]) if prompt else None,
        completion_tokens=int(completion[-1]) if completion else None,
        finish_reasons=tuple(reason.decode() for reason in _FINISH_REASON.findall(tail)),
        spec_verify_ct=int(verify[-1]) if verify else None,
    )
