"""Endpoint load as an admission instance sees it: scraper reports plus grants not yet visible.

`LoadBoard` is in-memory and synchronous (the decision path reads it without I/O); `LoadFollower`
keeps it current from the load bucket the scraper writes (llmgw.load): it reads every endpoint's
latest report at start, so a new instance has current state at once, then follows a KV watch.

A grant made at time t for endpoint e (by this instance or, via flow-control gossip, another)
counts against e's saturation until the edge announces the request's end, or a report of e
scraped at or after t + `visibility_margin` arrives (by then the engine's own running/waiting numbers include the request), or until it is
``router.stale_after`` old. Without this, a burst granted between two scrapes would pass the
saturation check en masse (seed 002).

Health: each report's ``healthy`` goes to the `HealthBoard`, which the provider catalog reads to
mark a managed provider degraded for a model when none of its endpoints serving it is healthy.
An endpoint no report has mentioned counts as healthy and stale (saturated, never dropped).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from pydantic import ValidationError

from llmgw.core.flow import PoolView
from llmgw.core.saturation import EndpointLoad, SaturationSettings
from llmgw.core.saturation import update as update_load
from llmgw.load import REPORT_KEY_PREFIX, EndpointReport
from llmgw.services.admission.health import HealthBoard

if TYPE_CHECKING:
    from llmgw.config.schema import Config
    from llmgw.state.kv import KVStore

log = logging.getLogger("llmgw.admission.load")

# Seconds between a grant and the first scrape that can be trusted to show its request: the
# edge's lease handling and dispatch to the engine come first (a few ms; this allows for a busy
# host). Capped at a quarter of the scrape interval: a longer margin counts each grant twice for
# a whole scrape (in the engine's numbers and as pending), which leaves batch slots idle.
MAX_VISIBILITY_MARGIN = 0.1


def visibility_margin(config: Config) -> float:
    return min(MAX_VISIBILITY_MARGIN, config.router.scrape_interval / 4)


def saturation_settings(config: Config) -> SaturationSettings:
    return SaturationSettings(
        target_waiting=config.scoring.target_waiting,
        kv_ceiling=config.scoring.kv_ceiling,
        stale_after=config.router.stale_after,
    )


class LoadBoard:
    """Latest load per managed endpoint, with pending grants; reads never block or do I/O."""

    def __init__(self, config: Config, health: HealthBoard) -> None:
        self.settings = saturation_settings(config)
        self.visibility_margin = visibility_margin(config)
        self.health = health
        managed = {p.id for p in config.providers if p.kind == "managed"}
        self._endpoints = [e.id for e in config.endpoints if e.provider in managed]
        self._serving: dict[str, list[str]] = {}
        for endpoint in config.endpoints:
            if endpoint.provider in managed:
                for model in endpoint.models:
                    self._serving.setdefault(model, []).append(endpoint.id)
        self._loads: dict[str, EndpointLoad] = {e: EndpointLoad() for e in self._endpoints}
        # Requests an endpoint takes before counting as full: scoring.target_inflight, scaled by
        # its weight relative to the heaviest endpoint (weights are relative capacities).
        top_weight = max((e.weight for e in config.endpoints if e.provider in managed), default=1)
        self._inflight_capacity = {
            e.id: config.scoring.target_inflight * e.weight / top_weight
            for e in config.endpoints
            if e.provider in managed
        }
        self._health_at: dict[str, float] = {}
        self._pending: dict[str, list[float]] = {e: [] for e in self._endpoints}
        self._ended_since_sample: dict[str, int] = {e: 0 for e in self._endpoints}
        self.reports = 0

    def knows(self, endpoint_id: str) -> bool:
        return endpoint_id in self._loads

    def apply(self, report: EndpointReport) -> None:
        """Take a report in; older reports than the one held (another scraper's) teach capacity only."""
        endpoint_id = report.endpoint
        load = self._loads.get(endpoint_id)
        if load is None:
            return  # not a managed endpoint of this config
        self.reports += 1
        if report.scraped_at >= self._health_at.get(endpoint_id, float("-inf")):
            self._health_at[endpoint_id] = report.scraped_at
            self.health.set_healthy(endpoint_id, report.healthy)
        # The scraper's learned capacity is a floor (another scraper may have seen more).
        load = EndpointLoad(max(load.capacity, report.capacity), load.sample, load.sampled_at)
        if report.sample is not None:
            load = update_load(load, report.sample.to_core(), report.scraped_at)
        self._loads[endpoint_id] = load
        if load.sampled_at != report.scraped_at:
            return  # no sample, or older than the one held: it taught capacity only
        self._ended_since_sample[endpoint_id] = 0
        pending = self._pending[endpoint_id]
        del pending[: bisect.bisect_right(pending, report.scraped_at - self.visibility_margin)]

    def record_grant(self, endpoint_id: str, at: float) -> None:
        pending = self._pending.get(endpoint_id)
        if pending is not None:
            bisect.insort(pending, at)

    def forget_grant(self, endpoint_id: str, at: float) -> bool:
        """Undo `record_grant` (the request went elsewhere, or ended); False if not pending."""
        pending = self._pending.get(endpoint_id)
        if pending:
            index = bisect.bisect_left(pending, at)
            if index < len(pending) and pending[index] == at:
                del pending[index]
                return True
        return False

    def request_ended(self, endpoint_id: str, granted_at: float, ended_at: float) -> None:
        """A request counted on `endpoint_id` ended (the edge's RequestDone).

        Still pending: it stops counting. Otherwise, if the last sample showed it (granted early
        enough to be visible, ended after the scrape), that sample now overstates the engine by
        one until the next scrape: counted in ``_ended_since_sample``. Both keep inflight exact
        between scrapes, so a finished request's slot is refilled at once rather than at the
        next scrape (which would let batches fill in synchronized bursts).
        """
        if self.forget_grant(endpoint_id, granted_at):
            return
        load = self._loads.get(endpoint_id)
        if load is None or load.sampled_at is None:
            return
        if granted_at + self.visibility_margin <= load.sampled_at < ended_at:
            self._ended_since_sample[endpoint_id] += 1

    def pending(self, endpoint_id: str, now: float) -> int:
        pending = self._pending[endpoint_id]
        del pending[: bisect.bisect_left(pending, now - self.settings.stale_after)]
        return len(pending)

    def inflight(self, endpoint_id: str, now: float) -> int:
        """Engine running + waiting at its last scrape, less what ended since, plus new grants."""
        sample = self._loads[endpoint_id].sample
        seen = sample.running + sample.waiting if sample is not None else 0
        seen = max(0, seen - self._ended_since_sample[endpoint_id])
        return seen + self.pending(endpoint_id, now)

    def load(self, endpoint_id: str) -> EndpointLoad:
        return self._loads[endpoint_id]

    def scrape_age(self, endpoint_id: str, now: float) -> float | None:
        sampled_at = self._loads[endpoint_id].sampled_at
        return None if sampled_at is None else max(0.0, now - sampled_at)

    def endpoints(self) -> list[str]:
        return list(self._endpoints)

    def view(self, endpoint_ids: Iterable[str], now: float) -> PoolView | None:
        """A pool view over the given managed endpoints that are healthy; None if there are none."""
        ids = [e for e in endpoint_ids if e in self._loads and self.health.is_healthy(e)]
        if not ids:
            return None
        return PoolView(
            {e: self._loads[e] for e in ids},
            {e: self.inflight(e, now) for e in ids},
            now,
            self.settings,
            {e: self._inflight_capacity[e] for e in ids},
        )

    def pool(self, model: str, now: float) -> PoolView | None:
        """The healthy managed endpoints serving `model`; None when there are none."""
        return self.view(self._serving.get(model, ()), now)


class LoadFollower:
    """Keeps a `LoadBoard` current from the load bucket (read at start, then a KV watch)."""

    def __init__(
        self,
        board: LoadBoard,
        kv: KVStore,
        on_report: Callable[[EndpointReport], None] | None = None,
    ) -> None:
        self._board = board
        self._kv = kv
        self._on_report = on_report
        self._task: asyncio.Task[None] | None = None

    def _apply(self, raw: bytes) -> None:
        try:
            report = EndpointReport.model_validate_json(raw)
        except ValidationError as exc:
            log.warning("ignoring a load report that does not parse: %s", exc.errors()[:1])
            return
        self._board.apply(report)
        if self._on_report is not None:
            self._on_report(report)

    async def start(self) -> None:
        for entry in await self._kv.list(REPORT_KEY_PREFIX):
            self._apply(entry.value)
        self._task = asyncio.create_task(self._follow(), name="load-follower")

    async def _follow(self) -> None:
        while True:
            try:
                async for entry in self._kv.watch(REPORT_KEY_PREFIX):
                    if not entry.deleted:
                        self._apply(entry.value)
            except asyncio.CancelledError:
                raise
            except Exception:  # the connection is gone for good, or the stream was deleted
                log.warning("load watch ended; retrying in 1 s", exc_info=True)
                await asyncio.sleep(1.0)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
