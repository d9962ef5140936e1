"""Client connections past the simple cases: pipelined requests keep their deadlines apart, a
response that starts before its request's body is all in closes the connection, and every
hop-by-hop header RFC 9110 7.6.1 names stays on its hop both ways. Over real sockets."""

from __future__ import annotations

import gc
import json
import socket
import struct
import time
import weakref

import httpx
from proxy_faults import FaultServer
from proxy_harness import RunningProxy, read_until_closed, running_proxy, wait_for

DEADLINE_S = 0.5
WAIT_S = 10.0
"""How long a test waits for the proxy to act: far above the deadlines, never reached when it works."""
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}
GUARDED = {"header_timeout_s": DEADLINE_S, "body_timeout_s": 5.0, "keep_alive_timeout_s": 5.0, "max_header_bytes": 8192}


def connect(proxy: RunningProxy) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=WAIT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_responses(sock: socket.socket, count: int) -> list[tuple[bytes, bytes]]:
    """`count` whole responses (head, body) framed by content-length, or fewer if the proxy closed."""
    data, responses = b"", []
    while len(responses) < count:
        while b"\r\n\r\n" in data:
            head, rest = data.split(b"\r\n\r\n", 1)
            length = next(
                (
                    int(line.split(b":", 1)[1])
                    for line in head.lower().split(b"\r\n")
                    if line.startswith(b"content-length:")
                ),
                0,
            )
            if len(rest) < length:
                break
            responses.append((head, rest[:length]))
            data = rest[length:]
        if len(responses) >= count:
            break
        try:
            part = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not part:
            break
        data += part
    return responses


def post(body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n%s\r\n" % (len(body), extra)
    )


def test_a_pipelined_request_is_not_held_to_the_header_deadline_while_it_runs() -> None:
    # The second request's headers are in before the first response ends: the header deadline
    # must not start again for it (it used to: a 408 at 0.5 s in place of the upstream's answer).
    with (
        FaultServer("hang") as upstream,
        running_proxy(spec_urls=[upstream.url], policy="spec", first_token_timeout_s=2.0, **GUARDED) as proxy,
    ):
        body = json.dumps({**CHAT, "stream": True}).encode()
        with connect(proxy) as sock:
            started = time.monotonic()
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + post(body) + body)
            responses = read_responses(sock, 2)
            took = time.monotonic() - started
    assert [head.split(b" ")[1] for head, _ in responses] == [b"200", b"504"], responses
    assert b"first_token_timeout" in responses[1][1] and took >= 2.0


def test_a_pipelined_body_is_not_counted_as_headers() -> None:
    # The rest of the second request's body comes after the first response: it is body, not
    # 20 KB of headers over an 8 KiB limit (it used to get a 431).
    with FaultServer("echo") as upstream, running_proxy(spec_urls=[upstream.url], policy="spec", **GUARDED) as proxy:
        body = json.dumps({**CHAT, "user": "u" * 20_000}).encode()
        with connect(proxy) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + post(body) + body[:10])
            first = read_responses(sock, 1)
            sock.sendall(body[10:])
            second = read_responses(sock, 1)
    assert first and first[0][0].startswith(b"HTTP/1.1 200 ")
    assert second and second[0][0].startswith(b"HTTP/1.1 200 "), second
    assert len([r for r in upstream.requests if r.method == "POST"][0].body) == len(body)


def test_a_refusal_before_the_body_is_in_closes_the_connection() -> None:
    # 413 after 64 KiB of a declared 10 MB: the rest of the body must not be read as requests,
    # nor answered again; the client is told the connection closes.
    with (
        FaultServer("echo") as upstream,
        running_proxy(spec_urls=[upstream.url], policy="spec", max_body_bytes=65536, **GUARDED) as proxy,
    ):
        with connect(proxy) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                b"content-length: 10000000\r\n\r\n"
            )
            try:
                for _ in range(4):
                    sock.sendall(b"a" * 65536)
            except (BrokenPipeError, ConnectionResetError):
                pass
            data, _ = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 413 ") and b"\r\nconnection: close\r\n" in data.lower(), data[:300]
    assert data.count(b"HTTP/1.1 ") == 1, data


def test_every_hop_by_hop_header_stays_on_its_hop() -> None:
    with FaultServer("hopheaders") as upstream, running_proxy(spec_urls=[upstream.url], policy="spec") as proxy:
        body = json.dumps(CHAT).encode()
        with connect(proxy) as sock:
            sock.sendall(
                post(
                    body,
                    b"proxy-authenticate: Basic realm=x\r\nkeep-alive: timeout=5\r\n"
                    b"trailer: x-sum\r\nupgrade: websocket\r\nx-keep: yes\r\n",
                )
                + body
            )
            responses = read_responses(sock, 1)
    assert responses, "no answer"
    head = responses[0][0].lower().split(b"\r\n")
    names = {line.split(b":", 1)[0] for line in head[1:]}
    hop = {
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"keep-alive",
        b"x-internal-hop",
    }
    # The proxy's own Keep-Alive is about its own hop (its keep-alive timeout), never the upstream's.
    assert [line for line in head if line.startswith(b"keep-alive:")] == [b"keep-alive: timeout=75"]
    assert not names - {b"keep-alive"} & hop, names & hop
    sent = [r for r in upstream.requests if r.method == "POST"][0].headers
    assert not set(sent) & {name.decode() for name in hop}, set(sent) & {name.decode() for name in hop}
    assert sent["x-keep"] == "yes"


def test_behind_a_trusted_proxy_forwarded_also_ends_with_the_peer() -> None:
    # In append mode the front proxy is trusted to append; whatever the client wrote comes first,
    # and the address this proxy saw is last in both forms, so the upstream reads the real one.
    with (
        FaultServer("echo") as upstream,
        running_proxy(spec_urls=[upstream.url], policy="spec", forwarded_headers="append") as proxy,
    ):
        body = json.dumps(CHAT).encode()
        with connect(proxy) as sock:
            sock.sendall(post(body, b"forwarded: for=6.6.6.6\r\nx-forwarded-for: 6.6.6.6\r\n") + body)
            assert read_responses(sock, 1)
    sent = [r for r in upstream.requests if r.method == "POST"][0].headers
    assert sent["x-forwarded-for"] == "6.6.6.6, 127.0.0.1"
    assert sent["forwarded"] == "for=6.6.6.6, for=127.0.0.1"


def test_three_large_bodies_that_stall_are_cut_and_others_are_served(twin_pair) -> None:
    spec, base = twin_pair
    with running_proxy(
        spec_urls=[spec.url], base_urls=[base.url], header_timeout_s=DEADLINE_S, body_timeout_s=1.0
    ) as proxy:
        socks = [connect(proxy) for _ in range(3)]
        try:
            for sock in socks:  # 8 MB of a declared 15 MB each, then silence
                sock.sendall(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                    b"content-length: 15000000\r\n\r\n" + b" " * 8_000_000
                )
            with connect(proxy) as other:
                other.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert read_responses(other, 1)[0][0].startswith(b"HTTP/1.1 200 ")
            answers = [read_until_closed(sock)[0] for sock in socks]
        finally:
            for sock in socks:
                sock.close()
        assert all(a.startswith(b"HTTP/1.1 408 ") and b'"code":"body_timeout"' in a for a in answers), answers
        # The requests that held the bodies are gone with them (their bytes go with the request).
        wait_for(lambda: proxy.app.completions.open_requests == 0, what="the stalled requests to end")


def test_an_http_1_0_stream_ends_where_the_connection_closes_not_in_chunks() -> None:
    """HTTP/1.0 has no chunked coding (RFC 9112 6.1): a stream to a 1.0 client is its events as
    they are, ended by the close (uvicorn chunked it: the client read chunk sizes amid its SSE)."""
    body = json.dumps({**CHAT, "stream": True}).encode()
    with FaultServer("split:3") as upstream, running_proxy(spec_urls=[upstream.url], policy="spec") as proxy:
        heads = {}
        for version in (b"1.0", b"1.1"):
            with connect(proxy) as sock:
                sock.sendall(
                    b"POST /v1/chat/completions HTTP/%s\r\nHost: x\r\ncontent-type: application/json\r\n"
                    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (version, len(body), body)
                )
                data, _ = read_until_closed(sock)
            head, rest = data.split(b"\r\n\r\n", 1)
            heads[version] = (head.lower().split(b"\r\n"), rest)
    lines, rest = heads[b"1.0"]
    assert lines[0].startswith(b"http/1.1 200") and b"transfer-encoding: chunked" not in lines
    assert b"connection: close" in lines
    assert rest.startswith(b"data: {") and rest.endswith(b"data: [DONE]\n\n"), rest[:80]
    lines, rest = heads[b"1.1"]  # HTTP/1.1 keeps its chunks
    assert b"transfer-encoding: chunked" in lines and rest.endswith(b"0\r\n\r\n")


def test_a_response_on_a_connection_that_closes_does_not_also_offer_keep_alive() -> None:
    # uvicorn adds `connection: close` and kept the proxy's `keep-alive: timeout=N` beside it.
    with running_proxy(base_urls=["http://127.0.0.1:9"], **GUARDED) as proxy:
        for request, closes in (
            (b"GET /health HTTP/1.1\r\nHost: x\r\nconnection: close\r\n\r\n", True),
            (b"GET /health HTTP/1.0\r\n\r\n", True),
            (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", False),
        ):
            with connect(proxy) as sock:
                sock.sendall(request)
                [(head, _)] = read_responses(sock, 1)
            lines = head.lower().split(b"\r\n")
            said = [line for line in lines if line.startswith((b"connection:", b"keep-alive:"))]
            assert said == ([b"connection: close"] if closes else [b"keep-alive: timeout=5"]), (request, head)


def test_a_connection_reset_while_idle_is_let_go_at_once() -> None:
    # uvicorn cancels an idle connection's keep-alive timer only when it closes cleanly: one its
    # client reset (a client gone mid-stream after the last chunk went out, the soak's leavers)
    # stayed held by the timer, its protocol and last request with it, until the timeout.
    with running_proxy(base_urls=["http://127.0.0.1:9"], **{**GUARDED, "keep_alive_timeout_s": 3600.0}) as proxy:
        sock = connect(proxy)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        [(head, _)] = read_responses(sock, 1)
        assert head.startswith(b"HTTP/1.1 200")
        [protocol] = wait_for(lambda: list(proxy.server.server_state.connections), "the connection")
        held = weakref.ref(protocol)
        del protocol
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        sock.close()
        wait_for(
            lambda: gc.collect() >= 0 and held() is None, "the reset connection's protocol to be freed", timeout=WAIT_S
        )


def chunked(body: bytes) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n" % (len(body), body)
    )


def test_a_chunked_bodys_trailer_fields_are_no_request_headers_and_are_bounded() -> None:
    """uvicorn appended a chunked body's trailer fields to the request's headers: a client could
    set routing headers after the proxy's checks and past its header limit, and one field grew
    the proxy by hundreds of MB (a review: 188 -> 733 MB, a 200 to the request). Dropped now, and
    refused (431) past the header limit, whether many fields or one long one."""
    with FaultServer("echo") as upstream, running_proxy(spec_urls=[upstream.url], **GUARDED) as proxy:
        body = json.dumps(CHAT).encode()
        with connect(proxy) as sock:
            sock.sendall(chunked(body) + b"x-specroute-pool: bogus\r\nx-request-id: from-a-trailer\r\n\r\n")
            ((head, _),) = read_responses(sock, 1)
        assert head.startswith(b"HTTP/1.1 200 "), head  # the pool header was not read: no 400
        assert b"from-a-trailer" not in head.lower()
        # Many fields; one field of 1 MB, more than one read (an unread rest is not counted)
        for trailers in (b"x-t: " + b"a" * 500 + b"\r\n",) * 40, (b"x-t: ", *(b"a" * 100_000,) * 10):
            with connect(proxy) as sock:
                sock.sendall(chunked(body))
                try:
                    for piece in trailers:
                        sock.sendall(piece)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # refused part-way
                answer, _ = read_until_closed(sock)
            assert answer.startswith(b"HTTP/1.1 431 ") and b"trailers_too_large" in answer, answer[:200]
        assert len([r for r in upstream.requests if r.method == "POST"]) == 1


def test_a_websocket_upgrade_is_plain_http_and_a_clients_bad_requests_write_no_log_lines(capfd) -> None:
    """uvicorn took `Upgrade: websocket` to its WebSocket handler, which wrote two INFO lines with
    the client's address per attempt (a review: 701 lines in 0.2 s), and warned of each request
    its parser refused: a client could write the proxy's log at will. The upgrade is not taken
    (the request is served as plain HTTP) and a refused request is answered, not logged."""
    with running_proxy(**GUARDED) as proxy:
        capfd.readouterr()
        with connect(proxy) as sock:
            sock.sendall(
                b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
            )
            ((head, body),) = read_responses(sock, 1)
        assert head.startswith(b"HTTP/1.1 200 ") and b"upgrade" not in head.lower(), head
        for _ in range(20):
            with connect(proxy) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nbad header\r\n\r\n")
                answer, _ = read_until_closed(sock)
            assert answer.startswith(b"HTTP/1.1 400 ") and b'"code":"invalid_http"' in answer, answer
    logged = capfd.readouterr().err
    assert "WebSocket" not in logged and "Invalid HTTP request" not in logged and "127.0.0.1:" not in logged, logged


def test_a_chunked_body_must_come_in_chunks_of_some_size() -> None:
    """The parser calls back per chunk: 1 MB sent a byte a chunk cost the event loop 0.6-0.85 s
    (a review). Past 1,024 chunks they must average 2 bytes: a byte a chunk is refused within its
    first few KB; an httpx upload of a JSON encoder's pieces (about 5 bytes each: a review saw a
    first rule of 256 refuse it) passes, as does a body written in writes that end just after
    a chunk's size line (a review saw the first trailer count take those reads for trailers)."""
    with FaultServer("echo") as upstream, running_proxy(spec_urls=[upstream.url], **GUARDED) as proxy:
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        body = json.dumps({**CHAT, "user": "u" * 1_000_000}).encode()
        with connect(proxy) as sock:
            sock.sendall(head)
            try:
                for start in range(0, len(body), 4096):
                    sock.sendall(b"".join(b"1\r\n%c\r\n" % byte for byte in body[start : start + 4096]))
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused part-way
            answer, _ = read_until_closed(sock)
        assert answer.startswith(b"HTTP/1.1 400 ") and b"chunks_too_small" in answer, answer[:300]
        assert not [r for r in upstream.requests if r.method == "POST"]

        pieces = {**CHAT, "messages": [{"role": "user", "content": f"line {i}"} for i in range(300)]}
        sent = httpx.post(
            proxy.base_url + "/chat/completions",
            content=(piece.encode() for piece in json.JSONEncoder().iterencode(pieces)),
            headers={"content-type": "application/json"},
            timeout=WAIT_S,
        )
        assert sent.status_code == 200, sent.text
        assert json.loads([r for r in upstream.requests if r.method == "POST"][-1].body) == pieces

        # 16 KB chunks, each write ending just after the next chunk's size line.
        size = 16384
        parts = [body[i : i + size] for i in range(0, len(body), size)]
        with connect(proxy) as sock:
            sock.sendall(head + b"%x\r\n" % len(parts[0]))
            for part, following in zip(parts, [*parts[1:], b""], strict=True):
                sock.sendall(part + b"\r\n" + b"%x\r\n" % len(following) + (b"\r\n" if not following else b""))
            ((answered, _),) = read_responses(sock, 1)
        assert answered.startswith(b"HTTP/1.1 200 "), answered
        assert [r for r in upstream.requests if r.method == "POST"][-1].body == body
