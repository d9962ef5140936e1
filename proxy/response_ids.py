"""Stored responses' ids bound to the key that made them, so that with proxy keys on a client
can read, cancel or continue only its own.

SGLang and vLLM take a Responses request's `request_id` as the id of the response it stores, and
keep no owner: whoever knows an id may use it. With keys on, the proxy chooses the id itself:
`resp_`, NONCE_HEX random hex digits, then TAG_HEX hex digits of an HMAC of the nonce keyed by
the client's key (its digest, itself put through an HMAC keyed by SPECROUTE_RESPONSE_ID_SECRET
when that is set). Any replica that knows the key and the secret checks an id without state (a
response made through another replica, or before a restart, is still its maker's), and a client
with another key cannot make or guess a tag that checks. Without the secret, an id tests guesses
at its client's key offline (an HMAC of SHA-256 is fast): keys must then be long and random.
Without keys every id is everyone's, as on the servers themselves.
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
HEX = frozenset("0123456789abcdef")
CONTEXT = b"specroute stored response\x00"
"""Keeps this HMAC apart from any other use of the same key digest."""


class ResponseIds:
    """Mints and checks the ids of stored responses for the clients' keys (their digests)."""

    def __init__(self, secret: bytes = b"") -> None:
        self.secret = secret

    def tag(self, owner: bytes, nonce: str) -> str:
        key = hmac.new(self.secret, owner, hashlib.sha256).digest() if self.secret else owner
        return hmac.new(key, CONTEXT + nonce.encode("ascii"), hashlib.sha256).hexdigest()[:TAG_HEX]

    def minted(self, owner: bytes) -> str:
        """A new response id belonging to `owner` (the digest of a client's key)."""
        nonce = secrets.token_hex(NONCE_HEX // 2)
        return PREFIX + nonce + self.tag(owner, nonce)

    @staticmethod
    def shaped(response_id: str) -> bool:
        """Whether `response_id` has the shape of one the proxy mints (any key's)."""
        rest = response_id.removeprefix(PREFIX)
        return len(rest) == NONCE_HEX + TAG_HEX != len(response_id) and all(c in HEX for c in rest)

    def belongs(self, response_id: str, owner: bytes | None) -> bool:
        """Whether the client whose key's digest is `owner` may use `response_id` (None: no
        keys, every id is everyone's)."""
        if owner is None:
            return True
        if not self.shaped(response_id):
            return False
        nonce, claimed = response_id[len(PREFIX) : -TAG_HEX], response_id[-TAG_HEX:]
        return hmac.compare_digest(claimed, self.tag(owner, nonce))
