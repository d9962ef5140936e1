"""OpenAI-shaped errors: the proxy's own, and upstream ones normalised to the same shape."""

from __future__ import annotations

from typing import Any

import orjson

TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def error_type_for(status: int) -> str:
    return TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")


class ProxyError(Exception):
    """An error the proxy answers itself, before any response byte was sent."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        retryable: bool | None = None,
        payload: bytes | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or error_type_for(status)
        self.retryable = retryable
        """False adds `x-should-retry: false` (the proxy already failed over); None says nothing."""
        self.payload = payload
        """A ready OpenAI-shaped body (an upstream's error, normalised) to send instead."""
        self.headers = headers or []
        """Extra response headers (an upstream's retry-after)."""

    def body(self) -> bytes:
        return self.payload if self.payload is not None else error_body(self.message, self.type, self.code, self.param)


def error_object(message: str, type: str, code: str | int | None = None, param: str | None = None) -> dict[str, Any]:
    return {"message": message, "type": type, "param": param, "code": code}


def error_body(message: str, type: str, code: str | int | None = None, param: str | None = None) -> bytes:
    return orjson.dumps({"error": error_object(message, type, code, param)})


def stream_error_event(message: str, type: str = "server_error", code: str | None = None) -> bytes:
    """What ends a stream whose upstream failed mid-way: an error event, then [DONE]."""
    payload = orjson.dumps({"error": error_object(message, type, code)})
    return b"data: " + payload + b"\n\ndata: [DONE]\n\n"


def response_error_event(message: str, type: str = "server_error", code: str | None = None) -> bytes:
    """`stream_error_event` for a Responses API stream: its `error` event (type, code, message),
    which also carries the error object the SDKs raise on; no [DONE] (the API sends none)."""
    payload = orjson.dumps(
        {"type": "error", "code": code, "message": message, "param": None, "error": error_object(message, type, code)}
    )
    return b"event: error\ndata: " + payload + b"\n\n"


MAX_UPSTREAM_MESSAGE_CHARS = 1000


def normalise_upstream_error(status: int, body: bytes, request_id: str) -> bytes:
    """Any upstream error body as {"error": {message, type, param, code}}, without internals.

    A 5xx is the server's fault, and its body may hold a traceback, file paths and addresses:
    the client gets only `upstream server error (HTTP n; request id r)` (r: the id the proxy sent
    upstream as x-request-id, which finds the request in both logs). A 4xx is the client's to act on: a
    JSON error's message is kept (at most MAX_UPSTREAM_MESSAGE_CHARS); nested bodies (vLLM,
    OpenAI) keep their fields, SGLang's flat {"object": "error", ...} is lifted into "error", a
    `type` outside OpenAI's vocabulary (SGLang sends "BadRequestError") becomes the OpenAI type
    for the status, and a numeric `code` (SGLang's is the status) becomes a string, as OpenAI's
    codes are. A body that is not a JSON error (HTML from a load balancer, plain text) is
    replaced by `upstream answered HTTP n`.
    """
    if status >= 500:
        return error_body(
            f"upstream server error (HTTP {status}; request id {request_id})", error_type_for(status), str(status)
        )
    try:
        data = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        inner = data.get("error")
        if isinstance(inner, dict):
            source = inner
        elif isinstance(inner, str):
            source = {"message": inner, **{k: v for k, v in data.items() if k != "error"}}
        else:
            source = data
        message = source.get("message") or source.get("detail")
        if message is not None:
            kind = source.get("type")
            code = source.get("code")
            param = source.get("param")
            text = message if isinstance(message, str) else orjson.dumps(message).decode()
            if len(text) > MAX_UPSTREAM_MESSAGE_CHARS:
                text = text[: MAX_UPSTREAM_MESSAGE_CHARS - 3] + "..."  # cut, and says so
            return error_body(
                text,
                kind if isinstance(kind, str) and kind.endswith("_error") else error_type_for(status),
                code if isinstance(code, str) else str(code if type(code) is int else status),
                param if isinstance(param, str) else None,
            )
    return error_body(f"upstream answered HTTP {status}", error_type_for(status), str(status))
