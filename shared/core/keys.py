"""Key names and value codecs of the routing bucket, layout version 2 (docs/adr/0002-*).

    meta.layout                 LayoutValue: the layout version and the shard count
    member.<instance>           MemberValue: an admission instance is alive (renewed every second)
    shard.<k>                   ShardValue: which instance owns shard k (0 <= k < shards)
    quota.<provider>.<mk>       llmgw.core.quota.QuotaBook: every instance's quota of a pair
    pin.<k>.<mk>.<session>      PinValue: the session's pin; at most one per (model, session)

Nothing is written per request: pins change when they are created, moved, refreshed (at most a
few times per inactivity timeout) or removed; quotas when demand shifts; members and shards on
heartbeats and ownership changes.

`mk` is `model_key(model)`: the first 16 hex digits of sha256(model name) (model names contain
dots; keys may not). Sessions are hex digests, instances and providers safe tokens: no client
text reaches a key or subject. Values are compact JSON with "v": 2; decoders reject other
versions and name the field that is wrong. Pure: no clock, no I/O.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LAYOUT_KEY",
    "LAYOUT_VERSION",
    "MEMBER_PREFIX",
    "PIN_PREFIX",
    "QUOTA_PREFIX",
    "SHARD_PREFIX",
    "KeyFormatError",
    "LayoutValue",
    "MemberValue",
    "PinValue",
    "ShardValue",
    "ValueFormatError",
    "is_safe_token",
    "member_key",
    "model_key",
    "parse_pin_key",
    "pin_key",
    "pin_shard_prefix",
    "quota_key",
    "safe_token",
    "shard_key",
]

LAYOUT_VERSION = 2
MODEL_KEY_LENGTH = 16
LAYOUT_KEY = "meta.layout"
MEMBER_PREFIX = "member."
SHARD_PREFIX = "shard."
QUOTA_PREFIX = "quota."
PIN_PREFIX = "pin."

_SAFE_TOKEN = re.compile(r"[A-Za-z0-9_-]+")
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
_MODEL_KEY = re.compile(r"[0-9a-f]{16}")


class KeyFormatError(ValueError):
    """A key, or a part given to build one, does not follow the layout."""


class ValueFormatError(ValueError):
    """A stored value is not valid JSON of the expected shape and version."""


def is_safe_token(text: str) -> bool:
    """True when `text` can be one subject token of a key (letters, digits, "_", "-")."""
    return isinstance(text, str) and _SAFE_TOKEN.fullmatch(text) is not None


def safe_token(text: str) -> str:
    """`text` with every run of other characters replaced by "-" (for instance names)."""
    cleaned = _UNSAFE.sub("-", text).strip("-")
    return cleaned or "x"


def _token(what: str, text: str) -> str:
    if not is_safe_token(text):
        raise KeyFormatError(f"{what} {text!r} is not a safe key token ([A-Za-z0-9_-]+)")
    return text


def _shard(shard: int) -> int:
    if isinstance(shard, bool) or not isinstance(shard, int) or shard < 0:
        raise KeyFormatError(f"shard {shard!r} is not a non-negative integer")
    return shard


def model_key(model: str) -> str:
    """The 16-hex-digit key token of a model name."""
    return hashlib.sha256(model.encode("utf-8")).hexdigest()[:MODEL_KEY_LENGTH]


def member_key(instance: str) -> str:
    return MEMBER_PREFIX + _token("instance", instance)


def shard_key(shard: int) -> str:
    return f"{SHARD_PREFIX}{_shard(shard)}"


def quota_key(provider: str, model: str) -> str:
    return f"{QUOTA_PREFIX}{_token('provider', provider)}.{model_key(model)}"


def pin_key(shard: int, model: str, session: str) -> str:
    return f"{PIN_PREFIX}{_shard(shard)}.{model_key(model)}.{_token('session', session)}"


def pin_shard_prefix(shard: int) -> str:
    """Prefix of every pin key of one shard (a server-side filter: pins of a shard load alone)."""
    return f"{PIN_PREFIX}{_shard(shard)}."


def parse_pin_key(key: str) -> tuple[int, str, str]:
    """(shard, mk, session) of a pin key."""
    parts = key.split(".")
    if len(parts) != 4 or parts[0] != "pin" or not parts[1].isdigit():
        raise KeyFormatError(f"{key!r} is not pin.<shard>.<mk>.<session>")
    if _MODEL_KEY.fullmatch(parts[2]) is None or not is_safe_token(parts[3]):
        raise KeyFormatError(f"{key!r} is not pin.<shard>.<mk>.<session>")
    return int(parts[1]), parts[2], parts[3]


def _decode(raw: bytes, what: str) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueFormatError(f"{what} is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ValueFormatError(f"{what} is not a JSON object")
    if body.get("v") != LAYOUT_VERSION:
        raise ValueFormatError(f"{what} has version {body.get('v')!r}, expected {LAYOUT_VERSION}")
    return body


def _encode(body: dict[str, Any]) -> bytes:
    return json.dumps({"v": LAYOUT_VERSION, **body}, separators=(",", ":")).encode()


def _field(body: dict[str, Any], name: str, kind: type, what: str) -> Any:
    value = body.get(name)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ValueFormatError(f"{what}: field {name!r} must be {kind.__name__}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class LayoutValue:
    shards: int

    def to_json(self) -> bytes:
        return _encode({"shards": self.shards})

    @classmethod
    def from_json(cls, raw: bytes) -> LayoutValue:
        body = _decode(raw, "layout")
        return cls(_field(body, "shards", int, "layout"))


@dataclass(frozen=True, slots=True)
class MemberValue:
    """An admission instance's heartbeat. Alive while now < renewed_at + member TTL.
    ``leaving``: it is stopping (handing its shards over): give it none."""

    instance: str
    joined_at: float
    renewed_at: float
    leaving: bool = False
    # The stable name the deployment gave the process (a StatefulSet pod's name, `llmgw
    # admission --instance-name`): a process started under it takes an earlier incarnation's
    # key for dead once that key stops being renewed (services/admission/successor.py).
    name: str | None = None

    def to_json(self) -> bytes:
        body: dict[str, Any] = {
            "instance": self.instance,
            "joined_at": self.joined_at,
            "renewed_at": self.renewed_at,
            "leaving": self.leaving,
        }
        if self.name is not None:
            body["name"] = self.name
        return _encode(body)

    @classmethod
    def from_json(cls, raw: bytes) -> MemberValue:
        body = _decode(raw, "member")
        name = body.get("name")
        return cls(
            _field(body, "instance", str, "member"),
            _field(body, "joined_at", float, "member"),
            _field(body, "renewed_at", float, "member"),
            bool(body.get("leaving", False)),
            name if isinstance(name, str) else None,
        )


@dataclass(frozen=True, slots=True)
class ShardValue:
    """Who owns a shard, since when. ``owner`` None: released, nobody owns it; ``previous``: the
    owner before (whose quota covers the shard's leases until someone adopts them)."""

    owner: str | None
    since: float
    previous: str | None = None

    def to_json(self) -> bytes:
        return _encode({"owner": self.owner, "since": self.since, "previous": self.previous})

    @classmethod
    def from_json(cls, raw: bytes) -> ShardValue:
        body = _decode(raw, "shard")
        for name in ("owner", "previous"):
            value = body.get(name)
            if value is not None and not isinstance(value, str):
                raise ValueFormatError(
                    f"shard: field {name!r} must be a string or null, got {value!r}"
                )
        return cls(body.get("owner"), _field(body, "since", float, "shard"), body.get("previous"))


@dataclass(frozen=True, slots=True)
class PinValue:
    """A session's pin as stored: the durable part of `llmgw.core.ledger.PinRecord`.
    ``parent``: a sub-agent's parent session, written only when it has one (a reader before it
    ignores the field; one after it reads None from a pin written before)."""

    pin_id: str
    provider: str
    model: str
    session: str
    created_at: float
    since: float
    refreshed_at: float
    parent: str | None = None

    def to_json(self) -> bytes:
        body: dict[str, Any] = {
            "pin_id": self.pin_id,
            "provider": self.provider,
            "model": self.model,
            "session": self.session,
            "created_at": self.created_at,
            "since": self.since,
            "refreshed_at": self.refreshed_at,
        }
        if self.parent is not None:
            body["parent"] = self.parent
        return _encode(body)

    @classmethod
    def from_json(cls, raw: bytes) -> PinValue:
        body = _decode(raw, "pin")
        parent = body.get("parent")
        if parent is not None and not is_safe_token(parent):
            raise ValueFormatError(f"pin: field 'parent' must be a session id, got {parent!r}")
        return cls(
            _field(body, "pin_id", str, "pin"),
            _field(body, "provider", str, "pin"),
            _field(body, "model", str, "pin"),
            _field(body, "session", str, "pin"),
            _field(body, "created_at", float, "pin"),
            _field(body, "since", float, "pin"),
            _field(body, "refreshed_at", float, "pin"),
            parent,
        )
