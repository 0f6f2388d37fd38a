"""The scrape loop: every interval, scrape every managed endpoint and publish what it learned.

A round scrapes all endpoints concurrently through the one `httpx.AsyncClient` it is given;
per endpoint, ``GET /health`` and ``GET /metrics`` also run concurrently, each bounded by
``timeout``. An engine whose dialect states its batch capacity (SGLang, TGI, llama.cpp:
`llmgw.core.engine_capacity`) is asked for it too, alongside, from the scrape after the one
that showed its dialect and then every `CAPACITY_REFRESH` (and at once when its dialect
changes); every report carries its latest answer (``stated_capacity``). Each endpoint publishes its own report as soon as its scrape is done, so a slow or
dead endpoint delays no other endpoint's report (only the pool reports, which need them all,
wait for the slowest, at most ``timeout``). Per endpoint and round:

1. the report goes to the load bucket under `report_key` (latest state for new readers), then
2. on `endpoint_event_subject("scraped", provider)`, then
3. on ``...healthy`` / ``...unhealthy`` when the health verdict changed, or is this scraper's
   first verdict for the endpoint (so subscribers learn the initial state).

After every endpoint: one `PoolReport` per (provider, pool) on `pool_event_subject`.

Context windows: an endpoint's report carries its engine's context window
(`EndpointReport.context_window`), read where its dialect tells it (`reports.window_paths`:
vLLM's and SGLang's ``GET /v1/models``, llama.cpp's ``GET /props``, TGI's ``GET /info``)
when it first answers healthy, when it turns healthy again (a restart may change it) and every
`window_refresh` seconds (``fleet.models_refresh``); a read that fails keeps the last window.

Failures: an endpoint that cannot be scraped still gets its report (healthy False, or sample
None; stale endpoints score at least 1.0): nothing is ever dropped. Metrics that cannot be read
(an HTTP error, a timeout, a malformed exposition, or a fault in the scraper's own processing of
them) are a report with ``metrics: error`` and no sample: counted under ``result=
"metrics_error"``, logged when the outcome changes, and scored on the gateway's own accounting
(never as saturated) while ``/health`` says the engine is healthy. A bucket write or publish
that fails is counted (``llmgw_scraper_publish_failures_total``) and logged once per outage; it
never stops the loop. Rounds run at a fixed rate (``interval`` from one start to the next); a
round that overruns starts the next one at once, without bursts to catch up.

Ownership: the loop is the only writer of its per-endpoint state (learned load, last health),
and rounds never overlap.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Literal, Protocol, TypedDict

import httpx

from llmgw.core.context import ContextWindow
from llmgw.core.engine_capacity import CAPACITY_PATHS, parse_capacity
from llmgw.core.engine_metrics import EngineDialect
from llmgw.core.saturation import EndpointLoad, SaturationSettings
from llmgw.events import EndpointEvent, EventName, PoolMeasured, RoutingEvent, event_id
from llmgw.load import (
    EndpointReport,
    report_key,
)
from llmgw.services.scraper.metrics import ScraperMetrics
from llmgw.services.scraper.reports import (
    Fetched,
    ScrapeOutcome,
    ScrapeTarget,
    build_report,
    failed_report,
    health_event_verb,
    pool_reports,
    read_window,
    window_paths,
)
from llmgw.state.kv import KVEntry

if TYPE_CHECKING:
    from llmgw.contracts import Clock

__all__ = [
    "CAPACITY_REFRESH",
    "LoadBucket",
    "Publisher",
    "Scraper",
    "health_window",
    "new_http_client",
]

_log = logging.getLogger("llmgw.scraper")

# Seconds between two questions to an engine about its batch capacity (a restart with other
# settings is seen within this long); an engine that did not answer is asked again as late.
CAPACITY_REFRESH = 60.0

# The event `_publish` sends for each verb (`endpoint.<verb>`).
_ENDPOINT_EVENTS: dict[
    str,
    Literal[EventName.ENDPOINT_SCRAPED, EventName.ENDPOINT_HEALTHY, EventName.ENDPOINT_UNHEALTHY],
] = {
    "scraped": EventName.ENDPOINT_SCRAPED,
    "healthy": EventName.ENDPOINT_HEALTHY,
    "unhealthy": EventName.ENDPOINT_UNHEALTHY,
}


class _ScrapeContext(TypedDict):
    """What `build_report` and `failed_report` take besides the scrape itself."""

    scraped_at: float
    now: float
    settings: SaturationSettings
    scraper: str


class LoadBucket(Protocol):
    """The load bucket as the scraper uses it (`llmgw.state.NatsKV` satisfies it)."""

    async def put(self, key: str, value: bytes) -> int: ...

    async def get(self, key: str) -> KVEntry | None: ...


class Publisher(Protocol):
    """Core NATS publish (a nats-py `Client` satisfies it)."""

    async def publish(self, subject: str, payload: bytes = b"") -> None: ...


async def _nothing() -> tuple[bool, int | None]:
    return False, None


def health_window(interval: float, timeout: float) -> float:
    """How long after its last round a healthy scraper may go without completing another.

    Two intervals, as long as a round fits in one; a round lasts up to ``timeout`` (the scrape)
    plus a publish bounded by ``interval``, so a longer timeout widens the window.
    """
    return max(2 * interval, interval + 2 * timeout)


def new_http_client(timeout: float, endpoints: int) -> httpx.AsyncClient:
    """The one client of a scraper: two requests per endpoint at once, kept alive between rounds.

    Environment proxies are ignored: scrapes go to the engines directly, as the edge does.
    """
    connections = max(10, 2 * endpoints)
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        trust_env=False,
    )


class Scraper:
    """Scrapes `targets` every `interval` seconds; see the module docstring.

    The `clock`'s wall time (unix seconds in the product) stamps reports and judges staleness;
    readers compare ``scraped_at`` with their own clock. Its monotonic time measures durations
    and paces rounds. The composition root (`main.serve`) gives it.
    """

    def __init__(
        self,
        targets: Sequence[ScrapeTarget],
        *,
        client: httpx.AsyncClient,
        bucket: LoadBucket,
        publisher: Publisher,
        metrics: ScraperMetrics,
        settings: SaturationSettings,
        instance: str,
        interval: float,
        timeout: float,
        clock: Clock,
        capacities: dict[str, int] | None = None,
        window_refresh: float | None = None,
    ) -> None:
        self.targets = tuple(targets)
        self.window_refresh = window_refresh
        self._floors = dict(capacities or {})
        self._client = client
        self._bucket = bucket
        self._publisher = publisher
        self.metrics = metrics
        self.settings = settings
        self.instance = instance
        self.interval = interval
        self.timeout = timeout
        # A stalled NATS call must not hold the loop for longer than a round is meant to take.
        self.publish_timeout = interval
        self._clock = clock.wall
        self._timer = clock.monotonic
        self._loads: dict[str, EndpointLoad] = {}
        self._read_at: dict[str, float] = {}  # when each endpoint's /metrics was last read
        self._healthy: dict[str, bool] = {}
        # Per endpoint: the capacity its engine last stated, and when (timer) and in which
        # dialect it was last asked.
        self._stated: dict[str, int] = {}
        self._asked: dict[str, tuple[float, EngineDialect]] = {}
        self._outcomes: dict[str, ScrapeOutcome] = {}
        self._windows: dict[str, ContextWindow] = {}  # each engine's context window, last read
        self._window_read_at: dict[str, float] = {}
        self._dialects: dict[str, EngineDialect] = {}  # each engine's metrics dialect, last seen
        self._failing: set[str] = set()  # publish kinds in an outage (logged once each)
        self.rounds = 0
        self.started_at: float | None = None
        self.last_round_at: float | None = None
        self._round_done = asyncio.Condition()
        self._new_scrapes: set[asyncio.Task[None]] = set()  # first scrapes of new endpoints
        metrics.declare(t.endpoint for t in self.targets)
        metrics.watch_ages(self.scrape_ages)

    # ---- state, read by metrics and the admin port ----------------------------------------

    def load(self, endpoint: str) -> EndpointLoad:
        return self._loads.get(endpoint, EndpointLoad(self._floors.get(endpoint, 0)))

    def scrape_ages(self) -> Iterable[tuple[str, float | None]]:
        """Seconds since each endpoint's ``/metrics`` was last read successfully, whatever it
        held (all, some or none of the load gauges, or a 404); None: never."""
        now = self._clock()
        for target in self.targets:
            read_at = self._read_at.get(target.endpoint)
            yield target.endpoint, None if read_at is None else max(0.0, now - read_at)

    def health_problem(self) -> str | None:
        """Why the loop is not keeping up (None when it is): for the admin port's /health."""
        reference = self.last_round_at if self.last_round_at is not None else self.started_at
        if reference is None:
            return "the scrape loop has not started"
        quiet = self._clock() - reference
        window = health_window(self.interval, self.timeout)
        if quiet > window:
            return f"no scrape round completed for {quiet:.1f}s (allowed {window:g}s)"
        return None

    # ---- the live fleet ---------------------------------------------------------------------

    def retarget(self, targets: Sequence[ScrapeTarget], capacities: dict[str, int]) -> None:
        """Scrape `targets` from now on (the live fleet changed). A new endpoint is scraped at
        once, not at the next round, so admission learns its load and health within one
        scrape's time; one that left is no longer scraped (its last report stays in the
        bucket until the bucket forgets it, and admission ignores it)."""
        known = {t.endpoint for t in self.targets}
        self.targets = tuple(targets)
        for endpoint, floor in capacities.items():
            if floor != self._floors.get(endpoint):
                self._floors[endpoint] = floor
                load = self._loads.get(endpoint)
                if load is not None:
                    self._loads[endpoint] = EndpointLoad(
                        floor, load.sample, load.sampled_at, load.reported_at
                    )
        self.metrics.declare(t.endpoint for t in self.targets if t.endpoint not in known)
        for target in self.targets:
            if target.endpoint not in known:
                task = asyncio.create_task(self._scrape_new(target), name="scrape-new")
                self._new_scrapes.add(task)
                task.add_done_callback(self._new_scrapes.discard)

    async def _scrape_new(self, target: ScrapeTarget) -> None:
        try:
            await self._scrape(target)
        except Exception:
            _log.exception("scraping the new endpoint %s failed", target.endpoint)

    # ---- the loop -------------------------------------------------------------------------

    async def adopt_known_capacity(self) -> None:
        """Take each endpoint's capacity in the bucket's report as this scraper's floor.

        Capacity is learned slowly (only a busy engine shows it), so a restarted or second
        scraper starts from what is already known rather than from 0. Best effort: an
        unreadable bucket or report leaves the capacity to be learned.
        """

        async def adopt(target: ScrapeTarget) -> None:
            try:
                async with asyncio.timeout(self.publish_timeout):
                    entry = await self._bucket.get(report_key(target.endpoint))
                if entry is None:
                    return
                report = EndpointReport.model_validate_json(entry.value)
            except Exception as exc:  # unreachable bucket, foreign or old report
                _log.info("no known capacity for %s: %s", target.endpoint, exc)
                return
            load = self.load(target.endpoint)
            if report.capacity > load.capacity:
                self._loads[target.endpoint] = EndpointLoad(
                    report.capacity, load.sample, load.sampled_at, load.reported_at
                )

        await asyncio.gather(*(adopt(t) for t in self.targets))

    async def run(self, stop: asyncio.Event) -> None:
        """Round after round, `interval` apart, until `stop` is set (the current round ends)."""
        self.started_at = self._clock()
        next_start = self._timer()
        while not stop.is_set():
            try:
                await self.run_round()
            except Exception:  # a bug in one round must not end the scraper
                _log.exception("scrape round failed")
            next_start += self.interval
            delay = next_start - self._timer()
            if delay < 0:  # overran: go again now, and pace from here
                next_start, delay = self._timer(), 0.0
            try:
                async with asyncio.timeout(delay):
                    await stop.wait()
            except TimeoutError:
                pass

    async def run_round(self) -> list[EndpointReport]:
        """Scrape and publish every endpoint, then the pools; the endpoint reports, in order."""
        started = self._timer()
        results = await asyncio.gather(
            *(self._scrape(t) for t in self.targets), return_exceptions=True
        )
        reports = []
        for target, result in zip(self.targets, results, strict=True):
            if isinstance(result, BaseException):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                _log.error("scraping %s failed", target.endpoint, exc_info=result)
            else:
                reports.append(result)
        for pool in pool_reports(
            self.targets,
            {t.endpoint: self.load(t.endpoint) for t in self.targets},
            self._healthy,
            now=self._clock(),
            settings=self.settings,
            scraper=self.instance,
        ):
            self.metrics.observe_pool(pool)
            event = PoolMeasured(
                id=event_id(), at=pool.measured_at, instance=self.instance, report=pool
            )
            await self._publish_event(event)
        self.metrics.round_duration.observe(self._timer() - started)
        self.last_round_at = self._clock()
        self.metrics.last_round.set(self.last_round_at)
        self.metrics.rounds.inc()
        async with self._round_done:
            self.rounds += 1
            self._round_done.notify_all()
        return reports

    async def wait_for_rounds(self, count: int) -> None:
        """Return once `count` rounds have completed in total (bound it with asyncio.timeout)."""
        async with self._round_done:
            await self._round_done.wait_for(lambda: self.rounds >= count)

    # ---- one endpoint ---------------------------------------------------------------------

    def _capacity_due(self, endpoint: str, now: float) -> EngineDialect | None:
        """The dialect to ask the endpoint's engine about its capacity in, if it is time."""
        dialect = self._dialects.get(endpoint)
        if dialect is None or dialect not in CAPACITY_PATHS:
            return None
        asked = self._asked.get(endpoint)
        if asked is not None and asked[1] is dialect and now - asked[0] < CAPACITY_REFRESH:
            return None
        return dialect

    async def _ask_capacity(self, url: str, dialect: EngineDialect) -> tuple[bool, int | None]:
        """(answered, the capacity it states): the dialect's paths in turn, the first that
        answers 200 read; not answered at all: (False, None), the last answer stands."""
        for path in CAPACITY_PATHS[dialect]:
            fetched = await self._get(url + path)
            if fetched.status is None:
                return False, None
            if fetched.status == 200:
                return True, parse_capacity(dialect, fetched.body)
        return True, None

    async def _scrape(self, target: ScrapeTarget) -> EndpointReport:
        scraped_at = self._clock()
        started = self._timer()
        endpoint = target.endpoint
        dialect = self._capacity_due(endpoint, started)
        health, metrics, asked = await asyncio.gather(
            self._get(target.url + "/health"),
            self._get(target.url + "/metrics"),
            self._ask_capacity(target.url, dialect) if dialect is not None else _nothing(),
        )
        duration = self._timer() - started
        if dialect is not None:
            self._asked[endpoint] = (started, dialect)
            answered, stated = asked
            if answered and stated is not None:
                self._stated[endpoint] = stated
            elif answered:
                self._stated.pop(endpoint, None)
        context: _ScrapeContext = {
            "scraped_at": scraped_at,
            "now": self._clock(),
            "settings": self.settings,
            "scraper": self.instance,
        }
        window = self._windows.get(target.endpoint)
        try:
            report, load, outcome = build_report(
                target,
                health,
                metrics,
                self.load(endpoint),
                window=window,
                stated=self._stated.get(endpoint),
                **context,
            )
        except Exception as exc:  # a bug here must not leave a healthy engine unreported
            _log.exception("reading the scrape of %s failed", target.endpoint)
            report, load, outcome = failed_report(
                target,
                health,
                self.load(endpoint),
                f"scraper error: {type(exc).__name__}: {exc}",
                window=window,
                stated=self._stated.get(endpoint),
                **context,
            )
        self._loads[endpoint] = load
        if report.sample is not None:
            if self._dialects.get(endpoint) not in (None, report.sample.dialect):
                self._stated.pop(endpoint, None)  # another engine: its word is not this one's
            self._dialects[endpoint] = report.sample.dialect
        if report.metrics in ("full", "partial", "none"):  # /metrics answered and was read
            self._read_at[target.endpoint] = scraped_at
        previous = self._healthy.get(target.endpoint)
        self._healthy[target.endpoint] = report.healthy
        if report.healthy and self._window_due(target.endpoint, previous, scraped_at):
            read = await self._read_window(target)
            if read is not None and read != window:
                self._windows[target.endpoint] = read
                report = report.model_copy(
                    update={"context_window": read.tokens, "window_holds_output": read.hold_output}
                )
        try:  # accounting only: a fault here must not keep the report from being published
            self.metrics.observe_scrape(report, outcome, duration)
            self._log_outcome(report, outcome)
        except Exception:
            _log.exception("recording the scrape of %s failed", target.endpoint)
        await self._publish(report, health_event_verb(previous, report.healthy))
        return report

    def _window_due(self, endpoint: str, was_healthy: bool | None, now: float) -> bool:
        """Whether to read the engine's context window now (it answers healthy): never read,
        healthy again, or last read `window_refresh` ago."""
        read_at = self._window_read_at.get(endpoint)
        if read_at is None or was_healthy is False:
            return True
        return self.window_refresh is not None and now - read_at >= self.window_refresh

    async def _read_window(self, target: ScrapeTarget) -> ContextWindow | None:
        """The engine's context window, from the first of its dialect's sources that tells it."""
        self._window_read_at[target.endpoint] = self._clock()
        for path in window_paths(self._dialects.get(target.endpoint)):
            window = read_window(path, await self._get(target.url + path), target.served)
            if window is not None:
                return window
        return None

    async def _get(self, url: str) -> Fetched:
        try:
            # httpx's timeout bounds each phase; this bounds the whole request (a trickling body).
            async with asyncio.timeout(self.timeout):
                response = await self._client.get(url)
        except (TimeoutError, httpx.TimeoutException):
            return Fetched(error=f"no answer within {self.timeout:g}s", timed_out=True)
        except Exception as exc:  # connection refused, reset, bad URL...: the endpoint is down
            detail = str(exc)
            return Fetched(error=type(exc).__name__ + (f": {detail}" if detail else ""))
        return Fetched(status=response.status_code, body=response.text)

    def _log_outcome(self, report: EndpointReport, outcome: ScrapeOutcome) -> None:
        """One line when an endpoint's outcome changes, not one per round."""
        previous = self._outcomes.get(report.endpoint)
        self._outcomes[report.endpoint] = outcome
        if previous == outcome or (previous is None and outcome is ScrapeOutcome.OK):
            if outcome is ScrapeOutcome.OK and report.metrics == "partial" and previous is None:
                _log.info(
                    "endpoint %s reports only some engine load metrics (%s missing): the "
                    "gateway's own accounting covers the rest",
                    report.endpoint,
                    ", ".join(report.sample.to_core().missing) if report.sample else "?",
                )
            return
        if outcome is ScrapeOutcome.OK:
            _log.info("endpoint %s: scraped fine again", report.endpoint)
        elif outcome is ScrapeOutcome.NO_METRICS:
            _log.info(
                "endpoint %s exposes no engine load metrics: the gateway counts its load itself "
                "(its inflight against its batch capacity)",
                report.endpoint,
            )
        else:
            _log.warning(
                "endpoint %s: %s (%s)",
                report.endpoint,
                outcome.value,
                report.health_error or report.metrics_error,
            )

    async def _publish(self, report: EndpointReport, transition: str | None) -> None:
        payload = report.to_bytes()
        await self._send("kv", lambda: self._bucket.put(report_key(report.endpoint), payload))
        for verb in ("scraped", transition) if transition is not None else ("scraped",):
            event = EndpointEvent(
                event=_ENDPOINT_EVENTS[verb],
                id=event_id(),
                at=report.scraped_at,
                instance=self.instance,
                report=report,
            )
            await self._publish_event(event)

    async def _publish_event(self, event: RoutingEvent) -> bool:
        return await self._send(
            "event", lambda: self._publisher.publish(event.subject, event.to_bytes())
        )

    async def _send(self, kind: str, send: Callable[[], Awaitable[object]]) -> bool:
        """Run one write or publish, bounded; never raises (but cancellation)."""
        try:
            async with asyncio.timeout(self.publish_timeout):
                await send()
        except Exception as exc:
            self.metrics.publish_failures.labels(kind).inc()
            if kind not in self._failing:
                self._failing.add(kind)
                _log.warning(
                    "cannot publish to %s: %r (further failures are only counted until "
                    "one succeeds)",
                    kind,
                    exc,
                )
            return False
        if kind in self._failing:
            self._failing.discard(kind)
            _log.info("publishing to %s again", kind)
        return True
