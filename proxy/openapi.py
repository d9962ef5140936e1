"""The OpenAPI description the proxy serves at GET /openapi.json.

Written out rather than generated: the completion paths are a raw ASGI route that FastAPI does
not see, and the request fields the proxy checks are the ones that matter (the rest go upstream
as sent). Property tests (tests/proxy/test_openapi_fuzz.py, schemathesis) fuzz the proxy
against it, and client generators can read it.
"""

from __future__ import annotations

from typing import Any

from proxy import __version__

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}
ERROR_STATUSES = ("400", "401", "403", "404", "405", "408", "413", "415", "429", "431", "500", "502", "503", "504")
COMMON = {
    "model": {"type": "string"},
    "stream": {"type": ["boolean", "null"]},
    "max_tokens": {"type": ["integer", "null"], "minimum": 0},
    "max_completion_tokens": {"type": ["integer", "null"], "minimum": 0},
    "n": {"type": ["integer", "null"], "minimum": 1},
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
    "stream_options": {"type": ["object", "null"], "properties": {"include_usage": {"type": "boolean"}}},
    "service_tier": {"type": ["string", "null"]},
}
ROUTING_HEADERS = [
    {
        "name": "x-specroute-pool",
        "in": "header",
        "required": False,
        "schema": {"type": "string", "enum": ["spec", "base", "auto"]},
    },
    {
        "name": "x-specroute-class",
        "in": "header",
        "required": False,
        "schema": {"type": "string", "enum": ["latency", "batch"]},
    },
    {"name": "x-request-id", "in": "header", "required": False, "schema": {"type": "string"}},
]


RESPONSES_FIELDS = {
    "model": {"type": "string"},
    "stream": {"type": ["boolean", "null"]},
    "instructions": {"type": ["string", "null"]},
    "max_output_tokens": {"type": ["integer", "null"], "minimum": 1},
    "previous_response_id": {"type": ["string", "null"]},
    "store": {"type": ["boolean", "null"]},
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
    "service_tier": {"type": ["string", "null"]},
}


def completion_path(
    summary: str, prompt: dict[str, Any], required: str, fields: dict[str, Any] = COMMON
) -> dict[str, Any]:
    body = {"type": "object", "required": ["model", required], "properties": {**fields, required: prompt}}
    responses: dict[str, Any] = {
        "200": {
            "description": "The completion (JSON), or with `stream: true` its server-sent events",
            "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {"schema": {}}},
        },
    }
    responses.update(
        {
            status: {"description": "An OpenAI-shaped error", "content": {"application/json": {"schema": ERROR}}}
            for status in ERROR_STATUSES
        }
    )
    return {
        "post": {
            "summary": summary,
            "parameters": ROUTING_HEADERS,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": responses,
        }
    }


def stored(method: str, summary: str, ok: dict[str, Any]) -> dict[str, Any]:
    error = {"description": "An OpenAI-shaped error", "content": {"application/json": {"schema": ERROR}}}
    parameter = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        method: {
            "summary": summary,
            "parameters": [parameter],
            "responses": {"200": ok, **{status: error for status in ("400", "401", "404", "502")}},
        }
    }


def describe() -> dict[str, Any]:
    messages = {
        "type": "array",
        "items": {
            "type": "object",
            "required": ["role"],
            "properties": {
                "role": {"type": "string", "enum": ["system", "user", "assistant", "tool", "developer"]},
                "content": {"type": ["string", "array", "null"]},
            },
        },
    }
    prompt = {"type": ["string", "array"]}
    simple = {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}
    error = {"description": "An OpenAI-shaped error", "content": {"application/json": {"schema": ERROR}}}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "specroute",
            "version": __version__,
            "description": "OpenAI-compatible proxy routing each request to a speculative or a plain pool.",
        },
        "paths": {
            "/v1/chat/completions": completion_path("Chat completion, routed", messages, "messages"),
            "/v1/completions": completion_path("Text completion, routed", prompt, "prompt"),
            "/v1/responses": completion_path(
                "Response (the Responses API), routed; a follow-up goes to the server holding its previous_response_id",
                prompt,
                "input",
                RESPONSES_FIELDS,
            ),
            "/v1/responses/{response_id}": stored("get", "A stored response, from the server holding it", simple),
            "/v1/responses/{response_id}/cancel": stored(
                "post", "Cancel a background response on the server running it", simple
            ),
            "/v1/models": {"get": {"summary": "The pools' models", "responses": {"200": simple}}},
            "/v1/models/{model_id}": {
                "get": {
                    "summary": "One of the pools' models (its id may hold slashes: specroute/twin)",
                    "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                    "responses": {"200": simple, "404": error},
                }
            },
            "/health": {"get": {"summary": "Liveness", "responses": {"200": simple}}},
            "/ready": {"get": {"summary": "Readiness", "responses": {"200": simple, "503": simple}}},
        },
    }
