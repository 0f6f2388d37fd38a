"""Checks the routing invariants over what a run recorded, and reports every breach.

Two records, because state lives in two places (docs/adr/0002-admission-at-memory-speed.md):

**The bucket's history** (`check_history`: every write in revision order, from `HistoryRecorder`
or `MemoryKV.history`), replayed write by write:

    order     revisions do not strictly increase
    layout    a key or value that does not decode (pin, quota, member, shard, meta keys)
    quota     a pair's quota book with Σg > G, Σu > G - R or Σp > P, or a holder with u > g:
              the shares the instances grant from must never add up to more than the limits
    I3        one pin key per (model, session) is structural; a pin value naming another
              session or model than its key is a layout breach

**The audit trail** (`check_audit`: every grant, adoption and end of a lease and every pin
added or removed, by every instance, with the instance's quota and use at each grant; recorded
by `AuditLog`, a `LedgerObserver`), replayed in time order:

    I2a       live leases of a pair > G (across all instances)
    I2b       live unreserved leases of a pair > G - R
    I2c       live leases listed in one pin > S
    I2d       live pins of a pair > P
    I3        two live pins (different ids) of one (model, session) at once
    IK        live leases of one API key > its max_parallel_requests (the limit its leases
              were granted under), across all instances
    quota     an instance granting beyond its own quota (leases >= g, unreserved >= u, pins >= p)
    double    a lease id granted while it is live
    fenced    a lease granted on a pin by an instance that held that pin when it was fenced
              (it decides nothing from its fence on; the pin left the count then, so I2c and
              I3 cannot see such a grant)

A lease is live from its grant until its end; an adoption moves it to its adopter (same id,
still live, never counted twice). An end counts at the instance that holds the lease, except one
its edge sent while the lease's shard was on its way to a new owner (a handover, or an adoption
after a crash): that owner leaves the lease out and records the end, which counts wherever the
lease was last held (a crashed holder records nothing). An instance that *crashed*
(`AuditLog.crash`) ends nothing:
its leases stay live until adopted, or until ``lease_timeout`` after the crash (by then their
edges have been told they are lost, or could not renew them, and ended their requests); one it
granted after its crash was recorded (a decision in flight while it was being killed) until
``lease_timeout`` after that grant. Its pins
stop counting against P at the crash (nobody routes with a pin that only the bucket holds) and
count again when the shard's next owner adopts them; for I3 they are not live at all. An
instance that *stopped* (`AuditLog.stopped`) decides nothing more either: whatever its ledger
still held (a shard it could not hand over or release) is treated as a crashed instance's. An
instance *fenced* (`LedgerObserver.fenced`, stamped when its fence took effect, which it may
learn later) keeps its leases (their edges still run them) but not the pins it held then: it
decides nothing with them, and another instance may have claimed the shard and pinned the
session again where a pin's write had not landed. Pins it adds after its fence count; a lease
it grants on a pin it held at its fence is a breach of its own (``fenced``), unless it added
that pin again since (joined again, it adopted the bucket's copy of a shard's pins). A grant
counts as after the fence by its decision's time (``granted_at``), not by when the trail
recorded it: a process stalled between the two (a loaded host) decided before its fence.
"""

from __future__ import annotations

import heapq
import json
import threading
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from llmgw.core.keys import (
    LAYOUT_KEY,
    MEMBER_PREFIX,
    PIN_PREFIX,
    QUOTA_PREFIX,
    SHARD_PREFIX,
    KeyFormatError,
    LayoutValue,
    MemberValue,
    PinValue,
    ShardValue,
    ValueFormatError,
    model_key,
    parse_pin_key,
)
from llmgw.core.ledger import EndReason, LeaseRecord, LedgerObserver, PinRecord
from llmgw.core.quota import PairLimits, Quota, QuotaBook, QuotaCounts, QuotaError
from llmgw.state.kv import KVEntry

__all__ = ["AuditEvent", "AuditLog", "Violation", "check_audit", "check_history"]


@dataclass(frozen=True, slots=True)
class Violation:
    invariant: str
    key: str
    revision: int  # the KV revision (history) or the audit event's index (audit)
    message: str
    # What led to it (audit: the pins or leases counted, who held them, the events around it):
    # enough to tell a real breach from a recording gap without rerunning.
    context: str = ""

    def __str__(self) -> str:
        text = f"[{self.invariant}] #{self.revision}, {self.key}: {self.message}"
        return f"{text}\n{self.context}" if self.context else text


# ---- the bucket's history -----------------------------------------------------------------------


def check_history(
    entries: Iterable[KVEntry], limits: Mapping[tuple[str, str], PairLimits | None]
) -> list[Violation]:
    """Every breach in a bucket's history (see the module docstring)."""
    by_mk = {(provider, model_key(model)): lim for (provider, model), lim in limits.items()}
    violations: list[Violation] = []
    last = 0
    for entry in entries:
        if entry.revision <= last:
            violations.append(
                Violation("order", entry.key, entry.revision, f"does not follow {last}")
            )
        last = max(last, entry.revision)
        if entry.deleted:
            continue
        key = entry.key
        try:
            if key.startswith(QUOTA_PREFIX):
                book = QuotaBook.from_json(entry.value)
                _, provider, mk = key.split(".", 2)
                lim = by_mk.get((provider, mk))
                for instance, q in book.holders.items():
                    if q.u > q.g:
                        violations.append(
                            Violation(
                                "quota", key, entry.revision, f"{instance} holds u={q.u} > g={q.g}"
                            )
                        )
                if lim is not None:
                    try:
                        book.check(lim)
                    except QuotaError as exc:
                        violations.append(Violation("quota", key, entry.revision, str(exc)))
            elif key.startswith(PIN_PREFIX):
                _, mk, session = parse_pin_key(key)
                pin = PinValue.from_json(entry.value)
                if pin.session != session or model_key(pin.model) != mk:
                    violations.append(
                        Violation(
                            "layout",
                            key,
                            entry.revision,
                            "pin value names another session or model",
                        )
                    )
            elif key.startswith(MEMBER_PREFIX):
                MemberValue.from_json(entry.value)
            elif key.startswith(SHARD_PREFIX):
                ShardValue.from_json(entry.value)
            elif key == LAYOUT_KEY:
                LayoutValue.from_json(entry.value)
        except (KeyFormatError, ValueFormatError, QuotaError, ValueError) as exc:
            violations.append(Violation("layout", key, entry.revision, str(exc)))
    return violations


# ---- the audit trail -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AuditEvent:
    """One thing an instance's ledger did. ``kind``: granted, adopted, ended, pin_added,
    pin_removed, crashed."""

    at: float
    seq: int
    instance: str
    kind: str
    lease: LeaseRecord | None = None
    pin: tuple[str, str, str, str] | None = None  # (provider, model, session, pin_id)
    quota: Quota | None = None
    use: QuotaCounts | None = None  # what the instance used of the pair before the grant
    reason: str | None = None
    shard: int | None = None

    def describe(self) -> str:
        """One line for a violation's context."""
        text = f"#{self.seq} t={self.at:.3f} {self.instance} {self.kind}"
        if self.pin is not None:
            text += f" pin {self.pin[0]}/{self.pin[2]} id={self.pin[3]}"
        if self.lease is not None:
            text += f" lease {self.lease.lease_id} on {self.lease.provider}"
        if self.shard is not None:
            text += f" shard {self.shard}"
        if self.quota is not None and self.use is not None:
            text += f" (quota g={self.quota.g} u={self.quota.u} p={self.quota.p}, use {tuple(self.use)})"
        if self.reason is not None:
            text += f" ({self.reason})"
        return text


class _InstanceObserver(LedgerObserver):
    def __init__(self, log: AuditLog, instance: str) -> None:
        self._log = log
        self.instance = instance

    def lease_granted(self, lease: LeaseRecord, quota: Quota | None, before: QuotaCounts) -> None:
        self._log.add(self.instance, "granted", lease=lease, quota=quota, use=before)

    def lease_adopted(self, lease: LeaseRecord, quota: Quota | None, before: QuotaCounts) -> None:
        self._log.add(self.instance, "adopted", lease=lease, quota=quota, use=before)

    def lease_ended(self, lease: LeaseRecord, reason: EndReason, at: float) -> None:
        self._log.add(self.instance, "ended", lease=lease, reason=reason.value)

    def lease_ended_in_transit(self, lease: LeaseRecord, at: float) -> None:
        self._log.add(self.instance, "ended", lease=lease, reason=ENDED_IN_TRANSIT)

    def pin_added(self, pin: PinRecord, at: float, quota: Quota | None, before: int) -> None:
        self._log.add(
            self.instance,
            "pin_added",
            pin=(pin.provider, pin.model, pin.session, pin.pin_id),
            quota=quota,
            use=QuotaCounts(pins=before),
            shard=pin.shard,
        )

    def pin_removed(self, pin: PinRecord, at: float, reason: str) -> None:
        self._log.add(
            self.instance,
            "pin_removed",
            pin=(pin.provider, pin.model, pin.session, pin.pin_id),
            reason=reason,
            shard=pin.shard,
        )

    def fenced(self, at: float) -> None:
        self._log.add(self.instance, "fenced", at=at)


@dataclass
class AuditLog:
    """Collects the audit trail of every instance in one process (tests, benchmarks).

    `observer(instance)` is the `LedgerObserver` to give that instance's ledger; `crash(instance)`
    records that it died without ending anything (a SIGKILL). ``clock``: the clock every
    instance stamps with (time.time in the product).
    """

    clock: object = None
    events: list[AuditEvent] = field(default_factory=list)
    _seq: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.clock is None:
            import time

            self.clock = time.time

    def observer(self, instance: str) -> LedgerObserver:
        return _InstanceObserver(self, instance)

    def add(self, instance: str, kind: str, at: float | None = None, **fields: object) -> None:
        """Record an event, stamped now: in one process the recording order is the real
        order (a ledger's own `now` may have been taken before an await). ``at``: when it
        happened, if earlier (a fence is learnt after the fact)."""
        with self._lock:
            self._seq += 1
            if at is None:
                at = self.clock()  # type: ignore[operator]
            self.events.append(AuditEvent(at, self._seq, instance, kind, **fields))  # type: ignore[arg-type]

    def crash(self, instance: str) -> None:
        self.add(instance, "crashed")

    def stopped(self, instance: str) -> None:
        """It stopped gracefully (context for a violation's report; nothing ends by it)."""
        self.add(instance, "stopped")

    def to_json(self) -> str:
        return json.dumps(
            [
                {
                    "at": e.at,
                    "instance": e.instance,
                    "kind": e.kind,
                    "lease": e.lease.lease_id if e.lease else None,
                    "pin": e.pin,
                    "reason": e.reason,
                }
                for e in self.events
            ]
        )


# The reason of an audit trail's end of a lease that its edge ended while its shard was on the way
# to the instance that records it (`LedgerObserver.lease_ended_in_transit`).
ENDED_IN_TRANSIT = "ended_in_transit"


def check_audit(
    events: Iterable[AuditEvent],
    limits: Mapping[tuple[str, str], PairLimits | None],
    *,
    lease_timeout: float,
    changed: Sequence[tuple[float, Mapping[tuple[str, str], PairLimits | None]]] = (),
) -> list[Violation]:
    """Every breach in an audit trail (see the module docstring). `changed`: limits applied
    while it ran, as (from when, the limits from then on), by time: a grant or a pin is held to
    the limits in force when it was made (leases granted before a lowering are never revoked,
    but no grant after it may take a pair above the new limit)."""
    ordered = sorted(events, key=lambda e: (e.at, e.seq))
    steps = sorted(changed, key=lambda step: step[0])

    def limits_at(at: float) -> Mapping[tuple[str, str], PairLimits | None]:
        current = limits
        for since, later in steps:
            if since > at:
                break
            current = later
        return current

    violations: list[Violation] = []
    live: dict[str, tuple[str, LeaseRecord]] = {}  # lease id -> (holder, lease)
    per_pair: dict[tuple[str, str], set[str]] = defaultdict(set)
    unreserved: dict[tuple[str, str], set[str]] = defaultdict(set)
    per_pin: dict[str, set[str]] = defaultdict(set)
    per_key: dict[str, set[str]] = defaultdict(set)
    pins: dict[
        tuple[str, str], tuple[str, str, str]
    ] = {}  # (model, session) -> (provider, id, holder)
    pins_per_pair: dict[tuple[str, str], set[tuple[str, str]]] = defaultdict(set)
    crashed: dict[str, float] = {}
    # instance -> (its fence's moment, the ids of the pins it held then)
    fenced: dict[str, tuple[float, set[str]]] = {}
    expiries: list[tuple[float, str]] = []  # (time, lease id): crashed holders' leases
    # For the reports only: each live pin's adding event, each pair's last pin events, and
    # the instances' crashes and stops.
    pin_events: dict[tuple[str, str], deque[AuditEvent]] = defaultdict(lambda: deque(maxlen=40))
    added_by: dict[tuple[str, str], AuditEvent] = {}
    lifecycle: list[AuditEvent] = []

    def pin_context(pair: tuple[str, str]) -> str:
        lines = [f"  live pins on {pair[0]}/{pair[1]}:"]
        for skey in sorted(pins_per_pair[pair]):
            added = added_by.get(skey)
            holder = pins[skey][2]
            state = " (crashed)" if holder in crashed else ""
            lines.append(f"    {skey[1]}: {added.describe() if added else '?'}{state}")
        lines.append("  instances: " + (", ".join(e.describe() for e in lifecycle) or "-"))
        lines.append("  last pin events of the pair:")
        lines.extend(f"    {e.describe()}" for e in pin_events[pair])
        return "\n".join(lines)

    granted_at: dict[str, float] = {}  # for the reports only
    lease_events: dict[str, list[AuditEvent]] = defaultdict(list)  # for the reports only

    def leases_context(heading: str, lease_ids: Iterable[str], detailed: bool) -> str:
        """The live leases `lease_ids`, each with its holder and since when (`detailed`: its
        kind and its events too), and the instances' crashes and stops."""
        lines = [heading]
        for lease_id in lease_ids:
            holder, lease = live[lease_id]
            state = f" (crashed at {crashed[holder]:.3f})" if holder in crashed else ""
            since = granted_at.get(lease_id)
            line = f"    {lease_id} at {holder}{state}" + (f", since {since:.3f}" if since else "")
            if not detailed:
                lines.append(line)
                continue
            kind = "unreserved" if lease.unreserved else "reserved"
            lines.append(f"{line} ({lease.kind.value}, {kind})")
            lines.extend(f"      {e.describe()}" for e in lease_events[lease_id])
        lines.append("  instances: " + (", ".join(e.describe() for e in lifecycle) or "-"))
        return "\n".join(lines)

    def key_context(key: str, at: float) -> str:
        return leases_context(f"  live leases of the key at {at:.3f}:", sorted(per_key[key]), False)

    def pair_context(pair: tuple[str, str], at: float) -> str:
        ids = sorted(per_pair[pair], key=lambda i: granted_at.get(i, 0.0))
        return leases_context(f"  live leases on {pair[0]}/{pair[1]} at {at:.3f}:", ids, True)

    def end(lease_id: str) -> None:
        holder_lease = live.pop(lease_id, None)
        if holder_lease is None:
            return
        lease = holder_lease[1]
        per_pair[lease.pair].discard(lease_id)
        unreserved[lease.pair].discard(lease_id)
        if lease.pin_id is not None:
            per_pin[lease.pin_id].discard(lease_id)
        if lease.key is not None:
            per_key[lease.key].discard(lease_id)

    for index, event in enumerate(ordered):
        while expiries and expiries[0][0] <= event.at:
            _, lease_id = heapq.heappop(expiries)
            held = live.get(lease_id)
            if held is not None and held[0] in crashed:
                end(lease_id)
        where = event.instance
        if event.kind in ("crashed", "stopped"):
            lifecycle.append(event)
            crashed[event.instance] = event.at
            for lease_id, (holder, _) in live.items():
                if holder == event.instance:
                    heapq.heappush(expiries, (event.at + lease_timeout, lease_id))
            # Its pins are in limbo: only in the bucket, used by nobody, until the shard's next
            # owner adopts them (pin_added, within that owner's quota) or refuses them.
            for skey, (provider, _, holder) in pins.items():
                if holder == event.instance:
                    pins_per_pair[(provider, skey[0])].discard(skey)
            continue
        if event.kind == "fenced":
            # It decides nothing from its fence on: the pins its ledger holds then are used by
            # nobody until it drops them (the shard's next owner adopts their bucket copies, or
            # the session pins again where a write had not landed). A pin it adds later counts.
            lifecycle.append(event)
            dropped = fenced.setdefault(event.instance, (event.at, set()))[1]
            for skey, (provider, pin_id, holder) in list(pins.items()):
                if holder == event.instance:
                    del pins[skey]
                    pins_per_pair[(provider, skey[0])].discard(skey)
                    dropped.add(pin_id)
            continue
        if event.lease is not None:
            lease_events[event.lease.lease_id].append(event)
        if event.kind in ("granted", "adopted"):
            lease = event.lease
            assert lease is not None
            granted_at.setdefault(lease.lease_id, event.at)
            pair = lease.pair
            lim = limits_at(event.at).get(pair)
            current = live.get(lease.lease_id)
            if event.kind == "granted" and current is not None:
                violations.append(
                    Violation(
                        "double",
                        lease.lease_id,
                        index,
                        f"granted by {where} while live at {current[0]}",
                    )
                )
            fence = fenced.get(where)
            if (
                event.kind == "granted"
                and fence is not None
                # decided after the fence: the decision's own time (its instance's clock, the
                # fence's), not when the trail recorded it (a stall between the two moves that)
                and lease.granted_at > fence[0]
                and lease.pin_id is not None
                and lease.pin_id in fence[1]
            ):
                violations.append(
                    Violation(
                        "fenced",
                        lease.lease_id,
                        index,
                        f"granted by {where} on pin {lease.pin_id}, which it held when fenced "
                        f"at {fence[0]:.3f}",
                        "  instances: " + (", ".join(e.describe() for e in lifecycle) or "-"),
                    )
                )
            if event.kind == "granted" and event.quota is not None and event.use is not None:
                q, (leases, unres, _) = event.quota, event.use
                if leases >= q.g or (lease.unreserved and unres >= q.u):
                    violations.append(
                        Violation(
                            "quota",
                            lease.lease_id,
                            index,
                            f"{where} granted with use {leases}/{unres} at quota g={q.g} u={q.u}",
                        )
                    )
            end(lease.lease_id)
            live[lease.lease_id] = (where, lease)
            if where in crashed:
                # Granted while its instance was being killed (a kill is not instantaneous: a
                # decision in flight may still land): if its edge got the reply, nobody else
                # confirms it, so the edge ends it within lease_timeout like the others.
                heapq.heappush(expiries, (event.at + lease_timeout, lease.lease_id))
            per_pair[pair].add(lease.lease_id)
            if lease.unreserved:
                unreserved[pair].add(lease.lease_id)
            if lease.pin_id is not None and lease.kind.value in ("pinned", "new_pin"):
                per_pin[lease.pin_id].add(lease.lease_id)
            if lease.key is not None and lease.key_limit is not None:
                per_key[lease.key].add(lease.lease_id)
                if len(per_key[lease.key]) > lease.key_limit:
                    violations.append(
                        Violation(
                            "IK",
                            lease.lease_id,
                            index,
                            f"{len(per_key[lease.key])} live leases of API key {lease.key} > "
                            f"max_parallel_requests={lease.key_limit}",
                            key_context(lease.key, event.at),
                        )
                    )
            if lim is not None:
                g = lim.max_global_in_flight_request_slots
                r = min(lim.global_in_flight_request_slots_reserved_for_pinned_sessions, g)
                s = lim.max_per_session_in_flight_request_slots
                if len(per_pair[pair]) > g:
                    violations.append(
                        Violation(
                            "I2a",
                            lease.lease_id,
                            index,
                            f"{len(per_pair[pair])} live leases on {pair[0]}/{pair[1]} > G={g}",
                            pair_context(pair, event.at),
                        )
                    )
                if len(unreserved[pair]) > g - r:
                    violations.append(
                        Violation(
                            "I2b",
                            lease.lease_id,
                            index,
                            f"{len(unreserved[pair])} unreserved "
                            f"leases on {pair[0]}/{pair[1]} > G-R={g - r}",
                            pair_context(pair, event.at),
                        )
                    )
                if lease.pin_id is not None and len(per_pin[lease.pin_id]) > s:
                    violations.append(
                        Violation(
                            "I2c",
                            lease.lease_id,
                            index,
                            f"pin {lease.pin_id} lists {len(per_pin[lease.pin_id])} leases > S={s}",
                        )
                    )
        elif event.kind == "ended":
            lease = event.lease
            assert lease is not None
            held = live.get(lease.lease_id)
            # An instance's end of a lease counts where it holds it; one its edge ended while
            # its shard was on the way to `where` counts wherever it was last held.
            if held is not None and (held[0] == where or event.reason == ENDED_IN_TRANSIT):
                end(lease.lease_id)
        elif event.kind == "pin_added":
            assert event.pin is not None
            provider, model, session, pin_id = event.pin
            skey = (model, session)
            if where in fenced:
                # Joined again after its fence and adopted the bucket's copy of a pin it held
                # then: from here on it decides with it as any owner does.
                fenced[where][1].discard(pin_id)
            live_pin = pins.get(skey)
            if live_pin is not None and live_pin[1] != pin_id and live_pin[2] not in crashed:
                violations.append(
                    Violation(
                        "I3",
                        f"{model}/{session}",
                        index,
                        f"pin {pin_id} added by {where} while pin {live_pin[1]} lives at {live_pin[2]}",
                        f"  the live pin: {added_by[skey].describe()}\n"
                        + "  instances: "
                        + (", ".join(e.describe() for e in lifecycle) or "-")
                        + "\n"
                        + "\n".join(
                            f"    {e.describe()}"
                            for e in pin_events[(live_pin[0], model)]
                            if e.pin is not None and e.pin[2] == session
                        ),
                    )
                )
            if (
                event.quota is not None
                and event.use is not None
                and event.use.pins >= event.quota.p
            ):
                violations.append(
                    Violation(
                        "quota",
                        f"{model}/{session}",
                        index,
                        f"{where} took pin {pin_id} with {event.use.pins} pins at quota "
                        f"p={event.quota.p}",
                    )
                )
            if live_pin is not None:
                pins_per_pair[(live_pin[0], model)].discard(skey)
            pins[skey] = (provider, pin_id, where)
            pins_per_pair[(provider, model)].add(skey)
            added_by[skey] = event
            pin_events[(provider, model)].append(event)
            lim = limits_at(event.at).get((provider, model))
            if lim is not None and len(pins_per_pair[(provider, model)]) > lim.max_pinned_sessions:
                violations.append(
                    Violation(
                        "I2d",
                        f"{model}/{session}",
                        index,
                        f"{len(pins_per_pair[(provider, model)])} live pins on {provider}/{model} "
                        f"> P={lim.max_pinned_sessions}",
                        pin_context((provider, model)),
                    )
                )
        elif event.kind == "pin_removed":
            assert event.pin is not None
            provider, model, session, pin_id = event.pin
            skey = (model, session)
            pin_events[(provider, model)].append(event)
            live_pin = pins.get(skey)
            if live_pin is not None and live_pin[1] == pin_id and live_pin[2] == where:
                del pins[skey]
                pins_per_pair[(provider, model)].discard(skey)
    return violations
