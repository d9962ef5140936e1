"""Client keys as a user meets them: the openai SDK's api_key, probes left open, operator
endpoints, pool pinning, a keys file reloaded on change and on SIGHUP, and no key anywhere it
should not be (upstream, logs, traces, `specroute config`, error bodies)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
import pytest
from proxy_faults import FaultServer
from proxy_harness import RunningProxy, running_proxy, wait_for

from sim.testing import TwinSpec, twins

MESSAGES = [{"role": "user", "content": "Say hi."}]
CHAT = {"model": "m", "messages": MESSAGES, "max_tokens": 2}


def error_of(response: httpx.Response) -> dict:
    return response.json()["error"]


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture()
def keyed(twin_pair) -> Iterator[RunningProxy]:
    spec, base = twin_pair
    with running_proxy(
        spec_urls=[spec.url], base_urls=[base.url], api_keys="sk-good-1, sk-good-2", operator_api_keys="sk-operator"
    ) as proxy:
        yield proxy


def test_the_sdk_with_a_known_key_streams_and_lists_models(keyed: RunningProxy) -> None:
    client = openai.OpenAI(base_url=keyed.base_url, api_key="sk-good-2", max_retries=0)
    reply = client.chat.completions.create(model="specroute/twin", messages=MESSAGES, max_tokens=4)
    assert reply.usage is not None and reply.usage.completion_tokens == 4
    chunks = list(client.chat.completions.create(model="specroute/twin", messages=MESSAGES, max_tokens=4, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [m.id for m in client.models.list()]
    wait_for(lambda: keyed.in_flight() == 0, what="in-flight released")


def test_a_wrong_or_missing_key_gets_an_openai_401_that_never_echoes_it(keyed: RunningProxy) -> None:
    client = openai.OpenAI(base_url=keyed.base_url, api_key="sk-wrong-secret", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    assert "sk-wrong-secret" not in refused.value.response.text
    with pytest.raises(openai.AuthenticationError):
        client.models.list()

    missing = httpx.post(keyed.base_url + "/chat/completions", json=CHAT)
    assert missing.status_code == 401 and error_of(missing)["code"] == "invalid_api_key"
    assert error_of(missing)["type"] == "authentication_error"
    assert missing.headers["www-authenticate"].startswith("Bearer")
    malformed = httpx.post(
        keyed.base_url + "/completions",
        json={"model": "m", "prompt": "x"},
        headers={"authorization": "Basic c2stZ29vZC0xOg=="},
    )
    assert malformed.status_code == 401 and "c2stZ29vZC0x" not in malformed.text
    # A key that is a known key's prefix, or one with a known key inside it, is not that key.
    for near in ("sk-good", "sk-good-1x", "xsk-good-1"):
        assert httpx.post(keyed.base_url + "/chat/completions", json=CHAT, headers=bearer(near)).status_code == 401

    metrics = httpx.get(keyed.url + "/metrics")  # open by default
    assert metrics.status_code == 200
    counts = {
        line.split("}")[0].split('reason="')[1].rstrip('"'): float(line.split()[-1])
        for line in metrics.text.splitlines()
        if line.startswith("specroute_auth_refused_total{")
    }
    assert counts["missing"] >= 1 and counts["malformed"] >= 1 and counts["invalid"] >= 5
    assert "sk-wrong" not in metrics.text and "sk-good" not in metrics.text
    assert (
        keyed.app.router.pools["spec"].instances[0].dispatched_total
        + keyed.app.router.pools["base"].instances[0].dispatched_total
        == 0
    )  # nothing refused went upstream


def test_probes_stay_open_and_the_state_endpoint_needs_an_operator_key(keyed: RunningProxy) -> None:
    assert httpx.get(keyed.url + "/health").status_code == 200
    assert httpx.get(keyed.url + "/ready").status_code == 200
    ready = httpx.get(keyed.url + "/ready").json()
    assert [i["name"] for i in ready["pools"]["spec"]] == ["spec-0"] and "127.0.0.1" not in str(ready)
    assert httpx.get(keyed.url + "/v1/specroute/state").status_code == 401
    as_client = httpx.get(keyed.url + "/v1/specroute/state", headers=bearer("sk-good-1"))
    assert as_client.status_code == 403 and error_of(as_client)["code"] == "operator_key_required"
    as_operator = httpx.get(keyed.url + "/v1/specroute/state", headers=bearer("sk-operator"))
    assert as_operator.status_code == 200
    instance = as_operator.json()["pools"]["spec"]["instances"][0]
    assert instance["name"] == "spec-0" and instance["url"].startswith("http://127.0.0.1:")
    # An operator key is a client key too.
    assert httpx.post(keyed.base_url + "/chat/completions", json=CHAT, headers=bearer("sk-operator")).status_code == 200


def test_the_clients_key_never_goes_upstream_when_proxy_keys_are_on(twin_pair) -> None:
    _, base = twin_pair
    with FaultServer("echo") as upstream:
        with running_proxy(
            spec_urls=[upstream.url], base_urls=[base.url], policy="spec", api_keys="sk-client"
        ) as proxy:
            assert (
                httpx.post(proxy.base_url + "/chat/completions", json=CHAT, headers=bearer("sk-client")).status_code
                == 200
            )
        with running_proxy(
            spec_urls=[upstream.url], base_urls=[base.url], policy="spec", api_keys="sk-client", spec_api_key="sk-pool"
        ) as proxy:
            assert (
                httpx.post(proxy.base_url + "/chat/completions", json=CHAT, headers=bearer("sk-client")).status_code
                == 200
            )
        with running_proxy(spec_urls=[upstream.url], base_urls=[base.url], policy="spec") as proxy:
            # No proxy keys: the client's Authorization is the upstream's business, as before.
            assert (
                httpx.post(proxy.base_url + "/chat/completions", json=CHAT, headers=bearer("sk-theirs")).status_code
                == 200
            )
    posts = [r.headers.get("authorization") for r in upstream.requests if r.method == "POST"]
    assert posts == [None, "Bearer sk-pool", "Bearer sk-theirs"]


def test_an_upstream_refusing_the_proxys_credentials_is_a_502_and_fails_over(twin_pair) -> None:
    # A 401 would tell the client its own (valid) key is wrong, and its SDK would not retry.
    _, base = twin_pair
    with FaultServer("status:401") as refusing:
        with running_proxy(
            spec_urls=[refusing.url], base_urls=[base.url], api_keys="sk-client", spec_api_key="sk-stale"
        ) as proxy:
            pinned = httpx.post(
                proxy.base_url + "/chat/completions",
                json=CHAT,
                headers=bearer("sk-client") | {"x-specroute-pool": "spec"},
            )
            assert pinned.status_code == 502 and error_of(pinned)["code"] == "upstream_auth"
            assert "SPECROUTE_SPEC_API_KEY" in error_of(pinned)["message"] and "sk-" not in pinned.text
            served = httpx.post(proxy.base_url + "/chat/completions", json=CHAT, headers=bearer("sk-client"))
            assert served.status_code == 200  # spec refused it: base served it
        with running_proxy(spec_urls=[refusing.url], base_urls=[base.url], policy="spec") as proxy:
            # No proxy keys and no pool key: the client's key went upstream, the refusal is the client's.
            theirs = httpx.post(proxy.base_url + "/chat/completions", json=CHAT, headers=bearer("sk-wrong"))
            assert theirs.status_code == 401


@pytest.mark.parametrize("value", [" ", ",", "#secret", "#a,#b", "k1,#k2", "k\u00fc", "a b"])
def test_a_keys_setting_that_holds_no_usable_key_stops_start_up(value: str) -> None:
    # " ", "," or only '#' entries turned keys off: every endpoint open behind a setting that
    # looked like keys. The message names the setting, never the value.
    from proxy.settings import SettingsError, load_settings

    with pytest.raises(SettingsError, match="SPECROUTE_API_KEYS") as refused:
        load_settings(api_keys=value, base_urls=["http://127.0.0.1:9"])
    assert "secret" not in str(refused.value)


def test_settings_that_need_keys_warn_when_there_are_none(caplog) -> None:
    from proxy.auth import Access, warn_if_open
    from proxy.settings import load_settings

    settings = load_settings(
        state_access="operators", key_max_concurrency=2, pool_pin="operators", base_urls=["http://127.0.0.1:9"]
    )
    with caplog.at_level("WARNING", logger="specroute"):
        warn_if_open(settings, Access.from_settings(settings))
    warned = [r.getMessage() for r in caplog.records if "apply only with keys" in r.getMessage()]
    assert len(warned) == 1 and "SPECROUTE_STATE_ACCESS" in warned[0] and "SPECROUTE_KEY_MAX_CONCURRENCY" in warned[0]
    assert "SPECROUTE_POOL_PIN" in warned[0]  # anyone could pin a pool: it looked restricted


def test_who_may_pin_a_pool_is_a_setting(twin_pair) -> None:
    spec, base = twin_pair
    pin = {"x-specroute-pool": "base"}
    with running_proxy(spec_urls=[spec.url], base_urls=[base.url], pool_pin="off") as proxy:
        refused = httpx.post(proxy.base_url + "/chat/completions", json=CHAT, headers=pin)
        assert refused.status_code == 403 and error_of(refused)["code"] == "pool_pin_not_allowed"
        assert httpx.post(proxy.base_url + "/chat/completions", json=CHAT).status_code == 200
        # `auto` pins nothing; the header on a path that routes nothing is no pin either.
        auto = {"x-specroute-pool": "auto"}
        assert httpx.post(proxy.base_url + "/chat/completions", json=CHAT, headers=auto).status_code == 200
        assert httpx.get(proxy.url + "/health", headers=pin).status_code == 200
    with running_proxy(
        spec_urls=[spec.url], base_urls=[base.url], pool_pin="off", api_keys="sk-client", metrics_access="keys"
    ) as proxy:
        assert httpx.get(proxy.url + "/metrics", headers=pin | bearer("sk-client")).status_code == 200
        assert httpx.get(proxy.base_url + "/models", headers=pin | bearer("sk-client")).status_code == 200
    with running_proxy(
        spec_urls=[spec.url],
        base_urls=[base.url],
        pool_pin="operators",
        api_keys="sk-client",
        operator_api_keys="sk-operator",
    ) as proxy:
        refused = httpx.post(proxy.base_url + "/chat/completions", json=CHAT, headers=pin | bearer("sk-client"))
        assert refused.status_code == 403 and error_of(refused)["code"] == "operator_key_required"
        pinned = httpx.post(proxy.base_url + "/chat/completions", json=CHAT, headers=pin | bearer("sk-operator"))
        assert pinned.status_code == 200 and pinned.headers["x-specroute-pool"] == "base"
        assert pinned.headers["x-specroute-reason"] == "override"
        assert (
            httpx.post(proxy.base_url + "/chat/completions", json=CHAT, headers=bearer("sk-client")).status_code == 200
        )
        # `auto` is no pin (a client key may send it); /health and /ready stay open whatever it says.
        auto = {"x-specroute-pool": "AUTO"} | bearer("sk-client")
        assert httpx.post(proxy.base_url + "/chat/completions", json=CHAT, headers=auto).status_code == 200
        for probe in ("/health", "/ready"):
            assert httpx.get(proxy.url + probe, headers=pin).status_code == 200


def test_the_keys_file_is_reread_when_it_changes_and_a_broken_edit_keeps_the_old_keys(
    twin_pair, tmp_path: Path
) -> None:
    spec, base = twin_pair
    keys = tmp_path / "keys"
    keys.write_text("# team a\nsk-file-a\n\n")
    with running_proxy(spec_urls=[spec.url], base_urls=[base.url], api_keys_file=str(keys)) as proxy:

        def status(key: str) -> int:
            return httpx.post(proxy.base_url + "/chat/completions", json=CHAT, headers=bearer(key)).status_code

        assert status("sk-file-a") == 200 and status("# team a") == 401
        keys.write_text("sk-file-b-longer\n")
        wait_for(lambda: status("sk-file-b-longer") == 200, what="the new key accepted", timeout=10)
        assert status("sk-file-a") == 401
        keys.unlink()
        keys.mkdir()  # unreadable as a file: logged, the keys read before stay
        assert status("sk-file-b-longer") == 200 and status("sk-file-a") == 401


class RecordingOtlpSink:
    """An OTLP/HTTP receiver on 127.0.0.1 that keeps every export's bytes."""

    def __init__(self) -> None:
        received = self.received = []

        class Handler(BaseHTTPRequestHandler):
            disable_nagle_algorithm = True  # TCP_NODELAY, as every server in the project sets it

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                received.append(self.rfile.read(int(self.headers.get("content-length", "0"))))
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> RecordingOtlpSink:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_sighup_rereads_the_keys_file_and_no_key_reaches_logs_traces_config_or_errors(
    twin_pair, tmp_path: Path
) -> None:
    spec, _ = twin_pair
    keys = tmp_path / "keys"
    keys.write_text("sk-file-secret-AAAA\n")
    port = free_port()
    secrets = {
        "SPECROUTE_API_KEYS": "sk-inline-secret-1",
        "SPECROUTE_OPERATOR_API_KEYS": "sk-operator-secret-2",
        "SPECROUTE_SPEC_API_KEY": "sk-pool-secret-3",
        "SPECROUTE_RESPONSE_ID_SECRET": "response-ids-secret-5",
    }
    with FaultServer("echo") as echo, RecordingOtlpSink() as sink:
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("SPECROUTE_", "OTEL_"))}
        env = {
            **clean,
            **secrets,
            "SPECROUTE_API_KEYS_FILE": str(keys),
            "SPECROUTE_SPEC_URLS": spec.url,
            "SPECROUTE_BASE_URLS": echo.url,
            "SPECROUTE_PORT": str(port),
            "SPECROUTE_LOG_LEVEL": "debug",
            "OTEL_EXPORTER_OTLP_ENDPOINT": sink.url,
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy.cli", "serve"],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        url = f"http://127.0.0.1:{port}"
        bodies: list[str] = []
        try:

            def ready() -> bool:
                assert proc.poll() is None, proc.communicate()
                try:
                    return httpx.get(url + "/ready", timeout=2).status_code == 200
                except httpx.TransportError:
                    return False

            wait_for(ready, what="specroute serve ready", timeout=60)

            def post(key: str, **headers: str) -> httpx.Response:
                response = httpx.post(
                    url + "/v1/chat/completions", json=CHAT, headers=bearer(key) | headers, timeout=30
                )
                bodies.append(response.text)
                return response

            assert post("sk-file-secret-AAAA").status_code == 200
            assert post("sk-inline-secret-1", **{"x-specroute-pool": "base"}).status_code == 200  # to the echo
            assert post("sk-wrong-secret-4").status_code == 401
            bodies.append(httpx.get(url + "/v1/specroute/state", headers=bearer("sk-operator-secret-2")).text)
            bodies.append(httpx.get(url + "/metrics").text)
            # Same size, same modification time: only SIGHUP can tell the proxy.
            stat = keys.stat()
            keys.write_text("sk-file-secret-BBBB\n")
            os.utime(keys, ns=(stat.st_atime_ns, stat.st_mtime_ns))
            proc.send_signal(signal.SIGHUP)
            wait_for(lambda: post("sk-file-secret-BBBB").status_code == 200, what="SIGHUP reload", timeout=10)
            assert post("sk-file-secret-AAAA").status_code == 401
            proc.send_signal(signal.SIGTERM)  # the export process sends what it holds before exit
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        config = subprocess.run(
            [sys.executable, "-m", "proxy.cli", "config"],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    upstream_auth = [r.headers.get("authorization") for r in echo.requests if r.method == "POST"]
    # The pinned request reached base, and so may unpinned ones (the policy routes them: a spec
    # reading gone stale on a loaded machine sends them to base): none carries a key, as base
    # has no pool key and the client's never goes on.
    assert upstream_auth and set(upstream_auth) == {None}
    assert '"status":200' in out.replace(" ", "") and sink.received, (
        "nothing logged or traced: the check below would be empty"
    )
    assert '"outcome":"auth_refused","reason":"invalid"' in out.replace(" ", "")  # logged, its key not
    everything = {
        "stdout": out,
        "stderr": err,
        "config": config,
        "responses": "\n".join(bodies),
        "traces": b"".join(sink.received).decode("latin-1"),
    }
    for where, text in everything.items():
        for secret in ("secret-AAAA", "secret-BBBB", "secret-1", "secret-2", "secret-3", "secret-4", "secret-5"):
            assert secret not in text, f"{secret} found in {where}"


@pytest.mark.parametrize(
    ("host", "keys", "warned"),
    [
        ("0.0.0.0", None, True),
        ("10.1.2.3", None, True),
        ("gpu-gateway.internal", None, True),
        ("127.0.0.1", None, False),
        ("::1", None, False),
        ("localhost", None, False),
        ("0.0.0.0", "sk-a", False),
    ],
)
def test_start_up_warns_once_when_open_beyond_loopback(host: str, keys: str | None, warned: bool, caplog) -> None:
    from proxy.auth import Access, warn_if_open
    from proxy.settings import load_settings

    settings = load_settings(host=host, api_keys=keys, base_urls=["http://127.0.0.1:9"])
    with caplog.at_level("WARNING", logger="specroute"):
        warn_if_open(settings, Access.from_settings(settings))
    assert len([r for r in caplog.records if "SPECROUTE_API_KEYS" in r.getMessage()]) == (1 if warned else 0)


@pytest.mark.parametrize("secret", [None, "a-secret-of-24-characters"])
def test_keys_without_the_response_id_secret_are_warned_about(secret: str | None, caplog) -> None:
    from proxy.auth import Access, warn_if_open
    from proxy.settings import load_settings

    settings = load_settings(api_keys="sk-a", response_id_secret=secret, base_urls=["http://127.0.0.1:9"])
    with caplog.at_level("WARNING", logger="specroute"):
        warn_if_open(settings, Access.from_settings(settings))
    said = [r for r in caplog.records if "SPECROUTE_RESPONSE_ID_SECRET" in r.getMessage()]
    assert len(said) == (1 if secret is None else 0)


def test_a_key_may_hold_at_most_its_share_of_open_requests() -> None:
    # Streams that stay open until their clients leave (2 chunks, then silence): a twin's
    # stream, fast and small enough for the socket buffers, could end before the third request
    # came on a busy machine (it did once in a fresh clone's compiled run).
    stream = {"model": "m", "messages": MESSAGES, "max_tokens": 20000, "stream": True}

    def opened(key: str) -> httpx.Response:
        return httpx.stream("POST", proxy.base_url + "/chat/completions", json=stream, headers=bearer(key), timeout=30)

    def status(key: str) -> int:
        with opened(key) as response:
            return response.status_code

    with (
        FaultServer("stall:2") as upstream,
        running_proxy(spec_urls=[upstream.url], policy="spec", api_keys="sk-a,sk-b", key_max_concurrency=2) as proxy,
    ):
        streams = [opened("sk-a") for _ in range(2)]
        try:
            assert all(s.__enter__().status_code == 200 for s in streams)
            third = httpx.post(proxy.base_url + "/chat/completions", json=CHAT, headers=bearer("sk-a"))
            assert third.status_code == 429 and third.json()["error"]["code"] == "key_concurrency_limit"
            assert third.headers["retry-after"] == "1"
            assert status("sk-b") == 200  # another key's share is its own
        finally:
            for s in streams:
                s.__exit__(None, None, None)
        wait_for(lambda: proxy.app.key_limits.open == {}, what="the key's requests released")
        assert status("sk-a") == 200
        assert 'specroute_auth_refused_total{reason="key_concurrency"} 1.0' in httpx.get(proxy.url + "/metrics").text


def read_response(sock: socket.socket) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """One response with a content-length from a raw socket: its headers (lower-cased names), its body."""
    data = b""
    while b"\r\n\r\n" not in data:
        part = sock.recv(65536)
        assert part, data
        data += part
    head, body = data.split(b"\r\n\r\n", 1)
    headers = [tuple(line.split(b": ", 1)) for line in head.split(b"\r\n")[1:]]
    pairs = [(name.lower(), value) for name, value in headers]
    length = int(dict(pairs)[b"content-length"])
    while len(body) < length:
        part = sock.recv(65536)
        assert part, body
        body += part
    return pairs, body


def test_a_keys_429_says_one_thing_of_its_connection() -> None:
    # Its refusal comes before the body is read: a body not all in yet closes the connection
    # (the rest would be read as a request), and uvicorn's `keep-alive: timeout=75` said the
    # opposite beside `connection: close`; a body already in leaves the connection open.
    stream = {"model": "m", "messages": MESSAGES, "max_tokens": 20000, "stream": True}
    body = json.dumps(CHAT).encode()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: p\r\nauthorization: Bearer sk-a\r\ncontent-type: application/json\r\n"
    with (
        FaultServer("stall:2") as upstream,
        running_proxy(spec_urls=[upstream.url], policy="spec", api_keys="sk-a", key_max_concurrency=1) as proxy,
        httpx.stream(
            "POST", proxy.base_url + "/chat/completions", json=stream, headers=bearer("sk-a"), timeout=30
        ) as held,
    ):
        assert held.status_code == 200
        for request, closes in (
            (head + b"expect: 100-continue\r\ncontent-length: %d\r\n\r\n" % len(body), True),
            (head + b"content-length: %d\r\n\r\n%s" % (len(body), body[:5]), True),
            (head + b"content-length: %d\r\n\r\n%s" % (len(body), body), False),
        ):
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
                sock.sendall(request)
                headers, answer = read_response(sock)
                assert json.loads(answer)["error"]["code"] == "key_concurrency_limit"
                connection = [value for name, value in headers if name == b"connection"]
                keep_alive = [value for name, value in headers if name == b"keep-alive"]
                if closes:
                    assert (connection, keep_alive) == ([b"close"], []), headers
                    assert sock.recv(65536) == b""  # and it does close
                else:
                    assert (connection, keep_alive) == ([], [b"timeout=75"]), headers
                    sock.sendall(b"GET /health HTTP/1.1\r\nhost: p\r\n\r\n")  # and it stays open
                    assert read_response(sock)[1]


def test_a_keys_file_saved_with_a_byte_order_mark_keeps_its_first_key(tmp_path: Path, caplog) -> None:
    """Windows editors open a UTF-8 file with a byte order mark: it stuck to the first key, which
    no client could send, while the log said every key was read. Lines no client could send as
    a key are left out, and the log says so."""
    from proxy.auth import KeyRing, Role

    keys = tmp_path / "keys"
    keys.write_bytes("\ufeffsk-first-key\nsk-second-key\nsk with space\nsk-caf\u00e9\n".encode())
    ring = KeyRing([], [], str(keys))
    assert ring.role_of("sk-first-key")[0] is Role.CLIENT
    assert ring.role_of("sk-second-key")[0] is Role.CLIENT
    assert any("2 lines left out" in r.getMessage() for r in caplog.records)


def test_with_keys_a_session_name_belongs_to_the_key_that_named_it(keyed: RunningProxy) -> None:
    """A review's finding: `user="alice"` from two keys was one session, so a client with
    another key could move the pointer of a conversation it did not own."""
    state = bearer("sk-operator")

    def sessions() -> int:
        return httpx.get(keyed.url + "/v1/specroute/state", headers=state, timeout=5).json()["prefix"]["sessions"]

    chat = {**CHAT, "user": "alice"}
    for key in ("sk-good-1", "sk-good-1", "sk-good-2"):
        answer = httpx.post(keyed.url + "/v1/chat/completions", json=chat, headers=bearer(key), timeout=30)
        assert answer.status_code == 200
    assert sessions() == 2  # the first key's "alice" once, the second key's its own


def cached_tokens(proxy: RunningProxy, key: str, **extra) -> int:
    body = {**CHAT, "messages": [{"role": "user", "content": SECRET_PROMPT}], "max_tokens": 1, **extra}
    answer = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers=bearer(key), timeout=30)
    assert answer.status_code == 200, answer.text
    return (answer.json()["usage"]["prompt_tokens_details"] or {"cached_tokens": 0})["cached_tokens"]


SECRET_PROMPT = "CONFIDENTIAL contract 7731 " + "lorem ipsum dolor " * 400


def test_with_keys_a_prompt_is_cached_for_its_own_key_alone() -> None:
    """A review's probe: Bob sending Alice's secret prompt was routed to the instance holding it
    and told by `cached_tokens` that it had been sent (six times in six). Each key's completions
    now go with its own cache_salt (SGLang and vLLM keep salted caches apart); the proxy's
    prefix index keys blocks by it too."""
    args = ("--enable-cache-report", "--output-len", "fixed:1")
    with twins(TwinSpec("spec", seed=1, args=args), TwinSpec("base", seed=2, args=args)) as (spec, base):
        keys = {"spec_urls": [spec.url], "base_urls": [base.url], "api_keys": "sk-alice-1,sk-bob-2"}
        with running_proxy(**keys, operator_api_keys="sk-operator") as proxy:
            assert cached_tokens(proxy, "sk-alice-1") <= 1
            assert cached_tokens(proxy, "sk-alice-1") > 1000  # her own cache: the salt is the same each time
            assert cached_tokens(proxy, "sk-bob-2") <= 1
            log = httpx.get(proxy.url + "/v1/specroute/state", headers=bearer("sk-operator"), timeout=5).json()
            assert log["decisions"][-1]["cached"] == {}  # nor did routing credit Bob with Alice's cache
            assert cached_tokens(proxy, "sk-bob-2", cache_salt="mine") <= 1  # a salt of his own: apart again
            assert cached_tokens(proxy, "sk-bob-2", cache_salt="mine") > 1000
            assert cached_tokens(proxy, "sk-bob-2", cache_salt=None) > 1000  # null: his key's salt
            wrong = httpx.post(
                proxy.url + "/v1/chat/completions", json={**CHAT, "cache_salt": 7}, headers=bearer("sk-bob-2")
            )
            assert wrong.status_code == 400 and error_of(wrong)["param"] == "cache_salt"
        with running_proxy(**keys, cache_scope="shared") as proxy:  # clients that trust each other
            assert cached_tokens(proxy, "sk-alice-1") <= 1  # unsalted: not the salted runs' cache
            assert cached_tokens(proxy, "sk-bob-2") > 1000


def test_only_an_operator_reads_the_decisions_per_request_fields(twin_pair) -> None:
    """A review's probe: with SPECROUTE_STATE_ACCESS=keys, any client read every request's id,
    prompt size and workload key, the keyed hash of its system prompt, and confirmed a guessed
    prompt by sending it and comparing its own request's key."""
    spec, base = twin_pair
    system = {"role": "system", "content": "You are AcmeBank's fraud assistant. Escalation code 7731."}
    chat = {**CHAT, "messages": [system, *MESSAGES]}
    with running_proxy(
        spec_urls=[spec.url],
        base_urls=[base.url],
        api_keys="sk-alice-1,sk-bob-2",
        operator_api_keys="sk-operator",
        state_access="keys",
    ) as proxy:
        sent = httpx.post(proxy.url + "/v1/chat/completions", json=chat, headers=bearer("sk-alice-1"), timeout=30)
        assert sent.status_code == 200

        def decisions(key: str) -> list[dict]:
            state = httpx.get(proxy.url + "/v1/specroute/state", headers=bearer(key), timeout=5)
            assert state.status_code == 200
            return state.json()["decisions"]

        (full,) = decisions("sk-operator")
        assert full["request_id"] == sent.headers["x-request-id"] and full["workload"] and full["prompt_tokens"]
        (public,) = decisions("sk-bob-2")
        assert public == {name: full[name] for name in ("at", "ts", "pool", "reason", "class")}
