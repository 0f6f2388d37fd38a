"""`llmgw admission`: the composition root of the admission service.

Endpoint health and load come from the scraper through the load bucket (`LoadFollower`); with
no scraper running, every managed endpoint counts as healthy but stale, i.e. saturated: only
bands whose ceiling is at least 1 reach our engines, the others overflow or wait. The instance
prints its ready line once it serves: it has joined, holds its quotas and serves its shards.
"""

from __future__ import annotations

import argparse
import logging

from llmgw import natsconn
from llmgw.config import parse_hostport
from llmgw.core.keys import safe_token
from llmgw.events import EventPublisher, MemberEvent
from llmgw.runtime import (
    load_or_exit,
    require_nats_server,
    run_service,
    service_instance,
    setup_logging,
    wait_for_stop_signal,
)
from llmgw.services.admission.admin import create_admin_app
from llmgw.services.admission.health import HealthBoard
from llmgw.services.admission.loadboard import LoadBoard, LoadFollower
from llmgw.services.admission.metrics import AdmissionMetrics
from llmgw.services.admission.service import AdmissionService
from llmgw.serving import start_server
from llmgw.state.setup import open_events_stream, open_load_bucket, open_routing_store
from llmgw.tracing import open_tracing

log = logging.getLogger("llmgw.admission")


def run(args: argparse.Namespace) -> int:
    config = load_or_exit(args.config)
    setup_logging("admission", config)
    require_nats_server(config, "admission")
    admin_listen = getattr(args, "admin_listen", None)
    admin = parse_hostport(admin_listen) if admin_listen else None

    async def main() -> None:
        nc = await natsconn.connect(config.nats, name="llmgw-admission")
        instance = safe_token(service_instance("admission"))
        board = LoadBoard(config, HealthBoard())
        follower = LoadFollower(board, await open_load_bucket(nc, config))
        await follower.start()
        metrics = AdmissionMetrics()
        metrics.watch_load(board, [m.name for m in config.models])
        store = await open_routing_store(nc, config)
        await open_events_stream(nc, config)
        events = EventPublisher(nc, instance)
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
        metrics.watch_breakers(service.breakers, [e.id for e in config.endpoints])
        metrics.watch_ledger(service.ledger, lambda: len(service.shards.serving))
        await service.start()
        events.emit(MemberEvent, event="member.joined", member=service.instance)
        admin_server = None
        if admin is not None:
            admin_server = await start_server(create_admin_app(service, nc), *admin)
        suffix = f", admin {admin_server.url}" if admin_server is not None else ""
        print(
            f"llmgw admission ready ({service.instance}, {len(service.shards.serving)} shards"
            f"{suffix})",
            flush=True,
        )
        try:
            await wait_for_stop_signal()
        finally:
            await service.stop()
            await events.publish(
                events.build(MemberEvent, event="member.left", member=service.instance)
            )
            if admin_server is not None:
                await admin_server.stop()
            await follower.stop()
            await natsconn.drain_or_close(nc)

    return run_service(main)
