"""Reading spend back: every edge's daily totals from the spend bucket, summed (pure over the
entries; `read_spend` does the one bucket listing)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmgw.core.spend import SPEND_KEY_PREFIX, SpendTotals
from llmgw.wire import SpendTotalsReport

if TYPE_CHECKING:
    from llmgw.state.nats_kv import NatsKV


@dataclass(slots=True)
class SpendRecord:
    """Totals per UTC day, summed over the edges; the currency the edges counted in."""

    days: dict[str, SpendTotals] = field(default_factory=dict)
    edges: set[str] = field(default_factory=set)
    currencies: set[str] = field(default_factory=set)

    def add(self, report: SpendTotalsReport) -> None:
        totals = self.days.setdefault(report.day, SpendTotals())
        totals.merge(SpendTotals.from_wire(report.rows))
        self.edges.add(report.edge)
        self.currencies.add(report.currency)

    def between(self, first: str, last: str) -> SpendTotals:
        """The sum of the days from `first` to `last` (``YYYY-MM-DD``, inclusive; a month
        ``YYYY-MM`` matches its days)."""
        out = SpendTotals()
        for day, totals in self.days.items():
            if first <= day[: len(first)] and day[: len(last)] <= last:
                out.merge(totals)
        return out


def record_of(values: Iterable[bytes]) -> SpendRecord:
    record = SpendRecord()
    for value in values:
        try:
            report = SpendTotalsReport.model_validate_json(value)
        except ValueError:
            continue
        record.add(report)
    return record


async def read_spend(bucket: NatsKV) -> SpendRecord:
    entries = await bucket.list(SPEND_KEY_PREFIX)
    return record_of(entry.value for entry in entries if entry.value)


async def open_spend_reader(js: object, name: str) -> NatsKV | None:
    """The spend bucket for reading (never created here); None when there is none yet."""
    from nats.js.errors import NotFoundError

    from llmgw.state.nats_kv import NatsKV

    try:
        info = await js.stream_info(f"KV_{name}")  # type: ignore[attr-defined]
    except NotFoundError:
        return None
    return NatsKV(js, name, direct=bool(info.config.allow_direct))  # type: ignore[arg-type]
