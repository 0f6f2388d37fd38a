"""Endpoint load as an admission instance sees it: the gateway's own accounting plus engine reports.

Inflight of a managed endpoint = this instance's live leases on it (exact: its ledger) + every
other admission instance's (their `FlowLoad` gossip, forgotten after `PEER_FORGET_AFTER`) + the
engine's *foreign* load (requests its metrics show that the gateway did not send). So a request
counts from the moment it is granted to the moment its end message arrives: no lag behind the
scraper, and no request counted after it ended (the phantom load a scrape-based count has).

Foreign load is estimated at each report: what the engine reported running + waiting, minus the
most the gateway had on it in the `FOREIGN_WINDOW` before the scrape (so requests that ended
around the scrape, or whose end message crossed the report, are not mistaken for somebody
else's; grants made after the scrape are not subtracted, they are not in the engine's count),
never below 0.

Batch capacity is stated or learned (`llmgw.core.saturation`). Stated: the configuration's
(``endpoints[].capacity``, else a simulated engine's ``max_num_seqs``), else the engine's own
statement in the reports (``stated_capacity``). Learned: from ``scoring.target_inflight`` scaled
by the endpoint's weight, raised by the high-water mark of running (the scraper's and this
board's readings) and by the gateway's own count on the endpoint at a scrape whose reading
showed none waiting (the least the gateway had on it in the `FOREIGN_WINDOW` up to the scrape:
the engine ran at least that many at once). Never 0.

Health: each report's ``healthy`` goes to the `HealthBoard`. An endpoint no report has mentioned
counts as healthy and stale (saturated, never dropped). Context window: the one its engine last
reported (`window`), kept while later reports do not say. `LoadFollower` keeps the board current
from the load bucket (read at start, then a KV watch).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

from pydantic import ValidationError

from llmgw.core.context import ContextWindow
from llmgw.core.flow import PoolView
from llmgw.core.saturation import (
    EndpointLoad,
    SaturationSettings,
    endpoint_saturation,
    state,
)
from llmgw.core.saturation import update as update_load
from llmgw.load import (
    REPORT_KEY_PREFIX,
    EndpointReport,
    capacity_floors,
    configured_capacities,
)
from llmgw.services.admission.health import HealthBoard
from llmgw.tasks import cancel_and_wait

if TYPE_CHECKING:
    from llmgw.config.schema import Config
    from llmgw.state.kv import KVStore

log = logging.getLogger("llmgw.admission.load")

PEER_FORGET_AFTER = 3.0  # seconds: a peer's load not refreshed for this long is dropped
_BUCKET = 0.05  # seconds per history bucket of the gateway's inflight
_HISTORY = 4.0  # seconds of history kept (more than a scrape's round trip)
# Seconds before a scrape in which the gateway's own inflight is compared with the engine's
# reading: clock skew between scraper and admission, and requests in flight to the engine.
FOREIGN_WINDOW = 0.1


def saturation_settings(config: Config) -> SaturationSettings:
    return SaturationSettings(
        target_waiting=config.scoring.target_waiting,
        kv_ceiling=config.scoring.kv_ceiling,
        stale_after=config.router.stale_after,
    )


class LoadBoard:
    """Latest load per managed endpoint; reads never block or do I/O."""

    def __init__(self, config: Config, health: HealthBoard) -> None:
        self.settings = saturation_settings(config)
        self.health = health
        self.floors = capacity_floors(config)
        self._configured = configured_capacities(config)
        self._endpoints = list(self.floors)
        self._serving = _serving(config)
        self._loads: dict[str, EndpointLoad] = {
            e: EndpointLoad(self.floors[e], stated=e in self._configured) for e in self.floors
        }
        # The latest report of an endpoint this board does not know (yet): one added to the
        # fleet whose first scrape arrived before the fleet's change did.
        self._unknown: dict[str, EndpointReport] = {}
        self._own: dict[str, int] = {}
        self._peers: dict[str, tuple[float, dict[str, int]]] = {}
        self._foreign: dict[str, int] = {}
        # Per endpoint: (bucket, max, min, last) of the gateway's count, and the last count
        # before the oldest bucket kept.
        self._history: dict[str, deque[tuple[int, int, int, int]]] = {
            e: deque() for e in self.floors
        }
        self._baseline: dict[str, int] = {}
        self._health_at: dict[str, float] = {}
        self._metrics_mode: dict[str, str] = {}
        self._windows: dict[str, ContextWindow] = {}  # each engine's context window, reported
        self.reports = 0

    def knows(self, endpoint_id: str) -> bool:
        return endpoint_id in self._loads

    def endpoints(self) -> list[str]:
        return list(self._endpoints)

    def serving(self, model: str) -> list[str]:
        return list(self._serving.get(model, ()))

    # ---- inputs -----------------------------------------------------------------------------

    def set_own(self, endpoint_id: str, count: int, now: float) -> None:
        """This instance's live leases on the endpoint (from its ledger)."""
        if endpoint_id not in self._loads:
            return
        self._own[endpoint_id] = count
        self._record(endpoint_id, now)

    def peer_load(
        self, instance: str, at: float, inflight: dict[str, int], now: float, *, full: bool = True
    ) -> bool:
        """Another instance's live leases per endpoint (its gossip): all of them (`full`), or
        the endpoints that changed. True if it holds fewer on some endpoint than before (a
        request of its ended: it may have quota idle again)."""
        previous = self._peers.get(instance)
        before = previous[1] if previous is not None else {}
        counts = {} if full or previous is None else dict(before)
        counts.update(inflight)
        self._peers[instance] = (at, counts)
        touched = set(inflight) | set(before)
        for endpoint in touched:
            if endpoint in self._loads:
                self._record(endpoint, now)
        return any(counts.get(e, 0) < n for e, n in before.items())

    def forget_peer(self, instance: str) -> None:
        self._peers.pop(instance, None)

    def apply(self, report: EndpointReport) -> None:
        """Take a report in; older reports than the one held (another scraper's) teach capacity
        only."""
        endpoint_id = report.endpoint
        load = self._loads.get(endpoint_id)
        if load is None:  # not a managed endpoint of this config (yet)
            known = self._unknown.get(endpoint_id)
            if known is None or known.scraped_at <= report.scraped_at:
                self._unknown[endpoint_id] = report
            return
        self.reports += 1
        if report.scraped_at >= self._health_at.get(endpoint_id, float("-inf")):
            self._health_at[endpoint_id] = report.scraped_at
            self.health.set_healthy(endpoint_id, report.healthy)
            if report.context_window is not None:
                self._windows[endpoint_id] = ContextWindow(
                    report.context_window, report.window_holds_output
                )
        sample = report.sample.to_core() if report.sample is not None else None
        if endpoint_id not in self._configured and report.stated_capacity is not None:
            load = state(load, report.stated_capacity)  # the engine's own word
        elif not load.stated or endpoint_id in self._configured:
            # The scraper's capacity is a floor too (another scraper may have seen more).
            load = replace(load, capacity=max(load.capacity, report.capacity))
        gateway = self._gateway_least_around(endpoint_id, report.scraped_at)
        load = update_load(load, sample, report.scraped_at, gateway)
        self._loads[endpoint_id] = load
        if sample is not None and load.sampled_at == report.scraped_at:
            engine = (sample.running or 0) + (sample.waiting or 0)
            ours = self._gateway_max_around(endpoint_id, report.scraped_at)
            self._foreign[endpoint_id] = max(0, engine - ours)
        elif sample is None:
            self._foreign[endpoint_id] = 0
        self._metrics_mode[endpoint_id] = report.metrics or (
            "full" if sample is not None and sample.complete else "partial" if sample else "none"
        )

    def reconfigure(self, config: Config, draining: frozenset[str] = frozenset()) -> None:
        """Follow a change of the live fleet: a new managed endpoint starts from its capacity
        floor (and the latest report already seen for it), one that left is forgotten, and a
        changed capacity takes effect (the scrapes raise it again if the engine runs more). A
        draining endpoint stays counted but is in no model's pool: flow control does not count
        its free slots, which take no new work."""
        self.settings = saturation_settings(config)  # `scoring`, applied live too
        floors = capacity_floors(config)
        previous, self._configured = self._configured, configured_capacities(config)
        for endpoint_id in [e for e in self._loads if e not in floors]:
            for table in (self._loads, self._own, self._foreign, self._history):
                table.pop(endpoint_id, None)
            self._baseline.pop(endpoint_id, None)
            self._health_at.pop(endpoint_id, None)
            self._metrics_mode.pop(endpoint_id, None)
            self._windows.pop(endpoint_id, None)
        for endpoint_id, floor in floors.items():
            load = self._loads.get(endpoint_id)
            stated = endpoint_id in self._configured
            if load is None:
                self._loads[endpoint_id] = EndpointLoad(floor, stated=stated)
                self._history[endpoint_id] = deque()
                report = self._unknown.pop(endpoint_id, None)
                if report is not None:
                    self.apply(report)
            elif floor != self.floors.get(endpoint_id) or stated != (endpoint_id in previous):
                self._loads[endpoint_id] = EndpointLoad(
                    floor, load.sample, load.sampled_at, load.reported_at, stated
                )
        self.floors = floors
        self._endpoints = list(floors)
        self._serving = {
            model: [e for e in ids if e not in draining] for model, ids in _serving(config).items()
        }

    # ---- the gateway's inflight history (for the foreign-load estimate) -----------------------

    def _gateway(self, endpoint_id: str, now: float) -> int:
        own = self._own.get(endpoint_id, 0)
        if not self._peers:  # the only instance (admission in the edge): several calls a request
            return own
        peers = sum(
            counts.get(endpoint_id, 0)
            for at, counts in self._peers.values()
            if now - at <= PEER_FORGET_AFTER
        )
        return own + peers

    def _record(self, endpoint_id: str, now: float) -> None:
        """Note the gateway's count on the endpoint now: per 50 ms bucket its max, its min and
        its last."""
        history = self._history[endpoint_id]
        bucket = int(now / _BUCKET)
        value = self._gateway(endpoint_id, now)
        if history and history[-1][0] == bucket:
            _, top, least, _ = history[-1]
            history[-1] = (bucket, max(top, value), min(least, value), value)
            return
        history.append((bucket, value, value, value))
        horizon = bucket - int(_HISTORY / _BUCKET)
        while history and history[0][0] < horizon:
            self._baseline[endpoint_id] = history.popleft()[3]

    def _gateway_around(self, endpoint_id: str, at: float) -> tuple[int, int]:
        """The most and the least the gateway had on the endpoint in the FOREIGN_WINDOW up to
        `at` (the count in force as the window opens included)."""
        first = int((at - FOREIGN_WINDOW) / _BUCKET)
        last = int(at / _BUCKET)
        carried = self._baseline.get(endpoint_id, 0)  # the count in force as the window opens
        top = least = None
        for bucket, high, low, final in self._history[endpoint_id]:
            if bucket < first:
                carried = final
            elif bucket <= last:
                top = high if top is None else max(top, high)
                least = low if least is None else min(least, low)
        if top is None or least is None:
            return carried, carried
        return max(carried, top), min(carried, least)

    def _gateway_max_around(self, endpoint_id: str, at: float) -> int:
        """The most the gateway had on the endpoint in the FOREIGN_WINDOW up to `at`."""
        return self._gateway_around(endpoint_id, at)[0]

    def _gateway_least_around(self, endpoint_id: str, at: float) -> int:
        """The least the gateway had on the endpoint in the FOREIGN_WINDOW up to `at`: requests
        it surely had out when the engine was read (what a reading of none waiting teaches a
        learned capacity)."""
        return self._gateway_around(endpoint_id, at)[1]

    # ---- reading ----------------------------------------------------------------------------

    def own(self, endpoint_id: str) -> int:
        return self._own.get(endpoint_id, 0)

    def foreign(self, endpoint_id: str) -> int:
        return self._foreign.get(endpoint_id, 0)

    def inflight(self, endpoint_id: str, now: float) -> int:
        """The gateway's live requests on the endpoint (every instance) plus foreign load."""
        return self._gateway(endpoint_id, now) + self._foreign.get(endpoint_id, 0)

    def load(self, endpoint_id: str) -> EndpointLoad:
        return self._loads[endpoint_id]

    def capacity(self, endpoint_id: str) -> int:
        return max(1, self._loads[endpoint_id].capacity)

    def window(self, endpoint_id: str) -> ContextWindow | None:
        """The context window the endpoint's engine last reported; None: it never did."""
        return self._windows.get(endpoint_id)

    def metrics_mode(self, endpoint_id: str) -> str:
        """ "full", "partial" or "none" (its own accounting only), by the latest report."""
        return self._metrics_mode.get(endpoint_id, "unknown")

    def saturation(self, endpoint_id: str, now: float) -> float:
        return endpoint_saturation(
            self._loads[endpoint_id], now, self.settings, self.inflight(endpoint_id, now)
        )

    def reading(self, endpoint_id: str, now: float) -> tuple[int, float, int]:
        """`inflight`, `saturation` and `capacity` of a known endpoint, read at once."""
        load = self._loads[endpoint_id]
        inflight = self.inflight(endpoint_id, now)
        return (
            inflight,
            endpoint_saturation(load, now, self.settings, inflight),
            max(1, load.capacity),
        )

    def scrape_age(self, endpoint_id: str, now: float) -> float | None:
        reported_at = self._loads[endpoint_id].reported_at
        return None if reported_at is None else max(0.0, now - reported_at)

    def view(self, endpoint_ids: Iterable[str], now: float) -> PoolView | None:
        """A pool view over the given managed endpoints that are healthy; None if none are."""
        ids = [e for e in endpoint_ids if e in self._loads and self.health.is_healthy(e)]
        if not ids:
            return None
        return PoolView(
            {e: self._loads[e] for e in ids},
            {e: self.inflight(e, now) for e in ids},
            now,
            self.settings,
        )

    def pool(self, model: str, now: float) -> PoolView | None:
        """The healthy managed endpoints serving `model`; None when there are none."""
        return self.view(self._serving.get(model, ()), now)


def _serving(config: Config) -> dict[str, list[str]]:
    """Model -> the managed endpoints serving it, in config order."""
    serving: dict[str, list[str]] = {}
    managed = {p.id for p in config.providers if p.kind == "managed"}
    for endpoint in config.endpoints:
        if endpoint.provider in managed:
            for model in endpoint.models:
                serving.setdefault(model, []).append(endpoint.id)
    return serving


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
        """Read the reports there are, then follow. A read that times out (JetStream not ready
        yet on a fresh cluster) does not fail the start: the watch replays the last report of
        every endpoint first, and retries until the bucket answers; until then the board knows
        no load (as for engines that publish no metrics)."""
        try:
            entries = await self._kv.list(REPORT_KEY_PREFIX)
        except TimeoutError:
            log.warning("the load bucket did not answer in time; following it as it comes up")
        else:
            for entry in entries:
                self._apply(entry.value)
        self._task = asyncio.create_task(self._follow(), name="load-follower")

    async def _follow(self) -> None:
        while self._task is not None:
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
            task, self._task = self._task, None
            await cancel_and_wait([task])
