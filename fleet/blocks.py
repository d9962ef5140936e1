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
which is closer to what real tokenizers do with it than the 4-characters rule; a credit in
these tokens is put in the prompt estimate's (fleet/features.py) by `fleet.model.credit_scale`. Markers and
padding are bytes 0xF8-0xFF, which UTF-8 never contains, so no text can imitate the framing.
What the twin does not count but a server's template renders is hashed too, so that requests
differing there do not share blocks: `tools` (first, as chat templates put them), a message's
other fields (`name`, `tool_calls`, `tool_call_id`, ...), non-text content parts (a digest of
each). A completion's string prompt is its text; a list of token ids is 4 bytes per id after a
4-byte marker.

Request fields outside the prompt that change what a server computes for it, and so what its
cache holds under it (`CACHE_FIELDS`: the model, which may name a LoRA adapter or another model
of the same server; SGLang's `lora_path`; the chat template's arguments, e.g. enable_thinking;
the reasoning effort), are a header the chain starts from: the running hash takes their digest before the first block, so requests differing
there share no block, while the stream (and block i's place in the twin's tokens) is unchanged.
A request without any of them has the same hashes as before the header existed. The header
costs one JSON dump and one digest of those fields per request, whatever the prompt's length.

Hashes are XXH3-64 of the running stream (`xxhash.xxh3_64`, seed 0), read as an unsigned int:
stable across processes and machines (Python's `hash` is not), and about 6x cheaper here than
the SHA-256 chain it replaced (a 48 KB prompt's 47 blocks: 6.5 against 38 us, most of the latter
the digests and their conversion to ints; bench/prefix_index.py). Not collision-resistant
against a client crafting one: such a collision only credits an instance with a prefix it does
not hold (the server's cache keys on its own hashes): it misroutes the crafted requests, and
their misses lower that server's trust, which all clients' credit there shares
(docs/routing.md, "Prefix index").
Past the hash the cost is the Python loop, hence blocks of 256 tokens by default.
`PromptBlocks` hashes a request's prompt only as far as its decision needs (a little past the
first block no instance holds) and keeps the hashes for the insert after dispatch, which hashes
the rest, and for a failover.

Block ids that come with a request (the virtual clock's `Arrival.prefix`, e.g. the Mooncake
trace's `hash_ids`) are chained the same way by `chain_ids`, so the evaluation and the proxy
use one index.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Collection, Container, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any, overload

import orjson
import xxhash

from fleet.features import CHARS_PER_TOKEN

BLOCK_TOKENS = 256
"""Default tokens per block (1 KiB of the stream). Smaller blocks credit a prefix more finely
(at most one block of it goes uncredited) but cost about 0.15 us each to hash (0.25 with the
SHA-256 chain before XXH3-64), and as much again to insert and match (docs/routing.md, "Prefix
index")."""

_START = b"\xf8\xf8\xf8\xf8"  # <|start_header_id|>
_END = b"\xf9\xf9\xf9\xf9"  # <|end_header_id|>
_EOT = b"\xfa\xfa\xfa\xfa"  # <|eot_id|>
_FIELDS = b"\xfb\xfb\xfb\xfb"  # a message's fields other than role and content
_PART = b"\xfc\xfc\xfc\xfc"  # a non-text content part (its digest follows)
_TOOLS = b"\xfd\xfd\xfd\xfd"  # the request's tool definitions
_IDS = b"\xfe\xfe\xfe\xfe"  # a completion prompt given as token ids
_PAD = (b"", b"\xff\xff\xff", b"\xff\xff", b"\xff")  # by length % 4
_TEXT_VOCAB = 128_000  # the twin's role ids: crc32(role) % 128000 (sim/tokens.py)
CACHE_FIELDS = ("model", "lora_path", "chat_template_kwargs", "reasoning_effort", "cache_salt", "extra_key")
"""Request fields besides the prompt that change the tokens, the weights or the namespace a
server caches the prompt's KV under: folded into the chain's header (`prompt_header`). The model
names the weights (vLLM serves a LoRA adapter under its own name; SGLang takes `lora_path`);
template arguments and a reasoning effort may be rendered ahead of the messages; `cache_salt`
(SGLang and vLLM) and `extra_key` (SGLang) keep a prompt's cache apart from the same prompt sent
without them (the proxy salts each client key's requests, proxy/cache_salt.py). Not
`add_generation_prompt` nor `continue_final_message`: they change only the prompt's end, after
every block the two requests share."""


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
                out.append(xxhash.xxh3_64_digest(_json(part)))
    elif isinstance(content, str):
        _text(content, out)
    if len(message) > ("role" in message) + ("content" in message):
        out.append(_FIELDS)
        out.append(_json({k: v for k, v in message.items() if k != "role" and k != "content"}))
    out.append(_EOT)


def prompt_stream(body: Mapping[str, Any]) -> bytes | None:
    """The canonical byte stream of a chat (`messages`) or completion (`prompt`) body; None for
    shapes with no single prompt (batched prompts, none at all), and for a Responses follow-up
    (`previous_response_id`): its prompt begins with the stored conversation, which is on the
    server and not in the body, so its new input's blocks would claim, and credit, a prefix no
    server holds (the follow-up goes to the server holding that conversation anyway:
    proxy/responses.py)."""
    if body.get("previous_response_id"):
        return None
    messages = body.get("messages")
    if isinstance(messages, list):
        out: list[bytes] = []
        tools = body.get("tools")
        if tools:
            out.append(_TOOLS)
            out.append(_json(tools))
        for message in messages:
            if type(message) is dict:
                # The common message, {"role": a known role, "content": text}: `_message` inline.
                role, content = message.get("role"), message.get("content")
                header = _HEADERS.get(role) if type(role) is str else None
                if header is not None and type(content) is str and len(message) == 2 and "role" in message:
                    data = content.encode("utf-8", "surrogatepass")
                    out += (header, data, _PAD[len(data) & 3], _EOT)
                    continue
                _message(message, out)
            elif isinstance(message, Mapping):
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


def prompt_header(body: Mapping[str, Any]) -> bytes:
    """The digest of the body's `CACHE_FIELDS` that it sets (empty when it sets none): what the
    chain of its blocks starts from. A digest, so that the chain's cost past it does not grow
    with those fields (a large `chat_template_kwargs` is serialized and hashed once)."""
    # Unset, null and empty values are left out: `{}` renders as no arguments at all.
    given = {name: body[name] for name in CACHE_FIELDS if body.get(name) not in (None, {}, "")}
    if not given:
        return b""
    return xxhash.xxh3_128_digest(_json(given))


def chain(data: bytes, block_bytes: int, max_blocks: int | None = None, header: bytes = b"") -> tuple[int, ...]:
    """Hashes of `data`'s whole blocks of `block_bytes`, each covering `header` and the blocks
    before it (at most `max_blocks`, the leading ones)."""
    return PromptBlocks(data, block_bytes, max_blocks, header).all()


def block_hashes(
    body: Mapping[str, Any], block_tokens: int = BLOCK_TOKENS, max_blocks: int | None = None
) -> tuple[int, ...]:
    """The chained block hashes of a request body's prompt (empty when it has no single prompt
    or is shorter than one block). `max_blocks` bounds the work on a huge prompt: blocks past
    what the index can hold earn nothing."""
    data = prompt_stream(body)
    if data is None:
        return ()
    return chain(data, block_tokens * CHARS_PER_TOKEN, max_blocks, prompt_header(body))


LEADING_CHUNK = 4
"""Blocks `PromptBlocks.hash_while_held` hashes first (then twice as many each time)."""


class PromptBlocks(Sequence[int]):
    """One request's block hashes, computed only as far as they are read: a decision needs the
    blocks some instance may hold (`PrefixIndex.match` stops soon after the first block none
    holds), the insert after dispatch all of them. Keep it for the request's life (its
    decision, its insert, a failover's second decision): nothing is hashed twice. The same
    hashes as `block_hashes`."""

    __slots__ = ("_view", "_block", "_n", "_hashes", "_update", "_digest")

    def __init__(self, data: bytes, block_bytes: int, max_blocks: int | None = None, header: bytes = b""):
        if block_bytes <= 0:
            raise ValueError("block_bytes must be positive")
        n = len(data) // block_bytes
        self._n = n if max_blocks is None else max(min(n, max_blocks), 0)
        self._view = memoryview(data)
        self._block = block_bytes
        self._hashes: list[int] = []
        running = xxhash.xxh3_64()
        if header:  # every block's hash then covers it: the chain starts from the header
            running.update(header)
        self._update, self._digest = running.update, running.intdigest

    @classmethod
    def of(
        cls, body: Mapping[str, Any], block_tokens: int = BLOCK_TOKENS, max_blocks: int | None = None
    ) -> PromptBlocks:
        """A request body's blocks (none when it has no single prompt)."""
        return cls(prompt_stream(body) or b"", block_tokens * CHARS_PER_TOKEN, max_blocks, prompt_header(body))

    def __len__(self) -> int:
        return self._n

    @property
    def stream_tokens(self) -> int:
        """The whole stream's length in tokens of CHARS_PER_TOKEN bytes (its tail included):
        the prompt's length in the unit its blocks' tokens are counted in."""
        return -(-len(self._view) // CHARS_PER_TOKEN)

    @property
    def computed(self) -> int:
        """Blocks hashed so far."""
        return len(self._hashes)

    def _extend(self, upto: int) -> None:
        """Hash up to block `upto` (excluded): one running XXH3-64, whose intdigest() reads it
        without ending it."""
        hashes, block, view = self._hashes, self._block, self._view
        update, digest = self._update, self._digest
        append = hashes.append
        for start in range(len(hashes) * block, min(upto, self._n) * block, block):
            update(view[start : start + block])
            append(digest())

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[int, ...]: ...

    def __getitem__(self, i: int | slice) -> int | tuple[int, ...]:
        if isinstance(i, slice):
            _, stop, step = i.indices(self._n)
            self._extend(stop if step > 0 else self._n)
            return tuple(self._hashes[i])
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("block index out of range")
        if i >= len(self._hashes):
            self._extend(i + 1)
        return self._hashes[i]

    def __iter__(self) -> Iterator[int]:
        return iter(self[:])

    def all(self) -> tuple[int, ...]:
        """Every block's hash (what `insert` records)."""
        return self[:]

    def hashed(self) -> Sequence[int]:
        """The hashes computed so far (read them, do not change them)."""
        return self._hashes

    def hash_while_held(self, holders: Collection[Container[int]]) -> int:
        """Hashes blocks in growing chunks (LEADING_CHUNK, then twice as many each time) until
        no holder contains a chunk's last block, or all are hashed; returns how many are
        hashed. Holders that are prefix-closed (the prefix index's) hold none past that point,
        so a match needs no more; at most twice the matched blocks plus LEADING_CHUNK are
        hashed, and never more than all of them."""
        n = self._n
        if not holders:
            return 0
        hashes = self._hashes
        chunk = LEADING_CHUNK
        end = len(hashes)
        while end < n:
            end = min(end + chunk, n)
            self._extend(end)
            last = hashes[end - 1]
            for holder in holders:
                if last in holder:
                    break
            else:
                return end
            chunk *= 2
        return len(hashes)


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
    running = xxhash.xxh3_64()
    update, digest = running.update, running.intdigest
    hashes: list[int] = []
    for i, block in enumerate(blocks):
        if max_blocks is not None and i >= max_blocks:
            break
        data = _id_bytes(block)
        update(len(data).to_bytes(4, "little"))
        update(data)
        hashes.append(digest())
    return tuple(hashes)
