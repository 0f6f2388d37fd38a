"""One admission instance composed from the config: what `llmgw admission` runs, and what an
edge runs beside itself with ``admission.colocated`` (services/edge/colocated.py).

`open_admission` starts it on its own NATS connection (joined, holding its quotas, serving its
shards); `RunningAdmission.close` hands its shards over, leaves and closes the connection.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmgw import natsconn
from llmgw.events import EventPublisher, MemberEvent
from llmgw.fleet import live_config
from llmgw.services.admission.health import HealthBoard
from llmgw.services.admission.live import FleetCollector, FleetFollower, apply_fleet
from llmgw.services.admission.loadboard import LoadBoard, LoadFollower
from llmgw.services.admission.metrics import AdmissionMetrics
from llmgw.services.admission.service import AdmissionService
from llmgw.services.admission.spend import (
    BudgetAccounts,
    SpendRecorder,
    holder_ttl,
    open_spend_bucket,
)
from llmgw.services.admission.successor import remove_exited_member, supersede_name
from llmgw.state.fleet import FleetMirror, start_fleet
from llmgw.state.setup import open_events_stream, open_load_bucket, open_routing_store
from llmgw.tracing import open_tracing

if TYPE_CHECKING:
    from llmgw.config import Config


__all__ = ["RunningAdmission", "open_admission", "remove_exited_member"]

log = logging.getLogger("llmgw.admission")


@dataclass
class RunningAdmission:
    service: AdmissionService
    metrics: AdmissionMetrics
    nc: Any
    follower: LoadFollower
    events: EventPublisher
    fleet: FleetMirror  # the live fleet it runs on (its admin port serves changes to it)
    spend: SpendRecorder | None = None
    budgets: BudgetAccounts | None = None

    async def close(self) -> None:
        """Hand every shard over (or release it), say goodbye, close the connection."""
        await self.service.stop()
        if self.budgets is not None:
            await self.budgets.stop()
        if self.spend is not None:
            await self.spend.stop()
        await self.events.publish(
            self.events.build(MemberEvent, event="member.left", member=self.service.instance)
        )
        await self.follower.stop()
        await self.fleet.stop()
        await natsconn.drain_or_close(self.nc)


async def open_admission(
    config: Config,
    instance: str,
    connection_name: str,
    *,
    supersedes: str | None = None,
    name: str | None = None,
) -> RunningAdmission:
    """Start one admission instance named `instance` on a connection of its own.

    `supersedes`: an instance known to be dead (its process exited: `llmgw up` restarting an
    edge that ran admission in process, or an admission process). Its member key is removed
    before this one joins, as the reaper would once its TTL had passed, so its shards are
    adopted at once instead of after ``admission.member_ttl``, and its quota is returned once
    they are (services/admission/successor.py). Only a supervisor that saw the process end may
    say so.

    `name`: the stable name the deployment gives this process (``admission.instance_name``):
    an earlier incarnation's key is taken for dead once it is no longer renewed, and
    `successor.NameInUse` is raised when it is (another process runs under the name)."""
    nc = await natsconn.connect(config.nats, name=connection_name)
    try:
        return await _open(config, nc, instance, supersedes, name)
    except BaseException:
        await natsconn.drain_or_close(nc)
        raise


async def _open(
    config: Config, nc: Any, instance: str, supersedes: str | None, name: str | None
) -> RunningAdmission:
    fleet = await start_fleet(nc, config, seed=True)
    try:
        return await _compose(config, fleet, nc, instance, supersedes, name)
    except BaseException:
        await fleet.stop()
        raise


async def _compose(
    base: Config,
    fleet: FleetMirror,
    nc: Any,
    instance: str,
    supersedes: str | None,
    name: str | None,
) -> RunningAdmission:
    # The file's endpoints until the fleet answers (then the first snapshot is applied).
    config = live_config(base, fleet.fleet) if fleet.ready.is_set() else base
    board = LoadBoard(config, HealthBoard())
    follower = LoadFollower(board, await open_load_bucket(nc, config))
    await follower.start()
    metrics = AdmissionMetrics()
    metrics.watch_load(board, [m.name for m in config.models])
    store = await open_routing_store(nc, config)
    await open_events_stream(nc, config)
    events = EventPublisher(nc, instance)
    gone: list[str] = []
    try:
        if supersedes is not None and await remove_exited_member(store, supersedes):
            gone.append(supersedes)
        if name is not None:
            gone += await supersede_name(
                store,
                name,
                heartbeat=config.admission.heartbeat,
                member_ttl=config.admission.member_ttl,
            )
    except BaseException:
        await follower.stop()
        raise
    for member in gone:
        events.emit(MemberEvent, event="member.expired", member=member)
    service = AdmissionService(
        config,
        nc,
        store,
        instance=instance,
        health=board.health,
        load=board,
        metrics=metrics,
        events=events,
        tracing=open_tracing("admission", config.tracing),
    )
    service.membership.name = name
    if fleet.ready.is_set():
        apply_fleet(service, base, fleet.fleet)  # draining endpoints out of placement
    fleet.on_change(FleetFollower(service, base))
    watch_service(metrics, service)
    await service.start()
    events.emit(MemberEvent, event="member.joined", member=service.instance)
    spend_bucket = await open_spend_bucket(nc, config)
    spend = SpendRecorder(nc, spend_bucket)
    await spend.start()
    budgets = BudgetAccounts(nc, spend_bucket, ttl=holder_ttl(config))
    await budgets.start()
    return RunningAdmission(service, metrics, nc, follower, events, fleet, spend, budgets)


def watch_service(metrics: AdmissionMetrics, service: AdmissionService) -> None:
    """Export what `service` holds: breakers, ledger (leases, pins, quotas), loans."""
    # The endpoints it runs on at each scrape: its config follows every fleet change.
    metrics.watch_breakers(service.breakers, lambda: [e.id for e in service.config.endpoints])
    metrics.watch_ledger(service.ledger, lambda: len(service.shards.serving))
    metrics.watch_quotas(service.quotas)
    metrics.watch_prefixes(service.prefixes)
    metrics.registry.register(FleetCollector(service))
