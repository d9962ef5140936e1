"""SGLang's OpenAI-compatible request models and response shapes, as far as the twin needs them.

Validation follows SGLang 0.5.23 (`srt/entrypoints/openai/protocol.py`): pydantic models that
ignore unknown fields; a missing or ill-typed field is a 400 with SGLang's flat error body
`{"object": "error", "message", "type", "param", "code"}`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

DEFAULT_MODEL_NAME = "default"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = DEFAULT_MODEL_NAME
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    rid: str | None = None
    return_spec_tokens_details: bool = False


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    return_meta_info: bool = False

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16  # OpenAI's and SGLang's default for /v1/completions
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens


class TwinError(Exception):
    """A request the twin answers with an SGLang-shaped error."""

    def __init__(self, message: str, status: int = 400, err_type: str = "BadRequestError"):
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type

    def body(self) -> dict[str, Any]:
        return {"object": "error", "message": self.message, "type": self.err_type, "param": None, "code": self.status}


def parse_request(kind: Literal["chat", "completion"], body: Any) -> ChatCompletionRequest | CompletionRequest:
    model = ChatCompletionRequest if kind == "chat" else CompletionRequest
    if not isinstance(body, dict):
        raise TwinError("The request body must be a JSON object.", err_type="Bad Request")
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        # SGLang turns FastAPI's 422 into a 400 whose message is the validation error text.
        raise TwinError(str(exc), err_type="Bad Request") from None
    unsupported_features(request)
    check_sampling(request)
    return request


def check_sampling(request: ChatCompletionRequest | CompletionRequest) -> None:
    """SGLang's SamplingParams.verify messages for the parameters the twin reads or echoes."""
    if request.max_new_tokens is not None and request.max_new_tokens < 0:
        raise TwinError(f"max_new_tokens must be at least 0, got {request.max_new_tokens}.")
    if request.temperature is not None and request.temperature < 0:
        raise TwinError(f"temperature must be non-negative, got {request.temperature}.")
    if request.top_p is not None and not 0 < request.top_p <= 1:
        raise TwinError(f"top_p must be in (0, 1], got {request.top_p}.")


def unsupported_features(request: ChatCompletionRequest | CompletionRequest) -> None:
    """The twin does not pretend: features it cannot imitate get a clear 400."""
    found = []
    if request.n != 1:
        found.append("n != 1")
    if isinstance(request, ChatCompletionRequest):
        if request.logprobs or request.top_logprobs:
            found.append("logprobs")
        if request.tools:
            found.append("tools")
        if request.response_format and request.response_format.get("type", "text") != "text":
            found.append("response_format")
    else:
        if request.logprobs:
            found.append("logprobs")
        if request.echo:
            found.append("echo")
        if request.best_of not in (None, 1):
            found.append("best_of")
        if request.suffix:
            found.append("suffix")
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) > 1:
            found.append("batched prompts")
    if found:
        raise TwinError(f"The SGLang twin does not support {', '.join(found)}.")


def stop_strings(request: ChatCompletionRequest | CompletionRequest) -> tuple[str, ...]:
    if request.stop is None:
        return ()
    if isinstance(request.stop, str):
        return (request.stop,)
    return tuple(request.stop)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": None,
        "reasoning_tokens": 0,
    }


def choice(kind: str, text: str, finish_reason: str | None, matched_stop: Any, *, stream: bool,
           first: bool = False) -> dict[str, Any]:
    if kind == "chat":
        if stream:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            body: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            body = {"index": 0, "message": {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": None}}
    else:
        body = {"index": 0, "text": text}
    body["logprobs"] = None
    body["finish_reason"] = finish_reason
    body["matched_stop"] = matched_stop
    return body


def object_name(kind: str, stream: bool) -> str:
    if kind == "chat":
        return "chat.completion.chunk" if stream else "chat.completion"
    return "text_completion"
