"""What `llmgw state` shows (pure: no I/O), from one read of the routing bucket and the answers
of the live admission instances.

Input: the stored pins, the quota books, the member and shard keys, each admission instance's
`StateReply` (its live leases and pins per pair and its quota), and the scraper's latest report
of each managed endpoint (its load bucket): health, the engine's metrics dialect and load. Leases live only in
the instances that hold them (docs/adr/0002-*), so the lease counts are theirs: an instance that
did not answer is listed as silent and its leases are missing from the totals. A snapshot of a
moving system, not a transaction.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from llmgw.config.durations import format_duration
from llmgw.core.keys import MemberValue, PinValue, ShardValue
from llmgw.core.quota import PairLimits, QuotaBook, QuotaCounts
from llmgw.load import EndpointReport
from llmgw.wire import EndpointPrefixes, StateReply

__all__ = [
    "EndpointState",
    "InstanceReport",
    "PairReport",
    "PinReport",
    "StateReport",
    "build_report",
    "descendants",
    "format_report",
    "report_json",
]


@dataclass(frozen=True, slots=True)
class PairReport:
    """One provider/model pair. Maxima are None for a pair without limits."""

    provider: str
    model: str
    pins_stored: int = 0  # pins in the bucket (the durable copy)
    pins: int = 0  # pins the answering instances hold
    max_pins: int | None = None
    leases: int = 0  # live leases of the answering instances
    unreserved: int = 0
    max_leases: int | None = None
    reserved: int | None = None  # R
    max_per_session: int | None = None
    quota_leases: int = 0  # Σg of the book
    quota_unreserved: int = 0  # Σu
    quota_pins: int = 0  # Σp
    holders: Mapping[str, QuotaCounts] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PinReport:
    session: str
    model: str
    provider: str
    pin_id: str
    shard: int
    refreshed_at: float
    idle_for: float
    expires_in: float  # by the stored refreshed_at: the owner's in-memory clock may be newer
    parent: str | None = None  # a sub-agent's session: its parent session


@dataclass(frozen=True, slots=True)
class InstanceReport:
    instance: str
    alive: bool
    answered: bool
    shards: int
    leases: int
    edges: int


@dataclass(frozen=True, slots=True)
class EndpointState:
    """A managed endpoint by the scraper's latest report. ``dialect`` is the engine's metrics
    dialect (vllm, sglang, llamacpp, tgi; None: no load gauges, or unreadable), ``metrics``
    how much of it it shows (full, partial, none, error); a gauge it does not report is None;
    ``context_window``: the engine's context window as it reports it (None: not known)."""

    endpoint: str
    provider: str
    pool: str
    healthy: bool
    dialect: str | None
    metrics: str | None
    running: int | None
    waiting: int | None
    kv_usage: float | None
    capacity: int
    saturation: float | None
    age: float  # seconds since the scrape the report is of
    scraper: str
    metrics_error: str | None = None
    context_window: int | None = None


@dataclass(frozen=True, slots=True)
class StateReport:
    bucket: str
    at: float
    lease_timeout: float
    pin_inactivity_timeout: float
    shards: int
    owned_shards: int
    pairs: tuple[PairReport, ...]
    instances: tuple[InstanceReport, ...]
    pins: tuple[PinReport, ...]
    leases_by_kind: Mapping[str, int] = field(default_factory=dict)
    endpoints: tuple[EndpointState, ...] = ()
    load_bucket: str | None = None  # None: not read (no such bucket)
    # What the prefix indexes hold, as one answering instance sees it (every instance builds
    # the same from the prefix stream), and which instance that is.
    prefixes: tuple[EndpointPrefixes, ...] = ()
    prefixes_of: str | None = None


def build_report(
    *,
    bucket: str,
    now: float,
    limits: Mapping[tuple[str, str], PairLimits | None],
    pins: Iterable[tuple[str, PinValue]],
    books: Iterable[QuotaBook],
    members: Iterable[MemberValue],
    owners: Mapping[int, ShardValue],
    replies: Iterable[StateReply],
    shards: int,
    member_ttl: float,
    lease_timeout: float,
    pin_inactivity_timeout: float,
    endpoints: Iterable[EndpointReport] = (),
    load_bucket: str | None = None,
) -> StateReport:
    pairs: dict[tuple[str, str], dict[str, Any]] = {pm: {} for pm in limits}
    pin_reports = []
    for key, pin in pins:
        pair = pairs.setdefault((pin.provider, pin.model), {})
        pair["pins_stored"] = pair.get("pins_stored", 0) + 1
        idle = max(0.0, now - pin.refreshed_at)
        pin_reports.append(
            PinReport(
                pin.session,
                pin.model,
                pin.provider,
                pin.pin_id,
                int(key.split(".")[1]),
                pin.refreshed_at,
                idle,
                max(0.0, pin_inactivity_timeout - idle),
                pin.parent,
            )
        )
    for book in books:
        pair = pairs.setdefault((book.provider, book.model), {})
        g, u, p = book.totals()
        pair.update(quota_leases=g, quota_unreserved=u, quota_pins=p)
        pair["holders"] = {i: q.counts for i, q in sorted(book.holders.items())}
    kinds: dict[str, int] = {}
    answered = {}
    for reply in replies:
        answered[reply.instance] = reply
        for holding in reply.pairs:
            pair = pairs.setdefault((holding.provider, holding.model), {})
            pair["leases"] = pair.get("leases", 0) + holding.leases
            pair["unreserved"] = pair.get("unreserved", 0) + holding.unreserved
            pair["pins"] = pair.get("pins", 0) + holding.pins
        for kind, n in reply.leases_by_kind.items():
            kinds[kind] = kinds.get(kind, 0) + n
    owned: dict[str, int] = {}
    for value in owners.values():
        if value.owner is not None:
            owned[value.owner] = owned.get(value.owner, 0) + 1
    instances = []
    seen = set()
    for member in members:
        seen.add(member.instance)
        answer = answered.get(member.instance)
        instances.append(
            InstanceReport(
                member.instance,
                now < member.renewed_at + member_ttl,
                answer is not None,
                len(answer.shards) if answer else owned.get(member.instance, 0),
                sum(h.leases for h in answer.pairs) if answer else 0,
                answer.edges if answer else 0,
            )
        )
    for name, reply in answered.items():
        if name not in seen:
            instances.append(
                InstanceReport(
                    name,
                    True,
                    True,
                    len(reply.shards),
                    sum(h.leases for h in reply.pairs),
                    reply.edges,
                )
            )
    reports = []
    for (provider, model), data in sorted(pairs.items()):
        lim = limits.get((provider, model))
        reports.append(
            PairReport(
                provider=provider,
                model=model,
                max_pins=None if lim is None else lim.max_pinned_sessions,
                max_leases=None if lim is None else lim.max_global_in_flight_request_slots,
                reserved=None
                if lim is None
                else lim.global_in_flight_request_slots_reserved_for_pinned_sessions,
                max_per_session=None
                if lim is None
                else lim.max_per_session_in_flight_request_slots,
                **data,
            )
        )
    pin_reports = _as_trees(pin_reports)
    # The index of the instance that knows most (all read the same stream).
    seer = max(answered.values(), key=lambda r: len(r.prefixes), default=None)
    return StateReport(
        bucket,
        now,
        lease_timeout,
        pin_inactivity_timeout,
        shards,
        sum(1 for v in owners.values() if v.owner is not None),
        tuple(reports),
        tuple(sorted(instances, key=lambda i: i.instance)),
        tuple(pin_reports),
        kinds,
        tuple(_endpoint_state(r, now) for r in sorted(endpoints, key=lambda r: r.endpoint)),
        load_bucket,
        seer.prefixes if seer is not None else (),
        seer.instance if seer is not None and seer.prefixes else None,
    )


def _endpoint_state(report: EndpointReport, now: float) -> EndpointState:
    sample = report.sample
    return EndpointState(
        endpoint=report.endpoint,
        provider=report.provider,
        pool=report.pool,
        healthy=report.healthy,
        dialect=sample.dialect.value if sample is not None else None,
        metrics=report.metrics,
        running=sample.running if sample is not None else None,
        waiting=sample.waiting if sample is not None else None,
        kv_usage=sample.kv_usage if sample is not None else None,
        capacity=report.capacity,
        saturation=report.saturation,
        age=max(0.0, now - report.scraped_at),
        scraper=report.scraper,
        metrics_error=report.metrics_error,
        context_window=report.context_window,
    )


def report_json(report: StateReport, *, with_pins: bool) -> dict[str, Any]:
    """The machine-readable form (`llmgw state --json`); durations in seconds."""
    data = {"v": 2, **asdict(report)}
    data["prefixes"] = [endpoint.model_dump() for endpoint in report.prefixes]
    if not with_pins:
        del data["pins"]
    return data


def _of(used: int, limit: int | None) -> str:
    return str(used) if limit is None else f"{used}/{limit}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]


def format_report(report: StateReport, *, with_pins: bool) -> str:
    """The human-readable form: pairs, admission instances, and the pins if asked."""
    at = datetime.fromtimestamp(report.at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    lines = [
        f"routing bucket {report.bucket}: lease timeout {format_duration(report.lease_timeout)}, "
        f"pin inactivity timeout {format_duration(report.pin_inactivity_timeout)}",
        f"read at {at}; {report.owned_shards}/{report.shards} shards owned",
        "",
    ]
    rows = [
        [
            p.provider,
            p.model,
            _of(p.pins, p.max_pins)
            + (f" ({p.pins_stored} stored)" if p.pins_stored != p.pins else ""),
            _of(p.leases, p.max_leases),
            "-" if p.reserved is None else f"{p.leases - p.unreserved}/{p.reserved}",
            "-"
            if p.max_leases is None
            else f"{p.quota_leases}/{p.quota_unreserved}/{p.quota_pins}",
        ]
        for p in report.pairs
    ]
    lines += _table(
        ["provider", "model", "pins", "leases", "reserved in use", "quota held g/u/p"], rows
    )
    if report.leases_by_kind:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(report.leases_by_kind.items()))
        lines += ["", f"leases by kind: {kinds}"]
    lines += ["", "admission instances:"]
    if report.instances:
        lines += _table(
            ["instance", "alive", "answered", "shards", "leases", "edges"],
            [
                [
                    i.instance,
                    "yes" if i.alive else "no",
                    "yes" if i.answered else "no",
                    str(i.shards),
                    str(i.leases),
                    str(i.edges),
                ]
                for i in report.instances
            ],
        )
    else:
        lines.append("  none (start `llmgw admission`, or `llmgw up`)")
    lines += _endpoint_lines(report)
    lines += _prefix_lines(report)
    if with_pins:
        unwritten = sum(max(p.pins - p.pins_stored, 0) for p in report.pairs)
        lines += [
            "",
            f"pins ({len(report.pins)}, from the bucket"
            + (
                f"; {unwritten} more held in memory only: a new session's pin is written once "
                "it sends another request"
                if unwritten
                else ""
            )
            + "):",
        ]
    if with_pins and report.pins:
        depth = _depths(report.pins)
        lines += _table(
            ["session", "model", "provider", "shard", "idle", "expires in"],
            [
                [
                    "  " * depth[(p.model, p.session)]
                    + ("└ " if depth[(p.model, p.session)] else "")
                    + p.session,
                    p.model,
                    p.provider,
                    str(p.shard),
                    format_duration(round(p.idle_for)),
                    format_duration(round(p.expires_in)),
                ]
                for p in report.pins
            ],
        )
    return "\n".join(lines)


def _as_trees(pins: list[PinReport]) -> list[PinReport]:
    """`pins` by model, provider and session, each sub-agent's right below its parent's (a
    tree per conversation; a sub-agent whose parent has no pin is a root)."""
    held = {(p.model, p.session) for p in pins}
    children: dict[tuple[str, str], list[PinReport]] = {}
    roots: list[PinReport] = []
    for pin in sorted(pins, key=lambda p: (p.model, p.provider, p.session)):
        if pin.parent is not None and (pin.model, pin.parent) in held:
            children.setdefault((pin.model, pin.parent), []).append(pin)
        else:
            roots.append(pin)
    ordered: list[PinReport] = []
    seen: set[tuple[str, str]] = set()

    def visit(pin: PinReport) -> None:
        if (pin.model, pin.session) in seen:  # a cycle of parents: listed once
            return
        seen.add((pin.model, pin.session))
        ordered.append(pin)
        for child in children.get((pin.model, pin.session), ()):
            visit(child)

    for pin in roots:
        visit(pin)
    ordered += [p for p in pins if (p.model, p.session) not in seen]  # cycles without a root
    return ordered


def _depths(pins: tuple[PinReport, ...]) -> dict[tuple[str, str], int]:
    """How many ancestors with a pin each pin has (its indentation in the tree)."""
    parents = {(p.model, p.session): p.parent for p in pins}
    depth: dict[tuple[str, str], int] = {}
    for model, session in parents:
        n, at, seen = 0, parents[(model, session)], {session}
        while at is not None and (model, at) in parents and at not in seen:
            seen.add(at)
            n, at = n + 1, parents[(model, at)]
        depth[(model, session)] = n
    return depth


def descendants(pins: tuple[PinReport, ...], sessions: set[str]) -> set[str]:
    """`sessions` and every session whose parent chain reaches one of them."""
    found = set(sessions)
    grew = True
    while grew:
        grew = False
        for pin in pins:
            if pin.parent in found and pin.session not in found:
                found.add(pin.session)
                grew = True
    return found


def _maybe(value: float | None, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def _endpoint_lines(report: StateReport) -> list[str]:
    """Each managed endpoint by the scraper's latest report (dialect "-": no load gauges)."""
    if report.load_bucket is None:
        return [
            "",
            "endpoints: no load bucket read (none yet: start `llmgw scraper`, or `llmgw up`; "
            "or this NATS user may not read it)",
        ]
    lines = ["", f"endpoints (scraper reports in {report.load_bucket}):"]
    if not report.endpoints:
        return [*lines, "  none reported yet"]
    return lines + _table(
        [
            "endpoint",
            "provider",
            "healthy",
            "dialect",
            "metrics",
            "running",
            "waiting",
            "kv",
            "capacity",
            "saturation",
            "window",
            "age",
        ],
        [
            [
                e.endpoint,
                e.provider,
                "yes" if e.healthy else "no",
                e.dialect or "-",
                e.metrics or "-",
                _maybe(e.running),
                _maybe(e.waiting),
                _maybe(e.kv_usage, "{:.0%}"),
                str(e.capacity),
                _maybe(e.saturation, "{:.2f}"),
                _maybe(e.context_window),
                f"{e.age:.1f}s",
            ]
            for e in report.endpoints
        ],
    )


def _prefix_lines(report: StateReport) -> list[str]:
    """What each endpoint's prefix cache is believed to hold, and the prompt prefixes placed
    there most (by their first block's hash: prompts are never shown)."""
    if not report.prefixes:
        return []
    lines = ["", f"prefix caches (as {report.prefixes_of} sees them):"]
    rows = []
    for endpoint in report.prefixes:
        rows.append(
            [
                endpoint.endpoint,
                f"{endpoint.sent_blocks}/{endpoint.capacity_blocks}",
                str(endpoint.held_blocks),
                "",
                "",
                "",
            ]
        )
        for top in endpoint.top:
            ago = max(0.0, report.at - top.last_at)
            rows.append(
                ["", "", "", top.prefix, f"{top.placements} ({top.blocks} blocks)", f"{ago:.0f}s"]
            )
    return lines + _table(
        ["endpoint", "sent blocks", "held blocks", "top prefixes", "placements", "last"], rows
    )
