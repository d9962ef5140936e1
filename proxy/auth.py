"""Who may use the proxy: client API keys, operator keys, and what each may reach.

    access = Access.from_settings(settings)
    refusal = access.check(path, headers)      # None: allowed; else a ProxyError (401/403)

Keys come from SPECROUTE_API_KEYS, SPECROUTE_API_KEYS_FILE (one a line, `#` comments; reread
when the file changes, looked at most once a second, or on SIGHUP) and
SPECROUTE_OPERATOR_API_KEYS (client keys that may also read the operator endpoints and pin a
pool). With no key configured anywhere, everything is open. A presented key is hashed and
compared with every known key's hash in constant time, whichever matches; the key itself is
never stored, logged or echoed.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import time
from collections.abc import Callable, Iterable
from enum import IntEnum
from pathlib import Path
from typing import Literal

from proxy.errors import ProxyError
from proxy.scan import DIALECTS
from proxy.settings import Settings, inline_keys

log = logging.getLogger("specroute")

FILE_CHECK_S = 1.0
"""How often a request may look at the keys file's modification time."""
OPEN_PATHS = frozenset({"/health", "/ready", "/openapi.json"})
"""Probes stay open: an orchestrator has no key."""
METRICS_PATH = "/metrics"
STATE_PATH = "/v1/specroute/state"
KEY_SCOPE = "specroute.key"
"""The ASGI scope entry holding the digest of the key a request was admitted with (its session
names are scoped by it)."""
POOL_HEADER = b"x-specroute-pool"
ROUTED_PATHS = frozenset(DIALECTS)
"""The paths a request is routed on, where x-specroute-pool pins a pool."""
NOT_PINS = frozenset({b"auto", b""})
"""Values of x-specroute-pool that pin nothing (`auto`: the policy decides; empty: refused as
a bad header after the key is checked)."""

Need = Literal["open", "keys", "operators"]
"""What a path needs: nothing, any known key, or an operator key."""


class Role(IntEnum):
    NONE = 0
    CLIENT = 1
    OPERATOR = 2


class AuthRefused(ProxyError):
    """A 401/403; `reason` is the metric label (never the key)."""

    def __init__(self, status: int, message: str, code: str, reason: str) -> None:
        headers = [(b"www-authenticate", b'Bearer realm="specroute"')] if status == 401 else []
        super().__init__(status, message, code=code, headers=headers)
        self.reason = reason


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def file_keys(text: str) -> tuple[list[str], int]:
    """Keys from a keys file's lines, '#' lines being comments; and how many lines were left out
    for holding no key a client can send (printable ASCII without spaces, as inline keys are)."""
    keys, bad = [], 0
    for line in text.splitlines():
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if key.isascii() and key.isprintable() and " " not in key:
            keys.append(key)
        else:
            bad += 1
    return keys, bad


class KeyRing:
    """Known key hashes with their roles; the file's keys follow the file."""

    def __init__(
        self,
        inline: Iterable[str],
        operators: Iterable[str],
        path: str | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.inline = {digest(k): Role.CLIENT for k in inline}
        self.inline.update({digest(k): Role.OPERATOR for k in operators})
        self.path = Path(path) if path else None
        self.clock = clock
        self.file_keys: dict[bytes, Role] = {}
        self.file_stamp: tuple[int, int, int] | None = None
        self.next_check = 0.0
        self.keys: list[tuple[bytes, Role]] = []
        self.reload()

    @property
    def enabled(self) -> bool:
        return bool(self.inline) or self.path is not None

    def reload(self) -> None:
        """Reread the keys file (SIGHUP, or its modification time changed). An unreadable file
        keeps the keys read before, logged: a botched edit must not open the proxy."""
        if self.path is not None:
            try:
                stat = os.stat(self.path)
                # utf-8-sig: a file saved with a byte order mark (Windows editors) kept it on its
                # first key, which no client could then send (a review's probe).
                text = self.path.read_text("utf-8-sig")
            except (OSError, UnicodeDecodeError) as exc:
                log.error(
                    "cannot read SPECROUTE_API_KEYS_FILE %s (%s); keeping the %d keys read before",
                    self.path,
                    type(exc).__name__,
                    len(self.file_keys),
                )
            else:
                self.file_stamp = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
                keys, bad = file_keys(text)
                self.file_keys = {digest(k): Role.CLIENT for k in keys}
                log.info("read %d keys from SPECROUTE_API_KEYS_FILE", len(self.file_keys))
                if bad:
                    log.warning(
                        "SPECROUTE_API_KEYS_FILE: %d lines left out, holding no key a client can send"
                        " (keys are printable ASCII without spaces)",
                        bad,
                    )
        merged = dict(self.file_keys)
        merged.update(self.inline)  # an operator key stays one if the file lists it too
        self.keys = list(merged.items())

    def _refresh(self) -> None:
        now = self.clock()
        if self.path is None or now < self.next_check:
            return
        self.next_check = now + FILE_CHECK_S
        try:
            stat = os.stat(self.path)
            stamp: tuple[int, int, int] | None = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        except OSError:
            stamp = None
        if stamp != self.file_stamp:
            self.reload()

    def role_of(self, key: str) -> tuple[Role, bytes]:
        """The key's role (NONE if unknown) and its hash, which names it from here on."""
        presented = digest(key)
        return self.role_of_digest(presented), presented

    def role_of_digest(self, presented: bytes | None) -> Role:
        """The role of the key whose hash is `presented` (NONE if unknown or None)."""
        if presented is None:
            return Role.NONE
        self._refresh()
        role = Role.NONE
        for known, known_role in self.keys:  # every key compared: the time says nothing of which
            if hmac.compare_digest(presented, known):
                role = known_role
        return role


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> tuple[str | None, bool]:
    """The Authorization header's bearer token, and whether an Authorization header was sent."""
    values = [value for name, value in headers if name.lower() == b"authorization"]
    if len(values) != 1:
        return None, bool(values)
    scheme, _, token = values[0].decode("latin-1").strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None, True
    return token, True


class Access:
    """The rules: which paths need a key, which need an operator's, who may pin a pool."""

    def __init__(self, keys: KeyRing, metrics: Need, state: Need, pool_pin: Literal["any", "operators", "off"]) -> None:
        self.keys = keys
        self.metrics = metrics
        self.state = state
        self.pool_pin = pool_pin

    @classmethod
    def from_settings(cls, settings: Settings) -> Access:
        keys = KeyRing(inline_keys(settings.api_keys), inline_keys(settings.operator_api_keys), settings.api_keys_file)
        return cls(keys, settings.metrics_access, settings.state_access, settings.pool_pin)

    @property
    def enabled(self) -> bool:
        return self.keys.enabled

    def needed(self, path: str) -> Need:
        if path in OPEN_PATHS:
            return "open"
        if path == METRICS_PATH:
            return self.metrics
        if path == STATE_PATH:
            return self.state
        return "keys"

    def check(self, path: str, headers: list[tuple[bytes, bytes]]) -> AuthRefused | bytes | None:
        """The refusal to send; else the hash of the client's key (None when no key was needed)."""
        needed = self.needed(path)
        # A pin is a pool named on a path that routes (the completion paths): `auto` (no pin)
        # and the header on /health or /metrics, where nothing is routed, closed the open probes
        # and refused clients' `auto` (a review's probe).
        pins = path in ROUTED_PATHS and any(
            name.lower() == POOL_HEADER and value.strip().lower() not in NOT_PINS for name, value in headers
        )
        if pins and self.pool_pin == "off":
            return AuthRefused(
                403,
                "pinning a pool (x-specroute-pool) is turned off on this proxy",
                "pool_pin_not_allowed",
                "pin_not_allowed",
            )
        if not self.enabled:
            return None
        if pins and self.pool_pin == "operators":
            needed = "operators"
        if needed == "open":
            return None
        token, sent = bearer_token(headers)
        if token is None:
            reason = "malformed" if sent else "missing"
            return AuthRefused(
                401,
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
                if not sent
                else "The Authorization header must be 'Bearer <key>'.",
                "invalid_api_key",
                reason,
            )
        role, key = self.keys.role_of(token)
        if role is Role.NONE:
            return AuthRefused(401, "Incorrect API key provided.", "invalid_api_key", "invalid")
        if needed == "operators" and role is not Role.OPERATOR:
            what = "pinning a pool (x-specroute-pool)" if pins and path not in (METRICS_PATH, STATE_PATH) else path
            return AuthRefused(403, f"{what} needs an operator key", "operator_key_required", "not_operator")
        return key


class KeyLimits:
    """At most `limit` open completion requests per client key (SPECROUTE_KEY_MAX_CONCURRENCY;
    0: no limit), so one client cannot hold every slot of the fleet."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open: dict[bytes, int] = {}

    def acquire(self, key: bytes) -> bool:
        held = self.open.get(key, 0)
        if self.limit and held >= self.limit:
            return False
        self.open[key] = held + 1
        return True

    def release(self, key: bytes) -> None:
        held = self.open.get(key, 0) - 1
        if held > 0:
            self.open[key] = held
        else:
            self.open.pop(key, None)

    def refusal(self) -> AuthRefused:
        refused = AuthRefused(
            429,
            f"this key already has {self.limit} requests open; retry after 1 s",
            "key_concurrency_limit",
            "key_concurrency",
        )
        refused.headers.append((b"retry-after", b"1"))
        return refused


def without_authorization(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The request's headers minus the client's key, which goes no further than this check."""
    return [(name, value) for name, value in headers if name.lower() != b"authorization"]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve to anything


def warn_if_open(settings: Settings, access: Access) -> None:
    if access.enabled:
        if settings.response_id_secret is None:
            log.warning(
                "SPECROUTE_RESPONSE_ID_SECRET is unset: a stored response's id and a key's cache salt are"
                " bound to its client's key alone, and test guesses at that key offline; set it (the same"
                " on every replica) unless every key is long and random"
            )
        return
    if not is_loopback(settings.host):
        log.warning(
            "no SPECROUTE_API_KEYS set and listening on %s: anyone who reaches this address can use the GPUs behind it",
            settings.host,
        )
    # Settings that restrict by key do nothing without keys: say so rather than seem to apply.
    unapplied = [
        "SPECROUTE_" + field.upper()
        for field, applies in (
            ("state_access", settings.state_access != "open"),
            ("metrics_access", settings.metrics_access != "open"),
            ("key_max_concurrency", settings.key_max_concurrency > 0),
            ("pool_pin", settings.pool_pin == "operators"),
            ("response_id_secret", settings.response_id_secret is not None),
            ("cache_scope", settings.cache_scope != "key"),
        )
        if applies and field in settings.model_fields_set
    ]
    if unapplied:
        log.warning("%s apply only with keys (SPECROUTE_API_KEYS): without them they do nothing", ", ".join(unapplied))
