"""`llmgw edge`: the composition root of the HTTP edge."""

from __future__ import annotations

import argparse
import asyncio
import logging

from llmgw import natsconn
from llmgw.config import parse_hostport
from llmgw.runtime import (
    load_or_exit,
    require_nats_server,
    run_service,
    service_instance,
    setup_logging,
    wait_for_stop_signal,
)
from llmgw.services.edge.admin import create_admin_app
from llmgw.services.edge.app import EdgeDeps, create_app
from llmgw.services.edge.metrics import EdgeMetrics
from llmgw.services.edge.upstream import Timeouts, new_session
from llmgw.serving import start_server
from llmgw.state.setup import open_routing_state

log = logging.getLogger("llmgw.edge")


def run(args: argparse.Namespace) -> int:
    setup_logging("edge")
    config = load_or_exit(args.config)
    require_nats_server(config, "edge")
    host, port = parse_hostport(args.listen or config.listen)
    admin_host, admin_port = parse_hostport(args.admin_listen or config.admin_listen)

    async def main() -> None:
        nc = await natsconn.connect(config.nats, name="llmgw-edge")
        session = new_session(Timeouts.from_section(config.timeouts))
        routing = await open_routing_state(
            nc, config, instance_id=service_instance("edge"), follow_slots=False
        )
        deps = EdgeDeps(nc=nc, session=session, metrics=EdgeMetrics(), routing=routing)
        app = create_app(config, deps)
        api = await start_server(app, host, port)
        admin = await start_server(create_admin_app(deps), admin_host, admin_port)
        print(f"llmgw edge ready on {api.url} (admin {admin.url})", flush=True)
        try:
            await wait_for_stop_signal()
        finally:
            # Stop taking requests, let running ones finish (uvicorn's
            # graceful shutdown), then close what they used.
            await asyncio.gather(api.stop(timeout=10), admin.stop())
            await app.edge.drain()  # lease releases still in flight
            await session.close()
            await nc.drain()

    return run_service(main)
