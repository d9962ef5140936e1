"""Stored responses' ids bound to a key (proxy/response_ids.py), and the member the proxy puts
first in a body it forwards."""

from __future__ import annotations

import orjson

from proxy.auth import digest
from proxy.response_ids import ResponseIds
from proxy.scan import with_first_member


def test_an_id_belongs_to_the_key_that_made_it_alone() -> None:
    ids = ResponseIds()
    alice, bob = digest("sk-alice"), digest("sk-bob")
    made = ids.minted(alice)
    assert made.startswith("resp_") and len(made) == 45 and made != ids.minted(alice)
    assert ids.belongs(made, alice) and not ids.belongs(made, bob)
    assert ids.belongs(made, None) and ids.belongs("resp_anything", None)  # no keys: every id is everyone's
    forged = made[:-1] + ("0" if made[-1] != "0" else "1")
    for other in (forged, made.upper(), made + "0", made[:-1], "resp_" + "0" * 40, "x" * 45, "resp_" + "é" * 40):
        assert not ids.belongs(other, alice), other


def test_with_a_secret_an_id_says_nothing_of_its_key_alone() -> None:
    """A review's finding: keyed by the key's digest alone, one id tests guesses at the key
    offline. With the replicas' secret in the HMAC's key, the key alone checks nothing."""
    alice = digest("sk-alice")
    keyed, plain, other = ResponseIds(b"s" * 32), ResponseIds(), ResponseIds(b"t" * 32)
    made = keyed.minted(alice)
    assert keyed.belongs(made, alice) and ResponseIds(b"s" * 32).belongs(made, alice)  # another replica
    assert not plain.belongs(made, alice) and not other.belongs(made, alice)
    assert not keyed.belongs(plain.minted(alice), alice)


def test_a_member_goes_first_in_any_object() -> None:
    member = b'"request_id":"resp_1"'
    for body in (b"{}", b" { \n} ", b'{"a":1}', b'  {"a": [1, {"b": 2}]}'):
        forwarded = orjson.loads(with_first_member(body, member))
        assert next(iter(forwarded)) == "request_id" and forwarded["request_id"] == "resp_1"
        assert {k: v for k, v in forwarded.items() if k != "request_id"} == orjson.loads(body)
