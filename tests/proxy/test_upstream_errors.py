"""normalise_upstream_error on the bodies servers send: OpenAI's shape, string codes, no internals."""

from __future__ import annotations

import orjson
import pytest

from proxy.errors import normalise_upstream_error


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"object": "error", "message": "m", "type": "BadRequestError", "param": None, "code": 400}, "400"),
        (
            {"error": {"message": "m", "type": "invalid_request_error", "code": "context_length_exceeded"}},
            "context_length_exceeded",
        ),
        ({"error": {"message": "m", "code": None}}, "400"),
        # A JSON boolean is not a number (Python's bool is an int): the status stands in for it.
        ({"error": {"message": "m", "code": True}}, "400"),
        ({"error": {"message": "m", "code": 1.5}}, "400"),
    ],
)
def test_a_client_error_keeps_its_message_and_gets_a_string_code(body: dict, code: str) -> None:
    error = orjson.loads(normalise_upstream_error(400, orjson.dumps(body), "rid"))["error"]
    assert error["message"] == "m"
    assert error["code"] == code
    assert error["type"] == "invalid_request_error"


def test_a_server_error_body_is_replaced() -> None:
    body = b'{"error": {"message": "Traceback (most recent call last): /srv/app.py", "code": 500}}'
    error = orjson.loads(normalise_upstream_error(500, body, "rid-1"))["error"]
    assert "Traceback" not in error["message"] and "rid-1" in error["message"]
    assert error["code"] == "500" and error["type"] == "server_error"


def test_a_long_client_error_message_is_cut_and_says_so() -> None:
    body = orjson.dumps({"error": {"message": "x" * 1970, "code": 400}})
    message = orjson.loads(normalise_upstream_error(400, body, "rid"))["error"]["message"]
    assert len(message) == 1000 and message.endswith("x...")
