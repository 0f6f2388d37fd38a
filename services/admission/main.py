"""`llmgw admission`: the composition root of the admission service.

Endpoint health and load come from the scraper through the load bucket (`LoadFollower`); with
no scraper running, every managed endpoint counts as healthy but stale, i.e. saturated: only
bands whose ceiling is at least 1 reach our engines, the others overflow or wait.
"""

from __future__ import annotations

import argparse
import logging

from llmgw import natsconn
from llmgw.config import parse_hostport
from llmgw.events import EventPublisher
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
from llmgw.state.nats_kv import open_routing_bucket
from llmgw.state.setup import open_routing_state

log = logging.getLogger("llmgw.admission")


def run(args: argparse.Namespace) -> int:
    setup_logging("admission")
    config = load_or_exit(args.config)
    require_nats_server(config, "admission")
    admin_listen = getattr(args, "admin_listen", None)
    admin = parse_hostport(admin_listen) if admin_listen else None

    async def main() -> None:
        nc = await natsconn.connect(config.nats, name="llmgw-admission")
        instance = service_instance("admission")
        board = LoadBoard(config, HealthBoard())
        load_kv = await open_routing_bucket(
            nc.jetstream(),
            config.router.load_bucket,
            storage="memory",
            history=1,
            replicas=config.replicas_of(config.router.load_bucket),
        )
        follower = LoadFollower(board, load_kv)
        await follower.start()
        metrics = AdmissionMetrics()
        metrics.watch_load(board, [m.name for m in config.models])
        routing = await open_routing_state(nc, config, instance_id=instance)
        service = AdmissionService(
            config,
            nc,
            routing,
            board.health,
            load=board,
            metrics=metrics,
            events=EventPublisher(nc, instance),
            instance=instance,
        )
        metrics.watch_breakers(service.breakers, [e.id for e in config.endpoints])
        await service.start()
        admin_server = None
        if admin is not None:
            admin_server = await start_server(create_admin_app(service, nc), *admin)
        suffix = f", admin {admin_server.url}" if admin_server is not None else ""
        print(f"llmgw admission ready ({service.instance}{suffix})", flush=True)
        try:
            await wait_for_stop_signal()
        finally:
            await service.stop()
            if admin_server is not None:
                await admin_server.stop()
            await follower.stop()
            await routing.close()
            await nc.drain()

    return run_service(main)
