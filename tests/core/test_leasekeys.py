"""Routing-state key names and value codecs: round trips, safe tokens, clear decode errors."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.leasekeys import (
    KeyFormatError,
    LeaseKind,
    LeaseSlotKey,
    LeaseSlotValue,
    PinKey,
    PinSlotKey,
    PinSlotValue,
    PinValue,
    UnlimitedLeaseKey,
    ValueFormatError,
    decode_value,
    lease_prefix,
    lease_slot_key,
    model_key,
    parse_key,
    pin_key,
    pin_prefix,
    pin_slot_key,
    pin_slot_prefix,
    unlimited_lease_key,
)

MK = model_key("meta/llama-3.1-8b.instruct")
tokens = st.from_regex(r"[A-Za-z0-9_-]{1,24}", fullmatch=True)
times = st.floats(min_value=0, max_value=1e10, allow_nan=False)


def test_model_key_is_the_first_16_hex_digits_of_the_name_sha256() -> None:
    name = "meta/llama-3.1-8b.instruct"
    assert MK == hashlib.sha256(name.encode()).hexdigest()[:16]
    assert model_key("a.b") != model_key("a-b")


@pytest.mark.parametrize(
    ("key", "parsed"),
    [
        (f"pin.{MK}.abc123", PinKey(MK, "abc123")),
        (f"pslot.iris.{MK}.0", PinSlotKey("iris", MK, 0)),
        (f"lease.iris.{MK}.15", LeaseSlotKey("iris", MK, 15)),
        (f"lease.ext.{MK}.u9f3e", UnlimitedLeaseKey("ext", MK, "9f3e")),
    ],
    ids=["pin", "pin-slot", "lease-slot", "unlimited-lease"],
)
def test_parse_key_inverts_the_key_builders(key: str, parsed: object) -> None:
    assert parse_key(key) == parsed
    assert parsed.key == key  # type: ignore[attr-defined]


@given(provider=tokens, session=tokens, index=st.integers(0, 10_000), lease_id=tokens)
def test_every_built_key_parses_back(
    provider: str, session: str, index: int, lease_id: str
) -> None:
    assert parse_key(pin_key(MK, session)) == PinKey(MK, session)
    assert parse_key(pin_slot_key(provider, MK, index)) == PinSlotKey(provider, MK, index)
    assert parse_key(lease_slot_key(provider, MK, index)) == LeaseSlotKey(provider, MK, index)
    assert parse_key(unlimited_lease_key(provider, MK, lease_id)) == UnlimitedLeaseKey(
        provider, MK, lease_id
    )
    assert lease_slot_key(provider, MK, index).startswith(lease_prefix(provider, MK))
    assert pin_slot_key(provider, MK, index).startswith(pin_slot_prefix(provider, MK))
    assert pin_key(MK, session).startswith(pin_prefix(MK))


@pytest.mark.parametrize("session", ["a.b", "*", ">", "a b", "", "x\n", "é"])
def test_unsafe_tokens_never_become_part_of_a_key(session: str) -> None:
    with pytest.raises(KeyFormatError, match="session"):
        pin_key(MK, session)
    with pytest.raises(KeyFormatError, match="provider"):
        lease_slot_key(session, MK, 0)


@pytest.mark.parametrize(
    "key",
    [
        "pin.x.s",
        f"pin.{MK}",
        f"pin.{MK}.s.t",
        f"pslot.iris.{MK}.-1",
        f"pslot.iris.{MK}.01",
        f"pslot.iris.{MK}.uL1",
        f"lease.iris.{MK}.u",
        "events.x",
        "",
    ],
)
def test_keys_outside_the_layout_are_rejected(key: str) -> None:
    with pytest.raises(KeyFormatError):
        parse_key(key)


@given(
    pin_id=tokens,
    provider=tokens,
    session=tokens,
    slot=st.none() | st.integers(0, 99),
    leases=st.dictionaries(tokens, tokens, max_size=4),
    at=times,
)
def test_pin_values_round_trip(
    pin_id: str, provider: str, session: str, slot: int | None, leases: dict[str, str], at: float
) -> None:
    value = PinValue(pin_id, provider, "m.1", session, slot, leases, at)
    assert PinValue.from_json(value.to_json()) == value
    assert decode_value(pin_key(MK, session), value.to_json()) == value


@given(
    lease_id=tokens,
    kind=st.sampled_from(LeaseKind),
    session=st.none() | tokens,
    pin_id=st.none() | tokens,
    granted=times,
    renewed=times,
)
def test_slot_values_round_trip(
    lease_id: str,
    kind: LeaseKind,
    session: str | None,
    pin_id: str | None,
    granted: float,
    renewed: float,
) -> None:
    lease = LeaseSlotValue.taken(
        lease_id, kind, session=session, pin_id=pin_id, edge_id="edge-1", granted_at=granted
    ).renewed(renewed)
    assert LeaseSlotValue.from_json(lease.to_json()) == lease
    assert LeaseSlotValue.from_json(LeaseSlotValue.free().to_json()) == LeaseSlotValue.free()
    pin_slot = PinSlotValue.taken(session or "s", pin_id or "p", granted)
    assert PinSlotValue.from_json(pin_slot.to_json()) == pin_slot


def test_values_are_compact_versioned_json() -> None:
    assert LeaseSlotValue.free().to_json() == b'{"v":1,"state":"free"}'
    assert PinSlotValue.taken("s", "p", 1.5).to_json() == (
        b'{"v":1,"state":"taken","session":"s","pin_id":"p","at":1.5}'
    )


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b'{"v":2,"state":"free"}', "'v'"),
        (b'{"v":1,"state":"gone"}', "'state'"),
        (
            b'{"v":1,"state":"taken","lease_id":"l","kind":"vip","session":null,"pin_id":null,'
            b'"edge_id":"e","granted_at":1,"renewed_at":1}',
            "'kind'",
        ),
        (
            b'{"v":1,"state":"taken","lease_id":"l","kind":"pinned","session":null,"pin_id":null,'
            b'"edge_id":"e","granted_at":true,"renewed_at":1}',
            "'granted_at'",
        ),
        (b'{"v":1,"state":"taken","lease_id":"l","kind":"pinned"}', "'session' is missing"),
        (b"[1]", "JSON object"),
        (b"\xff", "not JSON"),
    ],
)
def test_decode_errors_name_the_field(raw: bytes, field: str) -> None:
    with pytest.raises(ValueFormatError, match=field):
        LeaseSlotValue.from_json(raw)


def test_lease_liveness_follows_the_last_renewal() -> None:
    lease = LeaseSlotValue.taken(
        "l", LeaseKind.PINNED, session="s", pin_id="p", edge_id="e", granted_at=100.0
    )
    assert lease.is_live(129.9, 30.0) and not lease.is_live(130.0, 30.0)
    assert lease.renewed(120.0).is_live(149.9, 30.0)
    assert not LeaseSlotValue.free().is_live(0.0, 30.0)


def test_pin_lease_edits_return_new_values() -> None:
    pin = PinValue("p", "iris", "m", "s", 0, {}, 5.0)
    with_lease = pin.with_lease("l1", "lease.iris.x.1")
    assert pin.leases == {} and with_lease.leases == {"l1": "lease.iris.x.1"}
    assert with_lease.without_lease("l1").leases == {}
    assert pin.refreshed(3.0).refreshed_at == 5.0 and pin.refreshed(9.0).refreshed_at == 9.0
