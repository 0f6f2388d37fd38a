"""Key names and value codecs of the routing-state bucket (pins, pin slots, lease slots).

Key layout (one key per slot, so no key is hot and every limit is structural):

    pin.<mk>.<session>            PinValue: the session's pin; at most one per (model, session)
    pslot.<provider>.<mk>.<k>     PinSlotValue, k in [0, max_pinned_sessions)
    lease.<provider>.<mk>.<i>     LeaseSlotValue, i in [0, G); slots i < R take kind "pinned" only
    lease.<provider>.<mk>.u<id>   LeaseSlotValue (always taken) for pairs without limits;
                                  deleted, not freed, on release

`mk` is `model_key(model)`: the first 16 hex digits of sha256(model name). Model names contain
dots, so they never appear raw in a key; values carry the readable name. Providers, sessions and
lease ids must be safe tokens (letters, digits, "_" and "-"): they become subject tokens, so a
dot, "*", ">" or a space would change which keys a filter matches.

Values are compact JSON objects carrying "v": 1. Slots are freed by writing state "free" (never
deleted) so taking a slot is one CAS and tombstones do not pile up. Decoders reject other versions
and name the offending field. Everything here is pure: no clock, no I/O.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "LEASE_PREFIX",
    "PIN_PREFIX",
    "PIN_SLOT_PREFIX",
    "VALUE_VERSION",
    "KeyFormatError",
    "LeaseKind",
    "LeaseSlotKey",
    "LeaseSlotValue",
    "ParsedKey",
    "PinKey",
    "PinSlotKey",
    "PinSlotValue",
    "PinValue",
    "RoutingValue",
    "SlotState",
    "SlotValue",
    "UnlimitedLeaseKey",
    "ValueFormatError",
    "decode_value",
    "is_safe_token",
    "lease_prefix",
    "lease_slot_key",
    "model_key",
    "parse_key",
    "pin_key",
    "pin_prefix",
    "pin_slot_key",
    "pin_slot_prefix",
    "unlimited_lease_key",
]

VALUE_VERSION = 1
MODEL_KEY_LENGTH = 16
PIN_PREFIX = "pin."
PIN_SLOT_PREFIX = "pslot."
LEASE_PREFIX = "lease."
UNLIMITED_LEASE_MARK = "u"

_SAFE_TOKEN = re.compile(r"[A-Za-z0-9_-]+")
_MODEL_KEY = re.compile(r"[0-9a-f]{16}")
_INDEX = re.compile(r"0|[1-9][0-9]*")


class KeyFormatError(ValueError):
    """A key, or a part given to build one, does not follow the routing-state layout."""


class ValueFormatError(ValueError):
    """A stored value is not valid JSON of the expected shape and version."""


# ---------------------------------------------------------------------------------------------
# Key names


def is_safe_token(text: str) -> bool:
    """True when `text` can be one subject token of a key (letters, digits, "_", "-")."""
    return isinstance(text, str) and _SAFE_TOKEN.fullmatch(text) is not None


def _token(what: str, text: str) -> str:
    if not is_safe_token(text):
        raise KeyFormatError(f"{what} {text!r} is not a safe key token ([A-Za-z0-9_-]+)")
    return text


def _model_token(mk: str) -> str:
    if not isinstance(mk, str) or _MODEL_KEY.fullmatch(mk) is None:
        raise KeyFormatError(f"model key {mk!r} is not 16 lowercase hex digits (use model_key())")
    return mk


def _index(what: str, index: int) -> int:
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise KeyFormatError(f"{what} {index!r} is not a non-negative integer")
    return index


def model_key(model: str) -> str:
    """The 16-hex-digit key token of a model name (names may contain dots; keys may not)."""
    return hashlib.sha256(model.encode("utf-8")).hexdigest()[:MODEL_KEY_LENGTH]


def pin_key(mk: str, session: str) -> str:
    return f"{PIN_PREFIX}{_model_token(mk)}.{_token('session', session)}"


def pin_prefix(mk: str | None = None) -> str:
    """Prefix of every pin key, or of the pins of one model."""
    return PIN_PREFIX if mk is None else f"{PIN_PREFIX}{_model_token(mk)}."


def pin_slot_key(provider: str, mk: str, index: int) -> str:
    return (
        f"{PIN_SLOT_PREFIX}{_token('provider', provider)}.{_model_token(mk)}."
        f"{_index('pin slot index', index)}"
    )


def pin_slot_prefix(provider: str | None = None, mk: str | None = None) -> str:
    """Prefix of every pin slot, of one provider's, or of one provider/model pair's."""
    if provider is None:
        return PIN_SLOT_PREFIX
    if mk is None:
        return f"{PIN_SLOT_PREFIX}{_token('provider', provider)}."
    return f"{PIN_SLOT_PREFIX}{_token('provider', provider)}.{_model_token(mk)}."


def lease_slot_key(provider: str, mk: str, index: int) -> str:
    return (
        f"{LEASE_PREFIX}{_token('provider', provider)}.{_model_token(mk)}."
        f"{_index('lease slot index', index)}"
    )


def unlimited_lease_key(provider: str, mk: str, lease_id: str) -> str:
    """Key of the lease record of a pair without limits (one key per lease)."""
    return (
        f"{LEASE_PREFIX}{_token('provider', provider)}.{_model_token(mk)}."
        f"{UNLIMITED_LEASE_MARK}{_token('lease id', lease_id)}"
    )


def lease_prefix(provider: str | None = None, mk: str | None = None) -> str:
    """Prefix of every lease key, of one provider's, or of one provider/model pair's."""
    if provider is None:
        return LEASE_PREFIX
    if mk is None:
        return f"{LEASE_PREFIX}{_token('provider', provider)}."
    return f"{LEASE_PREFIX}{_token('provider', provider)}.{_model_token(mk)}."


@dataclass(frozen=True, slots=True)
class PinKey:
    mk: str
    session: str

    @property
    def key(self) -> str:
        return pin_key(self.mk, self.session)


@dataclass(frozen=True, slots=True)
class PinSlotKey:
    provider: str
    mk: str
    index: int

    @property
    def key(self) -> str:
        return pin_slot_key(self.provider, self.mk, self.index)


@dataclass(frozen=True, slots=True)
class LeaseSlotKey:
    provider: str
    mk: str
    index: int

    @property
    def key(self) -> str:
        return lease_slot_key(self.provider, self.mk, self.index)


@dataclass(frozen=True, slots=True)
class UnlimitedLeaseKey:
    provider: str
    mk: str
    lease_id: str

    @property
    def key(self) -> str:
        return unlimited_lease_key(self.provider, self.mk, self.lease_id)


ParsedKey = PinKey | PinSlotKey | LeaseSlotKey | UnlimitedLeaseKey


def parse_key(key: str) -> ParsedKey:
    """The structured form of a routing-state key; KeyFormatError if it is not one."""
    parts = key.split(".") if isinstance(key, str) else []
    kind = parts[0] if parts else ""
    try:
        if kind == "pin" and len(parts) == 3:
            return PinKey(_model_token(parts[1]), _token("session", parts[2]))
        if kind in ("pslot", "lease") and len(parts) == 4:
            provider = _token("provider", parts[1])
            mk = _model_token(parts[2])
            last = parts[3]
            if _INDEX.fullmatch(last):
                cls = PinSlotKey if kind == "pslot" else LeaseSlotKey
                return cls(provider, mk, int(last))
            if kind == "lease" and last.startswith(UNLIMITED_LEASE_MARK):
                return UnlimitedLeaseKey(provider, mk, _token("lease id", last[1:]))
    except KeyFormatError as exc:
        raise KeyFormatError(f"key {key!r}: {exc}") from None
    raise KeyFormatError(
        f"key {key!r} is not pin.<mk>.<session>, pslot.<provider>.<mk>.<k>, "
        "lease.<provider>.<mk>.<i> or lease.<provider>.<mk>.u<lease_id>"
    )


# ---------------------------------------------------------------------------------------------
# Values


class SlotState(enum.StrEnum):
    FREE = "free"
    TAKEN = "taken"


class LeaseKind(enum.StrEnum):
    PINNED = "pinned"  # a request of an existing pin: may use the reserved slots (i < R)
    NEW_PIN = "new_pin"  # the request that creates a pin: unreserved slots only
    TEMPORARY = "temporary"  # unpinned or fallback request: unreserved slots only


def _encode(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _decode(what: str, raw: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueFormatError(f"{what}: not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ValueFormatError(f"{what}: expected a JSON object, got {type(obj).__name__}")
    if obj.get("v") != VALUE_VERSION:
        raise ValueFormatError(f"{what}: field 'v': expected {VALUE_VERSION}, got {obj.get('v')!r}")
    return obj


def _field(
    what: str, obj: Mapping[str, Any], name: str, types: tuple[type, ...], *, nullable: bool = False
) -> Any:
    if name not in obj:
        raise ValueFormatError(f"{what}: field {name!r} is missing")
    value = obj[name]
    if value is None and nullable:
        return None
    # bool is an int subclass; never accept it where a number or a string is meant
    if isinstance(value, bool) or not isinstance(value, types):
        expected = "/".join(t.__name__ for t in types) + (" or null" if nullable else "")
        raise ValueFormatError(f"{what}: field {name!r}: expected {expected}, got {value!r}")
    return value


def _number(what: str, obj: Mapping[str, Any], name: str) -> float:
    return float(_field(what, obj, name, (int, float)))


def _state(what: str, obj: Mapping[str, Any]) -> SlotState:
    raw = _field(what, obj, "state", (str,))
    try:
        return SlotState(raw)
    except ValueError:
        raise ValueFormatError(
            f"{what}: field 'state': expected 'free' or 'taken', got {raw!r}"
        ) from None


@dataclass(frozen=True, slots=True)
class PinValue:
    """A session's pin. `leases` maps lease_id -> lease key for the pinned leases it holds.

    Invariants kept by the routing operations (checked by the history checker): len(leases) <= S;
    the pin is deleted only from a revision whose `leases` is empty, so it never expires while a
    lease it lists is live. Treat `leases` as read-only; use with_lease / without_lease.
    """

    pin_id: str
    provider: str
    model: str
    session: str
    pin_slot: int | None
    leases: Mapping[str, str] = field(default_factory=dict)
    refreshed_at: float = 0.0
    # A pin being created (or moved) that has not yet taken its pin slot and first
    # lease. It names its pin_id before the slot does, so a slot naming a pin that
    # no key names is provably orphaned. Not yet a pin: it routes nothing, counts
    # against no limit, lists no lease, and an abandoned one is deleted by repair.
    pending: bool = False
    # While pending for a move: the pin_id of the pin it replaces, whose value is written back
    # if the move fails; that pin's slot stays its own until the move completes.
    replaces: str | None = None

    @property
    def mk(self) -> str:
        return model_key(self.model)

    @property
    def key(self) -> str:
        return pin_key(self.mk, self.session)

    def with_lease(self, lease_id: str, lease_key: str) -> PinValue:
        return replace(self, leases={**self.leases, lease_id: lease_key})

    def without_lease(self, lease_id: str) -> PinValue:
        return replace(self, leases={k: v for k, v in self.leases.items() if k != lease_id})

    def refreshed(self, now: float) -> PinValue:
        """This pin with refreshed_at moved forward to `now` (never backwards)."""
        return replace(self, refreshed_at=max(self.refreshed_at, now))

    def to_json(self) -> bytes:
        return _encode(
            {
                "v": VALUE_VERSION,
                "pin_id": self.pin_id,
                "provider": self.provider,
                "model": self.model,
                "session": self.session,
                "pin_slot": self.pin_slot,
                "leases": dict(self.leases),
                "refreshed_at": self.refreshed_at,
                **({"pending": True} if self.pending else {}),
                **({"replaces": self.replaces} if self.replaces else {}),
            }
        )

    @classmethod
    def from_json(cls, raw: bytes) -> PinValue:
        what = "pin value"
        obj = _decode(what, raw)
        leases = _field(what, obj, "leases", (dict,))
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in leases.items()):
            raise ValueFormatError(
                f"{what}: field 'leases': expected an object of string -> string"
            )
        pin_slot = _field(what, obj, "pin_slot", (int,), nullable=True)
        pending = obj.get("pending", False)
        if not isinstance(pending, bool):
            raise ValueFormatError(f"{what}: field 'pending': expected bool, got {pending!r}")
        replaces = obj.get("replaces")
        if replaces is not None and not isinstance(replaces, str):
            raise ValueFormatError(f"{what}: field 'replaces': expected str, got {replaces!r}")
        return cls(
            pin_id=_field(what, obj, "pin_id", (str,)),
            provider=_field(what, obj, "provider", (str,)),
            model=_field(what, obj, "model", (str,)),
            session=_field(what, obj, "session", (str,)),
            pin_slot=pin_slot,
            leases=dict(leases),
            refreshed_at=_number(what, obj, "refreshed_at"),
            pending=pending,
            replaces=replaces,
        )


@dataclass(frozen=True, slots=True)
class PinSlotValue:
    """One unit of a pair's pin capacity: free, or taken by one pin of one session."""

    state: SlotState
    session: str | None = None
    pin_id: str | None = None
    at: float | None = None

    @classmethod
    def free(cls) -> PinSlotValue:
        return cls(SlotState.FREE)

    @classmethod
    def taken(cls, session: str, pin_id: str, at: float) -> PinSlotValue:
        return cls(SlotState.TAKEN, session=session, pin_id=pin_id, at=at)

    @property
    def is_taken(self) -> bool:
        return self.state == SlotState.TAKEN

    def to_json(self) -> bytes:
        if not self.is_taken:
            return _encode({"v": VALUE_VERSION, "state": SlotState.FREE.value})
        return _encode(
            {
                "v": VALUE_VERSION,
                "state": SlotState.TAKEN.value,
                "session": self.session,
                "pin_id": self.pin_id,
                "at": self.at,
            }
        )

    @classmethod
    def from_json(cls, raw: bytes) -> PinSlotValue:
        what = "pin slot value"
        obj = _decode(what, raw)
        if _state(what, obj) == SlotState.FREE:
            return cls.free()
        return cls.taken(
            session=_field(what, obj, "session", (str,)),
            pin_id=_field(what, obj, "pin_id", (str,)),
            at=_number(what, obj, "at"),
        )


@dataclass(frozen=True, slots=True)
class LeaseSlotValue:
    """A request slot (or an unlimited pair's lease record): free, or held by one lease.

    A taken lease is live while now < renewed_at + lease_timeout (an injected clock decides now).
    """

    state: SlotState
    lease_id: str | None = None
    kind: LeaseKind | None = None
    session: str | None = None
    pin_id: str | None = None
    edge_id: str | None = None
    granted_at: float | None = None
    renewed_at: float | None = None

    @classmethod
    def free(cls) -> LeaseSlotValue:
        return cls(SlotState.FREE)

    @classmethod
    def taken(
        cls,
        lease_id: str,
        kind: LeaseKind,
        *,
        session: str | None,
        pin_id: str | None,
        edge_id: str,
        granted_at: float,
    ) -> LeaseSlotValue:
        return cls(
            SlotState.TAKEN,
            lease_id=lease_id,
            kind=LeaseKind(kind),
            session=session,
            pin_id=pin_id,
            edge_id=edge_id,
            granted_at=granted_at,
            renewed_at=granted_at,
        )

    @property
    def is_taken(self) -> bool:
        return self.state == SlotState.TAKEN

    def renewed(self, now: float) -> LeaseSlotValue:
        if not self.is_taken:
            raise ValueError("a free slot cannot be renewed")
        return LeaseSlotValue(
            SlotState.TAKEN,
            self.lease_id,
            self.kind,
            self.session,
            self.pin_id,
            self.edge_id,
            self.granted_at,
            now,
        )

    def expires_at(self, lease_timeout: float) -> float:
        """The instant the lease stops being live; -inf for a free slot."""
        if not self.is_taken or self.renewed_at is None:
            return float("-inf")
        return self.renewed_at + lease_timeout

    def is_live(self, now: float, lease_timeout: float) -> bool:
        return now < self.expires_at(lease_timeout)

    def to_json(self) -> bytes:
        if not self.is_taken:
            return _encode({"v": VALUE_VERSION, "state": SlotState.FREE.value})
        return _encode(
            {
                "v": VALUE_VERSION,
                "state": SlotState.TAKEN.value,
                "lease_id": self.lease_id,
                "kind": None if self.kind is None else str(self.kind),
                "session": self.session,
                "pin_id": self.pin_id,
                "edge_id": self.edge_id,
                "granted_at": self.granted_at,
                "renewed_at": self.renewed_at,
            }
        )

    @classmethod
    def from_json(cls, raw: bytes) -> LeaseSlotValue:
        what = "lease slot value"
        obj = _decode(what, raw)
        if _state(what, obj) == SlotState.FREE:
            return cls.free()
        kind_raw = _field(what, obj, "kind", (str,))
        try:
            kind = LeaseKind(kind_raw)
        except ValueError:
            allowed = ", ".join(repr(k.value) for k in LeaseKind)
            raise ValueFormatError(
                f"{what}: field 'kind': expected one of {allowed}, got {kind_raw!r}"
            ) from None
        return cls(
            SlotState.TAKEN,
            lease_id=_field(what, obj, "lease_id", (str,)),
            kind=kind,
            session=_field(what, obj, "session", (str,), nullable=True),
            pin_id=_field(what, obj, "pin_id", (str,), nullable=True),
            edge_id=_field(what, obj, "edge_id", (str,)),
            granted_at=_number(what, obj, "granted_at"),
            renewed_at=_number(what, obj, "renewed_at"),
        )


SlotValue = PinSlotValue | LeaseSlotValue
RoutingValue = PinValue | PinSlotValue | LeaseSlotValue


def decode_value(key: ParsedKey | str, raw: bytes) -> RoutingValue:
    """Decode the value stored under `key` with the codec its key kind uses."""
    parsed = parse_key(key) if isinstance(key, str) else key
    if isinstance(parsed, PinKey):
        return PinValue.from_json(raw)
    if isinstance(parsed, PinSlotKey):
        return PinSlotValue.from_json(raw)
    return LeaseSlotValue.from_json(raw)
