"""`llmgw admission`: the composition root of the admission service."""

from __future__ import annotations

import argparse
import logging

from llmgw import natsconn
from llmgw.events import EventPublisher
from llmgw.runtime import (
    load_or_exit,
    require_nats_server,
    run_service,
    service_instance,
    setup_logging,
    wait_for_stop_signal,
)
from llmgw.services.admission.health import HealthBoard, HealthProber
from llmgw.services.admission.service import AdmissionService
from llmgw.state.setup import open_routing_state

log = logging.getLogger("llmgw.admission")


def run(args: argparse.Namespace) -> int:
    setup_logging("admission")
    config = load_or_exit(args.config)
    require_nats_server(config, "admission")

    async def main() -> None:
        nc = await natsconn.connect(config.nats, name="llmgw-admission")
        board = HealthBoard()
        managed = [
            (e.id, e.url)
            for e in config.endpoints
            if config.provider(e.provider).kind == "managed"
        ]
        prober = HealthProber(
            board,
            managed,
            interval=config.router.scrape_interval,
            timeout=config.router.scrape_timeout,
        )
        instance = service_instance("admission")
        routing = await open_routing_state(nc, config, instance_id=instance)
        service = AdmissionService(
            config, nc, routing, board, events=EventPublisher(nc, instance), instance=instance
        )
        await service.start()
        prober.start()
        print(f"llmgw admission ready ({service.instance})", flush=True)
        try:
            await wait_for_stop_signal()
        finally:
            await prober.stop()
            await service.stop()
            await routing.close()
            await nc.drain()

    return run_service(main)
