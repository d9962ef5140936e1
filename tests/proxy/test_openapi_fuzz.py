"""The proxy fuzzed against the OpenAPI description it serves (schemathesis): generated requests,
valid and not, for every operation; every answer must match the description (OpenAI-shaped
errors, documented statuses and content types), and none may be a 5xx of the proxy's own."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from proxy_harness import RunningProxy, assert_upstream_failure, running_proxy
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance

MAX_EXAMPLES = 10_000 if os.environ.get("HYPOTHESIS_PROFILE") == "nightly" else 40


@pytest.fixture(scope="module")
def proxy(twin_pair) -> Iterator[RunningProxy]:
    spec, base = twin_pair
    with running_proxy(spec_urls=[spec.url], base_urls=[base.url]) as running:
        yield running


def test_every_operation_answers_as_described(proxy: RunningProxy) -> None:
    schema = schemathesis.openapi.from_url(proxy.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/models",
        "/v1/models/{model_id}",
    }
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
        def answers_as_described(case) -> None:
            if isinstance(case.body, dict):  # generated answers short: the twins run for real
                case.body["max_output_tokens" if operation.path == "/v1/responses" else "max_tokens"] = 4
            response = case.call(timeout=30)
            # Semantics are the upstream's (the twin, like SGLang, validates far more than the
            # proxy's description says): whether a request should be accepted is not checked here.
            case.validate_response(
                response, excluded_checks=[positive_data_acceptance, negative_data_rejection, not_a_server_error]
            )
            if response.status_code >= 500:
                assert_upstream_failure(response)

        answers_as_described()
