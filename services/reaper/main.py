"""`llmgw reaper`: the composition root of the reaper service.

Connects to NATS, opens the routing bucket, and runs `Reaper` passes every
`pinning.reaper_interval` until SIGTERM/SIGINT, which lets the current pass finish before exiting
0. Prints "llmgw reaper ready (...)" once running. Several reapers may run at once (each change is
made, and announced, once).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import uuid
from typing import TYPE_CHECKING

from nats.aio.client import Client as NATS

from llmgw import natsconn
from llmgw.clock import SYSTEM
from llmgw.config import Config, parse_hostport
from llmgw.config.fleet import fleet_bucket
from llmgw.events import EventPublisher
from llmgw.runtime import load_or_exit, run_service, setup_logging
from llmgw.services.fleet.janitor import HeartbeatJanitor
from llmgw.services.fleet.ops import FollowedConfig, admission_leases, running_config
from llmgw.services.fleet.served import ServedModelsFollower
from llmgw.services.reaper.metrics import ReaperMetrics
from llmgw.services.reaper.service import Reaper
from llmgw.state.fleet import FleetMirror, open_fleet
from llmgw.state.setup import open_events_stream, open_routing_store

if TYPE_CHECKING:
    from llmgw.contracts import Clock

__all__ = ["open_reaper", "run", "serve"]

log = logging.getLogger("llmgw.reaper")

EMBEDDED_NATS_HELP = (
    "nats.url is 'embedded': the reaper needs a running NATS server. `llmgw up` starts one "
    "(and its own reaper); to run another reaper against it, set LLMGW_NATS__URL to the NATS "
    "URL that `llmgw up` prints"
)


def run(args: argparse.Namespace) -> int:
    config = load_or_exit(args.config)
    setup_logging("reaper", config)
    if config.nats.is_embedded:
        print(f"llmgw reaper: {EMBEDDED_NATS_HELP}", file=sys.stderr)
        return 2
    admin_listen = getattr(args, "admin_listen", None)
    admin = parse_hostport(admin_listen) if admin_listen else None
    return run_service(lambda: serve(config, admin=admin))


def quota_grace(config: Config) -> float:
    """How long a dead instance's quota entry stays before the reaper drops it: long enough for
    the shards' new owners to have adopted what they could (member TTL, a rebalance, a roll
    call), with a wide margin."""
    admission = config.admission
    return 3 * admission.member_ttl + 10 * admission.rollcall_window + 2 * admission.heartbeat


async def open_reaper(
    nc: NATS,
    config: Config,
    *,
    instance: str,
    clock: Clock,
    metrics: ReaperMetrics | None = None,
) -> Reaper:
    """A Reaper over the configured bucket, publishing on `nc`."""
    store = await open_routing_store(nc, config)
    await open_events_stream(nc, config)
    return Reaper(
        store,
        EventPublisher(nc, instance, clock=clock),
        metrics or ReaperMetrics(),
        clock=clock,
        interval=config.pinning.reaper_interval,
        member_ttl=config.admission.member_ttl,
        quota_grace=quota_grace(config),
    )


async def serve(
    config: Config,
    *,
    admin: tuple[str, int] | None = None,
    stop: asyncio.Event | None = None,
    ready: asyncio.Event | None = None,
    metrics: ReaperMetrics | None = None,
    clock: Clock = SYSTEM,
) -> None:
    """Run one reaper until `stop` is set (default: until SIGTERM or SIGINT).

    `ready` is set once it runs (and its admin port, if any, accepts connections). `clock`'s
    wall time judges expiry (unix seconds: the stamps it compares are other hosts'); its
    monotonic time measures passes. Tests step it.
    """
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    instance = f"reaper-{uuid.uuid4().hex[:8]}"
    nc = await natsconn.connect(config.nats, name="llmgw-reaper")
    admin_server = None
    try:
        reaper = await open_reaper(nc, config, instance=instance, clock=clock, metrics=metrics)
        where = ""
        if admin is not None:
            # Imported only when asked for: the HTTP stack is not the reaper's default path.
            from llmgw.services.reaper.admin import create_admin_app
            from llmgw.serving import start_server

            admin_server = await start_server(create_admin_app(reaper.metrics, nc), *admin)
            where = f", admin {admin_server.url}"
        print(
            f"llmgw reaper ready ({instance}, bucket {config.pinning.bucket}, "
            f"every {reaper.interval:g}s{where})",
            flush=True,
        )
        if ready is not None:
            ready.set()
        # Self-registered endpoints that went silent: drained, then removed.
        janitor = HeartbeatJanitor(
            await open_fleet(nc, config, clock),
            lambda: admission_leases(nc),
            interval=reaper.interval,
            clock=clock,
        )
        loops = [reaper.run(stop), janitor.run(stop)]
        if config.fleet.models_refresh is not None:  # engines' model lists, read again
            followed = ServedModelsFollower(
                janitor.bucket,
                lambda: running_config(janitor.bucket, config),
                interval=config.fleet.models_refresh,
                scope=fleet_bucket(config),
                on_read=reaper.metrics.count_model_list_read,
            )
            await followed.listen(nc)  # and at once on an edge's notice of an engine's 404
            loops.append(followed.run(stop))
        discovery = config.fleet.kubernetes
        client = None
        mirror = None
        if discovery is not None:  # the engines behind a Kubernetes Service
            from llmgw.services.fleet.kubernetes import SliceWatcher, kubernetes_client
            from llmgw.services.fleet.ops import FleetOps

            client = kubernetes_client(discovery)
            # An engine joins checked against the config the cluster runs on (an applied
            # config's models and aliases too), followed as admission follows it.
            mirror = FleetMirror(janitor.bucket)
            await mirror.start()
            ops = FleetOps.on(nc, janitor.bucket, FollowedConfig(config, mirror), clock=clock)
            watcher = SliceWatcher(ops, discovery, client, lambda: admission_leases(nc))
            loops.append(watcher.run(stop))
        try:
            await asyncio.gather(*loops)
        finally:
            if client is not None:
                await client.aclose()
            if mirror is not None:
                await mirror.stop()
        log.info("stopping after %d passes", reaper.passes)
    finally:
        if admin_server is not None:
            await admin_server.stop()
        await natsconn.drain_or_close(nc)
