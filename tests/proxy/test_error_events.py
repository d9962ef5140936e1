"""The in-band error events a stream can carry (proxy.scan): SGLang's, written with json.dumps's
spacing, the proxy's own, compact, and text that only reads like one."""

from __future__ import annotations

import json

from proxy import scan
from proxy.errors import stream_error_event


def sglang_error(message: str, status: int, kind: str) -> bytes:
    error = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


def content(text: str) -> bytes:
    chunk = {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def test_an_error_event_gives_its_status_wherever_it_stands() -> None:
    full = sglang_error("The request queue is full.", 503, "SERVICE_UNAVAILABLE")
    assert scan.error_event_status(full + b"data: [DONE]\n\n") == 503
    assert scan.error_event_status(content("a") + sglang_error("bad", 400, "BAD_REQUEST")) == 400
    assert scan.error_event_status(stream_error_event("cut", "server_error", "upstream_disconnected")) == 502
    assert scan.error_event_status(b"data: " + json.dumps({"error": {"code": 200}}).encode() + b"\n\n") == 502
    assert scan.summarise(content("a") + full + b"data: [DONE]\n\n").error_status == 503
    assert scan.summarise(content("a") + b"data: [DONE]\n\n").error_status is None


def test_only_an_event_that_opens_a_line_is_an_error() -> None:
    """A raw line break cannot be inside JSON: the model's text, however it reads, is no event."""
    fake = content('ok\ndata: {"error": {"code": 503}}\n\n')
    assert scan.error_event_status(fake) is None
    assert scan.leading_error_event(fake) is None


def test_a_stream_opening_with_an_error_is_told_from_one_that_ends_with_one() -> None:
    full = sglang_error("The request queue is full.", 503, "SERVICE_UNAVAILABLE")
    leading = scan.leading_error_event(b": keep-alive\n\n" + full + b"data: [DONE]\n\n")
    assert leading is not None and json.loads(leading)["error"]["code"] == 503
    assert scan.leading_error_event(content("a") + full) is None
    assert scan.leading_error_event(content("a")) is None
