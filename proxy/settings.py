"""The one settings object: every SPECROUTE_* variable (and .env) is read here and nowhere else."""

from __future__ import annotations

import difflib
import os
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AliasChoices, Field, SecretStr, ValidationError, create_model, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from yarl import URL

from fleet.acceptance import DEFAULT_HALF_LIFE_S
from fleet.costmodel import DEFAULT_HALF_LIFE_S as COSTMODEL_HALF_LIFE_S
from fleet.prefix import DEFAULT_MAX_BLOCKS
from fleet.sessions import DEFAULT_MAX_SESSIONS, DEFAULT_SESSION_TTL_S
from policies import registry
from policies.goodput import GoodputParams

ENV_PREFIX = "SPECROUTE_"


TRACES_SAMPLERS = (
    "parentbased_always_on",
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
"""OTEL_TRACES_SAMPLER's values the OpenTelemetry SDK knows (`sampling._KNOWN_SAMPLERS`)."""


class SettingsError(Exception):
    """A wrong setting, phrased as one line that names the variable."""


class _SettingsHead(BaseSettings):
    """The settings listed before the policies' parameters (see `Settings`)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        validate_default=True,
        allow_inf_nan=False,  # an infinite timeout crashed every request (aiohttp rounds deadlines)
        env_ignore_empty=True,  # `NAME=` (an uncommented .env.example line) means unset, not ""
    )

    # Listening
    host: str = Field("127.0.0.1", description="Address the proxy listens on.")
    port: int = Field(8000, ge=0, le=65535, description="Port the proxy listens on (0: any free port).")

    # Pools
    spec_urls: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated base URLs of the speculative (EAGLE-3) SGLang servers (each server's root, e.g. http://10.0.0.5:30000, not its /v1).",
    )
    base_urls: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated base URLs of the plain (throughput-tuned) servers (each server's root, e.g. http://10.0.0.5:30000, not its /v1).",
    )
    spec_api_key: SecretStr | None = Field(
        None, description="Bearer key sent to the spec pool (replaces the client's Authorization)."
    )
    base_api_key: SecretStr | None = Field(
        None, description="Bearer key sent to the base pool (replaces the client's Authorization)."
    )

    # Access (proxy/auth.py): who may use the proxy
    api_keys: SecretStr | None = Field(
        None,
        description="Comma-separated client keys; when any key is set, completions and models need 'Authorization: Bearer <key>', and a stored response is its key's alone.",
    )
    api_keys_file: str | None = Field(
        None, description="File of client keys, one a line ('#' comments); reread when it changes or on SIGHUP."
    )
    operator_api_keys: SecretStr | None = Field(
        None,
        description="Comma-separated operator keys: client keys that may also reach the operator endpoints and pin pools.",
    )
    response_id_secret: SecretStr | None = Field(
        None,
        description="With keys on, a secret (at least 16 characters, the same on every replica) keying the HMACs that bind each stored response's id and each key's cache salt to its client's key; unset, an id or a salt checks guesses at its key offline, so keys must be long and random.",
    )
    cache_scope: Literal["key", "shared"] = Field(
        "key",
        description="With keys on, whose cached prompts a request may reuse: key (its key's own: each forwarded completion gets the key's cache_salt, so no client learns from the servers' prefix caches what another sent) or shared (every client's: more cache hits across keys, for clients that trust each other).",
    )
    metrics_access: Literal["open", "keys", "operators"] = Field(
        "open", description="Who may read GET /metrics when keys are on: open, keys (any key) or operators."
    )
    state_access: Literal["open", "keys", "operators"] = Field(
        "operators", description="Who may read GET /v1/specroute/state (instance addresses, scores) when keys are on."
    )
    pool_pin: Literal["any", "operators", "off"] = Field(
        "any",
        description="Who may pin a pool with x-specroute-pool (skipping the policy, its caps and failover): any client, operators, or nobody.",
    )
    key_max_concurrency: int = Field(
        0, ge=0, description="Most completion requests one client key may have open at once (429 past it; 0: no limit)."
    )
    expose_backend_urls: bool = Field(
        False,
        description="Name the upstream server in x-specroute-backend and /ready by its URL instead of its opaque name (spec-0, base-1...).",
    )

    # Routing
    policy: str = Field(
        "goodput",
        description="Routing policy, in any case: goodput, threshold, spec, base or round-robin (README, Routing).",
    )
    poll_interval_ms: int = Field(
        100, ge=10, le=60_000, description="Milliseconds between two load polls of each upstream instance."
    )
    stale_ms: int = Field(
        1000,
        ge=1,
        description="A load reading older than this is stale: the policy then routes conservatively (at least twice SPECROUTE_POLL_INTERVAL_MS).",
    )
    acceptance_half_life_s: float = Field(
        DEFAULT_HALF_LIFE_S, gt=0, description="Half-life in seconds of the spec pool's acceptance estimate."
    )
    num_draft_tokens: int = Field(
        3, ge=1, le=64, description="Draft tokens per verify step assumed until /server_info says otherwise."
    )
    profile: str | None = Field(
        None,
        description="Step-time profile seeding the cost model: a built-in name in any case (h200-llama8b, h200-llama8b-sglang, kimi-linear, kimi-linear-vllm, kimi-moe, kimi-moe-vllm) or a JSON path.",
    )
    costmodel_half_life_s: float = Field(
        COSTMODEL_HALF_LIFE_S,
        gt=0,
        description="Half-life in seconds of a learned step-time correction's trust without new observations while others arrive (it returns to the profile's; a lull with no traffic ages it one half-life at most).",
    )
    costmodel_lull_s: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=True,  # inf is a value here (NaN fails gt=0)
        description="Longest gap in seconds between the cost model's observations that ages what it learned (unset: "
        "the half-life, so a lull without traffic ages it by one half-life at most; inf: the wall clock,"
        " every correction back at the profile's about a minute after traffic stops).",
    )
    state_decisions: int = Field(
        64, ge=1, le=10_000, description="Recent routing decisions kept for GET /v1/specroute/state."
    )
    prefix_max_blocks: int = Field(
        DEFAULT_MAX_BLOCKS,
        ge=1,
        le=100_000_000,
        description="Most (instance, block of 256 prompt tokens) entries the prefix index keeps, about 200 bytes each; the least recently used go first.",
    )
    max_sessions: int = Field(
        DEFAULT_MAX_SESSIONS,
        ge=0,
        le=10_000_000,
        description="Named sessions remembered (x-specroute-session, prompt_cache_key, user); 0 ignores session names.",
    )
    session_ttl_s: float = Field(
        DEFAULT_SESSION_TTL_S, gt=0, description="Seconds a named session is remembered after its last request."
    )


def policy_setting(policy: str, param: str) -> str:
    """The setting of policy `policy`'s parameter `param`: `<policy>_<param>`
    (SPECROUTE_<POLICY>_<PARAM>), a dash in the policy's name read as an underscore."""
    return f"{policy}_{param}".replace("-", "_")


def policy_fields() -> dict[str, Any]:
    """One setting per parameter a policy declares (policies/base.py `PolicyParams`): its type,
    default and bounds as declared, its help prefixed with the policy's name."""
    fields: dict[str, Any] = {}
    for policy, params in registry.declared_params().items():
        for param, info in params.model_fields.items():
            annotation = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
            field = Field(info.default, description=f"{policy} policy: {info.description}")
            fields[policy_setting(policy, param)] = (annotation, field)
    return fields


# The policies' parameters go between the routing settings and the rest, as fields built from
# their declarations (there is no hand-written field per parameter). The type checker sees the
# class without them: read them through `Settings.policy_params`.
if TYPE_CHECKING:
    _SettingsWithPolicies = _SettingsHead
else:
    _SettingsWithPolicies = create_model("_SettingsWithPolicies", __base__=_SettingsHead, **policy_fields())


class Settings(_SettingsWithPolicies):
    """Every SPECROUTE_* setting: those of `_SettingsHead`, then one per declared policy
    parameter (`policy_setting`), then these."""

    # Admission (policies/admission.py): refuse up front what the fleet cannot serve in time
    admission_ttft_s: float | None = Field(
        None,
        ge=0,
        description="Refuse (429) requests predicted to get their first token later than this; unset: the goodput SLO's TTFT target; 0: off.",
    )
    admission_tpot_ms: float | None = Field(
        None,
        ge=0,
        description="Refuse (429) requests that would push their pool's time per output token past this; unset: the goodput SLO's TPOT target; 0: off.",
    )
    hold_max_s: float = Field(
        0.0,
        ge=0,
        description="Hold requests no pool can serve within the goodput SLO targets in the proxy, up to this many seconds, newest first (oldest first once past the fleet's mean time in system), instead of queueing them on a server (flow control); 0: off. Needs an SLO target.",
    )
    max_open_requests: int = Field(
        4096,
        ge=0,
        description="Completion requests the proxy holds open at once; past it new ones get 429 at once (0: no bound).",
    )

    # Request path
    connect_timeout_s: float = Field(5.0, gt=0, description="Seconds to open an upstream connection.")
    first_token_timeout_s: float = Field(
        120.0,
        gt=0,
        description="Seconds from sending a streamed request to the upstream's first byte (504 after); a non-streamed one is held to the total timeout.",
    )
    chunk_timeout_s: float = Field(
        60.0, gt=0, description="Longest gap in seconds between two chunks of an upstream response."
    )
    total_timeout_s: float = Field(
        3600.0,
        gt=0,
        description="Seconds one request may take end to end: a backstop (a stalled stream meets the chunk timeout, a hung engine the no-progress rule), long enough for a reasoning model's stream of tens of thousands of tokens.",
    )
    max_body_bytes: int = Field(16 * 1024 * 1024, gt=0, description="Largest request body accepted (413 above).")
    max_json_items: int = Field(
        100_000,
        ge=16,
        description="Most JSON objects and arrays a request body may hold (400 above; at least 16): bounds the work of parsing it.",
    )
    max_json_values: int = Field(
        250_000,
        ge=16,
        description="Most JSON array elements and object members a request body may hold (400 above; at least 16): counted outside strings, they bound the work of parsing it (a prompt of token ids needs one per token).",
    )
    forwarded_headers: Literal["replace", "append"] = Field(
        "replace",
        description="X-Forwarded-For sent upstream: replace (the client's address only; a client's own X-Forwarded-*/Forwarded are dropped) or append (behind a trusted proxy: its list plus the peer, also added to a Forwarded header it kept).",
    )
    stream_usage: bool = Field(
        True,
        description="Ask the upstream for a stream's usage chunk (stream_options.include_usage) when the client named no stream_options, and keep that chunk from the client: its token count is what the router learns a stream's time per token, acceptance and output length from.",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Seconds a client has to send a request's headers (from connecting, or from the first byte of the next request on a kept-alive connection); 408 and close after (a connection on which nothing of a request came is closed without an answer).",
    )
    body_timeout_s: float = Field(
        60.0, gt=0, description="Seconds a client has to send a request's body after its headers; 408 and close after."
    )
    keep_alive_timeout_s: float = Field(
        75.0,
        gt=0,
        le=3600,
        description="Seconds an idle keep-alive client connection stays open between requests: longer than clients and load balancers keep theirs (the OpenAI SDKs 5 s, load balancers often 60 s), or a request sent as the proxy closes the connection fails (each response's Keep-Alive header says so, for clients that close theirs first).",
    )
    max_header_bytes: int = Field(
        64 * 1024, ge=1024, description="Largest request line plus headers accepted (431 and close above)."
    )
    max_attempts: int = Field(
        3,
        ge=1,
        le=10,
        description="Upstream attempts per request, first try included (failover bound); a stream sent again without the stream_options the proxy added is not counted.",
    )
    max_connections: int = Field(1024, ge=1, description="Upstream connections kept per instance.")
    outlier_consecutive_failures: int = Field(
        5,
        ge=0,
        description="Failed attempts in a row (5xx, reset, first-token or chunk timeout) that eject an instance (0: never).",
    )
    outlier_slow_factor: float = Field(
        5.0,
        ge=0,
        description="Eject an instance whose first tokens come this many times later than its pool's others' (0: never; else above 1).",
    )
    outlier_ejection_s: float = Field(
        30.0, gt=0, description="Seconds an instance stays ejected, times the number of times it was ejected."
    )
    outlier_max_ejection_s: float = Field(300.0, gt=0, description="Longest ejection in seconds.")
    no_progress_s: float = Field(
        30.0,
        ge=0,
        description="Seconds a server that answers its load polls may leave the requests waiting on it without a byte while its engine's progress mark (SGLang's load snapshot time, vLLM's token counters and KV usage) holds still, before it is judged hung (an engine stuck behind a live HTTP front): it is ejected (rule no-progress) and every request waiting on it fails over, or its stream ends with an error event. Three times the predicted prefill of the longest prompt waiting there is added; a vLLM server is judged after the chunk timeout at least, and one with no mark known to move by streams alone, likewise. 0: never.",
    )
    query_of_death_servers: int = Field(
        2,
        ge=0,
        description="Different servers one request must fail on (a 500, or a dropped connection), served by none, to be judged their cause: its failures are taken back from their counts, and one that dropped their connections is not sent to another and is refused if sent again (0: never).",
    )
    query_of_death_s: float = Field(
        60.0,
        gt=0,
        description="Seconds a request judged to crash servers is refused if sent again (known by a hash of its path and body).",
    )
    drain_delay_s: float = Field(
        0.0,
        ge=0,
        description="After SIGTERM, seconds to keep accepting connections (/ready answers 503) before the listener closes and the drain starts.",
    )
    drain_timeout_s: float = Field(
        30.0, ge=0, le=86_400, description="On SIGTERM, seconds running requests get to finish before exit."
    )
    models_cache_s: float = Field(5.0, ge=0, description="Seconds a merged GET /v1/models answer is reused.")
    log_level: str = Field(
        "info", description="Log level of uvicorn and of the proxy's own lines: critical, error, warning, info, debug."
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        description="How the proxy's log lines (its own, uvicorn's, its libraries' warnings, the span export "
        "process's) are written to stderr; the request log is JSON on stdout either way: text (UTC time, "
        "level, logger, message) or json (one object per line: ts, level, logger, message, exception).",
    )

    # Telemetry (proxy/telemetry). The SDK reads the other OTEL_* variables itself.
    traces: bool | None = Field(
        None, description="Export OpenTelemetry traces over OTLP; unset: on when an OTLP endpoint is set."
    )
    trace_content: bool = Field(
        False, description="Opt-in: put prompts on trace spans (gen_ai.input.messages). Off by default."
    )
    trace_export: Literal["process", "inline"] = Field(
        "process",
        description="Where spans are encoded and exported: a child process (the event loop only hands "
        "each batch of requests over) or inline (on the event loop, and the SDK's export thread).",
    )
    request_log: bool = Field(True, description="Write one JSON line per request to stdout.")
    otlp_endpoint: str | None = Field(
        None,
        validation_alias=AliasChoices("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"),
        description="Where traces go, an http:// or https:// URL (host:port is taken for grpc; the SDK reads it; here it only switches tracing on).",
    )
    otlp_protocol: str = Field(
        "http/protobuf",
        validation_alias=AliasChoices("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"),
        description="OTLP transport for traces: http/protobuf or grpc.",
    )
    traces_sampler: str | None = Field(
        None,
        validation_alias=AliasChoices("OTEL_TRACES_SAMPLER"),
        description="Which requests are traced (the SDK reads it; checked here): parentbased_always_on "
        "(unset), always_on, always_off, traceidratio, parentbased_always_off, parentbased_traceidratio.",
    )
    traces_sampler_arg: str | None = Field(
        None,
        validation_alias=AliasChoices("OTEL_TRACES_SAMPLER_ARG"),
        description="The ratio sampled by traceidratio and parentbased_traceidratio, 0 to 1 (the SDK reads it; checked here).",
    )

    resource_attributes: str | None = Field(
        None,
        validation_alias=AliasChoices("OTEL_RESOURCE_ATTRIBUTES"),
        description="Attributes of every span's resource, key=value pairs separated by commas (the SDK "
        "reads it; checked here).",
    )

    @field_validator("spec_urls", "base_urls", mode="before")
    @classmethod
    def _split_urls(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("spec_urls", "base_urls")
    @classmethod
    def _check_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            problem = server_url_problem(url)
            if problem is not None:
                raise ValueError(problem)
        return [url.rstrip("/") for url in urls]

    @field_validator("response_id_secret")
    @classmethod
    def _check_response_id_secret(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value().strip():
            return None
        secret = value.get_secret_value().strip()
        if len(secret) < 16:
            raise ValueError("must be at least 16 characters (e.g. openssl rand -hex 32)")
        return SecretStr(secret)

    @field_validator("api_keys", "operator_api_keys")
    @classmethod
    def _check_keys(cls, value: SecretStr | None) -> SecretStr | None:
        """Keys as a header can carry them, and at least one: a value that held none (" ", ",",
        or only '#' entries) turned keys off and left the proxy open. The messages never quote
        a key."""
        if value is None:
            return None
        keys = inline_keys(value)
        if not keys:
            raise ValueError("is set but holds no key; unset it to run without keys")
        for key in keys:
            if key.startswith("#"):
                raise ValueError("a key may not start with '#' ('#' comments are for SPECROUTE_API_KEYS_FILE)")
            if not (key.isascii() and key.isprintable()) or " " in key:
                raise ValueError("keys are printable ASCII without spaces (as a Bearer token is sent)")
        return value

    @field_validator("spec_api_key", "base_api_key")
    @classmethod
    def _check_upstream_key(cls, value: SecretStr | None) -> SecretStr | None:
        """One key, sent as `Authorization: Bearer <key>`: the whitespace around it (a Secret
        written with `echo`, a trailing newline) is dropped, and a key no header can carry is
        refused here rather than failing every request to the pool. Never quoted."""
        if value is None:
            return None
        key = value.get_secret_value().strip()
        if not key:
            raise ValueError("is set but empty; unset it to send the client's Authorization")
        if not (key.isascii() and key.isprintable()) or " " in key:
            raise ValueError("a key is printable ASCII without spaces (as a Bearer token is sent)")
        return SecretStr(key)

    @field_validator("api_keys_file")
    @classmethod
    def _check_keys_file(cls, value: str | None) -> str | None:
        if value:
            try:
                with open(value, encoding="utf-8") as keys:
                    keys.read()
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"cannot read {value!r} ({type(exc).__name__})") from None
        return value or None

    @field_validator("port", mode="before")
    @classmethod
    def _check_port(cls, value: Any) -> Any:
        if isinstance(value, str) and "://" in value:
            raise ValueError(
                f"{value!r} is a Kubernetes service link (a Service named specroute sets SPECROUTE_PORT in "
                "every pod of its namespace): set SPECROUTE_PORT to a number, or enableServiceLinks: false"
            )
        return value

    @field_validator("host")
    @classmethod
    def _check_host(cls, value: str) -> str:
        if not value.strip():
            # uvicorn would listen on every interface: that must be asked for by name.
            raise ValueError("must not be empty (0.0.0.0 listens on every interface)")
        return value.strip()

    @field_validator("log_level")
    @classmethod
    def _check_log_level(cls, value: str) -> str:
        # Not uvicorn's "trace": it logs each request's scope, query string (where a client may
        # put its key) and client address included.
        levels = ("critical", "error", "warning", "info", "debug")
        if value.lower() not in levels:
            raise ValueError(f"must be one of {', '.join(levels)}")
        return value.lower()

    @model_validator(mode="after")
    def _check_otlp_endpoint(self) -> Settings:
        # The SDK's HTTP exporter takes an endpoint without a scheme and then fails every export,
        # logged once a batch: the proxy looked traced and no span left it. (Its gRPC exporter
        # takes `host:port`.)
        endpoint = self.otlp_endpoint
        if (
            endpoint
            and self.otlp_protocol == "http/protobuf"
            and not re.match(r"https?://[^/?#\s]+", endpoint, re.IGNORECASE)
        ):
            raise ValueError(
                f"the OTLP endpoint {endpoint!r} (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT)"
                " is not an http:// or https:// URL (e.g. http://localhost:4318)"
            )
        return self

    @field_validator("otlp_protocol")
    @classmethod
    def _check_otlp_protocol(cls, value: str) -> str:
        if value.strip() not in ("http/protobuf", "grpc"):
            raise ValueError(f"{value!r} is not supported; use http/protobuf or grpc")
        return value.strip()

    @field_validator("traces_sampler")
    @classmethod
    def _check_traces_sampler(cls, value: str | None) -> str | None:
        # The SDK only warns about a name it does not know and traces every request instead: a
        # mistyped ratio sampler would trace everything. It reads the variable itself, lowered
        # but not stripped: a space around the name is a name it does not know.
        if value is None or value == "":
            return None
        if value.lower() not in TRACES_SAMPLERS:
            raise ValueError(f"unknown sampler {value!r}; choose one of {', '.join(TRACES_SAMPLERS)}")
        return value.lower()

    @field_validator("traces_sampler_arg")
    @classmethod
    def _check_traces_sampler_arg(cls, value: str | None) -> str | None:
        # Unparsable or out of range, the SDK warns and samples every request.
        if value is None or not value.strip():
            return None
        try:
            ratio = float(value)
        except ValueError:
            raise ValueError(f"{value!r} is not a number; the sampled ratio is from 0 to 1") from None
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"{value!r} is not a ratio from 0 to 1")
        return value.strip()

    @field_validator("resource_attributes")
    @classmethod
    def _check_resource_attributes(cls, value: str | None) -> str | None:
        # The SDK skips a pair without "=" (a blank one too: a comma too many) with a warning
        # of its own in every process that builds a resource, written before the proxy's log
        # format is set: the attribute would be missing from every span, said only in passing.
        if value is None or value == "":
            return None
        for pair in value.split(","):
            key, equals, _ = pair.partition("=")
            if not pair.strip():
                raise ValueError(
                    "an empty pair (a comma too many, or spaces alone); write key=value pairs separated by commas"
                )
            if not equals or not key.strip():
                raise ValueError(f"{pair!r} is not key=value; write key=value pairs separated by commas")
        return value

    @property
    def traces_enabled(self) -> bool:
        return self.traces if self.traces is not None else bool(self.otlp_endpoint)

    @field_validator("policy")
    @classmethod
    def _check_policy(cls, value: str) -> str:
        # Case-insensitive like SPECROUTE_LOG_LEVEL (`Goodput` was refused); the registry's
        # spelling is what the rest of the proxy (and policy_setting) keys on.
        by_folded = {name.casefold(): name for name in registry.names()}
        if value.casefold() not in by_folded:
            raise ValueError(f"unknown policy {value!r}; choose one of {', '.join(registry.names())}")
        return by_folded[value.casefold()]

    @field_validator("profile")
    @classmethod
    def _check_profile(cls, value: str | None) -> str | None:
        if value:
            from fleet.costmodel import seed_from_profile
            from fleet.profile import builtin_names

            if not value.endswith(".json"):  # a built-in name, in any case (as policy names)
                value = {name.casefold(): name for name in builtin_names()}.get(value.casefold(), value)
            seed_from_profile(value)  # raises ValueError naming the built-in profiles
        return value or None

    @model_validator(mode="after")
    def _check_across(self) -> Settings:
        for policy, params in registry.declared_params().items():
            # The policy's own cross-checks (threshold: enter <= exit), naming the variables.
            names = {param: variable_name(policy_setting(policy, param)) for param in params.model_fields}
            problems = params.model_construct(**self.policy_params(policy)).describe_problems(names)
            if problems:
                raise ValueError("; ".join(problems))
        if self.total_timeout_s < self.connect_timeout_s:
            raise ValueError("SPECROUTE_TOTAL_TIMEOUT_S must not be shorter than SPECROUTE_CONNECT_TIMEOUT_S")
        problems = []
        # A reading must outlive the next poll, which may come a poll interval late: shorter, every
        # spec reading is stale most of the time and `stale` sends everything to base.
        if self.stale_ms < 2 * self.poll_interval_ms:
            problems.append(
                f"SPECROUTE_STALE_MS ({self.stale_ms}) must be at least twice SPECROUTE_POLL_INTERVAL_MS"
                f" ({self.poll_interval_ms})"
            )
        if self.hold_max_s >= self.total_timeout_s:
            problems.append(
                f"SPECROUTE_HOLD_MAX_S ({self.hold_max_s:g}) must be below SPECROUTE_TOTAL_TIMEOUT_S"
                f" ({self.total_timeout_s:g}): a request held that long would have no time left to be served"
            )
        if self.hold_max_s > 0 and self.slo_targets == (0.0, 0.0):
            problems.append(
                "SPECROUTE_HOLD_MAX_S needs an SLO target to judge which requests are lost"
                " (SPECROUTE_GOODPUT_SLO_TTFT_S or SPECROUTE_GOODPUT_SLO_TPOT_MS)"
            )
        if 0 < self.outlier_slow_factor <= 1:
            problems.append(
                f"SPECROUTE_OUTLIER_SLOW_FACTOR ({self.outlier_slow_factor:g}) must be 0 (never) or above 1"
                " (a server no slower than its pool's others would be ejected)"
            )
        if problems:
            raise ValueError("; ".join(problems))
        urls = self.spec_urls + self.base_urls
        repeated = sorted({url for url in urls if urls.count(url) > 1})
        if repeated:
            raise ValueError(f"SPECROUTE_SPEC_URLS/SPECROUTE_BASE_URLS list {', '.join(repeated)} more than once")
        return self

    def policy_params(self, policy: str | None = None) -> dict[str, Any]:
        """Policy `policy`'s (default: the chosen one's) declared parameters as set here, by
        parameter name: the keyword arguments of policies.registry.create(policy, ...)."""
        params = registry.params_of(policy or self.policy)
        if params is None:
            return {}
        return {param: getattr(self, policy_setting(policy or self.policy, param)) for param in params.model_fields}

    @property
    def slo_targets(self) -> tuple[float, float]:
        """(TTFT seconds, TPOT seconds) the SLO names (goodput's targets); 0 where none."""
        slo = GoodputParams(**self.policy_params("goodput"))
        return slo.slo_ttft_s, slo.slo_tpot_ms / 1000

    @property
    def admission_limits(self) -> tuple[float, float]:
        """(TTFT seconds, TPOT seconds) admission holds requests to; 0 where off."""
        ttft, tpot_s = self.slo_targets
        ttft = self.admission_ttft_s if self.admission_ttft_s is not None else ttft
        tpot_s = self.admission_tpot_ms / 1000 if self.admission_tpot_ms is not None else tpot_s
        return ttft, tpot_s

    def require_upstreams(self) -> None:
        if not self.spec_urls and not self.base_urls:
            raise SettingsError(
                f"set {ENV_PREFIX}SPEC_URLS and/or {ENV_PREFIX}BASE_URLS: the proxy has no upstream servers"
            )

    def public_view(self) -> dict[str, Any]:
        """Effective settings by variable name, secrets masked (for `specroute config`)."""
        view: dict[str, Any] = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, SecretStr):
                value = "********"
            elif name == "otlp_endpoint" and value:
                value = without_password(value)
            elif isinstance(value, list):
                value = ",".join(value)
            view[variable_name(name)] = value
        return view


def share_dotenv_otel(path: str = ".env") -> None:
    """Put the .env file's OTEL_* variables into the process environment, where the
    OpenTelemetry SDK reads them (it reads no .env file), so that traces go where
    `specroute config` says. The environment still wins; called once, at `specroute serve`."""
    from dotenv import dotenv_values

    for name, value in dotenv_values(path).items():
        if name.startswith("OTEL_") and value and not os.environ.get(name):  # empty = unset
            os.environ[name] = value


SERVICE_LINK = re.compile(r"SPECROUTE_(SERVICE_(HOST|PORT(_\w+)?)|PORT_\d+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)")
"""What Kubernetes puts in every pod's environment for a Service named `specroute` (service
links: SPECROUTE_SERVICE_HOST, SPECROUTE_PORT_8000_TCP_ADDR...): no settings, and not typos."""


def unknown_variables() -> list[str]:
    """The SPECROUTE_* variables set in the environment or the .env file that name no setting,
    each as a line saying so and which setting it most likely meant. pydantic-settings ignores
    them (a deployment's environment holds other things too), so a misspelt one would silently
    leave its setting at the default."""
    from dotenv import dotenv_values

    known = {variable_name(field) for field in Settings.model_fields}
    names = set(os.environ) | {name for name in dotenv_values(".env") if name}
    lines = []
    for name in sorted(names):
        upper = name.upper()  # pydantic-settings matches names in any case: so does this check
        if not upper.startswith(ENV_PREFIX) or upper in known or SERVICE_LINK.fullmatch(upper):
            continue
        close = difflib.get_close_matches(upper, known, n=1, cutoff=0.8)
        hint = f" (did you mean {close[0]}?)" if close else ""
        lines.append(f"{name} is not a setting{hint}; it is ignored (`specroute config` lists them)")
    return lines


def inline_keys(value: SecretStr | None) -> list[str]:
    """The keys of a comma-separated key setting (SPECROUTE_API_KEYS, SPECROUTE_OPERATOR_API_KEYS)."""
    if value is None:
        return []
    return [part.strip() for part in value.get_secret_value().split(",") if part.strip()]


def server_url_problem(url: str) -> str | None:
    """Why `url` is no LLM server's base URL (None: it is one); the reason shows the URL without
    credentials or query, which may hold secrets. For the pools' URLs and `specroute profile`."""
    shown = repr(re.split(r"[?#]", re.sub(r"//[^/@]*@", "//", url, count=1))[0])
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        return f"{shown} is not an http:// or https:// URL"
    try:
        parsed = URL(url)
        parsed.port  # noqa: B018  # a port out of range is refused only when read
    except ValueError as exc:
        return f"{shown} is not a valid URL ({exc})"
    if parsed.user is not None or parsed.password is not None:
        # The URL shows in x-specroute-backend, /v1/specroute/state, logs, traces and profiles.
        return f"{shown} carries credentials; give the servers' key apart (SPECROUTE_SPEC_API_KEY / SPECROUTE_BASE_API_KEY, or specroute profile's --api-key-file)"
    if parsed.query_string or parsed.fragment or "?" in url or "#" in url:
        return f"{shown} has a query or fragment; give the server's base URL"
    if parsed.path.rstrip("/").endswith("/v1"):
        # The OpenAI SDKs' base_url style: every path the proxy asks for (/v1/..., and SGLang's
        # /get_load, /metrics) would 404 behind it, and the server look idle.
        return f"{shown} ends in /v1; give the server's root (the proxy adds /v1/... itself)"
    if not parsed.host or any(c.isspace() for c in url):
        return f"{shown} is not a valid URL (no host, or a space in it)"
    return None


def without_password(url: str) -> str:
    """`url` with any password in it masked (an OTLP endpoint may carry basic-auth credentials)."""
    try:
        parsed = URL(url)
    except ValueError:
        return url
    return str(parsed.with_password("********")) if parsed.password else url


def load_settings(**overrides: Any) -> Settings:
    """Settings from the environment and .env; raise SettingsError naming the bad variable."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise SettingsError(describe(exc)) from None


def variable_name(field: str) -> str:
    """The environment variable a setting is read from: SPECROUTE_<FIELD>, or for the few
    standard OTEL_* ones the general variable (the per-signal one wins when both are set)."""
    alias = Settings.model_fields[field].validation_alias
    return str(alias.choices[-1]) if isinstance(alias, AliasChoices) else ENV_PREFIX + field.upper()


def describe(exc: ValidationError) -> str:
    lines = []
    across = False
    for error in exc.errors():
        location = error.get("loc") or ()
        message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        if location:
            name = str(location[0])  # a field name, or the first OTEL_* variable of an aliased field
            if name.startswith("OTEL_"):
                # Pydantic names the first alias; the user may have set the other one.
                name = (
                    " or ".join(
                        str(choice)
                        for field in Settings.model_fields.values()
                        if isinstance(field.validation_alias, AliasChoices) and name in field.validation_alias.choices
                        for choice in field.validation_alias.choices
                    )
                    or name
                )
            else:
                name = ENV_PREFIX + name.upper()
            lines.append(f"{name}: {message}")
        else:
            lines.append(message)  # a check across settings, naming them itself
            across = True
    return ("invalid settings: " if across else "invalid setting ") + "; ".join(lines)
