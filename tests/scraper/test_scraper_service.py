"""The scraper against real engines (simulators on uvicorn) and a real NATS server: what lands
in the load bucket and on the event subjects."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
import pytest_asyncio
from inproc import stop_servers
from nats.aio.client import Client as NatsClient
from scraper_helpers import (
    MODEL,
    Connect,
    EventLog,
    LoadGenerator,
    StartEngine,
    config_data,
    running_scraper,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route
from timing import SteppedClock

from llmgw.clock import SYSTEM
from llmgw.config import Config, config_from_dict
from llmgw.load import (
    LOAD_BUCKET_HISTORY,
    LOAD_BUCKET_STORAGE,
    EndpointReport,
    PoolReport,
    report_key,
)
from llmgw.services.scraper.metrics import ScraperMetrics
from llmgw.services.scraper.reports import ScrapeTarget, saturation_settings
from llmgw.services.scraper.service import Scraper, new_http_client
from llmgw.serving import RunningServer, free_port, start_server
from llmgw.state import NatsKV, open_routing_bucket

StartStatic = Callable[..., Awaitable[RunningServer]]


def make_config(nats_url: str, bucket: str, provider: str, endpoints: dict[str, str]) -> Config:
    return config_from_dict(config_data(nats_url, bucket, provider, endpoints), env={})


async def open_load_bucket(nc: NatsClient, name: str) -> NatsKV:
    return await open_routing_bucket(
        nc.jetstream(), name, storage=LOAD_BUCKET_STORAGE, history=LOAD_BUCKET_HISTORY
    )


async def stored_report(kv: NatsKV, endpoint: str) -> EndpointReport:
    entry = await kv.get(report_key(endpoint))
    assert entry is not None, f"no report of {endpoint} in the bucket"
    return EndpointReport.model_validate_json(entry.value)


@pytest_asyncio.fixture
async def start_static() -> AsyncIterator[StartStatic]:
    """Factory of fake engines: /health answers 200, /metrics answers the given text (with the
    given status, 200 unless told)."""
    servers: list[RunningServer] = []

    async def start(metrics_text: str, status: int = 200) -> RunningServer:
        async def metrics(request: Request) -> PlainTextResponse:
            return PlainTextResponse(metrics_text, status_code=status)

        async def health(request: Request) -> PlainTextResponse:
            return PlainTextResponse("ok")

        app = Starlette(routes=[Route("/metrics", metrics), Route("/health", health)])
        server = await start_server(app)
        servers.append(server)
        return server

    yield start
    await stop_servers(servers)


async def test_reports_land_in_the_bucket_with_the_capacity_learned_under_load(
    nats_url: str,
    load_bucket: str,
    unique_id: str,
    nats_client: NatsClient,
    start_engine: StartEngine,
    events: EventLog,
    load: LoadGenerator,
) -> None:
    engine = await start_engine(max_num_seqs=2, itl_base=0.5)
    config = make_config(nats_url, load_bucket, unique_id, {"busy": engine.url})
    async with running_scraper(config, instance="scraper-one"):
        idle = await events.wait_for_report("busy", lambda r: r.sample is not None)
        assert idle.healthy and idle.capacity == 1 and idle.sample is not None  # the config's
        assert idle.sample.running == 0

        load.start(engine.url, 3)  # two run (max_num_seqs), one waits
        busy = await events.wait_for_report(
            "busy",
            lambda r: r.sample is not None and (r.sample.running, r.sample.waiting) == (2, 1),
        )
        assert busy.capacity == 2
        assert busy.saturation == pytest.approx(1 / 4)  # 1 waiting / scoring.target_waiting

        kv = await open_load_bucket(nats_client, load_bucket)
        stored = await stored_report(kv, "busy")  # written before the event was published
        assert stored.capacity == 2 and stored.scraper == "scraper-one"
        assert stored.models == (MODEL,) and stored.pool == "gpu/a" and stored.provider == unique_id
        assert stored.scraped_at >= busy.scraped_at
    assert await kv.get(report_key("third-party")) is None  # unlimited providers: not scraped


async def test_an_engine_turning_unhealthy_is_reported_and_announced(
    nats_url: str,
    load_bucket: str,
    unique_id: str,
    nats_client: NatsClient,
    start_engine: StartEngine,
    events: EventLog,
) -> None:
    engine = await start_engine()
    config = make_config(nats_url, load_bucket, unique_id, {"flaky": engine.url})
    async with running_scraper(config, instance="scraper-one"), httpx.AsyncClient() as http:
        # The first verdict of a scraper is announced, so subscribers learn the initial state.
        await events.wait_until(lambda log: log.transitions("flaky") == ["healthy"])

        (await http.post(f"{engine.url}/sim/faults", json={"unhealthy": True})).raise_for_status()
        await events.wait_until(lambda log: log.transitions("flaky") == ["healthy", "unhealthy"])
        announced = events.reports("flaky", verb="unhealthy")[0]
        assert not announced.healthy and announced.health_error == "HTTP 503"
        assert announced.sample is not None  # its metrics are still read
        stored = await stored_report(await open_load_bucket(nats_client, load_bucket), "flaky")
        assert not stored.healthy

        (await http.post(f"{engine.url}/sim/faults", json={"reset": True})).raise_for_status()
        await events.wait_until(
            lambda log: log.transitions("flaky") == ["healthy", "unhealthy", "healthy"]
        )
    # One health event per change of verdict (plus the first), not one per round: each
    # follows the "scraped" publish of the same report on one connection, so all are here.
    verdicts = [r.healthy for r in events.reports("flaky")]
    changes = sum(a != b for a, b in itertools.pairwise(verdicts))
    assert len(events.transitions("flaky")) == 1 + changes
    scraped_times = {r.scraped_at for r in events.reports("flaky")}
    for verb in ("healthy", "unhealthy"):
        assert all(r.scraped_at in scraped_times for r in events.reports("flaky", verb=verb))


async def test_an_unreachable_endpoint_is_reported_every_round_and_never_dropped(
    nats_url: str,
    load_bucket: str,
    unique_id: str,
    nats_client: NatsClient,
    start_engine: StartEngine,
    events: EventLog,
) -> None:
    engine = await start_engine()
    dead = f"http://127.0.0.1:{free_port()}"
    config = make_config(nats_url, load_bucket, unique_id, {"live": engine.url, "dead": dead})
    async with running_scraper(config, instance="scraper-one"):
        await events.wait_until(
            lambda log: (
                len(log.reports("dead")) >= 3 and any(p.healthy == ("live",) for p in log.pools())
            )
        )
        stored = await stored_report(await open_load_bucket(nats_client, load_bucket), "dead")
    for report in [*events.reports("dead"), stored]:
        assert not report.healthy and report.health_error
        assert report.sample is None and report.metrics_error
        assert report.saturation == 1.0  # never read: stale, counted as saturated
    assert events.transitions("dead") == ["unhealthy"]
    pool = next(p for p in events.pools() if p.healthy == ("live",))
    assert pool.provider == unique_id and pool.pool == "gpu/a"
    assert pool.endpoints == ("live", "dead") and pool.stale == ("dead",)
    assert pool.saturation == pytest.approx(0.5)  # mean of an idle 0 and a stale 1


GARBLED = '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m1" 3\n'
SGLANG = (
    'sglang:num_running_reqs{model_name="m1"} 5\nsglang:num_queue_reqs{model_name="m1"} 2\n'
    'sglang:token_usage{model_name="m1"} 0.45\n'
)


async def test_malformed_metrics_are_a_metrics_error_and_sglang_metrics_are_read(
    nats_url: str,
    load_bucket: str,
    unique_id: str,
    start_static: StartStatic,
    events: EventLog,
) -> None:
    garbled, sglang = await start_static(GARBLED), await start_static(SGLANG)
    config = make_config(
        nats_url, load_bucket, unique_id, {"garbled": garbled.url, "sglang": sglang.url}
    )
    metrics = ScraperMetrics()
    async with running_scraper(config, instance="scraper-one", metrics=metrics):
        bad = await events.wait_for_report("garbled", lambda r: True)
        good = await events.wait_for_report("sglang", lambda r: True)
    assert bad.healthy and bad.sample is None
    assert bad.metrics_error is not None and bad.metrics_error.startswith("line 2:")
    assert good.sample is not None and good.sample.dialect == "sglang"
    assert (good.sample.running, good.sample.waiting, good.capacity) == (5, 2, 5)
    assert good.saturation == pytest.approx(0.5)  # kv 0.45 / 0.9 beats 2 waiting / 4

    def scrapes(endpoint: str, result: str) -> float | None:
        return metrics.registry.get_sample_value(
            "llmgw_scraper_scrapes_total", {"endpoint": endpoint, "result": result}
        )

    assert scrapes("garbled", "metrics_error") >= 1 and scrapes("garbled", "ok") == 0
    assert scrapes("sglang", "ok") >= 1 and scrapes("sglang", "metrics_error") == 0


PARTIAL = (
    'vllm:num_requests_running{model_name="m1"} 2\nvllm:num_requests_waiting{model_name="m1"} 1\n'
)


async def test_metrics_without_kv_usage_are_reported_every_round_and_never_raise(
    nats_url: str,
    load_bucket: str,
    unique_id: str,
    nats_client: NatsClient,
    start_static: StartStatic,
    events: EventLog,
) -> None:
    """A vLLM-like engine without ``vllm:kv_cache_usage_perc``: its reports keep coming, fresh,
    partial, and its scraper metrics show what it reports and nothing it does not."""
    partial = await start_static(PARTIAL)
    config = make_config(nats_url, load_bucket, unique_id, {"partial": partial.url})
    metrics = ScraperMetrics()
    async with running_scraper(config, instance="scraper-one", metrics=metrics):
        await events.wait_until(lambda log: len(log.reports("partial")) >= 3)
    reports = events.reports("partial")
    assert all(r.metrics == "partial" and r.metrics_error is None for r in reports)
    first = reports[0]
    assert first.sample is not None and first.sample.kv_usage is None
    assert (first.sample.running, first.sample.waiting) == (2, 1)
    kv = await open_load_bucket(nats_client, load_bucket)
    assert (await stored_report(kv, "partial")).metrics == "partial"

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"endpoint": "partial", **labels})

    assert value("llmgw_scraper_scrapes_total", result="ok") >= 3
    assert value("llmgw_scraper_engine_running") == 2
    assert value("llmgw_scraper_engine_waiting") == 1
    assert value("llmgw_scraper_engine_kv_usage") is None  # not reported: no series


LLAMACPP = (
    "# HELP llamacpp:requests_processing Number of requests processing.\n"
    "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 3\n"
    "# HELP llamacpp:requests_deferred Number of requests deferred.\n"
    "# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 1\n"
)


async def test_scrape_age_and_dialect_follow_the_last_successful_read_whatever_it_held(
    nats_url: str,
    load_bucket: str,
    unique_id: str,
    start_static: StartStatic,
    events: EventLog,
) -> None:
    """Scrape age is the age of the last successful ``/metrics`` read, load gauges or not: an
    endpoint that answers without engine metrics is fresh, one whose metrics fail is +Inf
    (never read) though it is reported every round, healthy, and scored 0, not saturated."""
    endpoints = {
        "plain": await start_static("process_cpu_seconds_total 1.5\n"),
        "no-route": await start_static("not found", status=404),
        "failing": await start_static("oops", status=500),
        "llama": await start_static(LLAMACPP),
        "vllm": await start_static(PARTIAL),
    }
    config = make_config(
        nats_url, load_bucket, unique_id, {name: s.url for name, s in endpoints.items()}
    )
    metrics = ScraperMetrics()
    async with running_scraper(config, instance="scraper-one", metrics=metrics):
        await events.wait_until(lambda log: all(len(log.reports(e)) >= 2 for e in endpoints))

        def sample(name: str, **labels: str) -> float | None:
            return metrics.registry.get_sample_value(name, labels)

        for endpoint in ("plain", "no-route", "llama", "vllm"):
            age = sample("llmgw_scraper_scrape_age_seconds", endpoint=endpoint)
            assert age is not None and 0 <= age < 5, (endpoint, age)
        assert sample("llmgw_scraper_scrape_age_seconds", endpoint="failing") == float("inf")

    failing = events.reports("failing")[-1]
    assert failing.healthy and failing.metrics == "error" and failing.saturation == 0.0
    llama = events.reports("llama")[-1]
    assert llama.sample is not None and llama.sample.dialect == "llamacpp"
    assert (llama.sample.running, llama.sample.waiting, llama.metrics) == (3, 1, "partial")
    assert llama.capacity == 3
    info = {
        endpoint: sorted(
            (s.labels["dialect"], s.labels["metrics"])
            for family in metrics.registry.collect()
            if family.name == "llmgw_scraper_engine_info"
            for s in family.samples
            if s.labels["endpoint"] == endpoint and s.value == 1
        )
        for endpoint in endpoints
    }
    assert info == {
        "plain": [("none", "none")],
        "no-route": [("none", "none")],
        "failing": [],
        "llama": [("llamacpp", "partial")],
        "vllm": [("vllm", "partial")],
    }
    assert sample("llmgw_scraper_scrapes_total", endpoint="failing", result="metrics_error") >= 2
    assert sample("llmgw_scraper_scrapes_total", endpoint="plain", result="no_metrics") >= 2


async def test_an_engine_that_states_its_capacity_is_asked_once_a_while_and_reported(
    nats_url: str, load_bucket: str, unique_id: str, events: EventLog
) -> None:
    """llama-server's /props says 2 slots: asked from the scrape after the one that showed the
    dialect, not every round; every report from then on carries it, and it is the capacity
    (below the default that held until then) unless the config sets one."""
    asked = 0

    async def props(request: Request) -> JSONResponse:
        nonlocal asked
        asked += 1
        return JSONResponse({"total_slots": 2, "model_path": "/m.gguf"})

    metrics_text = "llamacpp:requests_processing 1\nllamacpp:requests_deferred 0\n"
    app = Starlette(
        routes=[
            Route("/metrics", lambda r: PlainTextResponse(metrics_text)),
            Route("/health", lambda r: PlainTextResponse("ok")),
            Route("/props", props),
        ]
    )
    server = await start_server(app)
    try:
        data = config_data(
            nats_url, load_bucket, unique_id, {"llama": server.url, "configured": server.url}
        )
        del data["endpoints"][0]["capacity"]  # "llama": none configured; "configured": 1
        config = config_from_dict(data, env={})
        async with running_scraper(config, instance="scraper-one"):
            first = await events.wait_for_report("llama", lambda r: r.sample is not None)
            assert first.capacity == config.scoring.target_inflight > 2
            await events.wait_until(
                lambda log: all(
                    sum(r.stated_capacity == 2 for r in log.reports(e)) >= 5
                    for e in ("llama", "configured")
                )
            )
        stated = [r for r in events.reports("llama") if r.stated_capacity is not None]
        assert all(r.capacity == 2 for r in stated)
        # Configured 1, running 1 at most: what the engine says is reported, not used.
        assert {r.capacity for r in events.reports("configured")} == {1}
        # Per endpoint once for its capacity (again only after CAPACITY_REFRESH) and once for
        # its context window (again after fleet.models_refresh): not every round.
        rounds = min(len(events.reports(e)) for e in ("llama", "configured"))
        assert asked == 4 < 2 * rounds
    finally:
        await stop_servers([server])


async def test_a_fault_in_the_scrapers_reading_still_publishes_a_healthy_report(
    nats_url: str,
    load_bucket: str,
    unique_id: str,
    start_static: StartStatic,
    events: EventLog,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug in turning one endpoint's answers into a report (simulated by making the pure
    reader raise for it) is logged and reported as a metrics error: the endpoint stays
    reported, healthy and unsaturated, and the other endpoints are unaffected."""
    from llmgw.services.scraper import service

    real = service.build_report

    def faulty(target: ScrapeTarget, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        if target.endpoint == "unlucky":
            raise KeyError("x")
        return real(target, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(service, "build_report", faulty)
    unlucky, fine = await start_static(PARTIAL), await start_static(PARTIAL)
    config = make_config(
        nats_url, load_bucket, unique_id, {"unlucky": unlucky.url, "fine": fine.url}
    )
    async with running_scraper(config, instance="scraper-one"):
        report = await events.wait_for_report("unlucky", lambda r: True)
        other = await events.wait_for_report("fine", lambda r: True)
    assert report.healthy and report.metrics == "error" and report.saturation == 0.0
    assert report.metrics_error == "scraper error: KeyError: 'x'"
    assert other.metrics == "partial"


async def test_two_scrapers_leave_consistent_reports_and_a_new_one_adopts_known_capacity(
    nats_url: str,
    load_bucket: str,
    unique_id: str,
    nats_client: NatsClient,
    start_engine: StartEngine,
    events: EventLog,
    load: LoadGenerator,
) -> None:
    engine = await start_engine(max_num_seqs=2, itl_base=0.5)
    config = make_config(nats_url, load_bucket, unique_id, {"busy": engine.url})
    async with running_scraper(config, instance="scraper-a"):
        load.start(engine.url, 2)
        await events.wait_for_report("busy", lambda r: r.capacity == 2)
        await load.stop()
        idle = await events.wait_for_report(
            "busy", lambda r: r.sample is not None and r.sample.running == 0 and r.capacity == 2
        )
        async with running_scraper(config, instance="scraper-b"):
            await events.wait_until(
                lambda log: sum(r.scraper == "scraper-b" for r in log.reports("busy")) >= 3
            )
        stored = await stored_report(await open_load_bucket(nats_client, load_bucket), "busy")

    b_reports = [r for r in events.reports("busy") if r.scraper == "scraper-b"]
    # scraper-b never saw the engine running 2, yet knows its capacity from the bucket.
    assert all(r.sample is not None and r.sample.running == 0 for r in b_reports)
    assert all(r.capacity == 2 for r in b_reports)
    a_during_b = [
        r
        for r in events.reports("busy")
        if r.scraper == "scraper-a" and r.scraped_at > b_reports[0].scraped_at
    ]
    assert a_during_b  # both scraped at once, and agree
    assert all(r.capacity == 2 and r.healthy for r in a_during_b)
    assert stored.capacity == 2 and stored.scraped_at >= idle.scraped_at
    assert events.transitions("busy") == ["healthy", "healthy"]  # each scraper's first verdict


async def test_failed_publishing_is_counted_and_never_stops_the_loop(
    load_bucket: str,
    connect: Connect,
    start_engine: StartEngine,
    nats_url: str,
    unique_id: str,
) -> None:
    engine = await start_engine()
    config = make_config(nats_url, load_bucket, unique_id, {"e1": engine.url})
    nc = await connect()
    kv = await open_load_bucket(nc, load_bucket)
    metrics = ScraperMetrics()
    target = ScrapeTarget("e1", unique_id, "gpu/a", (MODEL,), engine.url)
    async with new_http_client(0.5, 1) as client:
        scraper = Scraper(
            [target],
            client=client,
            bucket=kv,
            publisher=nc,
            metrics=metrics,
            settings=saturation_settings(config),
            instance="scraper-one",
            interval=0.5,
            timeout=0.5,
            clock=SYSTEM,
        )

        def failures(kind: str) -> float | None:
            return metrics.registry.get_sample_value(
                "llmgw_scraper_publish_failures_total", {"kind": kind}
            )

        (first,) = await scraper.run_round()
        assert first.healthy and failures("kv") == 0 and failures("event") == 0
        await nc.close()
        (second,) = await scraper.run_round()
    assert second.healthy and second.sample is not None  # scraping goes on without NATS
    assert failures("kv") == 1
    assert failures("event") == 2  # the endpoint's report and the pool's
    assert scraper.rounds == 2


async def test_an_endpoint_goes_stale_once_the_scrapers_clock_passes_stale_after_its_answer(
    nats_url: str,
    load_bucket: str,
    unique_id: str,
    start_static: StartStatic,
    events: EventLog,
) -> None:
    """Stepped, not waited: an engine answers at T, then stops answering. Its pool report is
    not stale while the scraper's clock is at T + stale_after, and is from T + stale_after
    on (its report then scores it saturated); each report is known by its time stamp."""
    engine = await start_static(PARTIAL)
    config = make_config(nats_url, load_bucket, unique_id, {"e1": engine.url})
    stale_after = config.router.stale_after
    start = 10_000.0
    clock = SteppedClock(start)

    async def measured_at(moment: float) -> tuple[PoolReport, EndpointReport]:
        clock.now = moment
        await events.wait_until(
            lambda log: (
                any(p.measured_at == moment for p in log.pools())
                and any(r.scraped_at == moment for r in log.reports("e1"))
            )
        )
        pool = next(p for p in events.pools() if p.measured_at == moment)
        return pool, next(r for r in events.reports("e1") if r.scraped_at == moment)

    async with running_scraper(config, instance="scraper-one", clock=clock):
        await events.wait_for_report("e1", lambda r: r.healthy and r.scraped_at == start)
        await engine.stop()
        await events.wait_for_report("e1", lambda r: not r.healthy)  # unanswered, still at T
        pool, report = await measured_at(start + stale_after)
        assert pool.stale == () and report.saturation is not None and report.saturation < 1.0
        pool, report = await measured_at(start + stale_after + 0.001)
    assert pool.stale == ("e1",) and pool.healthy == ()
    assert not report.healthy and report.saturation == 1.0
