"""API keys: who may call the edge, which models and bands they get, and their limits.

A key is a random secret handed to its holder once; the gateway stores only its SHA-256
digest (`digest`), under ``apikey.<digest>`` in the key bucket, with a versioned JSON value
(`ApiKey.to_json` / `ApiKey.from_json`). Operators name a key by its `key_id` (the digest's
first 16 hex digits) and recognise it by its `prefix` (the secret's first characters); neither
lets anyone rebuild the secret.

The edge decides from a local mirror of the bucket, with the pure rules here:

- `authenticate`: no key, an unknown digest, a disabled key or an expired one -> a `Denial`
  (401 ``invalid_api_key``);
- `ApiKey.allows_model`: the asked name, or the model it resolves to, matches one of the key's
  patterns (names, aliases or ``fnmatch`` globs; ``*`` is every model);
- `ApiKey.band_for`: the band a request runs in. The band header chooses only when the key
  lets it (`band_header`) and names one of the key's bands; otherwise the key's default band.
  A header the key may not use is ignored, never an error (docs/keys.md).

Limits (`max_parallel_requests`, `rpm`, `tpm`) and the key's budget (`max_spend`,
`max_overflow_spend` over `budget_period`; `ApiKey.budget`) are data here; `RateWindow` is the fixed window
rpm and tpm are counted in. Pure: no clock (``now`` is passed in), no randomness (secrets are
made from bytes the caller draws), no I/O.
"""

from __future__ import annotations

import enum
import fnmatch
import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from llmgw.core.budget import Budget
from llmgw.core.codec import decode_versioned
from llmgw.core.spend import MICROS, micros_of

__all__ = [
    "API_KEY_PREFIX",
    "API_KEY_VERSION",
    "KEY_QUOTA_PROVIDER",
    "SECRET_PREFIX",
    "ApiKey",
    "ApiKeyError",
    "Denial",
    "KeyLimits",
    "RateWindow",
    "authenticate",
    "bearer_token",
    "digest_of",
    "key_id_of",
    "key_pair",
    "new_secret",
]

API_KEY_VERSION = 1
API_KEY_PREFIX = "apikey."  # KV key of a key: apikey.<digest>
SECRET_PREFIX = "sk-llmgw-"
_SECRET_BYTES = 24
_DISPLAY_CHARS = len(SECRET_PREFIX) + 6
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,63}")
_LABEL_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
# The "provider" of a key's quota pair (`key_pair`): a token no provider id can be (ids are slugs
# that start with a letter or digit), so a key's quota book never collides with a provider's.
KEY_QUOTA_PROVIDER = "_key"
_PERIODS = ("daily", "monthly", "total")


class ApiKeyError(ValueError):
    """A key value that does not decode, or a key spec with a bad field (the message names it)."""


class Denial(enum.StrEnum):
    """Why a request's key is refused; every one is a 401 ``invalid_api_key`` to the client."""

    MISSING = "missing"
    UNKNOWN = "unknown"  # never created, or revoked (deleted)
    DISABLED = "disabled"
    EXPIRED = "expired"


def new_secret(random_bytes: bytes) -> str:
    """A secret from `random_bytes` (draw 24 with `secrets.token_bytes`)."""
    if len(random_bytes) < _SECRET_BYTES:
        raise ValueError(f"a secret needs {_SECRET_BYTES} random bytes, got {len(random_bytes)}")
    return SECRET_PREFIX + random_bytes[:_SECRET_BYTES].hex()


def digest_of(secret: str) -> str:
    """The SHA-256 hex digest the bucket stores instead of the secret."""
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).hexdigest()


def key_id_of(digest: str) -> str:
    return digest[:16]


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (scheme case-insensitive)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    token = token.strip()
    return token or None


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One key as the bucket holds it. Invariants (checked at construction): `digest` is a
    SHA-256 hex digest; limits are positive integers or None (no limit); `default_band`, when
    set, is one of `bands` (if the key lists any)."""

    digest: str
    tenant: str
    prefix: str = ""
    models: tuple[str, ...] = ("*",)
    bands: tuple[str, ...] = ()  # empty: every band of the gateway
    default_band: str | None = None  # None: the gateway's admission.default_band
    band_header: bool = False  # may the band header choose among `bands`?
    max_parallel_requests: int | None = None
    rpm: int | None = None
    tpm: int | None = None
    expires_at: float | None = None  # unix seconds
    enabled: bool = True
    labels: Mapping[str, str] = field(default_factory=dict)
    created_at: float = 0.0
    # The key's own budget (llmgw.core.budget): amounts in the gateway's spend.currency, as
    # decimal strings with at most six decimals, over `budget_period`.
    budget_period: str | None = None  # daily, monthly or total
    max_spend: str | None = None
    max_overflow_spend: str | None = None

    def __post_init__(self) -> None:
        if not _DIGEST.fullmatch(self.digest):
            raise ApiKeyError("digest: expected 64 lowercase hex digits")
        if not isinstance(self.tenant, str) or not _TENANT.fullmatch(self.tenant):
            raise ApiKeyError(
                f"tenant: expected 1-64 characters of [A-Za-z0-9_.:@-], got {self.tenant!r}"
            )
        if not self.models or not all(isinstance(m, str) and m for m in self.models):
            raise ApiKeyError("models: expected a non-empty list of names, aliases or globs")
        if not all(isinstance(b, str) and b for b in self.bands):
            raise ApiKeyError("bands: expected a list of band names")
        if self.default_band is not None and self.bands and self.default_band not in self.bands:
            raise ApiKeyError(
                f"default_band: {self.default_band!r} is not one of the key's bands "
                f"({', '.join(self.bands)})"
            )
        for name in ("max_parallel_requests", "rpm", "tpm"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ApiKeyError(f"{name}: expected an integer >= 1 or null, got {value!r}")
        if self.expires_at is not None and not isinstance(self.expires_at, int | float):
            raise ApiKeyError(f"expires_at: expected unix seconds, got {self.expires_at!r}")
        for key, value in self.labels.items():
            if not _LABEL_KEY.fullmatch(key) or not isinstance(value, str) or len(value) > 256:
                raise ApiKeyError(f"labels: bad label {key!r}")
        for name in ("max_spend", "max_overflow_spend"):
            value = getattr(self, name)
            if value is not None:
                try:
                    micros_of(value)
                except ValueError as exc:
                    raise ApiKeyError(f"{name}: {exc}") from None
        if self.budget_period is not None and self.budget_period not in _PERIODS:
            raise ApiKeyError(
                f"budget_period: expected daily, monthly or total, got {self.budget_period!r}"
            )
        limited = self.max_spend is not None or self.max_overflow_spend is not None
        if limited and self.budget_period is None:
            raise ApiKeyError("budget_period: a budget needs a period (daily, monthly or total)")

    @property
    def key_id(self) -> str:
        return key_id_of(self.digest)

    @property
    def kv_key(self) -> str:
        return API_KEY_PREFIX + self.digest

    @property
    def budget(self) -> Budget | None:
        """The key's budget in picos, or None without one."""
        if self.budget_period is None or (
            self.max_spend is None and self.max_overflow_spend is None
        ):
            return None

        def picos(value: str | None) -> int | None:
            return None if value is None else micros_of(value) * MICROS

        return Budget(
            self.budget_period,  # type: ignore[arg-type]
            picos(self.max_spend),
            picos(self.max_overflow_spend),
        )

    def allows_model(self, asked: str, canonical: str) -> bool:
        """Whether the key may use `asked` (which resolves to `canonical`)."""
        for pattern in self.models:
            if pattern == "*" or pattern in (asked, canonical):
                return True
            if any(c in pattern for c in "*?[") and (
                fnmatch.fnmatchcase(asked, pattern) or fnmatch.fnmatchcase(canonical, pattern)
            ):
                return True
        return False

    def band_for(self, header: str | None, gateway_default: str) -> str:
        """The band a request of this key runs in (see the module docstring)."""
        if header is not None and self.band_header and (not self.bands or header in self.bands):
            return header
        if self.default_band is not None:
            return self.default_band
        if self.bands and gateway_default not in self.bands:
            return self.bands[0]
        return gateway_default

    def with_changes(self, **changes: Any) -> ApiKey:
        return replace(self, **changes)

    # ---- codec --------------------------------------------------------------------------------

    def as_dict(self) -> dict[str, Any]:
        return {
            "v": API_KEY_VERSION,
            "digest": self.digest,
            "tenant": self.tenant,
            "prefix": self.prefix,
            "models": list(self.models),
            "bands": list(self.bands),
            "default_band": self.default_band,
            "band_header": self.band_header,
            "max_parallel_requests": self.max_parallel_requests,
            "rpm": self.rpm,
            "tpm": self.tpm,
            "expires_at": self.expires_at,
            "enabled": self.enabled,
            "labels": dict(sorted(self.labels.items())),
            "created_at": self.created_at,
            "budget_period": self.budget_period,
            "max_spend": self.max_spend,
            "max_overflow_spend": self.max_overflow_spend,
        }

    def to_json(self) -> bytes:
        return json.dumps(self.as_dict(), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> ApiKey:
        return cls.from_dict(decode_versioned(raw, API_KEY_VERSION, "API key value", ApiKeyError))

    @classmethod
    def from_dict(cls, body: Mapping[str, Any]) -> ApiKey:
        """From a decoded value, ignoring unknown fields (newer writers may add some)."""
        try:
            return cls(
                digest=body["digest"],
                tenant=body["tenant"],
                prefix=str(body.get("prefix", "")),
                models=tuple(body.get("models") or ("*",)),
                bands=tuple(body.get("bands") or ()),
                default_band=body.get("default_band"),
                band_header=bool(body.get("band_header", False)),
                max_parallel_requests=body.get("max_parallel_requests"),
                rpm=body.get("rpm"),
                tpm=body.get("tpm"),
                expires_at=body.get("expires_at"),
                enabled=bool(body.get("enabled", True)),
                labels=dict(body.get("labels") or {}),
                created_at=float(body.get("created_at", 0.0)),
                budget_period=body.get("budget_period"),
                max_spend=_amount_text(body.get("max_spend")),
                max_overflow_spend=_amount_text(body.get("max_overflow_spend")),
            )
        except KeyError as exc:
            raise ApiKeyError(f"{exc.args[0]}: missing") from None
        except (TypeError, AttributeError) as exc:
            raise ApiKeyError(f"API key value does not decode: {exc}") from None


def _amount_text(value: object) -> str | None:
    """An amount as the key keeps it: a decimal string (a number is accepted as its text)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        raise ApiKeyError(f"expected an amount, got {value!r}")
    return str(value)


def authenticate(key: ApiKey | None, token: str | None, now: float) -> Denial | None:
    """None if `key` (the mirror's entry for `token`'s digest) may call now; else why not."""
    if token is None:
        return Denial.MISSING
    if key is None:
        return Denial.UNKNOWN
    if not key.enabled:
        return Denial.DISABLED
    if key.expires_at is not None and now >= key.expires_at:
        return Denial.EXPIRED
    return None


@dataclass(frozen=True, slots=True)
class RateWindow:
    """Fixed windows of `length` seconds aligned to the epoch (every edge computes the same
    window from its clock): rpm and tpm count requests and tokens per window."""

    length: float = 60.0

    def index(self, now: float) -> int:
        return math.floor(now / self.length)

    def reset_in(self, now: float) -> float:
        """Seconds until the current window ends (> 0)."""
        return (self.index(now) + 1) * self.length - now

    @staticmethod
    def remaining(limit: int, used: int) -> int:
        return max(0, limit - used)


def key_pair(key_id: str) -> tuple[str, str]:
    """The quota pair of a key's `max_parallel_requests`: ("_key", key id)."""
    return (KEY_QUOTA_PROVIDER, key_id)


@dataclass(slots=True)
class KeyLimits:
    """A key's `max_parallel_requests` as the limits of its quota pair (`key_pair`), so the
    admission instances share it exactly as they share a provider's in-flight slots
    (`llmgw.core.quota`): G = the limit, nothing reserved, no pins. `KeyLimits(limit)`."""

    max_global_in_flight_request_slots: int
    global_in_flight_request_slots_reserved_for_pinned_sessions: int = 0
    max_pinned_sessions: int = 0
    # Key leases are never listed in a pin of the key's pair: no per-session bound there.
    max_per_session_in_flight_request_slots: int = 2**31
