"""What `llmgw state` shows, computed from one read of the routing bucket (pure: no I/O).

Input: the live entries under `pslot.`, `lease.` and `pin.` (three listings, read one after the
other, so counts may straddle a change made between them: a snapshot of a moving system, not a
transaction). Output: per provider/model pair its pins and leases against its limits, the leases
past their timeout that no reaper has reclaimed yet, the sessions holding the most leases, and
optionally every pin. Entries that do not follow the key layout or value schema are counted as
`unreadable`, never fatal.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from llmgw.config.durations import format_duration
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
    model_key,
    parse_key,
)
from llmgw.core.leases import PairLimits, lease_is_expired, pin_is_idle_expired
from llmgw.state.kv import KVEntry

__all__ = [
    "PairReport",
    "PinReport",
    "SessionUse",
    "StateReport",
    "build_report",
    "format_report",
    "report_json",
]

TOP_SESSIONS = 5


@dataclass(frozen=True, slots=True)
class SessionUse:
    session: str
    leases: int  # taken lease slots (or records) naming this session on the pair


@dataclass(frozen=True, slots=True)
class PairReport:
    """One provider/model pair. Maxima are None for a pair without limits."""

    provider: str
    model: str
    pins: int = 0  # active pins on this pair
    max_pins: int | None = None
    pending_pins: int = 0  # pins being created or moved here: not pins yet, count against nothing
    pin_slots_taken: int = 0  # equals `pins` unless an operation is in flight or died
    leases: int = 0  # taken lease slots (records), live or expired
    live_leases: int = 0
    expired_leases: int = 0  # taken but not renewed in time: the reaper's next work
    max_leases: int | None = None
    reserved_slots: int | None = None  # R: slots only pinned requests may take
    reserved_taken: int = 0  # taken slots with index < R
    max_per_session: int | None = None
    leases_by_kind: Mapping[str, int] = field(default_factory=dict)
    top_sessions: tuple[SessionUse, ...] = ()


@dataclass(frozen=True, slots=True)
class PinReport:
    session: str
    model: str
    provider: str
    pin_id: str
    leases: int
    refreshed_at: float
    idle_for: float | None  # None while the pin holds a lease (idleness starts after the last)
    # None while busy; 0 when expired but not yet reaped. A pending pin "expires" when repair
    # may delete it as abandoned (lease_timeout after it was written).
    expires_in: float | None
    pending: bool = False  # being created or moved (see PinValue.pending)


@dataclass(frozen=True, slots=True)
class StateReport:
    bucket: str
    at: float
    lease_timeout: float
    pin_inactivity_timeout: float
    pairs: tuple[PairReport, ...]
    pins: tuple[PinReport, ...]
    unreadable: int = 0


def _decode(entries: Iterable[KVEntry], codec: Any) -> tuple[list[tuple[Any, Any]], int]:
    decoded, bad = [], 0
    for entry in entries:
        try:
            decoded.append((parse_key(entry.key), codec.from_json(entry.value)))
        except (KeyFormatError, ValueFormatError):
            bad += 1
    return decoded, bad


def _reserved(limits: PairLimits | None) -> int:
    if limits is None:
        return 0
    return limits.global_in_flight_request_slots_reserved_for_pinned_sessions


def build_report(
    *,
    bucket: str,
    pin_slots: Iterable[KVEntry],
    leases: Iterable[KVEntry],
    pins: Iterable[KVEntry],
    limits: Mapping[tuple[str, str], PairLimits | None],
    now: float,
    lease_timeout: float,
    pin_inactivity_timeout: float,
    top: int = TOP_SESSIONS,
) -> StateReport:
    """The report for the given listings at `now` (see the module docstring)."""
    models = {model_key(model): model for _, model in limits}
    decoded_pins, bad_pins = _decode(pins, PinValue)
    decoded_slots, bad_slots = _decode(pin_slots, PinSlotValue)
    decoded_leases, bad_leases = _decode(leases, LeaseSlotValue)
    for _, pin in decoded_pins:
        models.setdefault(model_key(pin.model), pin.model)

    counts: dict[tuple[str, str], Counter[str]] = {pm: Counter() for pm in limits}
    sessions: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    pin_reports = []
    for parsed, pin in decoded_pins:
        if not isinstance(parsed, PinKey):
            continue
        counts.setdefault((pin.provider, pin.model), Counter())[
            "pending" if pin.pending else "pins"
        ] += 1
        busy = bool(pin.leases)
        if pin.pending:
            expires_in: float | None = max(0.0, pin.refreshed_at + lease_timeout - now)
        elif busy:
            expires_in = None
        elif pin_is_idle_expired(pin, now, pin_inactivity_timeout):
            expires_in = 0.0
        else:
            expires_in = pin.refreshed_at + pin_inactivity_timeout - now
        pin_reports.append(
            PinReport(
                session=pin.session,
                model=pin.model,
                provider=pin.provider,
                pin_id=pin.pin_id,
                leases=len(pin.leases),
                refreshed_at=pin.refreshed_at,
                idle_for=None if busy or pin.pending else max(0.0, now - pin.refreshed_at),
                expires_in=expires_in,
                pending=pin.pending,
            )
        )
    for parsed, slot in decoded_slots:
        if isinstance(parsed, PinSlotKey) and slot.is_taken:
            pm = (parsed.provider, models.get(parsed.mk, parsed.mk))
            counts.setdefault(pm, Counter())["pin_slots"] += 1
    for parsed, lease in decoded_leases:
        if not isinstance(parsed, LeaseSlotKey | UnlimitedLeaseKey) or not lease.is_taken:
            continue
        pm = (parsed.provider, models.get(parsed.mk, parsed.mk))
        counter = counts.setdefault(pm, Counter())
        counter["leases"] += 1
        counter[f"kind:{lease.kind}"] += 1
        if lease_is_expired(lease, now, lease_timeout):
            counter["expired"] += 1
        if isinstance(parsed, LeaseSlotKey) and parsed.index < _reserved(limits.get(pm)):
            counter["reserved"] += 1
        if lease.session is not None:
            sessions[pm][lease.session] += 1

    pairs = []
    for (provider, model), c in sorted(counts.items()):
        pair_limits = limits.get((provider, model))
        top_users = sorted(sessions[(provider, model)].items(), key=lambda kv: (-kv[1], kv[0]))
        pairs.append(
            PairReport(
                provider=provider,
                model=model,
                pins=c["pins"],
                max_pins=None if pair_limits is None else pair_limits.max_pinned_sessions,
                pending_pins=c["pending"],
                pin_slots_taken=c["pin_slots"],
                leases=c["leases"],
                live_leases=c["leases"] - c["expired"],
                expired_leases=c["expired"],
                max_leases=(
                    None if pair_limits is None else pair_limits.max_global_in_flight_request_slots
                ),
                reserved_slots=None if pair_limits is None else _reserved(pair_limits),
                reserved_taken=c["reserved"],
                max_per_session=(
                    None
                    if pair_limits is None
                    else pair_limits.max_per_session_in_flight_request_slots
                ),
                leases_by_kind={k.value: c[f"kind:{k}"] for k in LeaseKind},
                top_sessions=tuple(SessionUse(s, n) for s, n in top_users[:top]),
            )
        )
    pin_reports.sort(key=lambda p: (p.model, p.provider, p.session))
    return StateReport(
        bucket,
        now,
        lease_timeout,
        pin_inactivity_timeout,
        tuple(pairs),
        tuple(pin_reports),
        bad_pins + bad_slots + bad_leases,
    )


def report_json(report: StateReport, *, with_pins: bool) -> dict[str, Any]:
    """The machine-readable form (`llmgw state --json`); durations in seconds."""
    data = asdict(report)
    data = {"v": 1, **data}
    if not with_pins:
        del data["pins"]
    return data


# ---------------------------------------------------------------------------------------------
# Text


def _of(used: int, limit: int | None) -> str:
    return str(used) if limit is None else f"{used}/{limit}"


def _ago(seconds: float | None) -> str:
    return "-" if seconds is None else format_duration(round(seconds))


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]


def format_report(report: StateReport, *, with_pins: bool) -> str:
    """The human-readable form: a pair table, the top sessions, and the pins if asked."""
    at = datetime.fromtimestamp(report.at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    lines = [
        f"routing bucket {report.bucket}: lease timeout {format_duration(report.lease_timeout)}, "
        f"pin inactivity timeout {format_duration(report.pin_inactivity_timeout)}",
        f"read at {at}",
        "",
    ]
    rows = [
        [
            p.provider,
            p.model,
            _of(p.pins, p.max_pins) + (f"+{p.pending_pins}" if p.pending_pins else ""),
            _of(p.live_leases, p.max_leases),
            "-" if p.reserved_slots is None else f"{p.reserved_taken}/{p.reserved_slots}",
            str(p.expired_leases),
            " ".join(f"{k}={n}" for k, n in p.leases_by_kind.items() if n) or "-",
        ]
        for p in report.pairs
    ]
    lines += _table(["PROVIDER", "MODEL", "PINS", "LEASES", "RESERVED", "EXPIRED", "BY KIND"], rows)
    lines.append(
        "(PINS used/max[+pending]; LEASES live/max; RESERVED slots for pinned requests "
        "taken/total; EXPIRED not renewed in time, not yet reaped; BY KIND every taken "
        "lease)"
    )
    mismatched = [p for p in report.pairs if p.max_pins is not None and p.pin_slots_taken != p.pins]
    for p in mismatched:
        lines.append(
            f"note: {p.provider}/{p.model} has {p.pin_slots_taken} pin slots taken for "
            f"{p.pins} pins (an operation in flight, or one the reaper will repair)"
        )
    busy = [p for p in report.pairs if p.top_sessions]
    if busy:
        lines += ["", "sessions holding the most leases:"]
        for p in busy:
            users = ", ".join(
                f"{u.session} {_of(u.leases, p.max_per_session)}" for u in p.top_sessions
            )
            lines.append(f"  {p.provider}/{p.model}: {users}")
    if report.unreadable:
        lines += ["", f"{report.unreadable} entries do not follow the routing-state layout"]
    if with_pins:
        lines += ["", f"pins ({len(report.pins)}):"]
        if report.pins:
            lines += [
                "  " + line
                for line in _table(
                    ["SESSION", "MODEL", "PROVIDER", "STATE", "LEASES", "IDLE FOR", "EXPIRES IN"],
                    [
                        [
                            p.session,
                            p.model,
                            p.provider,
                            "pending" if p.pending else "active",
                            str(p.leases),
                            _ago(p.idle_for),
                            _ago(p.expires_in),
                        ]
                        for p in report.pins
                    ],
                )
            ]
    return "\n".join(lines)
