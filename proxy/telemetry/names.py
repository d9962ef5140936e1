"""Every span, attribute, event and metric name specroute emits, in one place.

GenAI names follow OpenTelemetry semantic conventions v1.41.0 (the last release of the main
semconv repository that holds the GenAI text); they are still "Development", so a rename lands
here and nowhere else.
"""

from __future__ import annotations

# HTTP server span (HTTP semantic conventions, stable).
HTTP_REQUEST_METHOD = "http.request.method"
HTTP_ROUTE = "http.route"
HTTP_RESPONSE_STATUS_CODE = "http.response.status_code"
URL_PATH = "url.path"
URL_SCHEME = "url.scheme"
USER_AGENT_ORIGINAL = "user_agent.original"
ERROR_TYPE = "error.type"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"

# GenAI inference span (one CLIENT span per upstream attempt).
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_STREAM = "gen_ai.request.stream"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
# Of the input tokens, those served from the server's prefix cache (v1.41.0; SGLang's own spans
# still say gen_ai.usage.cached_tokens, the name before the conventions settled).
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
# Opt-in content (SPECROUTE_TRACE_CONTENT); JSON strings, the portable encoding on spans.
GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"

# SGLang and vLLM have no well-known provider value; the conventions allow a custom one. A server
# of no kind the proxy knows is not OpenAI's service, so not "openai" (which implies openai.*).
PROVIDER_BY_KIND = {"sglang": "sglang", "vllm": "vllm"}
PROVIDER_UNKNOWN = "openai_compatible"
OPERATION_BY_PATH = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}

EVENT_FIRST_TOKEN = "gen_ai.first_token"

# specroute's own attributes: the routing decision and where an attempt went.
ROUTE_POLICY = "specroute.policy"
ROUTE_POOL = "specroute.pool"
ROUTE_REASON = "specroute.reason"
ROUTE_OVERRIDE = "specroute.override"
ROUTE_INPUT_PREFIX = "specroute.decision."  # + a Decision.scores key, e.g. "spec.load", "t_spec_s"
ROUTE_PROMPT_TOKENS = "specroute.request.prompt_tokens"
ROUTE_REQUEST_CLASS = "specroute.request.class"
ATTEMPT_NUMBER = "specroute.attempt"
ATTEMPT_INSTANCE = "specroute.instance"
PREFIX_CREDITED_TOKENS = "specroute.prefix.credited_tokens"
REQUEST_ID = "specroute.request_id"
OVERHEAD_MS = "specroute.overhead_ms"

SPAN_DECISION = "specroute.route"

# Prometheus metric names (the exposition adds _total/_bucket/... suffixes itself).
M_REQUESTS = "specroute_requests"
M_DECISIONS = "specroute_decisions"
M_TTFT = "specroute_time_to_first_token_seconds"
M_INTER_TOKEN = "specroute_inter_token_seconds"
M_DURATION = "specroute_request_duration_seconds"
M_IN_FLIGHT = "specroute_in_flight_requests"
M_ALPHA = "specroute_pool_alpha"
M_SNAPSHOT_AGE = "specroute_snapshot_age_seconds"
M_HEALTHY = "specroute_upstream_healthy"
M_RETRIES = "specroute_retries"
M_FAILOVERS = "specroute_failovers"
M_OVERHEAD = "specroute_overhead_seconds"
M_TOKENS = "specroute_tokens"
M_AUTH_REFUSED = "specroute_auth_refused"
AUTH_REFUSED_REASONS = ("missing", "malformed", "invalid", "not_operator", "pin_not_allowed", "key_concurrency")
"""Every `reason` of proxy.auth's refusals: their series exist at 0 from the start."""
M_STORED = "specroute_stored_response_requests"
M_STORED_ASKED = "specroute_stored_response_upstream_requests"
M_UPSTREAM_ABORTS = "specroute_upstream_aborts"
UPSTREAM_ABORT_OUTCOMES = ("sent", "refused", "failed", "dropped")
ATTEMPTED_OUTCOMES = ("ok", "client_error", "error", "client_disconnected")
"""The `outcome`s of a request that reached a pool (proxy.telemetry.request.outcome_of); not
`refused`: the proxy's own 429s for load come before any attempt."""
UNATTEMPTED_OUTCOMES = ("client_error", "refused", "error", "client_disconnected")
"""The `outcome`s of a request refused before any attempt (pool `none`): never `ok`."""
M_EJECTED = "specroute_upstream_ejected"
M_HUNG_RANKS = "specroute_upstream_hung_ranks"
M_EJECTIONS = "specroute_upstream_ejections"
EJECTION_REASONS = (
    "consecutive-failures",
    "slow-first-token",
    "no-progress",
    "probe-failed",
    "probe-slow-first-token",
)
"""Every rule proxy.outliers ejects by (its RULES): their series exist at 0 per instance."""
M_PREFIX_CREDITED = "specroute_prefix_credited_tokens"
M_PREFIX_CACHED = "specroute_prefix_cached_tokens"
M_UNKNOWN_PATH = "specroute_unknown_path_requests"
STORED_RESPONSES_PREFIX = "/v1/responses/"
"""Paths under it name a stored response by its id: logged as `{id}` (`service.loggable_path`)."""
MAX_LOGGED_PATH_CHARS = 200
"""An unknown path's log line keeps this much of it (a client or a scanner chooses it)."""
MAX_MODEL_CHARS = 256
"""The longest model name the log line and the spans carry, the request's and the response's
alike (the body goes upstream whole)."""
M_TRACE_DROPPED = "specroute_trace_dropped_requests"
M_HELD = "specroute_held_requests"
M_HOLD_RELEASED = "specroute_hold_released_seconds"
HOLD_RELEASE_RULES = ("release-due", "release-room", "release-bound", "release-drain")
"""Every rule that lets a held request go (policies/flow.py): their series exist at 0 from the start."""
BUCKETS_HELD = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)

OVERHEAD_HEADER = "x-specroute-overhead-ms"
OVERHEAD_HEADER_BYTES = OVERHEAD_HEADER.encode()
TRACERESPONSE_HEADER_BYTES = b"traceresponse"

# Bucket boundaries (docs/observability.md, "Buckets"): the GenAI conventions'
# (gen-ai-metrics.md@v1.41.0) where they resolve what specroute serves, extended to its timeouts.
BUCKETS_TTFT = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    120.0,
)  # gen_ai.server.time_to_first_token's, then up to SPECROUTE_FIRST_TOKEN_TIMEOUT_S's default
# Not gen_ai.server.time_per_output_token's (10 ms ... 2.5 s): per-token gaps are 2-60 ms, so
# nearly every sample of both pools fell in its first bucket. Fine from 1 to 100 ms, where spec
# and base differ (a 3 ms speculative gap and a 20 ms plain one land four buckets apart).
BUCKETS_INTER_TOKEN = (
    0.001,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.2,
    0.5,
    2.5,
)
BUCKETS_DURATION = (
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
    40.96,
    81.92,
    163.84,
    327.68,
    655.36,
    1310.72,
    2621.44,
    3600.0,
)  # gen_ai.client.operation.duration's, then doubling on to SPECROUTE_TOTAL_TIMEOUT_S's default
BUCKETS_TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)  # token.usage
# The proxy's own work per request: tens of microseconds to a few milliseconds.
BUCKETS_OVERHEAD = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
