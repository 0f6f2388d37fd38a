"""What admission knows about providers and endpoints, as one placement snapshot per request.

`ProviderCatalog` keeps the config's providers in priority order (managed first, by priority,
then unlimited ones), the live endpoint health (the scraper's reports, via the `HealthBoard`),
the breakers, the load board, the rate balancer and this instance's ledger, and turns them into
the `llmgw.core.placement.Snapshot` a request is placed on. Nothing here decides.

A managed provider is *degraded* for a model when none of its endpoints serving the model is
healthy with a breaker that lets a request through (or an operator or test marked it so by
hand); unlimited providers are never degraded (third parties are not health-checked).

A catalog is immutable once built: a change of the live fleet builds a new one
(`services/admission/live.py`) that the service swaps in between two decisions. An endpoint
draining out of the fleet is in no placement snapshot, but still known by id (its leases end).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from llmgw.clock import SYSTEM, Clock, TimeSource, wall_of
from llmgw.core.affinity import HashRing
from llmgw.core.context import ContextNeed, ContextWindow, effective_window
from llmgw.core.placement import EndpointState, PinState, PlacementSettings, ProviderState, Snapshot
from llmgw.core.prefix import PromptPrefix
from llmgw.core.requests import Feature
from llmgw.core.routing import ProviderKind
from llmgw.core.spend import cheaper_first
from llmgw.services.admission.health import HealthBoard

if TYPE_CHECKING:
    from llmgw.config.schema import Config, EndpointConfig
    from llmgw.core.breaker import BreakerBoard
    from llmgw.core.ledger import Ledger, PinRecord
    from llmgw.services.admission.balancing import RateBoard
    from llmgw.services.admission.loadboard import LoadBoard
    from llmgw.services.admission.prefixes import PrefixBoard


class ProviderCatalog:
    def __init__(
        self,
        config: Config,
        health: HealthBoard,
        load: LoadBoard,
        rates: RateBoard,
        breakers: BreakerBoard,
        ledger: Ledger,
        *,
        clock: Clock | TimeSource = SYSTEM,
        draining: Collection[str] = frozenset(),
        prefixes: PrefixBoard | None = None,
    ) -> None:
        self._config = config
        self.prefixes = prefixes
        self.draining = frozenset(draining)
        self._health = health
        self._load = load
        self._rates = rates
        self._breakers = breakers
        self._ledger = ledger
        self.clock = wall_of(clock)
        pinning = config.pinning
        self.settings = PlacementSettings(
            session_load_factor=config.scoring.session_load_factor,
            return_home=pinning.return_home,
            return_home_after=pinning.return_home_after,
            return_home_saturation=pinning.return_home_saturation,
            prefix_weight=config.prefix.weight if config.prefix.enabled else 0.0,
            adapter_weight=config.prefix.adapter_weight,
            prefix_queue=config.prefix.queue_slots,
            parent_weight=pinning.parent_weight,
        )
        self.min_idle_before_evict = pinning.min_idle_before_evict
        self.forced_degraded: set[tuple[str, str]] = set()  # (provider, model) marked by hand
        self.order = [p.id for p in config.providers_in_priority_order()]
        # Cost-aware overflow (llmgw.core.spend.cheaper_first): None when nothing to reorder.
        self._overflow_costs = config.spend.overflow_costs(config)
        self._min_speed = config.spend.cheaper_overflow_min_speed
        self._kind = {p.id: ProviderKind(p.kind) for p in config.providers}
        self._strategy = {p.id: p.endpoint_strategy for p in config.providers}
        self._features = {
            p.id: {m.name: frozenset(Feature(f) for f in m.features) for m in p.models}
            for p in config.providers
        }
        # Endpoints of each (provider, model) that take new work (a draining one takes none: its
        # sessions move on their next request), highest endpoint priority first; a ring each.
        self._endpoints: dict[tuple[str, str], list[EndpointConfig]] = {}
        for provider in config.providers:
            for model in provider.models:
                self._endpoints[(provider.id, model.name)] = [
                    e
                    for e in config.endpoints_for(provider.id, model.name)
                    if e.id not in self.draining
                ]
        # Ring weights follow batch capacity: each replica is home to its share of sessions.
        self._rings = {
            pair: HashRing({e.id: float(load.floors.get(e.id) or e.weight) for e in endpoints})
            for pair, endpoints in self._endpoints.items()
            if endpoints
        }
        self._by_id = {e.id: e for e in config.endpoints}
        self._model_windows = {m.name: m.context_window for m in config.models}

    def _adapter_loaded(self, endpoint: EndpointConfig, model: str) -> bool:
        """Whether `model` is a LoRA adapter its engine has loaded now (its running or waiting
        requests use it, by the scraper's last `vllm:lora_requests_info`)."""
        if not self._load.knows(endpoint.id):
            return False
        sample = self._load.load(endpoint.id).sample
        adapters = sample.lora_adapters if sample is not None else None
        return adapters is not None and endpoint.upstream_name(model) in adapters

    # ---- the pinning questions ----------------------------------------------------------------

    def kind(self, provider: str) -> ProviderKind:
        return self._kind[provider]

    def is_unlimited(self, provider: str) -> bool:
        return self._kind.get(provider) is ProviderKind.UNLIMITED

    def supports(self, provider: str, model: str, feature: Feature) -> bool:
        return feature in self._features.get(provider, {}).get(model, frozenset())

    def endpoint_config(self, endpoint_id: str) -> EndpointConfig:
        return self._by_id[endpoint_id]

    def find_endpoint(self, endpoint_id: str) -> EndpointConfig | None:
        """An endpoint of the fleet by id; None when it left it (or never was in it)."""
        return self._by_id.get(endpoint_id)

    def _healthy(self, endpoint: EndpointConfig, provider: str) -> bool:
        return self.is_unlimited(provider) or self._health.is_healthy(endpoint.id)

    def degraded(self, provider: str, model: str, now: float | None = None) -> bool:
        if self.is_unlimited(provider):
            return False
        if (provider, model) in self.forced_degraded:
            return True
        at = self.clock() if now is None else now
        return not any(
            self._healthy(e, provider) and self._breakers.available(e.id, at)
            for e in self._endpoints.get((provider, model), ())
        )

    def can_overflow(self, model: str, feature: Feature) -> bool:
        """Whether a third party (an unlimited provider with an endpoint) serves `model` for
        `feature`: somewhere for a band that overflows to go."""
        return any(
            self.is_unlimited(p)
            and self.supports(p, model, feature)
            and bool(self._endpoints.get((p, model)))
            for p in self.order
        )

    # ---- context windows ----------------------------------------------------------------------

    def window(self, endpoint: EndpointConfig, model: str) -> ContextWindow | None:
        """`endpoint`'s context window for `model` (`llmgw.core.context.effective_window`: its
        configured one, else its engine's as the scraper last read it, else the model's)."""
        reported = self._load.window(endpoint.id) if self._load.knows(endpoint.id) else None
        return effective_window(endpoint.context_window, reported, self._model_windows.get(model))

    def fits(self, model: str, feature: Feature, need: ContextNeed) -> bool:
        """Whether a request of `need` fits some endpoint of a provider that serves `model` for
        `feature`, healthy or not (a model without such endpoints: yes, placement says why not)."""
        endpoints = [
            e
            for provider in self.order
            if self.supports(provider, model, feature)
            for e in self._endpoints.get((provider, model), ())
        ]
        return not endpoints or any(need.fits(self.window(e, model)) for e in endpoints)

    def largest_window(self, model: str, feature: Feature) -> int | None:
        """The largest known window of an endpoint serving `model` for `feature` (messages)."""
        sizes = [
            window.tokens
            for provider in self.order
            if self.supports(provider, model, feature)
            for e in self._endpoints.get((provider, model), ())
            if (window := self.window(e, model)) is not None
        ]
        return max(sizes, default=None)

    # ---- the snapshot -------------------------------------------------------------------------

    def snapshot(
        self,
        model: str,
        feature: Feature,
        session: str | None,
        exclude: Collection[str],
        now: float,
        prompt: PromptPrefix | None = None,
        parent: str | None = None,
        need: ContextNeed | None = None,
    ) -> tuple[Snapshot, PinRecord | None]:
        """The placement snapshot of one request, and the session's pin it shows; `prompt`:
        the request's prompt, matched against what each managed endpoint holds; `parent`: a
        sub-agent's parent session, whose pin's endpoint a new session starts near (that pin
        is here: a sub-agent's session lives in its family's shard); `need`: what it needs of
        a context window (each endpoint's `fits`)."""
        pin = self._ledger.pin(model, session) if session is not None else None
        near = None
        if pin is None and parent is not None:
            held = self._ledger.pin(model, parent)
            near = held.endpoint if held is not None else None
        pinned_on = pin.provider if pin is not None else None
        providers = tuple(
            self._provider(p, model, feature, exclude, now, prompt, near, need, pinned_on)
            for p in self.order
        )
        if self._overflow_costs is not None:
            costs, priorities = self._overflow_costs
            providers = cheaper_first(providers, costs.get(model, {}), priorities, self._min_speed)
        pin_state = (
            None
            if pin is None
            else PinState(pin.provider, self._ledger.session_full(pin), pin.since, pin.endpoint)
        )
        return Snapshot(providers, pin_state, now, self.settings), pin

    def _provider(
        self,
        provider: str,
        model: str,
        feature: Feature,
        exclude: Collection[str],
        now: float,
        prompt: PromptPrefix | None = None,
        near: str | None = None,
        need: ContextNeed | None = None,
        pinned_on: str | None = None,
    ) -> ProviderState:
        """`pinned_on`: the provider of the session's pin, where placement never makes it a
        new pin (it keeps it, or moves it elsewhere): whether a pin could be evicted there for
        one is not asked."""
        managed = not self.is_unlimited(provider)
        prefixes = self.prefixes if managed and prompt is not None else None
        configs = self._endpoints.get((provider, model), [])
        strategy = self._strategy[provider]
        endpoints = []
        saturations = []
        reachable = False  # some endpoint healthy with its breaker letting requests through
        for e in configs:
            healthy = not managed or self._health.is_healthy(e.id)
            open_to_requests = healthy and self._breakers.available(e.id, now)
            reachable = reachable or open_to_requests
            usable = open_to_requests and e.id not in exclude
            if managed and self._load.knows(e.id):
                inflight, saturation, capacity = self._load.reading(e.id, now)
                if healthy:
                    saturations.append(saturation)
            else:
                inflight = self._ledger.endpoint_leases(e.id)
                saturation, capacity = 0.0, max(1, e.capacity or 1)
            cached = prefixes.share(e.id, prompt, now) if prefixes is not None and prompt else 0.0
            endpoints.append(
                EndpointState(
                    e.id,
                    e.priority,
                    usable,
                    inflight,
                    capacity,
                    saturation,
                    cached=cached,
                    adapter_loaded=managed and self._adapter_loaded(e, model),
                    near_parent=e.id == near,
                    fits=need is None or need.fits(self.window(e, model)),
                )
            )
        if strategy == "rate" and len(endpoints) > 1:
            usable_ids = [s.id for s in endpoints if s.usable]
            exploring = {i: self._ledger.endpoint_leases(i) for i in usable_ids}
            weights = self._rates.weights(usable_ids, exploring)
            endpoints = [
                EndpointState(
                    s.id,
                    s.priority,
                    s.usable,
                    s.inflight,
                    s.capacity,
                    s.saturation,
                    weights.get(s.id),
                    s.cached,
                    s.adapter_loaded,
                    s.near_parent,
                    s.fits,
                )
                for s in endpoints
            ]
        room = self._ledger.room(provider, model)
        evictable = (
            not room.pin
            and provider != pinned_on
            and bool(self._ledger.to_evict(provider, model, now, self.min_idle_before_evict))
        )
        return ProviderState(
            id=provider,
            managed=managed,
            supports=self.supports(provider, model, feature),
            # `degraded`, from the loop's readings
            degraded=managed and ((provider, model) in self.forced_degraded or not reachable),
            endpoints=tuple(endpoints),
            room=room,
            strategy=strategy,
            evictable=evictable,
            saturation=sum(saturations) / len(saturations) if saturations else 0.0,
            ring=self._rings.get((provider, model)),
        )
