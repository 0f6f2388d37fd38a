"""`llmgw scraper`: the composition root of the scraper service.

Connects to NATS, opens the load bucket (``router.load_bucket``, memory storage, history 1),
creates the one HTTP client every scrape shares, and runs `Scraper` rounds every
``router.scrape_interval`` until SIGTERM/SIGINT, which lets the current round finish before
exiting 0. With cache-aware placement on (``prefix.enabled``), it also reads the KV cache events
of every endpoint that publishes them (``endpoints[].kv_events``; `kv_events.KvEvents`, which
needs the ``kv-events`` extra) into the prefix stream, which it creates if missing. Both follow
the live fleet. Prints "llmgw scraper ready (...)" once running. Several scrapers may run at
once: duplicates are harmless (see `llmgw.load`; two scrapers' KV cache updates count each
block twice and remove it twice).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from llmgw import natsconn
from llmgw.clock import SYSTEM
from llmgw.config import Config, parse_hostport
from llmgw.fleet import Fleet, live_config
from llmgw.load import capacity_floors
from llmgw.runtime import (
    load_or_exit,
    require_nats_server,
    run_service,
    service_instance,
    setup_logging,
    wait_for_stop_signal,
)
from llmgw.services.scraper.metrics import ScraperMetrics
from llmgw.services.scraper.reports import kv_event_sources, saturation_settings, scrape_targets
from llmgw.services.scraper.service import Scraper, new_http_client
from llmgw.state.fleet import start_fleet
from llmgw.state.setup import open_events_stream, open_load_bucket

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from llmgw.contracts import Clock
    from llmgw.services.scraper.kv_events import KvEvents

__all__ = ["run", "serve"]

log = logging.getLogger("llmgw.scraper")


def run(args: argparse.Namespace) -> int:
    config = load_or_exit(args.config)
    setup_logging("scraper", config)
    require_nats_server(config, "scraper")
    admin_listen = getattr(args, "admin_listen", None)
    admin = parse_hostport(admin_listen) if admin_listen else None
    return run_service(lambda: serve(config, admin=admin))


async def _set_on_signal(stop: asyncio.Event) -> None:
    await wait_for_stop_signal()
    stop.set()


async def start_kv_events(
    nc: NATS, config: Config, metrics: ScraperMetrics, *, clock: Clock
) -> KvEvents | None:
    """The KV cache events' readers (none yet: `retarget` starts them), publishing to the
    prefix stream (created if missing); None when cache-aware placement is off or the
    ``kv-events`` extra (pyzmq, msgpack) is not installed."""
    if not config.prefix.enabled:
        return None
    try:
        from llmgw.services.scraper.kv_events import (
            KvEvents,
            KvEventsSettings,
            LiveSink,
            StreamSink,
        )
    except ImportError as exc:
        log.info("KV cache events cannot be read (%s): the kv-events extra is missing", exc)
        return None
    from llmgw.prefix_stream import ensure_prefix_stream

    settings = KvEventsSettings.of(config)
    js = nc.jetstream()
    sink: StreamSink | LiveSink
    if await ensure_prefix_stream(js, config):
        sink = StreamSink(js, config.prefix_stream, ack_timeout=settings.ack_timeout, clock=clock)
    else:
        sink = LiveSink(nc, config.prefix_stream)
    return KvEvents(sink=sink, metrics=metrics, settings=settings, clock=clock)


async def serve(
    config: Config,
    *,
    admin: tuple[str, int] | None = None,
    stop: asyncio.Event | None = None,
    ready: asyncio.Event | None = None,
    instance: str | None = None,
    metrics: ScraperMetrics | None = None,
    clock: Clock = SYSTEM,
) -> None:
    """Run one scraper until `stop` is set (default: until SIGTERM or SIGINT).

    `ready` is set once it runs (and its admin port, if any, accepts connections). `instance`
    names it in reports (default: service, host and pid). `clock`'s wall time stamps reports (unix
    seconds: other hosts judge their age); its monotonic time paces rounds and measures them.
    Tests step it.
    """
    signal_task = None
    if stop is None:
        stop = asyncio.Event()
        signal_task = asyncio.create_task(_set_on_signal(stop))
    instance = instance or service_instance("scraper")
    router = config.router
    base = config
    nc = await natsconn.connect(config.nats, name="llmgw-scraper")
    fleet = await start_fleet(nc, base, seed=True)
    if fleet.ready.is_set():  # else the file's endpoints until the fleet answers
        config = live_config(base, fleet.fleet)
    targets = scrape_targets(config)
    if not targets:
        log.warning("no endpoint of a managed provider in the fleet yet: nothing to scrape")
    client = new_http_client(router.scrape_timeout, max(len(targets), 8))
    metrics = metrics or ScraperMetrics()
    admin_server = None
    kv_events: KvEvents | None = None
    try:
        bucket = await open_load_bucket(nc, config)
        await open_events_stream(nc, config)
        scraper = Scraper(
            targets,
            client=client,
            bucket=bucket,
            publisher=nc,
            metrics=metrics,
            settings=saturation_settings(config),
            instance=instance,
            interval=router.scrape_interval,
            timeout=router.scrape_timeout,
            capacities=capacity_floors(config),
            clock=clock,
            window_refresh=config.fleet.models_refresh,
        )
        await scraper.adopt_known_capacity()
        kv_events = await start_kv_events(nc, config, metrics, clock=clock)
        missing_extra_said = False

        def follow(snapshot: Fleet) -> None:
            nonlocal missing_extra_said
            live = live_config(base, snapshot)
            scraper.retarget(scrape_targets(live), capacity_floors(live))
            sources = kv_event_sources(live)
            if kv_events is not None:
                kv_events.retarget(sources)
            elif sources and config.prefix.enabled and not missing_extra_said:
                missing_extra_said = True
                log.warning(
                    "endpoints %s publish KV cache events, but the kv-events extra is not "
                    "installed (pip install 'llmgw[kv-events]'): placement goes by what was "
                    "sent there",
                    ", ".join(sorted(sources)),
                )

        fleet.on_change(follow)
        follow(fleet.fleet)  # a change between the first snapshot and now
        where = ""
        if admin is not None:
            # Imported only when asked for: the HTTP server stack is not the default path.
            from llmgw.services.scraper.admin import create_admin_app
            from llmgw.serving import start_server

            admin_server = await start_server(
                create_admin_app(scraper.metrics, nc, scraper), *admin
            )
            where = f", admin {admin_server.url}"
        print(
            f"llmgw scraper ready ({instance}, bucket {router.load_bucket}, "
            f"{len(targets)} endpoints every {router.scrape_interval:g}s{where})",
            flush=True,
        )
        if ready is not None:
            ready.set()
        await scraper.run(stop)
        log.info("stopping after %d rounds", scraper.rounds)
    finally:
        if signal_task is not None:
            signal_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await signal_task
        if admin_server is not None:
            await admin_server.stop()
        if kv_events is not None:
            await kv_events.stop()
        await fleet.stop()
        await client.aclose()
        await natsconn.drain_or_close(nc)
