"""A prompt's block hashes: what the prefix index (fleet/prefix.py) keys on, never the text.

A request's prompt, from the JSON body the proxy already parsed, is rendered into one canonical
byte stream, cut into fixed-size blocks of `block_tokens` x 4 bytes (about four characters a
token, `fleet.features.CHARS_PER_TOKEN`), and each block's hash covers everything before it: the
hash of block i is that of the stream's first (i + 1) blocks. Equal hashes therefore mean an
equal prefix (as vLLM's and the Mooncake trace's block hashes do), and a prompt that diverges
from another inside block i shares exactly its first i hashes with it. Only whole blocks are
hashed (a tail shorter than a block is never credited, as in vLLM's prefix cache).

The stream follows the twin's token model (sim/tokens.py) byte for byte in length: a chat
message is 4 bytes of start marker, 4 of role (its CRC-32, as the twin's role id), 4 of end
marker, its content (each text part padded to a multiple of 4 bytes) and 4 of end-of-turn, so
for ASCII text byte 4n is the twin's token n and block i covers the twin's tokens
[i x block_tokens, (i + 1) x block_tokens). Non-ASCII text takes more bytes than characters,
which is closer to what real tokenizers do with it than the 4-characters rule. Markers and
padding are bytes 0xF8-0xFF, which UTF-8 never contains, so no text can imitate the framing.
What the twin does not count but a server's template renders is hashed too, so that requests
differing there do not share blocks: `tools` (first, as chat templates put them), a message's
other fields (`name`, `tool_calls`, `tool_call_id`, ...), non-text content parts (a digest of
each). A completion's string prompt is its text; a list of token ids is 4 bytes per id after a
4-byte marker.

Hashes are SHA-256 of the running stream, truncated to 8 bytes (a little-endian int): stable
across processes and machines (Python's `hash` is not), and the fastest hashlib digest here
(2.0 GB/s with the CPU's SHA extensions, against 1.4 for BLAKE2b; bench/prefix_index.py). Past
that floor the cost is the Python loop, about 0.25 us a block, hence blocks of 256 tokens by
default; a caller hashes a request once and keeps the tuple (for its decision, its insert after
dispatch and any failover).

Block ids that come with a request (the virtual clock's `Arrival.prefix`, e.g. the Mooncake
trace's `hash_ids`) are chained the same way by `chain_ids`, so the evaluation and the proxy
use one index.
"""

from __future__ import annotations

import hashlib
import struct
import sys
import zlib
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

import orjson

from fleet.features import CHARS_PER_TOKEN

BLOCK_TOKENS = 256
"""Default tokens per block (1 KiB of the stream). Smaller blocks credit a prefix more finely
(at most one block of it goes uncredited) but cost about 0.25 us each to hash: a 12,000-token
chat costs about 50 us to hash and match in 256-token blocks, 60 in 128, 80 in 64
(docs/routing.md, "Prefix index")."""

_START = b"\xf8\xf8\xf8\xf8"  # <|start_header_id|>
_END = b"\xf9\xf9\xf9\xf9"  # <|end_header_id|>
_EOT = b"\xfa\xfa\xfa\xfa"  # <|eot_id|>
_FIELDS = b"\xfb\xfb\xfb\xfb"  # a message's fields other than role and content
_PART = b"\xfc\xfc\xfc\xfc"  # a non-text content part (its digest follows)
_TOOLS = b"\xfd\xfd\xfd\xfd"  # the request's tool definitions
_IDS = b"\xfe\xfe\xfe\xfe"  # a completion prompt given as token ids
_PAD = (b"", b"\xff\xff\xff", b"\xff\xff", b"\xff")  # by length % 4
_TEXT_VOCAB = 128_000  # the twin's role ids: crc32(role) % 128000 (sim/tokens.py)
_LITTLE = sys.byteorder == "little"


def _text(text: str, out: list[bytes]) -> None:
    data = text.encode("utf-8", "surrogatepass")
    out.append(data)
    out.append(_PAD[len(data) & 3])


def _json(value: Any) -> bytes:
    try:
        data = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # orjson.JSONEncodeError: not JSON-shaped (a value parsed elsewhere)
        data = repr(value).encode("utf-8", "surrogatepass")
    return data + _PAD[len(data) & 3]


_HEADERS: dict[str, bytes] = {}
"""role -> its 12 bytes of message header (the few roles there are; bounded)."""


def _header(role: str) -> bytes:
    header = _HEADERS.get(role)
    if header is None:
        role_id = zlib.crc32(role.encode("utf-8", "surrogatepass")) % _TEXT_VOCAB
        header = _START + role_id.to_bytes(4, "little") + _END
        if len(_HEADERS) < 64:
            _HEADERS[role] = header
    return header


def _message(message: Mapping[str, Any], out: list[bytes]) -> None:
    role = message.get("role", "")
    out.append(_header(role if type(role) is str else str(role)))
    content = message.get("content")
    if type(content) is str:
        data = content.encode("utf-8", "surrogatepass")
        out.append(data)
        out.append(_PAD[len(data) & 3])
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                _text(part["text"], out)
            else:  # an image, audio...: 12 bytes, its digest standing for it
                out.append(_PART)
                out.append(hashlib.sha256(_json(part)).digest()[:8])
    elif isinstance(content, str):
        _text(content, out)
    if len(message) > ("role" in message) + ("content" in message):
        out.append(_FIELDS)
        out.append(_json({k: v for k, v in message.items() if k != "role" and k != "content"}))
    out.append(_EOT)


def prompt_stream(body: Mapping[str, Any]) -> bytes | None:
    """The canonical byte stream of a chat (`messages`) or completion (`prompt`) body; None for
    shapes with no single prompt (batched prompts, none at all)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        out: list[bytes] = []
        tools = body.get("tools")
        if tools:
            out.append(_TOOLS)
            out.append(_json(tools))
        for message in messages:
            if type(message) is dict or isinstance(message, Mapping):
                _message(message, out)
        return b"".join(out)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        data = prompt.encode("utf-8", "surrogatepass")
        return data + _PAD[len(data) & 3]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        try:
            return _IDS + struct.pack(f"<{len(prompt)}I", *prompt)
        except struct.error:  # an id outside 0..2^32-1: 8 bytes each (a server refuses it anyway)
            return _IDS + _json(prompt)
    return None


def _ints(digests: list[bytes]) -> tuple[int, ...]:
    """The first 8 bytes of each SHA-256 digest as a little-endian int."""
    joined = b"".join(digests)
    if _LITTLE:
        return tuple(memoryview(joined).cast("Q")[::4].tolist())
    return struct.unpack("<" + "Q24x" * len(digests), joined)


def chain(data: bytes, block_bytes: int, max_blocks: int | None = None) -> tuple[int, ...]:
    """Hashes of `data`'s whole blocks of `block_bytes`, each covering the blocks before it
    (at most `max_blocks`, the leading ones)."""
    if block_bytes <= 0:
        raise ValueError("block_bytes must be positive")
    n = len(data) // block_bytes
    if max_blocks is not None:
        n = min(n, max_blocks)
    if n <= 0:
        return ()
    # One running hash; digest() reads it without ending it (no copy of the state per block).
    running = hashlib.sha256()
    update, digest = running.update, running.digest
    view = memoryview(data)
    digests: list[bytes] = []
    append = digests.append
    for start in range(0, n * block_bytes, block_bytes):
        update(view[start : start + block_bytes])
        append(digest())
    return _ints(digests)


def block_hashes(
    body: Mapping[str, Any], block_tokens: int = BLOCK_TOKENS, max_blocks: int | None = None
) -> tuple[int, ...]:
    """The chained block hashes of a request body's prompt (empty when it has no single prompt
    or is shorter than one block). `max_blocks` bounds the work on a huge prompt: blocks past
    what the index can hold earn nothing."""
    data = prompt_stream(body)
    if data is None:
        return ()
    return chain(data, block_tokens * CHARS_PER_TOKEN, max_blocks)


def _id_bytes(block: Hashable) -> bytes:
    if isinstance(block, int) and 0 <= block < 1 << 63:
        return block.to_bytes(8, "little")
    # Anything else by its repr (deterministic for ints, strings, bytes and tuples of them),
    # marked so that it cannot read as an int's 8 bytes.
    return b"\xff" + repr(block).encode("utf-8", "surrogatepass")


def chain_ids(blocks: Iterable[Hashable], max_blocks: int | None = None) -> tuple[int, ...]:
    """Given block ids (e.g. the virtual clock's `Arrival.prefix`, Mooncake's `hash_ids`)
    chained into the index's hashes: the i-th covers ids 0..i, so ids that happen to repeat at
    another position or after another prefix do not match."""
    running = hashlib.sha256()
    update, digest = running.update, running.digest
    digests: list[bytes] = []
    for i, block in enumerate(blocks):
        if max_blocks is not None and i >= max_blocks:
            break
        data = _id_bytes(block)
        update(len(data).to_bytes(4, "little"))
        update(data)
        digests.append(digest())
    return _ints(digests)
