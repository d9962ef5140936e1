"""Each client key's prompts cached apart from every other key's (with proxy keys on).

A server's prefix cache shared by all clients tells one client what another sent: a guessed
prompt comes back with `usage.prompt_tokens_details.cached_tokens` near its length (and a quicker
first token) when someone sent it before, and the proxy's prefix routing, which sends a prompt to
the instance holding its prefix, makes that probe reliable (a review confirmed a 3,600-token
secret prompt of another key's six times in six). SGLang and vLLM both take a request field,
`cache_salt`, that keeps a prompt's KV apart from the same prompt under another salt (SGLang also
`extra_key`), as OpenAI keeps caches apart between organizations. With keys on and
SPECROUTE_CACHE_SCOPE=key (the default) the proxy sets it on every completion it forwards to the
key's own salt: an HMAC of the key's digest (itself put through an HMAC keyed by
SPECROUTE_RESPONSE_ID_SECRET when that is set, so that a salt in a server's log tests no guess
at the key offline), 64 hex digits, what vLLM asks of a salt (256 unpredictable bits). A client's
own `cache_salt` is kept apart within its key: the two are combined by another HMAC. The salt is
one of the fields the prefix index keys a prompt's blocks by (fleet.blocks.CACHE_FIELDS), so the
proxy's own routing never credits one key with another's cache either.
"""

from __future__ import annotations

import hashlib
import hmac

CONTEXT = b"specroute cache salt\x00"
"""Keeps this HMAC apart from any other use of the same key digest (stored responses' ids)."""
SALT_HEX = 64


def key_salt(owner: bytes, secret: bytes = b"") -> str:
    """The cache salt of the client whose key's digest is `owner`: the same on every replica with
    the same secret, so that a key's requests share their cache through any of them."""
    key = hmac.new(secret, owner, hashlib.sha256).digest() if secret else owner
    return hmac.new(key, CONTEXT, hashlib.sha256).hexdigest()[:SALT_HEX]


def salted(salt: str, client_salt: str | None) -> str:
    """The salt a request is sent with: its key's, or with a salt of the client's own, both
    combined (a fixed length, so no client salt makes it longer than a server takes)."""
    if not client_salt:
        return salt
    return hmac.new(salt.encode("ascii"), client_salt.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()
