"""The routing bucket's layout: keys that cannot be injected into, values that round-trip."""

from __future__ import annotations

import pytest

from llmgw.core.keys import (
    KeyFormatError,
    MemberValue,
    PinValue,
    ShardValue,
    ValueFormatError,
    member_key,
    model_key,
    parse_pin_key,
    pin_key,
    quota_key,
    safe_token,
    shard_key,
)


def test_keys_carry_only_safe_tokens():
    assert (
        pin_key(3, "llama-3.3-70b", "ab" * 16) == f"pin.3.{model_key('llama-3.3-70b')}.{'ab' * 16}"
    )
    assert parse_pin_key(pin_key(3, "m", "s1")) == (3, model_key("m"), "s1")
    assert quota_key("iris", "m") == f"quota.iris.{model_key('m')}"
    assert shard_key(7) == "shard.7" and member_key("adm-1") == "member.adm-1"
    for bad in ("a.b", "a*", ">", "a b", ""):
        with pytest.raises(KeyFormatError):
            pin_key(0, "m", bad)
    with pytest.raises(KeyFormatError):
        shard_key(-1)
    assert safe_token("admission-host.example.com-42") == "admission-host-example-com-42"


@pytest.mark.parametrize(
    "value",
    [
        MemberValue("adm-1", 1.0, 2.0),
        ShardValue("adm-1", 3.0, "adm-0"),
        ShardValue(None, 3.0, "adm-0"),
        PinValue("p1", "iris", "m", "s1", 1.0, 2.0, 3.0),
        PinValue("p1", "iris", "m", "s1", 1.0, 2.0, 3.0, parent="s0"),
    ],
)
def test_values_round_trip(value):
    assert type(value).from_json(value.to_json()) == value


def test_values_of_another_version_or_shape_are_refused_with_the_field_named():
    with pytest.raises(ValueFormatError, match="version"):
        PinValue.from_json(b'{"v": 1}')
    with pytest.raises(ValueFormatError, match="'provider'"):
        PinValue.from_json(b'{"v": 2, "pin_id": "p", "provider": 3}')


def test_a_pins_parent_is_written_only_when_it_has_one_and_read_from_pins_written_before():
    plain = PinValue("p1", "iris", "m", "s1", 1.0, 2.0, 3.0)
    assert b"parent" not in plain.to_json()  # what a reader before it wrote and reads
    old = b'{"v":2,"pin_id":"p1","provider":"iris","model":"m","session":"s1",'
    old += b'"created_at":1.0,"since":2.0,"refreshed_at":3.0}'
    assert PinValue.from_json(old) == plain and PinValue.from_json(old).parent is None
    child = PinValue("p2", "iris", "m", "s2", 1.0, 2.0, 3.0, parent="s1")
    assert b'"parent":"s1"' in child.to_json()
    with pytest.raises(ValueFormatError, match="'parent'"):
        PinValue.from_json(old[:-1] + b',"parent":"not a token"}')
