"""Stored responses' ids bound to a key (proxy/response_ids.py), and the member the proxy puts
first in a body it forwards."""

from __future__ import annotations

import orjson

from proxy.auth import digest
from proxy.response_ids import belongs, minted
from proxy.scan import with_first_member


def test_an_id_belongs_to_the_key_that_made_it_alone() -> None:
    alice, bob = digest("sk-alice"), digest("sk-bob")
    made = minted(alice)
    assert made.startswith("resp_") and len(made) == 45 and made != minted(alice)
    assert belongs(made, alice) and not belongs(made, bob)
    assert belongs(made, None) and belongs("resp_anything", None)  # no keys: every id is everyone's
    forged = made[:-1] + ("0" if made[-1] != "0" else "1")
    for other in (forged, made.upper(), made + "0", made[:-1], "resp_" + "0" * 40, "x" * 45, "resp_" + "é" * 40):
        assert not belongs(other, alice), other


def test_a_member_goes_first_in_any_object() -> None:
    member = b'"request_id":"resp_1"'
    for body in (b"{}", b" { \n} ", b'{"a":1}', b'  {"a": [1, {"b": 2}]}'):
        forwarded = orjson.loads(with_first_member(body, member))
        assert next(iter(forwarded)) == "request_id" and forwarded["request_id"] == "resp_1"
        assert {k: v for k, v in forwarded.items() if k != "request_id"} == orjson.loads(body)
