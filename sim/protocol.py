"""SGLang's OpenAI-compatible request models and response shapes, as far as the twin needs them.

Validation follows SGLang 0.5.23 (`srt/entrypoints/openai/protocol.py`): pydantic models that
ignore unknown fields; a missing or ill-typed field is a 400 with SGLang's flat error body
`{"object": "error", "message", "type", "param", "code"}`.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

DEFAULT_MODEL_NAME = "default"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDef


class ToolChoiceName(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: ToolChoiceName


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = DEFAULT_MODEL_NAME
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    rid: str | None = None
    cache_salt: str | list[str] | None = None
    """SGLang's and vLLM's: the prompt's cache is kept apart from other salts' (`cache_namespace`)."""
    extra_key: str | list[str] | None = None
    """SGLang's, joined to the salt (vLLM has none: ignored there)."""
    return_spec_tokens_details: bool = False
    response_format: ResponseFormat | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | Literal["auto", "required", "none"] | None = None
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


def cache_namespace(request: _Common, vllm: bool = False) -> str | None:
    """What the request's cached prompt is kept under besides its tokens: SGLang joins
    `cache_salt` and `extra_key` (each a string when set) into one key its radix tree keeps
    apart; vLLM hashes `cache_salt` into the first block's hash. None: the shared cache."""
    parts = (
        (("cache_salt", request.cache_salt),)
        if vllm
        else (("cache_salt", request.cache_salt), ("extra_key", request.extra_key))
    )
    joined = ""
    for name, value in parts:
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise TwinError(f"Value of {name} must be a string, got {type(value).__name__}.")
        joined += value
    return joined or None


MAX_N = 128
"""The most choices one twin request may ask for (SGLang sets no bound; the twin must survive a fuzzer)."""


class TwinError(Exception):
    """A request the twin answers with an SGLang-shaped error."""

    def __init__(self, message: str, status: int = 400, err_type: str = "BadRequestError"):
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type

    def body(self) -> dict[str, Any]:
        return {"object": "error", "message": self.message, "type": self.err_type, "param": None, "code": self.status}


def parse_request(
    kind: Literal["chat", "completion"], body: Any, vllm: bool = False
) -> ChatCompletionRequest | CompletionRequest:
    """The request, or the TwinError SGLang (`vllm`: vLLM) answers it with."""
    model = ChatCompletionRequest if kind == "chat" else CompletionRequest
    if not isinstance(body, dict):
        raise TwinError("The request body must be a JSON object.", err_type="Bad Request")
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        # SGLang turns FastAPI's 422 into a 400 whose message is the validation error text.
        raise TwinError(str(exc), err_type="Bad Request") from None
    unsupported_features(request)
    check_sampling(request, vllm)
    return request


def check_sampling(request: ChatCompletionRequest | CompletionRequest, vllm: bool = False) -> None:
    """SGLang's SamplingParams.verify messages (`vllm`: vLLM's) for the parameters the twin reads
    or echoes."""
    n = request.max_new_tokens
    if vllm:
        if n is not None and n < 1:  # vLLM's SamplingParams._verify_args
            raise TwinError(f"max_tokens must be at least 1, got {n}.")
        if request.stream_options is not None and not request.stream:  # its validate_stream_options
            raise TwinError("Stream options can only be defined when `stream=True`.")
    elif isinstance(request, CompletionRequest) and n is not None and n <= 0:
        # SGLang's CompletionRequest.validate_max_tokens_positive (a pydantic validator; chat has none)
        raise TwinError("max_tokens must be positive", err_type="Bad Request")
    if n is not None and n < 0:
        raise TwinError(f"max_new_tokens must be at least 0, got {n}.")
    if request.temperature is not None and (not math.isfinite(request.temperature) or request.temperature < 0):
        raise TwinError(f"temperature must be a non-negative finite number, got {request.temperature}.")
    if request.top_p is not None and not 0 < request.top_p <= 1:
        raise TwinError(f"top_p must be in (0, 1], got {request.top_p}.")
    if vllm:
        return
    # The rest of SamplingParams.verify (sampling/sampling_params.py), as SGLang 0.5.23 words it.
    if request.min_p is not None and not 0.0 <= request.min_p <= 1.0:
        raise TwinError(f"min_p must be in [0, 1], got {request.min_p}.")
    if request.top_k is not None and request.top_k != -1 and request.top_k < 1:
        raise TwinError(f"top_k must be -1 (disable) or at least 1, got {request.top_k}.")
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(request, name)
        if value is not None and not -2.0 <= value <= 2.0:
            raise TwinError(f"{name} must be in [-2, 2], got {value}.")
    if request.repetition_penalty is not None and not 0.0 < request.repetition_penalty <= 2.0:
        raise TwinError(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {request.repetition_penalty}.")


MAX_TOP_LOGPROBS = 20  # OpenAI's bound


def unsupported_features(request: ChatCompletionRequest | CompletionRequest) -> None:
    """The twin does not pretend: features it cannot imitate get a clear 400; values that make no
    sense (n < 1, a negative logprobs count, a tool_choice naming no given tool) get one too."""
    if request.n < 1:
        raise TwinError(f"n must be at least 1, got {request.n}.")
    if request.n > MAX_N:
        # A twin-only bound: one engine request per choice, and n = 10^17 would take the process down.
        raise TwinError(f"n must be at most {MAX_N} on the twin, got {request.n}.")
    if isinstance(request, ChatCompletionRequest):
        if not request.messages:
            raise TwinError("Messages cannot be empty.")  # SGLang's _validate_request
        if request.stream and request.return_meta_info:  # its _convert_to_internal_request
            raise TwinError(
                "return_meta_info is not supported with streaming. "
                "Please set stream=false when using return_meta_info=true."
            )
        check_logprobs("top_logprobs", request.top_logprobs)
        check_tools(request)
    else:
        check_logprobs("logprobs", request.logprobs)
    check_response_format(request.response_format)
    found = []
    if isinstance(request, CompletionRequest):
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


def check_logprobs(name: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise TwinError(f"{name} must be between 0 and {MAX_TOP_LOGPROBS}, got {value}.")


def check_tools(request: ChatCompletionRequest) -> None:
    choice = request.tool_choice
    if choice is None or choice in ("auto", "none"):
        return
    names = [tool.function.name for tool in request.tools or ()]
    if not names:
        raise TwinError("tool_choice requires tools: no tools were given.")
    if isinstance(choice, ToolChoice) and choice.function.name not in names:
        raise TwinError(f"Tool '{choice.function.name}' not found in tools list.")


def check_response_format(fmt: ResponseFormat | None) -> None:
    if fmt is None or fmt.type != "json_schema":
        return
    schema = json_schema_of(fmt)
    if schema is None:
        raise TwinError("response_format of type json_schema needs a json_schema with a schema.")
    kind = schema.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise TwinError("The SGLang twin does not support a json_schema whose top-level type is not object.")


def json_schema_of(fmt: ResponseFormat) -> dict[str, Any] | None:
    """The schema of a json_schema response format; SGLang also takes it as response_format.schema."""
    if fmt.json_schema is not None and fmt.json_schema.schema_ is not None:
        return fmt.json_schema.schema_
    schema = (fmt.model_extra or {}).get("schema")
    return schema if isinstance(schema, dict) else None


def forced_tool(request: ChatCompletionRequest | CompletionRequest) -> Tool | None:
    """The function a request forces a call to: tool_choice "required" (the first tool) or named."""
    if not isinstance(request, ChatCompletionRequest) or not request.tools:
        return None
    choice = request.tool_choice
    if choice == "required":
        return request.tools[0]
    if isinstance(choice, ToolChoice):
        return next(t for t in request.tools if t.function.name == choice.function.name)
    return None


def stop_strings(request: ChatCompletionRequest | CompletionRequest) -> tuple[str, ...]:
    if request.stop is None:
        return ()
    if isinstance(request.stop, str):
        return (request.stop,)
    return tuple(request.stop)


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None, zero_cached: bool = False
) -> dict[str, Any]:
    """OpenAI usage as SGLang writes it: prompt_tokens_details only with --enable-cache-report
    (`cached_tokens` not None) and some tokens cached (its _details_if_cached: null for 0);
    `zero_cached`: a count of 0 written as such (vLLM's --enable-prompt-tokens-details)."""
    details = None
    if cached_tokens is not None and (cached_tokens > 0 or zero_cached):
        details = {"cached_tokens": cached_tokens}
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": details,
        "reasoning_tokens": 0,
        "completion_tokens_details": None,  # SGLang's UsageInfo: set only with reasoning tokens
    }


def object_name(kind: str, stream: bool) -> str:
    if kind == "chat":
        return "chat.completion.chunk" if stream else "chat.completion"
    return "text_completion"
