"""An admission instance following the live fleet: each fleet change swaps its catalog.

`FleetFollower` turns every new `llmgw.fleet.Fleet` the mirror delivers into the config the
instance runs on (`llmgw.fleet.live_config`) and applies it in one synchronous call, so no
decision ever sees half of a change: the load board learns new endpoints (and forgets gone
ones), the rate board learns their ids, and a new `ProviderCatalog`, built from the new config
with the draining endpoints left out of placement, replaces the old one between two decisions.

An applied config (`llmgw config apply`) changes the same way (`llmgw.fleet.take_live`): the
models' fallbacks, the bands (flow control's table too: queued requests of a kept band keep
their places, those of a removed band are answered and asked again), scoring, balancer and the
providers (added, removed, their pairs and priorities) reach the next decision. Limits go to
the quota keeper: lowered ones cap this instance's grants at once (`QuotaJoins.change_limits`),
raised ones are taken up at its next adjustment; a pair that starts to have limits (added with
them, or given them) is granted on only once its book counts what runs on it everywhere
(`QuotaJoins.keep`, `llmgw.core.pairs`); one that stops having them (removed, or its limits
gone) stops counting at once (`QuotaJoins.release`). Nothing about leases and pins changes
here: the ledger counts leases by endpoint id and ends them by lease id, so a lease on an
endpoint, provider or model that drained or left still ends exactly once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from llmgw.config.schema import limits_from_config
from llmgw.core.pairs import PairChanges, pair_changes
from llmgw.fleet import Fleet, live_config, restart_only_changes
from llmgw.services.admission.catalog import ProviderCatalog

if TYPE_CHECKING:
    from llmgw.config.schema import Config
    from llmgw.services.admission.service import AdmissionService

log = logging.getLogger("llmgw.admission.fleet")


def apply_fleet(service: AdmissionService, base: Config, fleet: Fleet) -> Config:
    """Run `service` on `base` with `fleet`'s endpoints; the config it now runs on."""
    config = live_config(base, fleet)
    if fleet.config_revision != service.config_revision:
        answered = service.follow_config(config)
        if answered:
            log.info("%d queued requests of removed bands answered (asked again)", answered)
    table = limits_from_config(config)
    changes = pair_changes(service.limits, table)
    for pair, limits in changes.changed.items():
        log.info("limits of %s/%s changed: %s", *pair, limits)
        service.quotas.joins.change_limits(pair, limits)  # lowered: capped at once
    for pair in changes.released:
        log.info("limits of %s/%s no longer kept (%s)", *pair, _gone(pair, changes))
        service.quotas.joins.release(pair)  # its leases stop counting against limits at once
    for pair, limits in changes.kept.items():
        log.info("limits of %s/%s kept from now on: %s", *pair, limits)
        service.quotas.joins.keep(pair, limits)  # no grant on it until its book has joined
    for pair in changes.added - changes.kept.keys():
        log.info("pair %s/%s added, without limits", *pair)
    service.limits = table
    draining = fleet.view().draining
    service.load.reconfigure(config, draining)
    service.rates.reconfigure(config)
    service.prefixes.reconfigure(config)
    old = service.catalog
    catalog = ProviderCatalog(
        config,
        service.health,
        service.load,
        service.rates,
        service.breakers,
        service.ledger,
        clock=old.clock,
        draining=draining,
        prefixes=old.prefixes,
    )
    catalog.forced_degraded = old.forced_degraded
    service.catalog = catalog
    service.config = config
    service.fleet_revision = fleet.revision
    service.config_revision = fleet.config_revision
    return config


def _gone(pair: tuple[str, str], changes: PairChanges[object]) -> str:
    return "removed" if pair in changes.removed else "its limits removed"


class FleetFollower:
    """Applies each fleet snapshot to one admission instance (`apply_fleet`)."""

    def __init__(self, service: AdmissionService, base: Config) -> None:
        self.service = service
        self.base = base
        self.applied = 0
        self._shape: object = None  # what the last fleet held, heartbeats aside

    def __call__(self, fleet: Fleet) -> None:
        started = time.perf_counter()
        new_revision = fleet.config_revision != self.service.config_revision
        if fleet.applied is not None and new_revision:
            restart = restart_only_changes(self.base, fleet.applied)
            if restart:
                log.warning(
                    "the applied config (revision %d) changes %s: not live, in force after a "
                    "restart",
                    fleet.config_revision,
                    ", ".join(restart),
                )
        config = apply_fleet(self.service, self.base, fleet)
        if new_revision:
            providers = {p.id for p in config.providers}
            gone = sorted(
                i for i, r in fleet.records.items() if r.endpoint.provider not in providers
            )
            if gone:
                log.info(
                    "endpoints of providers the applied config (revision %d) does not have take "
                    "no work: %s (llmgw endpoints drain, then remove, deletes them)",
                    fleet.config_revision,
                    ", ".join(gone),
                )
        self.applied += 1
        shape = fleet.shape()
        changed, self._shape = shape != self._shape, shape
        # A registered engine's heartbeat is a write too: logged only when it changed more.
        log.log(
            logging.INFO if changed else logging.DEBUG,
            "fleet revision %d applied: %d endpoints (%d draining) in %.1f ms",
            fleet.revision,
            len(fleet.records),
            len(fleet.view().draining),
            (time.perf_counter() - started) * 1000,
        )


class FleetCollector(Collector):
    """The live fleet as this instance runs on it: endpoints by state, and the revisions of
    the fleet and of the applied config (0: none applied, the file's)."""

    def __init__(self, service: AdmissionService) -> None:
        self._service = service

    def collect(self) -> Iterator[GaugeMetricFamily]:
        service = self._service
        draining = service.catalog.draining
        endpoints = GaugeMetricFamily(
            "llmgw_admission_fleet_endpoints",
            "Endpoints of the live fleet this instance places on, by state (active: takes new "
            "work; draining: finishes what runs there).",
            labels=["state"],
        )
        ids = [e.id for e in service.config.endpoints]
        endpoints.add_metric(["active"], float(sum(i not in draining for i in ids)))
        endpoints.add_metric(["draining"], float(sum(i in draining for i in ids)))
        yield endpoints
        fleet = GaugeMetricFamily(
            "llmgw_admission_fleet_revision",
            "The fleet bucket's revision this instance runs on (compare instances: equal once "
            "a change reached them all).",
        )
        fleet.add_metric([], float(service.fleet_revision))
        yield fleet
        applied = GaugeMetricFamily(
            "llmgw_admission_config_revision",
            "The applied config's revision this instance runs on (llmgw config apply); 0: the "
            "config file it started with.",
        )
        applied.add_metric([], float(service.config_revision))
        yield applied
