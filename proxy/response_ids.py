"""Stored responses' ids bound to the key that made them, so that with proxy keys on a client
can read, cancel or continue only its own.

SGLang and vLLM take a Responses request's `request_id` as the id of the response it stores, and
keep no owner: whoever knows an id may use it. With keys on, the proxy chooses the id itself:
`resp_`, NONCE_HEX random hex digits, then TAG_HEX hex digits of an HMAC of the nonce keyed by
the digest of the client's key. Any replica that knows the key checks an id without state (a
response made through another replica, or before a restart, is still its maker's), and a client
with another key cannot make or guess a tag that checks. Without keys every id is everyone's,
as on the servers themselves.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

PREFIX = "resp_"
NONCE_HEX = 24
"""96 random bits: no two responses share an id."""
TAG_HEX = 16
"""64 bits of the HMAC: a client guessing another key's tag needs about 2^63 tries."""
CONTEXT = b"specroute stored response\x00"
"""Keeps this HMAC apart from any other use of the same key digest."""


def tag(owner: bytes, nonce: str) -> str:
    return hmac.new(owner, CONTEXT + nonce.encode("ascii"), hashlib.sha256).hexdigest()[:TAG_HEX]


def minted(owner: bytes) -> str:
    """A new response id belonging to `owner` (the digest of a client's key)."""
    nonce = secrets.token_hex(NONCE_HEX // 2)
    return PREFIX + nonce + tag(owner, nonce)


def belongs(response_id: str, owner: bytes | None) -> bool:
    """Whether the client whose key's digest is `owner` may use `response_id` (None: no keys,
    every id is everyone's)."""
    if owner is None:
        return True
    rest = response_id.removeprefix(PREFIX)
    if len(rest) != NONCE_HEX + TAG_HEX or len(rest) == len(response_id):
        return False
    nonce, claimed = rest[:NONCE_HEX], rest[NONCE_HEX:]
    if not nonce.isascii():
        return False
    return hmac.compare_digest(claimed.encode("ascii", "replace"), tag(owner, nonce).encode("ascii"))
