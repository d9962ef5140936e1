"""The official openai Node SDK (npm `openai`, pinned in node_sdk/package-lock.json) through the proxy.

Many clients are Node: its SDK talks through Node's fetch (undici), with keep-alive connections
and AbortController cancellation, not httpx. node_sdk/client.mjs runs one scenario with the real
SDK against the proxy and prints what it saw as JSON; these tests assert on that. The SDK is
installed by tests/support/install_node_sdk.sh (`make node-sdk`, a prerequisite of `make test`);
the tests run it too, so that they also work alone. Without node or npm on the machine they are
skipped; a failed install fails them.
"""

from __future__ import annotations

import json
import queue
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from proxy_faults import FaultServer
from proxy_harness import TIME_SCALE, RunningProxy, running_proxy, twin_running, wait_for

from proxy.connection import GuardedProtocol
from sim.testing import RunningTwin, TwinSpec, twin, twins

pytestmark = pytest.mark.external  # node, and an npm install: `make unit` leaves these out

HERE = Path(__file__).resolve().parent
CLIENT = HERE / "node_sdk" / "client.mjs"
INSTALL = HERE.parent / "support" / "install_node_sdk.sh"
MODEL = "specroute/twin"


@pytest.fixture(scope="session")
def node() -> str:
    """The node binary, with the pinned SDK installed beside client.mjs."""
    found, npm = shutil.which("node"), shutil.which("npm")
    if found is None or npm is None:
        pytest.skip("node or npm is not on PATH: the openai Node SDK tests need both")
    version = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    assert int(version.lstrip("v").split(".")[0]) >= 20, f"the Node SDK needs node >= 20, found {version}"
    install = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, f"installing the Node SDK failed:\n{install.stdout}\n{install.stderr}"
    return found


def run_scenario(node: str, proxy: RunningProxy, scenario: str, timeout: float = 120) -> dict[str, Any]:
    done = subprocess.run(
        [node, str(CLIENT), proxy.base_url, scenario],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        cwd=CLIENT.parent,
    )
    assert done.returncode == 0, f"{scenario} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_openai_error(seen: dict[str, Any], status: int, kind: str) -> None:
    assert seen.get(kind) is True and seen["status"] == status, seen
    error = seen["error"]
    assert isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"].strip(), seen
    assert isinstance(error.get("type"), str) and error["type"], seen


def test_chat_non_streamed_with_headers(node: str, proxy: RunningProxy) -> None:
    seen = run_scenario(node, proxy, "chat")
    assert seen["content"] and seen["content"].strip()
    assert seen["finish"] == "length"
    usage = seen["usage"]
    assert usage["completion_tokens"] == 12 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert isinstance(seen["id"], str) and seen["id"]
    assert seen["model"] == MODEL  # the twin names the model asked for
    assert seen["object"] == "chat.completion"
    headers = seen["headers"]  # withResponse(): the fetch Response's headers
    assert headers["x-specroute-pool"] in ("spec", "base")
    assert headers["x-specroute-backend"] in ("spec-0", "base-0")
    assert len(headers["x-request-id"]) >= 16
    assert seen["requestID"] == headers["x-request-id"]  # the SDK's _request_id reads the same header
    raw = seen["raw"]  # asResponse(): the raw fetch Response
    assert raw["status"] == 200 and raw["usage"]["completion_tokens"] == 3
    assert raw["headers"]["x-specroute-pool"] in ("spec", "base") and len(raw["headers"]["x-request-id"]) >= 16
    assert raw["headers"]["x-request-id"] != headers["x-request-id"]


def test_chat_streamed_usage_only_when_asked(node: str, proxy: RunningProxy) -> None:
    seen = run_scenario(node, proxy, "chatStream")
    expected = seen["nonStreamedUsage"]["completion_tokens"]
    assert expected == 24  # ignore_eos: the twin runs to max_tokens
    for name in ("withUsage", "withoutUsage"):
        stream = seen[name]
        assert stream["chunks"] > 1 and stream["text"].strip(), (name, stream)
        assert stream["lastChoiceFinish"] == "length", (name, stream)
        assert len(stream["ids"]) == 1, (name, stream)
    usage = seen["withUsage"]["usage"]
    assert len(usage) == 1 and usage[0]["completion_tokens"] == expected, usage
    # The proxy asked upstream for usage on the client's behalf; the client that did not ask gets none.
    assert seen["withoutUsage"]["usage"] == []


def test_legacy_completions_both_ways(node: str, proxy: RunningProxy) -> None:
    seen = run_scenario(node, proxy, "completions")
    plain = seen["plain"]
    assert plain["text"].strip() and plain["finish"] == "length" and plain["usage"]["completion_tokens"] == 9
    assert plain["object"] == "text_completion"
    streamed = seen["streamed"]
    assert streamed["chunks"] > 1 and streamed["text"].strip() and streamed["finish"] == "length"
    assert len(streamed["usage"]) == 1 and streamed["usage"][0]["completion_tokens"] == 7
    bare = seen["bare"]
    assert bare["chunks"] > 1 and bare["text"].strip()
    assert bare["withUsage"] == 0 and bare["withoutChoices"] == 0, bare


def test_errors_are_the_sdks_typed_errors(node: str, proxy: RunningProxy) -> None:
    seen = run_scenario(node, proxy, "errors")
    for name in ("negativeMaxTokens", "missingMessages", "negativeMaxTokensStreamed"):
        assert_openai_error(seen[name], 400, "isBadRequest")
        assert seen[name]["name"] == "BadRequestError", seen[name]
        assert len(seen[name]["requestID"] or "") >= 16, seen[name]  # err.requestID: the proxy's x-request-id
    for name in ("noSuchRoute", "noSuchModel"):
        assert_openai_error(seen[name], 404, "isNotFound")
        assert seen[name]["name"] == "NotFoundError", seen[name]
    assert seen["noSuchModel"]["error"]["code"] == "model_not_found"
    wait_for(lambda: proxy.in_flight() == 0, what="in-flight counts back to zero", timeout=10)


def test_twenty_streams_one_after_another_on_one_client(
    node: str, proxy: RunningProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[object] = []
    connection_made = GuardedProtocol.connection_made

    def counted(protocol: GuardedProtocol, transport: Any) -> None:
        opened.append(protocol)
        connection_made(protocol, transport)

    monkeypatch.setattr(GuardedProtocol, "connection_made", counted)  # the proxy runs in this process
    seen = run_scenario(node, proxy, "keepAlive")
    # Node's fetch (undici) takes a second connection for the request that follows a finished
    # one (the first is not yet back in its pool) and alternates between the two: a plain Node
    # http server sees 2 for 10 sequential requests too. Without keep-alive it would be 21.
    assert len(opened) <= 2, f"{len(opened)} connections for 21 sequential requests"
    results = seen["results"]
    assert len(results) == 20
    for i, result in enumerate(results):
        assert result["text"].strip() and result["finish"] == "length", (i, result)
        assert result["completionTokens"] == 5 + i % 4, (i, result)
    assert seen["after"]["completion_tokens"] == 2
    wait_for(lambda: proxy.in_flight() == 0, what="in-flight counts back to zero", timeout=10)


def test_sixteen_concurrent_streams(node: str, proxy: RunningProxy, twin_pair) -> None:
    seen = run_scenario(node, proxy, "concurrent")
    results = seen["results"]
    assert len(results) == 16
    for result in results:
        assert result["text"].strip() and result["finish"] == "length", result
        assert result["completionTokens"] == result["maxTokens"], result
        assert len(result["ids"]) == 1, result
    assert len({r["ids"][0] for r in results}) == 16  # no stream got another's chunks
    wait_for(lambda: proxy.in_flight() == 0, what="in-flight counts back to zero", timeout=10)
    for running in twin_pair:
        wait_for(lambda: twin_running(running) == 0, what="the twins idle again", timeout=10)


def test_an_upstream_cut_mid_stream_is_an_sdk_error(node: str) -> None:
    with FaultServer("cut:3") as upstream, running_proxy(spec_urls=[upstream.url], policy="spec") as proxy:
        seen = run_scenario(node, proxy, "midStreamCut")
        wait_for(lambda: proxy.in_flight() == 0, what="in-flight released", timeout=10)
    assert seen["chunks"] == 3, seen
    caught = seen["caught"]  # the proxy's closing error event, thrown by the SDK's stream
    assert caught is not None and caught["isAPIError"] is True, seen
    assert caught["error"]["code"] == "upstream_disconnected" and caught["error"]["type"] == "server_error", seen


@pytest.fixture(scope="module")
def stored_proxy() -> Iterator[RunningProxy]:
    """Twins keeping their responses (SGLang's --enable-response-store)."""
    store = ("--enable-response-store", "--output-len", "fixed:4096")
    with twins(
        TwinSpec("spec", time_scale=TIME_SCALE, seed=1, args=store),
        TwinSpec("base", time_scale=TIME_SCALE, seed=2, args=store),
    ) as (spec, base):
        with running_proxy(spec_urls=[spec.url], base_urls=[base.url]) as running:
            yield running


def test_the_responses_api(node: str, stored_proxy: RunningProxy) -> None:
    seen = run_scenario(node, stored_proxy, "responses")
    first, stream, follow = seen["first"], seen["stream"], seen["follow"]
    assert first["id"].startswith("resp_") and first["text"].strip() and first["usage"]["output_tokens"] > 0
    assert stream["events"][0] == "response.created" and stream["events"][-1] == "response.incomplete"
    assert stream["text"] and stream["text"] == stream["lastText"] and stream["usage"]["output_tokens"] > 0
    # The follow-up went to the server holding the first answer, and carried its conversation.
    assert (follow["previous"], follow["backend"], follow["reason"]) == (
        first["id"],
        first["backend"],
        "response-owner",
    )
    assert follow["usage"]["input_tokens"] > first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    assert seen["fetched"]["text"].strip()
    assert_openai_error(seen["unknown"], 404, "isNotFound")
    wait_for(lambda: stored_proxy.in_flight() == 0, what="in-flight counts back to zero", timeout=10)


@pytest.fixture(scope="module")
def slow_twin() -> Iterator[RunningTwin]:
    """Real-time twin: 4,000 tokens take many seconds, so an abort shows in /v1/loads."""
    with twin("base", time_scale=1.0, seed=5, args=("--output-len", "fixed:4096")) as running:
        yield running


@pytest.fixture(scope="module")
def slow_proxy(slow_twin: RunningTwin) -> Iterator[RunningProxy]:
    with running_proxy(base_urls=[slow_twin.url], policy="base") as running:
        yield running


class Lines:
    """A child's stdout lines, each read with a deadline (a thread reads; the test waits on a queue)."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process
        self.lines: queue.Queue[str] = queue.Queue()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put("")  # end of output

    def next_json(self, timeout: float) -> Any:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line from the Node client within {timeout} s") from None
        assert line, f"the Node client ended early (exit {self.process.poll()})"
        return json.loads(line)


def test_abort_controller_frees_the_proxy_and_the_twin(node: str, slow_twin: RunningTwin, slow_proxy) -> None:
    client = subprocess.Popen(
        [node, str(CLIENT), slow_proxy.base_url, "abort"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=CLIENT.parent,
    )
    try:
        assert client.stdin is not None
        lines = Lines(client)
        assert lines.next_json(timeout=30) == {"streaming": 5}
        assert slow_proxy.in_flight() == 1
        wait_for(lambda: twin_running(slow_twin) == 1, timeout=10, what="the twin to show the stream")
        client.stdin.write("abort\n")
        client.stdin.flush()
        result = lines.next_json(timeout=30)
        assert result["aborted"] is True, result
        # The SDK's stream ends quietly on its own abort (openai-node 6 returns from the iterator),
        # after the events it had already read; any other error is wrong.
        assert result["caught"] is None or result["caught"]["name"] == "APIUserAbortError", result
        assert 5 <= result["chunks"] < 50 and result["text"].strip(), result
        # The Node process (and its connection pool) is still alive: the abort alone must free them.
        wait_for(lambda: slow_proxy.in_flight() == 0, timeout=5, what="in-flight released after the abort")
        wait_for(lambda: twin_running(slow_twin) == 0, timeout=5, what="the twin to drop the aborted stream")
        assert client.poll() is None
        client.stdin.close()  # the script exits
        assert client.wait(timeout=30) == 0
    finally:
        if client.poll() is None:
            client.kill()
            client.wait(timeout=10)
