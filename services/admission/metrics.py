"""The admission service's Prometheus metrics, in a registry of its own (never the global one).

Names start with ``llmgw_admission_``; labels use the closed vocabularies of the code (band
names from the config, `GateDecision`, `Refusal`, `Route`, `AffinityBreak`), so cardinality
stays bounded.
Pool saturation and scrape age are computed when scraped, from the live `LoadBoard`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from llmgw.clock import SYSTEM, Clock, TimeSource, wall_of
from llmgw.telemetry import LabelledChildren, service_registry

if TYPE_CHECKING:
    from llmgw.core.breaker import BreakerBoard
    from llmgw.core.ledger import Ledger
    from llmgw.services.admission.loadboard import LoadBoard
    from llmgw.services.admission.prefixes import PrefixBoard
    from llmgw.services.admission.quotas import QuotaKeeper

_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_DECISION_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5, 30)
_TICK_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05)
_SHARE_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)


class AdmissionMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or service_registry("admission")
        r = self.registry
        # The decision path's children (`child(metric, *values)`), without labels()'s parsing.
        self.child = LabelledChildren()
        self.queue_depth = Gauge(
            "llmgw_admission_queue_depth",
            "Requests waiting in this instance's queue, by band.",
            ["band"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "llmgw_admission_queue_wait_seconds",
            "Time queued requests waited, by band and how the wait ended.",
            ["band", "decision"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.flow_decisions = Counter(
            "llmgw_admission_flow_decisions",
            "Flow-control outcomes by band: granted (dispatched), overflow, queue_full, expired, "
            "cancelled.",
            ["band", "decision"],
            registry=r,
        )
        self.rejections = Counter(
            "llmgw_admission_rejections",
            "Admission requests answered with a rejection, by reason.",
            ["reason"],
            registry=r,
        )
        self.placements = Counter(
            "llmgw_admission_placements",
            "Admitted requests by provider and route.",
            ["provider", "route"],
            registry=r,
        )
        self.fallbacks = Counter(
            "llmgw_admission_fallbacks",
            "Requests served by a fallback model because every provider of theirs was degraded "
            "or full.",
            ["model", "fallback"],
            registry=r,
        )
        self.window_routes = Counter(
            "llmgw_admission_window_routes",
            "Requests whose prompt and requested output fit the context window of no endpoint "
            "of the model they asked for, by that model and the fallback they were sent to "
            "(served: none when no fallback fits either: refused, context_length_exceeded).",
            ["model", "served"],
            registry=r,
        )
        self.decision_duration = Histogram(
            "llmgw_admission_decision_seconds",
            "Time from an admission request's arrival to its answer (queueing included).",
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.tick_duration = Histogram(
            "llmgw_admission_tick_seconds",
            "Duration of one flow-control dispatch tick.",
            buckets=_TICK_BUCKETS,
            registry=r,
        )
        self.quota_holds = Counter(
            "llmgw_admission_quota_holds",
            "Requests of a band that waits (no overflow, or its overflow budget used up) put "
            "back at the head of their queue because only the pair's quota kept them off our "
            "engines, by band (each time).",
            ["band"],
            registry=r,
        )
        self.cancellations = Counter(
            "llmgw_admission_cancellations",
            "Queued requests dropped because their client went away.",
            registry=r,
        )
        self.affinity_breaks = Counter(
            "llmgw_admission_affinity_breaks",
            "Session requests placed off their home replica, by provider and why: home_unusable "
            "(unhealthy, breaker open, failed for this request), home_over_bound (over the "
            "bounded-load cap), home_busy (interactive: no free batch slot there, one elsewhere), "
            "home_cold (its prefix cache lost the prompt, another endpoint holds it).",
            ["provider", "reason"],
            registry=r,
        )
        self.offloads = Counter(
            "llmgw_admission_offloads",
            "Requests sent to an unlimited (third-party) provider, by provider and why: "
            "overflow (flow control: managed pool saturated), no_managed_room (a new pin or an "
            "unpinned request no managed provider could take), pinned_there (its session's pin "
            "is there), session_limit, global_limit, endpoint_failed, degraded, unsupported.",
            ["provider", "reason"],
            registry=r,
        )
        self.returned_home = Counter(
            "llmgw_admission_pins_returned_home",
            "Pins moved back to a higher-priority managed provider, by where from and where to.",
            ["from_provider", "provider"],
            registry=r,
        )
        self.pins_evicted = Counter(
            "llmgw_admission_pins_evicted",
            "Idle pins evicted to make room for a new session's pin (the pin table was full).",
            ["provider"],
            registry=r,
        )
        self.prefix_share = Histogram(
            "llmgw_admission_prefix_share_ratio",
            "Share of each placed prompt the chosen managed endpoint held, by the index that "
            "said so (cache-aware placement; 0: nothing of it was cached there).",
            ["index"],
            buckets=_SHARE_BUCKETS,
            registry=r,
        )
        self.leases_expired = Counter(
            "llmgw_admission_leases_expired",
            "Leases ended because their edge did not renew them within lease_timeout.",
            ["provider"],
            registry=r,
        )

    def watch_load(
        self, board: LoadBoard, models: Iterable[str], clock: Clock | TimeSource = SYSTEM
    ) -> None:
        """Export pool saturation per model and scrape age per endpoint from `board`."""
        self.registry.register(_LoadCollector(board, list(models), wall_of(clock)))

    def watch_ledger(self, ledger: Ledger, shards: Callable[[], int]) -> None:
        """Export leases, pins and quotas per pair, and the shards served."""
        self.registry.register(_LedgerCollector(ledger, shards))

    def watch_quotas(self, keeper: QuotaKeeper) -> None:
        """Export the quota keeper's loans: rounds borrowed by where room came from, and loans
        made to peers."""
        self.registry.register(_LoanCollector(keeper))

    def watch_prefixes(self, board: PrefixBoard) -> None:
        """Export the prefix indexes: blocks held per endpoint and index, each endpoint's
        bound, their memory, and the stream messages applied."""
        self.registry.register(_PrefixCollector(board))

    def watch_breakers(
        self,
        breakers: BreakerBoard,
        endpoints: Callable[[], Iterable[str]],
        clock: Clock | TimeSource = SYSTEM,
    ) -> None:
        """Export each endpoint's breaker state (1 for its current state, 0 for the others):
        of the endpoints `endpoints()` names at each scrape (the live fleet the instance runs
        on, so an endpoint added or removed at run time appears or leaves)."""
        self.registry.register(_BreakerCollector(breakers, endpoints, wall_of(clock)))


class _PrefixCollector(Collector):
    def __init__(self, board: PrefixBoard) -> None:
        self._board = board

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        board = self._board
        blocks = GaugeMetricFamily(
            "llmgw_admission_prefix_blocks",
            "Prompt blocks each endpoint's prefix cache is believed to hold, by index: sent "
            "(placements, any engine) or held (the engine's KV cache events).",
            labels=["endpoint", "index"],
        )
        bound = GaugeMetricFamily(
            "llmgw_admission_prefix_capacity_blocks",
            "The most blocks of the sent index an endpoint keeps (its engine's KV cache).",
            labels=["endpoint"],
        )
        for endpoint in board.endpoints():
            blocks.add_metric([endpoint, "sent"], board.sent.size(endpoint))
            blocks.add_metric([endpoint, "held"], board.held.size(endpoint))
            bound.add_metric([endpoint], board.sent.capacity(endpoint))
        yield blocks
        yield bound
        memory = GaugeMetricFamily(
            "llmgw_admission_prefix_memory_bytes",
            "Estimated memory of this instance's prefix indexes.",
        )
        memory.add_metric([], board.memory_bytes())
        yield memory
        messages = CounterMetricFamily(
            "llmgw_admission_prefix_messages",
            "Prefix stream messages this instance read, by kind: sent (another instance's "
            "placement), held (an engine's KV cache events), own (its own placement, skipped), "
            "malformed (skipped).",
            labels=["kind"],
        )
        for kind, count in sorted(board.received.items()):
            messages.add_metric([kind], float(count))
        yield messages
        published = CounterMetricFamily(
            "llmgw_admission_prefix_published",
            "Placements this instance published to the prefix stream.",
        )
        published.add_metric([], float(board.published))
        yield published


class _BreakerCollector(Collector):
    def __init__(
        self,
        breakers: BreakerBoard,
        endpoints: Callable[[], Iterable[str]],
        clock: Callable[[], float],
    ) -> None:
        self._breakers = breakers
        self._endpoints = endpoints
        self._clock = clock

    def collect(self) -> Iterator[GaugeMetricFamily]:
        from llmgw.core.breaker import BreakerState

        now = self._clock()
        family = GaugeMetricFamily(
            "llmgw_admission_endpoint_breaker",
            "Circuit breaker of each endpoint as this instance sees it (1 = its current state).",
            labels=["endpoint", "state"],
        )
        for endpoint in self._endpoints():
            current = self._breakers.state(endpoint, now)
            for state in BreakerState:
                family.add_metric([endpoint, state.value], 1.0 if state is current else 0.0)
        yield family


class _LoadCollector(Collector):
    def __init__(self, board: LoadBoard, models: list[str], clock: Callable[[], float]) -> None:
        self._board = board
        self._models = models
        self._clock = clock

    def collect(self) -> Iterator[GaugeMetricFamily]:
        now = self._clock()
        saturation = GaugeMetricFamily(
            "llmgw_admission_pool_saturation",
            "Saturation of each model's healthy managed endpoints as flow control sees it "
            "(the gateway's own live requests counted); 1 = the healthy limit.",
            labels=["model"],
        )
        for model in self._models:
            pool = self._board.pool(model, now)
            if pool is not None:
                saturation.add_metric([model], pool.saturation())
        yield saturation
        age = GaugeMetricFamily(
            "llmgw_admission_scrape_age_seconds",
            "Age of the newest scraper report per managed endpoint (absent: never reported).",
            labels=["endpoint"],
        )
        for endpoint in self._board.endpoints():
            value = self._board.scrape_age(endpoint, now)
            if value is not None:
                age.add_metric([endpoint], value)
        yield age
        inflight = GaugeMetricFamily(
            "llmgw_admission_endpoint_inflight",
            "Requests on each managed endpoint by the gateway's own accounting (every admission "
            "instance) plus the engine's foreign load.",
            labels=["endpoint"],
        )
        capacity = GaugeMetricFamily(
            "llmgw_admission_endpoint_capacity",
            "Batch capacity of each managed endpoint: configured, stated by its engine, or "
            "learned (raised by what it was seen running and by the gateway's own count while "
            "it reported none waiting).",
            labels=["endpoint"],
        )
        for endpoint in self._board.endpoints():
            inflight.add_metric([endpoint], self._board.inflight(endpoint, now))
            capacity.add_metric([endpoint], self._board.capacity(endpoint))
        yield inflight
        yield capacity


class _LoanCollector(Collector):
    def __init__(self, keeper: QuotaKeeper) -> None:
        self._keeper = keeper

    def collect(self) -> Iterator[CounterMetricFamily]:
        rounds = CounterMetricFamily(
            "llmgw_admission_quota_loans",
            "Borrowing rounds of this instance (requests its own quota share could not take "
            "while the limit could), by where the room came from: free (what no instance held), "
            "lent (a peer's idle quota), none (nothing to borrow: placed as without; also a "
            "request held back when nothing seemed to be had, without a round).",
            labels=["source"],
        )
        for source, count in sorted(self._keeper.loans.rounds.items()):
            rounds.add_metric([source], float(count))
        yield rounds
        lent = CounterMetricFamily(
            "llmgw_admission_quota_lent",
            "Loans this instance made of its idle quota to peers that asked.",
        )
        lent.add_metric([], float(self._keeper.loans.lent))
        yield lent


class _LedgerCollector(Collector):
    def __init__(self, ledger: Ledger, shards: Callable[[], int]) -> None:
        self._ledger = ledger
        self._shards = shards

    def collect(self) -> Iterator[GaugeMetricFamily]:
        leases = GaugeMetricFamily(
            "llmgw_admission_leases",
            "Live request leases this instance holds, by provider and model.",
            labels=["provider", "model"],
        )
        pins = GaugeMetricFamily(
            "llmgw_admission_pins",
            "Session pins this instance holds (of the shards it owns), by provider and model.",
            labels=["provider", "model"],
        )
        quota = GaugeMetricFamily(
            "llmgw_admission_quota",
            "This instance's quota of each pair with limits (kind: leases, unreserved, pins).",
            labels=["provider", "model", "kind"],
        )
        for (provider, model), use in sorted(self._ledger.use.items()):
            leases.add_metric([provider, model], use.leases)
            pins.add_metric([provider, model], use.pins)
        for (provider, model), q in sorted(self._ledger.quota.items()):
            quota.add_metric([provider, model, "leases"], q.g)
            quota.add_metric([provider, model, "unreserved"], q.u)
            quota.add_metric([provider, model, "pins"], q.p)
        yield leases
        yield pins
        yield quota
        shards = GaugeMetricFamily("llmgw_admission_shards", "Session shards this instance serves.")
        shards.add_metric([], self._shards())
        yield shards
