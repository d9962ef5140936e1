"""A completion request's body: parsed with its work bounded, the fields routing reads typed.

SPECROUTE_MAX_BODY_BYTES bounds the bytes; these bound the work. A body's objects and arrays
are counted before it is parsed (every one opens with a bracket; brackets inside strings only
make the count err high), so 16 MiB of `{}` is refused in milliseconds instead of becoming
millions of Python objects. Values are bounded the same way, by the commas and colons between
them, counted outside strings (so prose in a prompt costs nothing): millions of numbers or
unique keys need few brackets. A body over 256 KiB is measured and parsed in a worker process:
orjson holds the GIL while it parses, so a worker thread would not spare the loop (a 15 MiB
prompt held it ~18 ms); only the routing features and the small fields cross back (orjson also
refuses nesting deeper than 1,024).
The fields the proxy acts on are checked as OpenAI checks them: a `"stream": "true"` would
stream upstream (SGLang's pydantic accepts it) while the proxy logged, timed and routed it as
not streamed.

What routing needs of the prompt, besides its size, is its block hashes (fleet/blocks.py: what
the prefix index keys on) and the session it names (a hash of the name: proxy.routing.session_of).
A small body's blocks are hashed lazily on the loop, only as far as the decision and the
dispatch need them (`PromptBlocks`, at most a few hundred microseconds for 256 KiB); a body
parsed in the worker process is hashed there in full, and only the tuple of hashes comes back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import orjson

from fleet.blocks import BLOCK_TOKENS, PromptBlocks
from fleet.features import responses_as_chat
from fleet.types import Features
from proxy.cache_salt import salted
from proxy.errors import ProxyError
from proxy.routing import features_of, session_of
from proxy.scan import with_first_member

log = logging.getLogger("specroute")
T = TypeVar("T")

MAX_JSON_DEPTH = 128
"""Deepest nesting of JSON objects and arrays a body may have. orjson parses 1,024 levels, but
Python servers do not: SGLang's and vLLM's parsers and validators recurse, and about 1,000 levels
made the twin (FastAPI, as SGLang) fail with a 500 on every server the request was sent to. No
request needs more than a few dozen (OpenAI bounds a JSON schema's nesting at 10)."""
OFF_LOOP_BYTES = 256 * 1024
"""Bodies larger than this are parsed off the event loop (small ones: cheaper on it)."""
OFF_LOOP_ITEMS = 2048
"""Bodies with more JSON objects and arrays than this are parsed off the event loop too, however
small: what routing reads of each message or input item is Python work, about a microsecond
each (2,000: 2-3 ms), and 87,000 empty messages in 256 KB held the loop 125-450 ms a body (a
review: another client's call took 1.2-1.9 s while one client sent eight a second)."""
SCAN_BYTES = 64 * 1024
"""Separators outside strings are counted this many bytes at a time (a few hundred microseconds
each), so the counting thread hands the GIL back to the loop between pieces."""
TYPED_FIELDS: dict[str, tuple[type | tuple[type, ...], str]] = {
    "model": (str, "a string"),
    "stream": (bool, "a boolean"),
    "max_tokens": (int, "an integer"),
    "max_completion_tokens": (int, "an integer"),
    "n": (int, "an integer"),
    "ignore_eos": (bool, "a boolean"),
    "max_output_tokens": (int, "an integer"),
    "previous_response_id": (str, "a string"),
    "store": (bool, "a boolean"),
}


def parse_object(body: bytes) -> dict[str, Any]:
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ProxyError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise ProxyError(400, "request body must be a JSON object", code="invalid_json")
    return payload


NOT_NULL = frozenset({"model"})
"""Typed fields a client may leave out but not send as null (OpenAI's `model` is a string; the
others are nullable there)."""


def check_fields(payload: dict[str, Any]) -> None:
    for name, (kind, what) in TYPED_FIELDS.items():
        value = payload.get(name)
        if value is None:
            if name in NOT_NULL and name in payload:
                raise ProxyError(400, f"'{name}' must be {what}, not null", param=name, code="invalid_type")
            continue
        if kind is int and isinstance(value, float) and value.is_integer():
            continue  # 2.0 is an integer in JSON Schema, and SGLang's and vLLM's parsers take it
        wrong = not isinstance(value, kind) or (kind is int and isinstance(value, bool))
        if wrong:
            got = type(value).__name__ if not isinstance(value, str) else "a string"
            raise ProxyError(400, f"'{name}' must be {what}, not {got}", param=name, code="invalid_type")


NULL_MEANS_UNSET = ("stream", "stream_options")
"""Fields OpenAI reads as not set when null, which SGLang refuses as null (its `stream: bool =
False` answers 400): a body with one is forwarded without it (`Parsed.body`)."""


def without_null_members(payload: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes | None]:
    """The payload less its `NULL_MEANS_UNSET` members that are null, and the body to forward
    then (None: nothing to drop, the body goes as it came). The body is parsed again with the
    standard library and serialised without them: orjson reads an integer past 64 bits as a
    float, which would change a value the client sent; finding the member in the raw bytes
    instead is a scan a hostile body can make quadratic. Runs where the body was parsed (in
    the worker process for a large one), in linear time."""
    unset = [name for name in NULL_MEANS_UNSET if name in payload and payload[name] is None]
    if not unset:
        return payload, None
    exact = json.loads(body)
    for name in unset:
        del exact[name]
    forward = json.dumps(exact, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    return {name: value for name, value in payload.items() if name not in unset}, forward


def with_key_salt(payload: dict[str, Any], body: bytes, salt: str) -> tuple[dict[str, Any], bytes]:
    """The payload and the body to forward with `cache_salt` set to the key's `salt`, or to it
    combined with the client's own (proxy/cache_salt.py). A body without the member gets it put
    first (nothing re-encoded); one naming it (a null too: the last of two members wins) is
    parsed again with the standard library and serialised with the salt in its place, as
    `without_null_members` does."""
    own = payload.get("cache_salt")
    if own is not None and not isinstance(own, str):
        got = type(own).__name__
        raise ProxyError(400, f"'cache_salt' must be a string, not {got}", param="cache_salt", code="invalid_type")
    combined = salted(salt, own)
    if "cache_salt" not in payload:
        forward = with_first_member(body, b'"cache_salt":"' + combined.encode("ascii") + b'"')
    else:
        exact = json.loads(body)
        exact["cache_salt"] = combined
        forward = json.dumps(exact, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    return {**payload, "cache_salt": combined}, forward


NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
AS_SQUARE = bytes.maketrans(b"{}", b"[]")


def nested_deeper(body: bytes, limit: int) -> bool:
    """Whether objects and arrays nest more than `limit` levels in `body`, valid JSON (so its
    brackets pair up), read on its bytes: the brackets outside strings, as one kind, lose their
    innermost pairs once per level, at C speed (a walk of the parsed objects took 100 ms on the
    loop for 85,000 `[]` in 255 KB)."""
    unescaped = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = b"".join(unescaped.split(b'"')[0::2]).translate(AS_SQUARE, NOT_BRACKETS)
    for _ in range(limit):
        if not brackets:
            return False
        brackets = brackets.replace(b"[]", b"")
    return bool(brackets)


def separators_outside_strings(body: bytes, limit: int) -> int:
    """Commas and colons outside JSON strings, counted until past `limit` (then any count above it).

    Escapes are removed first (an escaped backslash, then an escaped quote), so every quote left
    opens or closes a string; pieces are cut after a run of backslashes so no escape is split.
    """
    count = 0
    inside = False
    start = 0
    while start < len(body) and count <= limit:
        end = min(start + SCAN_BYTES, len(body))
        while end < len(body) and body[end - 1] == 0x5C:  # a backslash
            end += 1
        piece = body[start:end].replace(b"\\\\", b"").replace(b'\\"', b"")
        parts = piece.split(b'"')
        outside = parts[1::2] if inside else parts[0::2]
        count += sum(part.count(b",") + part.count(b":") for part in outside)
        if len(parts) % 2 == 0:  # an odd number of quotes: the piece ends on the other side
            inside = not inside
        start = end
    return count


@dataclass(frozen=True, slots=True)
class Given:
    """What the request's headers and the prefix index add to the reading of its body."""

    request_class: str | None = None
    workload: str | None = None
    """The client's workload key (x-specroute-workload), else the features derive one."""
    session: str | None = None
    """The session name of x-specroute-session (validated), else the body's fields name one."""
    block_tokens: int = BLOCK_TOKENS
    """The prefix index's block size."""
    max_blocks: int | None = None
    """The most blocks worth hashing (what the index can hold for one instance)."""
    hash_key: bytes = b""
    """The key of a derived workload key's system-prompt hash (`Router.hash_key`)."""
    responses: bool = False
    """A Responses API body (`input`, `instructions`): read as the chat body it amounts to
    (`Parsed.payload`)."""
    owner: bytes | None = None
    """The client's API key as the proxy knows it (a digest; None without keys): its session
    names are its own (`session_key`)."""
    cache_salt: str | None = None
    """The client key's cache salt (proxy/cache_salt.py; None: the body's own, if any, goes as
    sent): set on the forwarded body, and so in the header its blocks are keyed by."""


@dataclass(frozen=True, slots=True)
class Parsed:
    """A request body as routing reads it."""

    payload: dict[str, Any]
    """The parsed body (without its prompt when parsed in the worker process); a Responses body
    with the fields of the chat it amounts to added (`fleet.features.responses_as_chat`)."""
    features: Features
    blocks: Sequence[int]
    """Its prompt's chained block hashes: `PromptBlocks` hashed as they are read, or a tuple
    computed off the loop; empty when it has no single prompt or one shorter than a block."""
    session: str | None
    """The session key (a hash of the name, never the name), if the request names one."""
    body: bytes | None = None
    """The body to forward when it is not the one received (`without_null_members`)."""


def read(body: bytes, max_items: int, max_values: int, given: Given = Given()) -> Parsed:
    """The parsed body and what routing needs of it (see `parse`); the blocks lazy."""
    items = body.count(b"{") + body.count(b"[")
    if items > max_items:
        raise ProxyError(
            400, f"request body has more than {max_items} JSON objects and arrays", code="request_too_complex"
        )
    # Counting everywhere is an upper bound: only a body over it needs the exact count.
    if body.count(b",") + body.count(b":") > max_values and separators_outside_strings(body, max_values) > max_values:
        raise ProxyError(
            400,
            f"request body has more than {max_values} JSON values (array elements and object members)",
            code="request_too_complex",
        )
    payload = parse_object(body)
    if items > MAX_JSON_DEPTH and nested_deeper(body, MAX_JSON_DEPTH):  # deeper needs more brackets
        raise ProxyError(
            400,
            f"request body nests JSON objects and arrays deeper than {MAX_JSON_DEPTH} levels",
            code="request_too_complex",
        )
    check_fields(payload)
    payload, forward = without_null_members(payload, body)
    if given.cache_salt is not None:
        payload, forward = with_key_salt(payload, forward if forward is not None else body, given.cache_salt)
    if given.responses:  # its own fields kept; routing, spans and content read the chat ones
        payload = {**payload, **responses_as_chat(payload)}
    blocks = PromptBlocks.of(payload, given.block_tokens, given.max_blocks)
    # The blocks' unit, for the credit (`Features.stream_tokens`).
    features = features_of(payload, given.request_class, given.workload, given.hash_key, blocks.stream_tokens)
    return Parsed(payload, features, blocks, session_of(payload, given.session, given.owner), forward)


def read_hashed(body: bytes, max_items: int, max_values: int, given: Given = Given()) -> Parsed:
    """`read` with every block hashed (off the loop: in a thread or the worker process)."""
    parsed = read(body, max_items, max_values, given)
    return Parsed(parsed.payload, parsed.features, tuple(parsed.blocks[:]), parsed.session, parsed.body)


# Bodies parsed off the loop go to a worker process: orjson holds the GIL while it parses, so
# even from a worker thread one 15 MiB prompt held the event loop about 18 ms, and 250,000
# numbers (0.5 MiB) about 10 ms.
BULK_FIELDS = ("messages", "prompt", "tools", "functions", "input", "instructions")
"""What a body parsed in the worker process leaves behind: only its routing features and its
small fields (model, sampling parameters) cross back."""


Parts = tuple[dict[str, Any], tuple[Any, ...], tuple[int, ...], str | None, bytes | None]
"""A body parsed in the worker as plain values: its small fields, its features' field values (in
`Features`' order), its block hashes, its session key, the body to forward if not the one sent.
Plain, because the worker may import the decision path from source while the proxy runs it
compiled (or the other way round: each process decides alone, fleet/native.py), and an object of
one class does not unpickle as the other."""


def warmed(future: asyncio.Future[None]) -> None:
    """A worker that failed to start is started again by the next large body (BrokenProcessPool)."""
    if not future.cancelled() and future.exception() is not None:
        log.error("the body parsing process did not start: %s", future.exception())


def read_in_worker(
    body: bytes, max_items: int, max_values: int, given: Given = Given()
) -> Parts | tuple[int, str, str | None, str | None]:
    """`read` in the worker process, every block hashed there (the loop gets the tuple of
    hashes, not the prompt); a refusal comes back as (status, message, code, param)."""
    try:
        parsed = read_hashed(body, max_items, max_values, given)
    except ProxyError as error:
        return error.status, error.message, error.code, error.param
    payload = {k: v for k, v in parsed.payload.items() if k not in BULK_FIELDS}
    features = tuple(getattr(parsed.features, f.name) for f in fields(Features))
    return payload, features, tuple(parsed.blocks), parsed.session, parsed.body


INTERRUPT = {signal.SIGINT}


def worker_started() -> None:
    """In the worker, first. A terminal's Ctrl-C reaches it too (the process group), and it
    printed a KeyboardInterrupt traceback beside the proxy's clean stop: it ignores SIGINT (blocked
    from its start, `BodyReader.submit`, so one sent while it imports is dropped here); the proxy
    ends it when it stops (`BodyReader.close`). And it ends with the proxy however that ends: it
    holds its own call queue's write end, so a proxy killed (OOM, SIGKILL) left it waiting for
    work forever (a review)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=exit_with, args=(parent.sentinel,), name="parent-watch", daemon=True).start()


def exit_with(parent_sentinel: int) -> None:
    """Wait for the proxy's end (its sentinel becomes readable), then end at once."""
    multiprocessing.connection.wait([parent_sentinel])
    os._exit(0)


def warm() -> None:
    """Nothing: run once in a new worker process, it has the worker import this module before
    the first large body needs it."""


class BodyReader:
    """Parses completion bodies: small ones on the event loop, bigger ones in a worker process
    (started with the proxy, `start`: spawning it and importing this module took ~300 ms, which
    the first large body paid). With prompts on traces (SPECROUTE_TRACE_CONTENT) the whole body
    is needed here, so bigger ones go to a worker thread instead."""

    def __init__(self, max_items: int, max_values: int, keep_content: bool = False) -> None:
        self.max_items = max_items
        self.max_values = max_values
        self.keep_content = keep_content
        self.pool: ProcessPoolExecutor | None = None
        self.warming: asyncio.Future[None] | None = None

    def start(self) -> None:
        """Start the worker process in the background (the proxy serves meanwhile: a large body
        sent before it is up waits for it, as it did when the first one started it)."""
        if self.keep_content or self.pool is not None:
            return
        self.pool = self.new_pool()
        self.warming = self.submit(self.pool, warm)
        self.warming.add_done_callback(warmed)

    @staticmethod
    def submit(pool: ProcessPoolExecutor, work: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """`work(*args)` in the worker; the worker, if this starts it, starts with SIGINT blocked
        (a mask is inherited through fork and exec)."""
        held = signal.pthread_sigmask(signal.SIG_BLOCK, INTERRUPT)
        try:
            return asyncio.get_running_loop().run_in_executor(pool, work, *args)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)

    @staticmethod
    def new_pool() -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=worker_started
        )

    async def parse(self, body: bytes, given: Given = Given()) -> Parsed:
        """The parsed body, its routing features, its prompt's block hashes and its session key;
        `given`: what the headers said (the client's workload key, else the features carry one
        derived from the body; its session name, else the body's fields may name one) and the
        prefix index's block size and bound."""
        args = (body, self.max_items, self.max_values, given)
        if len(body) <= OFF_LOOP_BYTES and body.count(b"{") + body.count(b"[") <= OFF_LOOP_ITEMS:
            return read(*args)
        if self.keep_content:  # the content is kept: parsed in a thread (the worker returns none)
            return await asyncio.to_thread(read_hashed, *args)
        if self.pool is None:
            self.pool = self.new_pool()
        try:
            result = await self.submit(self.pool, read_in_worker, *args)
        except BrokenProcessPool:
            # The worker died (killed, out of memory): this body is parsed in a thread, the next
            # big one starts a new worker.
            log.error("the body parsing process died; starting another for the next large body")
            self.pool = None
            return await asyncio.to_thread(read_hashed, *args)
        if isinstance(result[0], int):
            status, message, code, param = result
            raise ProxyError(status, message, code=code, param=param)
        payload, features, blocks, session, forward = result
        return Parsed(payload, Features(*features), blocks, session, forward)

    async def close(self) -> None:
        """End the worker process (in a thread: the loop keeps serving while it exits)."""
        pool, self.pool = self.pool, None
        self.warming = None
        if pool is not None:
            await asyncio.to_thread(pool.shutdown, True, cancel_futures=True)
