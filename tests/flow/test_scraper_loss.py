"""A scraper that dies: its reports go stale, admission stays safe, a new scraper restores flow."""

from __future__ import annotations

import asyncio
import contextlib
import time

from inproc import stop_servers
from rig import ENDPOINTS, admitted, open_rig
from timing import eventually

from llmgw.services.scraper.main import serve
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import start_server

STALE_AFTER = 0.6


async def test_admission_stays_safe_when_the_scraper_dies(nats_url, unique_id):
    engines = {
        name: await start_server(create_engine_app(EngineParams.zero_delay(), ["m1"]))
        for name in (*ENDPOINTS, "tensorx-1")
    }
    rig = await open_rig(
        nats_url,
        unique_id,
        urls={k: v.url for k, v in engines.items()},
        router={
            "scrape_interval": "100ms",
            "scrape_timeout": "500ms",
            "stale_after": f"{STALE_AFTER}s",
        },
    )
    board = rig.admissions[0].load

    def scrape_ages() -> list[float | None]:
        return [board.scrape_age(e, time.time()) for e in ENDPOINTS]

    def start_scraper() -> asyncio.Task[None]:
        return asyncio.create_task(serve(rig.config, stop=asyncio.Event()))

    scraper = start_scraper()
    try:
        await eventually(
            lambda: all(a is not None and a < STALE_AFTER for a in scrape_ages()),
            what="fresh reports from the scraper",
        )
        fresh = await rig.ask(band="bronze")
        assert admitted(fresh) and fresh.target.provider == "iris"

        scraper.cancel()  # dies mid-flight: no goodbye, its last reports stay in the bucket
        with contextlib.suppress(asyncio.CancelledError):
            await scraper
        await eventually(lambda: all(a > STALE_AFTER for a in scrape_ages()), what="stale reports")

        # Stale engines count as saturated, never as idle and never as gone.
        bronze = asyncio.create_task(rig.ask(band="bronze"))
        await eventually(lambda: rig.queued() == 1, what="bronze to wait")
        platinum = await rig.ask(band="platinum")
        assert admitted(platinum) and platinum.target.provider == "iris"
        gold = await rig.ask(band="gold")
        assert admitted(gold) and (gold.target.provider, gold.route) == ("tensorx", "overflow")
        assert not bronze.done()

        scraper = start_scraper()  # a replacement: fresh reports, bronze flows again
        reply = await asyncio.wait_for(bronze, 5)
        assert admitted(reply) and reply.target.provider == "iris"
    finally:
        scraper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await scraper
        await rig.close()
        await stop_servers(engines.values())
