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
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import orjson

from fleet.types import Features
from proxy.errors import ProxyError
from proxy.routing import features_of

log = logging.getLogger("specroute")

OFF_LOOP_BYTES = 256 * 1024
SCAN_BYTES = 64 * 1024
"""Separators outside strings are counted this many bytes at a time (a few hundred microseconds
each), so the counting thread hands the GIL back to the loop between pieces."""
"""Bodies larger than this are parsed off the event loop (small ones: cheaper on it)."""
TYPED_FIELDS: dict[str, tuple[type | tuple[type, ...], str]] = {
    "model": (str, "a string"),
    "stream": (bool, "a boolean"),
    "max_tokens": (int, "an integer"),
    "max_completion_tokens": (int, "an integer"),
    "n": (int, "an integer"),
    "ignore_eos": (bool, "a boolean"),
}


def parse_object(body: bytes) -> dict[str, Any]:
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ProxyError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise ProxyError(400, "request body must be a JSON object", code="invalid_json")
    return payload


def check_fields(payload: dict[str, Any]) -> None:
    for name, (kind, what) in TYPED_FIELDS.items():
        value = payload.get(name)
        if value is None:
            continue
        if kind is int and isinstance(value, float) and value.is_integer():
            continue  # 2.0 is an integer in JSON Schema, and SGLang's and vLLM's parsers take it
        wrong = not isinstance(value, kind) or (kind is int and isinstance(value, bool))
        if wrong:
            got = type(value).__name__ if not isinstance(value, str) else "a string"
            raise ProxyError(400, f"'{name}' must be {what}, not {got}", param=name, code="invalid_type")


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


def read(
    body: bytes, max_items: int, max_values: int, request_class: str | None, workload: str | None = None
) -> tuple[dict[str, Any], Features]:
    """The parsed body and what routing needs of it (see `parse`)."""
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
    check_fields(payload)
    return payload, features_of(payload, request_class, workload)


PROCESS_BYTES = OFF_LOOP_BYTES
"""Bodies larger than this are parsed in a worker process: orjson holds the GIL while it parses,
so even from a worker thread one 15 MiB prompt held the event loop about 18 ms, and 250,000
numbers (0.5 MiB) about 10 ms."""
BULK_FIELDS = ("messages", "prompt", "tools", "functions")
"""What a body parsed in the worker process leaves behind: only its routing features and its
small fields (model, sampling parameters) cross back."""


def read_in_worker(
    body: bytes, max_items: int, max_values: int, request_class: str | None, workload: str | None = None
) -> tuple[dict[str, Any], Features] | tuple[int, str, str | None, str | None]:
    """`read` in the worker process; a refusal comes back as (status, message, code, param)."""
    try:
        payload, features = read(body, max_items, max_values, request_class, workload)
    except ProxyError as error:
        return error.status, error.message, error.code, error.param
    return {k: v for k, v in payload.items() if k not in BULK_FIELDS}, features


class BodyReader:
    """Parses completion bodies: small ones on the event loop, bigger ones in a worker process
    (started at the first such body). With prompts on traces (SPECROUTE_TRACE_CONTENT) the whole
    body is needed here, so bigger ones go to a worker thread instead."""

    def __init__(self, max_items: int, max_values: int, keep_content: bool = False) -> None:
        self.max_items = max_items
        self.max_values = max_values
        self.keep_content = keep_content
        self.pool: ProcessPoolExecutor | None = None

    async def parse(
        self, body: bytes, request_class: str | None, workload: str | None = None
    ) -> tuple[dict[str, Any], Features]:
        """The parsed body and its routing features; `workload`: the client's workload key (else
        the features carry one derived from the body)."""
        args = (body, self.max_items, self.max_values, request_class, workload)
        if len(body) <= OFF_LOOP_BYTES:
            return read(*args)
        if len(body) <= PROCESS_BYTES or self.keep_content:
            return await asyncio.to_thread(read, *args)
        if self.pool is None:
            self.pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        try:
            result = await asyncio.get_running_loop().run_in_executor(self.pool, read_in_worker, *args)
        except BrokenProcessPool:
            # The worker died (killed, out of memory): this body is parsed in a thread, the next
            # big one starts a new worker.
            log.error("the body parsing process died; starting another for the next large body")
            self.pool = None
            return await asyncio.to_thread(read, *args)
        if isinstance(result[0], int):
            status, message, code, param = result
            raise ProxyError(status, message, code=code, param=param)
        return result

    async def close(self) -> None:
        """End the worker process (in a thread: the loop keeps serving while it exits)."""
        pool, self.pool = self.pool, None
        if pool is not None:
            await asyncio.to_thread(pool.shutdown, True, cancel_futures=True)
