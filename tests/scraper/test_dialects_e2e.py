"""Every engine metrics dialect, end to end on real parts: simulated engines speaking it (uvicorn),
the real scraper, an admission instance with the shipped bands and scoring, nats-server.

Per dialect: load sent to an engine directly (foreign load: not through the gateway) shows in
admission's board through the engine's own metrics and moves placement to the other engine,
and no request goes to the third party while a managed engine has a free batch slot. And an
engine whose metrics fail falls back to the gateway's own accounting instead of looking
saturated.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import nats
import pytest
from inproc import Cluster, before_any_lease, stop_servers
from scraper_helpers import WAIT, LoadGenerator, running_scraper
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from timing import eventually

from llmgw.config import Config, config_from_dict
from llmgw.services.admission.loadboard import LoadBoard
from llmgw.services.edge.admission_client import NatsAdmission
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import METRICS_DIALECTS, EngineParams
from llmgw.serving import RunningServer, start_server
from llmgw.state.setup import open_load_bucket
from llmgw.wire import AdmitReply, AdmitRequest, ReplyStatus

MODEL = "m1"
ENGINES = ("engine-1", "engine-2")
SLOTS = 4  # each engine's max_num_seqs, and its configured capacity


def e2e_config(
    nats_url: str, unique_id: str, urls: dict[str, str], *, configured: bool = True
) -> Config:
    """Managed `iris` (the two engines; their capacity configured unless `configured` is
    False) and the unlimited third party `tensorx`; bands, scoring and staleness as shipped, a
    quick scrape so the test need not wait long."""
    return config_from_dict(
        {
            "nats": {"url": nats_url, "request_timeout": "2s"},
            "router": {
                "load_bucket": f"load_{unique_id}",
                "scrape_interval": "100ms",
                "scrape_timeout": "500ms",
            },
            "pinning": {"bucket": f"routing_{unique_id}"},
            "admission": {"heartbeat": "200ms", "member_ttl": "10s"},
            "models": [{"name": MODEL}],
            "providers": [
                {"id": "iris", "kind": "managed", "priority": 100, "models": [{"name": MODEL}]},
                {"id": "tensorx", "kind": "unlimited", "models": [{"name": MODEL}]},
            ],
            "endpoints": [
                *(
                    {
                        "id": e,
                        "url": urls[e],
                        "provider": "iris",
                        "models": [MODEL],
                        **({"capacity": SLOTS} if configured else {}),
                    }
                    for e in ENGINES
                ),
                {
                    "id": "tensorx-1",
                    "url": "http://127.0.0.1:9/t",
                    "provider": "tensorx",
                    "models": [MODEL],
                },
            ],
        },
        source="<dialects e2e>",
        env={},
    )


@dataclass
class Gateway:
    config: Config
    board: LoadBoard
    client: NatsAdmission

    async def ask(self, band: str = "gold") -> AdmitReply:
        request = AdmitRequest(
            id=uuid.uuid4().hex, edge="edge-test", model=MODEL, feature="chat", shard=0, band=band
        )
        async with asyncio.timeout(WAIT):
            reply, _ = await self.client.admit(request)
        assert reply.status is ReplyStatus.ADMITTED, reply
        return reply

    async def fresh(self) -> None:
        """Until admission holds a fresh report of every engine (none is stale any more)."""
        await eventually(
            lambda: all(
                (age := self.board.scrape_age(e, time.time())) is not None
                and age < self.config.router.stale_after
                for e in ENGINES
            ),
            WAIT,
            "fresh reports of both engines",
        )


@contextlib.asynccontextmanager
async def gateway(
    nats_url: str, unique_id: str, urls: dict[str, str], *, configured: bool = True
) -> AsyncIterator[Gateway]:
    config = e2e_config(nats_url, unique_id, urls, configured=configured)
    nc = await nats.connect(nats_url)
    await open_load_bucket(nc, config)
    cluster = Cluster(config, nats_url)
    client = NatsAdmission(
        nc, request_timeout=config.nats.request_timeout, queue_ttl=config.admission.queue_ttl
    )
    try:
        with before_any_lease(config):
            admission = await cluster.add_admission()
            await cluster.settled()
        await client.start()
        async with running_scraper(config, instance="scraper-e2e"):
            yield Gateway(config, admission.service.load, client)
    finally:
        await client.stop()
        await cluster.stop()
        with contextlib.suppress(Exception):
            await nc.jetstream().delete_key_value(config.router.load_bucket)
        await nc.close()


@pytest.mark.parametrize("dialect", METRICS_DIALECTS)
async def test_foreign_load_moves_placement_away_and_nothing_overflows_with_a_slot_free(
    nats_url: str, unique_id: str, dialect: str, load: LoadGenerator
) -> None:
    params = EngineParams.zero_delay(metrics_dialect=dialect, max_num_seqs=SLOTS, itl_base=0.05)
    engines = {e: await start_server(create_engine_app(params, [MODEL])) for e in ENGINES}
    try:
        async with gateway(nats_url, unique_id, {e: s.url for e, s in engines.items()}) as gw:
            await gw.fresh()
            assert {gw.board.metrics_mode(e) for e in ENGINES} <= {"full", "partial"}

            # Somebody else's requests, straight to engine-1: a full batch and a queue behind.
            foreign = SLOTS + 2
            load.start(engines["engine-1"].url, foreign)
            await eventually(
                lambda: gw.board.foreign("engine-1") == foreign,
                WAIT,
                f"admission to see {foreign} foreign requests on engine-1",
            )
            assert gw.board.foreign("engine-2") == 0

            # Every slot engine-2 has is used before anything goes elsewhere, and only there.
            replies = [await gw.ask("gold") for _ in range(SLOTS)]
            assert [(r.target.provider, r.target.endpoint) for r in replies if r.target] == [
                ("iris", "engine-2")
            ] * SLOTS, dialect
    finally:
        await load.stop()
        await stop_servers(engines.values())


# What admission's board holds as each engine's capacity when none is configured: the engine's
# own statement (its max_num_seqs, below the default of scoring.target_inflight), or for vLLM's
# dialects, which state none, the default.
STATES_CAPACITY = {"sglang", "tgi", "llamacpp"}


@pytest.mark.parametrize("dialect", METRICS_DIALECTS)
async def test_an_engine_that_states_its_capacity_is_taken_at_its_word(
    nats_url: str, unique_id: str, dialect: str
) -> None:
    params = EngineParams.zero_delay(metrics_dialect=dialect, max_num_seqs=SLOTS)
    engines = {e: await start_server(create_engine_app(params, [MODEL])) for e in ENGINES}
    try:
        urls = {e: s.url for e, s in engines.items()}
        async with gateway(nats_url, unique_id, urls, configured=False) as gw:
            default = gw.config.scoring.target_inflight
            assert SLOTS < default
            expected = SLOTS if dialect in STATES_CAPACITY else default
            await eventually(
                lambda: all(gw.board.capacity(e) == expected for e in ENGINES),
                WAIT,
                f"admission to hold capacity {expected}",
            )
            stated = expected == SLOTS
            assert all(gw.board.load(e).stated is stated for e in ENGINES), dialect
            # Taken at its word: both engines' stated slots fill, one past them counts as queue.
            for _ in range(2 * SLOTS + 1 if stated else 0):
                await gw.ask("gold")
            if stated:
                assert sum(gw.board.saturation(e, time.time()) > 0 for e in ENGINES) == 1
    finally:
        await stop_servers(engines.values())


SATURATED = (
    "vllm:num_requests_running 4\nvllm:num_requests_waiting 12\nvllm:kv_cache_usage_perc 0.99\n"
)


async def test_an_engine_whose_metrics_fail_runs_on_the_gateways_accounting(
    nats_url: str, unique_id: str
) -> None:
    """Engines healthy by /health whose /metrics answer 500: gold stays on them (no overflow to
    the third party), up to their free slots. While they reported saturation, gold overflowed:
    the failure drops that reading instead of keeping it."""
    state = {"metrics": SATURATED, "status": 200}

    async def metrics(request: Request) -> PlainTextResponse:
        return PlainTextResponse(state["metrics"], status_code=int(state["status"]))

    async def health(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/metrics", metrics), Route("/health", health)])
    servers: list[RunningServer] = [await start_server(app) for _ in ENGINES]
    try:
        urls = {e: s.url for e, s in zip(ENGINES, servers, strict=True)}
        async with gateway(nats_url, unique_id, urls) as gw:
            await gw.fresh()
            await eventually(
                lambda: all(gw.board.foreign(e) == 16 for e in ENGINES),
                WAIT,
                "the saturated reading",
            )
            overflow = await gw.ask("gold")
            assert overflow.target is not None and overflow.target.provider == "tensorx"

            state.update(metrics="oops", status=500)
            await eventually(
                lambda: all(gw.board.metrics_mode(e) == "error" for e in ENGINES),
                WAIT,
                "reports of failed metrics",
            )
            replies = [await gw.ask("gold") for _ in range(2 * SLOTS)]
            assert {r.target.provider for r in replies if r.target} == {"iris"}
            assert all(gw.board.foreign(e) == 0 for e in ENGINES)
    finally:
        await stop_servers(servers)
