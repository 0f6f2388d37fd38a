"""One placement decision: which provider and which endpoint a request runs on, and what it does
to its session's pin, decided in memory over one snapshot.

Pure: `place` takes a `Snapshot` (providers in priority order with their endpoints' load, health
and breakers, the pair room this admission instance has, the session's pin) and a
`PlacementRequest`, and returns a `Placement` or a `Refusal` (UNSUPPORTED or NO_CAPACITY). No I/O, no clock (``now`` is in the
snapshot), no randomness (a uniform ``draw`` is in the request). The admission service applies
the result to its ledger in the same event-loop turn, so decision and transition are atomic.

The pinning rules, step by step:

- no session: the first usable provider with room runs it once;
- no pin: the first usable provider with pin and request room gets the session's pin; a full
  pin table evicts its least recently used idle pin
  that served one request, or has been idle `min_idle_before_evict` (`ProviderState.evictable`,
  `llmgw.core.ledger.Ledger.evictable`) instead of refusing;
- a pin on a provider that no longer serves the model, or is degraded: the pin moves to the next
  usable provider with room;
- a pin whose session or provider is at its in-flight limit: the request runs elsewhere once and
  the pin stays;
- otherwise the request runs on its pin.

Context windows (`llmgw.core.context`): an endpoint whose window the request does not fit
(`EndpointState.fits` False) is no candidate, wherever a candidate is picked. A pin on a
provider none of whose endpoints the request fits any more (its conversation outgrew them)
moves to the next provider that can take it (REPINNED, reason ``context_window``); a home
replica it outgrew is left as an unusable one is (HOME_UNUSABLE). When no endpoint of any
provider that serves the model fits, the answer is CONTEXT_LENGTH_EXCEEDED, never a placement.

Beyond those rules:

- *return home*: a session pinned to a lower-priority provider (a third party, or a lower
  managed provider) moves back to a higher-priority managed provider that is usable, has pin
  room (or an evictable pin, see `ProviderState.evictable`) and request room, is not busier than ``return_home_saturation``, once the pin has stayed put
  for ``return_home_after`` seconds (hysteresis: pins do not flap);
- *failures move across providers*: a retry whose pinned provider has no endpoint left to try
  (they failed for this request) runs once on the next provider while the pin stays;
- *flow control's overflow*: the managed pool is above the band's ceiling, so the request runs on
  the first usable unlimited provider now; no pin is created or moved;
- *endpoint choice* (managed providers, strategy "score"), within the highest priority tier of
  endpoints that is not saturated:

  - a session's request goes to its *home replica*: the endpoint its last request ran on (the
    pin remembers it; its prefix cache holds the conversation), or for a pin whose endpoint is
    unknown (taken over from a crashed instance) its consistent-hashing home. The home keeps it
    while it has a free batch slot (leaving would cost the cache and gain nothing), or while it
    is within the load bound: at most ``session_load_factor`` times its share, by batch
    capacity, of the tier's load (bounded loads, Mirrokni et al., weighted by capacity).
    Otherwise it goes to the endpoint with the most room (`AffinityBreak` says why);
  - work with no conversation of its own there (no session, or a session's first request on
    this provider, e.g. a one-shot conversation) goes where its prompt is cached, traded
    against room: a free batch slot first, then the lowest *cost*
    ``max(saturation, inflight / capacity) - prefix_weight * cached - adapter_weight *
    adapter_loaded - parent_weight * near_parent`` (``cached``: the share of the prompt the
    endpoint's prefix cache holds, 0..1, `llmgw.core.prefix`; ``adapter_loaded``: the
    request's LoRA adapter is in its GPU memory, by vLLM's ``lora_requests_info``;
    ``near_parent``: a sub-agent's new session, and its parent session's last request ran
    there, so it starts beside its parent while that endpoint has room), ties broken by
    the session's ring order so that idle endpoints share new sessions. An endpoint that
    holds at least half the prompt counts as having room up to ``prefix_queue`` requests past
    its slots (a slot frees sooner than a cold prefill elsewhere ends). A prompt's engine
    takes it while it has that room; past it, the prompt spreads (no herding);
  - a session whose home lost its prompt (evicted, or the engine restarted) follows it to an
    endpoint it may go to that holds ``FOLLOW_CACHE_MARGIN`` more of it (`AffinityBreak`
    HOME_COLD);
  - an *interactive* request (its band's flag) never goes to an endpoint without a free batch
    slot while another usable endpoint of the provider has one: queueing behind a full batch
    costs more than a prefix-cache miss.

  Strategy "rate" (unlimited providers): a weighted draw by the rate balancer's weights
  (computed by the caller, which also caps exploration).

Properties (tests/core/test_placement.py, hypothesis):

- a new session whose parent's endpoint has a free batch slot starts there, when nothing else
  it is traded against (a cached prompt, a loaded adapter, the priority tier, an interactive
  request's free slot) weighs more; it never goes there past its room while another endpoint
  of the tier has a free slot;
- a session's home replica is kept whenever it has a free batch slot, or has room under the
  load bound unless the request is interactive and another usable endpoint of the provider has
  a free slot (or its home lost its prompt to another endpoint); work without a cache of its
  own starts at the lowest cost, on a free slot whenever one exists;
- no interactive request is placed on an endpoint without a free batch slot while another usable
  endpoint of the same provider has one;
- an unlimited provider is chosen only when no managed provider can take the request now (usable,
  with room for the lease it needs, with a usable endpoint), or flow control said overflow, or
  the session is pinned there (and cannot return home);
- (tests/core/test_context_window.py) no request is placed on an endpoint it does not fit, it is
  refused CONTEXT_LENGTH_EXCEEDED exactly when no endpoint of a provider serving it fits, and a
  pinned session that outgrew every endpoint of its provider never stays there.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from llmgw.core.affinity import HashRing
from llmgw.core.ledger import LeaseKind, Room
from llmgw.core.outcomes import Refusal
from llmgw.core.records import record

__all__ = [
    "AffinityBreak",
    "EndpointState",
    "PinAction",
    "PinState",
    "Placement",
    "PlacementRequest",
    "PlacementSettings",
    "ProviderState",
    "Refusal",
    "Route",
    "Snapshot",
    "place",
]


class Route(enum.StrEnum):
    """How a placed request relates to its session's pin (a metrics label, `x-llmgw-route`)."""

    PINNED = "pinned"  # on the session's pin
    NEW_PIN = "new_pin"  # created the session's pin
    REPINNED = "repinned"  # moved the pin off a provider that is degraded or no longer serves it
    RETURNED_HOME = "returned_home"  # moved the pin back to a higher-priority managed provider
    TEMPORARY = "temporary"  # ran elsewhere this once (limit or failure); the pin stays
    UNPINNED = "unpinned"  # no session (e.g. embeddings)
    OVERFLOW = "overflow"  # flow control: the managed pool was saturated; ran on a third party
    LOCAL = "local"  # decided by the edge alone while NATS was unreachable (llmgw.core.outage)


class PinAction(enum.StrEnum):
    NONE = "none"
    CREATE = "create"
    MOVE = "move"


class AffinityBreak(enum.StrEnum):
    """Why a session's request did not go to its home replica (a metrics label)."""

    HOME_UNUSABLE = "home_unusable"  # unhealthy, breaker open, or failed for this request
    HOME_OVER_BOUND = "home_over_bound"  # over the bounded-load cap
    HOME_BUSY = "home_busy"  # interactive: no free batch slot there, one elsewhere
    HOME_COLD = "home_cold"  # its prefix cache lost the prompt; another endpoint holds it


# A pinned session follows its prompt to another endpoint when that one holds at least this
# much more of the prompt than its home (whose cache lost it: evicted, or the engine restarted).
FOLLOW_CACHE_MARGIN = 0.5
# An endpoint holding at least this share of a prompt may take it into a short queue
# (`PlacementSettings.prefix_queue` requests past its batch slots).
CACHED_ENOUGH = 0.5


@record
class EndpointState:
    """One endpoint of a provider as placement sees it.

    ``usable``: healthy, its breaker lets a request through, and not already tried by this
    request. ``inflight``: requests on it now by the gateway's own accounting plus the engine's
    foreign load. ``capacity``: its batch slots (> 0). ``rate_weight``: the rate balancer's
    weight (strategy "rate"), None where not computed.
    """

    id: str
    priority: int = 100
    usable: bool = True
    inflight: int = 0
    capacity: int = 1
    saturation: float = 0.0
    rate_weight: float | None = None
    cached: float = 0.0  # the share of the request's prompt its prefix cache holds, 0..1
    adapter_loaded: bool = False  # the request's LoRA adapter is in its GPU memory now
    near_parent: bool = False  # a new sub-agent session: its parent's last request ran here
    fits: bool = True  # the request fits its context window (llmgw.core.context)

    @property
    def free_slot(self) -> bool:
        return self.inflight < self.capacity

    @property
    def score(self) -> float:
        return max(self.saturation, self.inflight / self.capacity if self.capacity else 0.0)

    def has_room(self, queue_slots: int = 0) -> bool:
        """A free batch slot, or, holding at least `CACHED_ENOUGH` of the prompt, fewer than
        `queue_slots` requests past its slots (a cached prompt is worth a short wait: a slot
        frees long before a cold prefill of it would end elsewhere)."""
        if self.inflight < self.capacity:
            return True
        return self.cached >= CACHED_ENOUGH and self.inflight < self.capacity + queue_slots

    def cost(
        self, prefix_weight: float, adapter_weight: float = 0.0, parent_weight: float = 0.0
    ) -> float:
        """Its load traded against what it holds of the request: ``score - prefix_weight *
        cached - adapter_weight * adapter_loaded - parent_weight * near_parent``."""
        return (
            self.score
            - prefix_weight * self.cached
            - adapter_weight * self.adapter_loaded
            - parent_weight * self.near_parent
        )


@record
class ProviderState:
    """A provider for the request's model. ``degraded``: a managed provider none of whose
    endpoints is healthy with a closed (or probing) breaker. ``room``: what this admission
    instance can grant on the pair now. ``evictable``: a new pin may evict an idle pin instead
    of needing pin room. ``saturation``: the mean saturation of its endpoints for the model."""

    id: str
    managed: bool
    supports: bool
    degraded: bool
    endpoints: tuple[EndpointState, ...]
    room: Room
    strategy: str = "score"
    evictable: bool = False
    saturation: float = 0.0
    ring: HashRing | None = None

    @property
    def usable(self) -> bool:
        return self.supports and not self.degraded


@record
class PinState:
    """The session's pin: where, whether its session is at its in-flight limit, since when it is
    where it is, and the endpoint its last request ran on (its prefix cache; None: unknown)."""

    provider: str
    full: bool
    since: float
    endpoint: str | None = None


@dataclass(frozen=True, slots=True)
class PlacementSettings:
    session_load_factor: float = 1.25
    return_home: bool = True
    return_home_after: float = 30.0
    return_home_saturation: float = 0.5
    prefix_weight: float = 2.0  # `EndpointState.cost`: 0 is cache-blind
    adapter_weight: float = 0.25  # `EndpointState.cost`: a LoRA adapter loaded there
    prefix_queue: int = 1  # `EndpointState.has_room`: requests a cached prompt may wait behind
    parent_weight: float = 1.0  # `EndpointState.cost`: a new sub-agent's parent runs there


@record
class Snapshot:
    providers: tuple[ProviderState, ...]  # managed first (by priority), then unlimited
    pin: PinState | None
    now: float
    settings: PlacementSettings = PlacementSettings()


@record
class PlacementRequest:
    session: str | None = None
    interactive: bool = True
    overflow: bool = False  # flow control decided: run on an unlimited provider now
    draw: float = 0.0  # uniform in [0, 1): the randomness of weighted draws


@record
class Placement:
    """Run on `provider`/`endpoint` under a lease of `lease_kind`; `pin_action` says what
    happens to the session's pin (`evict`: make room by evicting an idle pin of the provider).
    `reason` says why a request left its pin (temporary, repinned, returned home)."""

    provider: str
    endpoint: str
    route: Route
    lease_kind: LeaseKind
    pin_action: PinAction = PinAction.NONE
    evict: bool = False
    reason: str | None = None
    affinity_break: AffinityBreak | None = None

    @property
    def refresh_pin_on_success(self) -> bool:
        return self.route in (Route.PINNED, Route.NEW_PIN, Route.REPINNED, Route.RETURNED_HOME)


Outcome = Placement | Refusal


def place(snapshot: Snapshot, request: PlacementRequest) -> Outcome:
    """The placement of one request (see the module docstring)."""
    providers = snapshot.providers
    if not any(p.supports for p in providers):
        return Refusal.UNSUPPORTED
    if _outgrown(p for p in providers if p.supports):
        return Refusal.CONTEXT_LENGTH_EXCEEDED
    if request.overflow:
        for provider in providers:
            if not provider.managed and provider.usable:
                chosen = _endpoint(provider, None, request, snapshot.settings)
                if chosen is not None:
                    return Placement(
                        provider.id,
                        chosen[0],
                        Route.OVERFLOW,
                        LeaseKind.TEMPORARY,
                        reason="overflow",
                    )
    if request.session is None:
        return _temporary(snapshot, request, None, Route.UNPINNED, None)
    pin = snapshot.pin
    if pin is None:
        return _new_pin(snapshot, request, None, Route.NEW_PIN, None)
    current = next((p for p in providers if p.id == pin.provider), None)
    if current is None or not current.usable:
        reason = "unsupported" if current is None or not current.supports else "degraded"
        return _new_pin(snapshot, request, pin.provider, Route.REPINNED, reason)
    if _outgrown((current,)):  # the conversation outgrew every endpoint of its provider
        return _new_pin(snapshot, request, pin.provider, Route.REPINNED, "context_window")
    home = _return_home(snapshot, request, current, pin)
    if home is not None:
        return home
    if pin.full:
        return _temporary(snapshot, request, current.id, Route.TEMPORARY, "session_limit")
    if not current.room.pinned:
        return _temporary(snapshot, request, current.id, Route.TEMPORARY, "global_limit")
    chosen = _endpoint(
        current, request.session, request, snapshot.settings, pin.endpoint, pinned=True
    )
    if chosen is None:  # every endpoint failed for this request: elsewhere once
        return _temporary(snapshot, request, current.id, Route.TEMPORARY, "endpoint_failed")
    return Placement(
        current.id, chosen[0], Route.PINNED, LeaseKind.PINNED, affinity_break=chosen[1]
    )


def can_take_now(provider: ProviderState, kind: LeaseKind, *, new_pin: bool) -> bool:
    """Usable, with room for a lease of `kind` (and a pin, if it needs one), and an endpoint
    (usable, and one the request fits)."""
    if not provider.usable or not any(e.usable and e.fits for e in provider.endpoints):
        return False
    room = provider.room
    if kind is LeaseKind.PINNED and not room.pinned:
        return False
    if kind is not LeaseKind.PINNED and not room.unreserved:
        return False
    return not new_pin or room.pin or provider.evictable


def _new_pin(
    snapshot: Snapshot,
    request: PlacementRequest,
    excluded: str | None,
    route: Route,
    reason: str | None,
) -> Outcome:
    """Create (or move, for a REPINNED route) the session's pin on the first provider that
    can take it."""
    action = PinAction.CREATE if route is Route.NEW_PIN else PinAction.MOVE
    for provider in snapshot.providers:
        if provider.id == excluded or not can_take_now(provider, LeaseKind.NEW_PIN, new_pin=True):
            continue
        chosen = _endpoint(provider, request.session, request, snapshot.settings)
        if chosen is None:
            continue
        return Placement(
            provider.id,
            chosen[0],
            route,
            LeaseKind.NEW_PIN,
            action,
            evict=not provider.room.pin,
            reason=reason,
            affinity_break=chosen[1],
        )
    return Refusal.NO_CAPACITY


def _temporary(
    snapshot: Snapshot,
    request: PlacementRequest,
    excluded: str | None,
    route: Route,
    reason: str | None,
) -> Outcome:
    for provider in snapshot.providers:
        if provider.id == excluded or not can_take_now(
            provider, LeaseKind.TEMPORARY, new_pin=False
        ):
            continue
        chosen = _endpoint(provider, request.session, request, snapshot.settings)
        if chosen is None:
            continue
        return Placement(
            provider.id,
            chosen[0],
            route,
            LeaseKind.TEMPORARY,
            reason=reason,
            affinity_break=chosen[1],
        )
    return Refusal.NO_CAPACITY


def _return_home(
    snapshot: Snapshot, request: PlacementRequest, current: ProviderState, pin: PinState
) -> Placement | None:
    settings = snapshot.settings
    if not settings.return_home or snapshot.now - pin.since < settings.return_home_after:
        return None
    for provider in snapshot.providers:
        if provider.id == current.id:
            return None  # only providers ahead of the current one are "home"
        if not provider.managed or provider.saturation > settings.return_home_saturation:
            continue
        if not can_take_now(provider, LeaseKind.NEW_PIN, new_pin=True):
            continue  # (pin room, or an evictable pin, and request room)
        chosen = _endpoint(provider, request.session, request, settings)
        if chosen is None:
            continue
        return Placement(
            provider.id,
            chosen[0],
            Route.RETURNED_HOME,
            LeaseKind.NEW_PIN,
            PinAction.MOVE,
            evict=not provider.room.pin,
            reason="return_home",
            affinity_break=chosen[1],
        )
    return None


def _endpoint(
    provider: ProviderState,
    session: str | None,
    request: PlacementRequest,
    settings: PlacementSettings,
    home: str | None = None,
    pinned: bool = False,
) -> tuple[str, AffinityBreak | None] | None:
    candidates = [e for e in provider.endpoints if e.usable and e.fits]
    if not candidates:
        return None
    if provider.strategy == "rate":
        return _weighted(candidates, request.draw), None
    if not provider.managed:
        return max(candidates, key=lambda e: e.priority).id, None
    return _managed_endpoint(
        provider, candidates, session, request.interactive, settings, home, pinned
    )


def _outgrown(providers: Iterable[ProviderState]) -> bool:
    """Whether these providers have endpoints and the request fits none of them."""
    endpoints = [e for p in providers for e in p.endpoints]
    return bool(endpoints) and not any(e.fits for e in endpoints)


def _weighted(candidates: Sequence[EndpointState], draw: float) -> str:
    weights = [max(0.0, e.rate_weight) if e.rate_weight is not None else 1.0 for e in candidates]
    total = sum(weights)
    if total <= 0:
        weights, total = [1.0] * len(candidates), float(len(candidates))
    threshold = draw * total
    cumulative = 0.0
    for endpoint, weight in zip(candidates, weights, strict=True):
        cumulative += weight
        if weight > 0 and threshold < cumulative:
            return endpoint.id
    return next(e.id for e, w in zip(candidates, weights, strict=True) if w > 0)


def _within_bound(
    endpoints: Sequence[EndpointState],
    factor: float,
    tier: Sequence[EndpointState] | None = None,
) -> list[EndpointState]:
    """The endpoints of `endpoints` (of `tier`, by default themselves) within their bounded
    load by capacity with this request added: inflight + 1 at most the most requests each may
    hold, ceil(factor * (tier's load + 1) * its share of the tier's batch slots)."""
    tier = endpoints if tier is None else tier
    load = sum(e.inflight for e in tier) + 1
    slots = sum(e.capacity for e in tier)
    return [e for e in endpoints if e.inflight + 1 <= math.ceil(factor * load * e.capacity / slots)]


def _best(
    endpoints: Sequence[EndpointState],
    walk: Sequence[str] = (),
    prefix_weight: float = 0.0,
    adapter_weight: float = 0.0,
    queue_slots: int = 0,
    parent_weight: float = 0.0,
) -> EndpointState:
    """Room first (`EndpointState.has_room`), then the lowest cost (load traded against the
    share of the prompt held, `EndpointState.cost`), then the most free slots, then the
    session's ring order (so equally idle endpoints share new sessions)."""
    order = {endpoint: index for index, endpoint in enumerate(walk)}
    return min(
        endpoints,
        key=lambda e: (
            not e.has_room(queue_slots),
            e.cost(prefix_weight, adapter_weight, parent_weight),
            e.inflight - e.capacity,
            order.get(e.id, len(order)),
        ),
    )


def _managed_endpoint(
    provider: ProviderState,
    candidates: list[EndpointState],
    session: str | None,
    interactive: bool,
    settings: PlacementSettings,
    home_hint: str | None = None,
    pinned: bool = False,
) -> tuple[str, AffinityBreak | None]:
    tiers = sorted({e.priority for e in candidates}, reverse=True)
    tier: list[EndpointState] = []
    for priority in tiers:
        tier = [e for e in candidates if e.priority == priority and e.saturation < 1.0]
        if tier:
            break
    if not tier:
        tier = [e for e in candidates if e.priority == tiers[0]]
    weight = settings.prefix_weight
    queue = settings.prefix_queue if weight > 0 else 0
    free = [e for e in candidates if e.has_room(queue)]
    if free:  # the free endpoints of the best tier that has one
        top = max(e.priority for e in free)
        free = [e for e in free if e.priority == top]
    home: str | None = None
    walk: list[str] | None = None  # the session's ring order, read only where it decides
    if (
        session is not None
        and home_hint is not None
        and any(e.id == home_hint for e in provider.endpoints)
    ):
        home = home_hint  # where the session's last request ran: its prefix cache
    elif pinned and session is not None and provider.ring:
        walk = provider.ring.walk(session)
        home = walk[0] if walk else None  # a pin whose endpoint is unknown (adopted)
    if home is None:
        # No conversation of its own here (no session, or its first request here): where its
        # prompt is cached, traded against room, so new work starts on its prefix and fills
        # free slots first.
        if walk is None:
            walk = provider.ring.walk(session) if session is not None and provider.ring else []
        pool = free if interactive and free else tier
        return _best(
            pool, walk, weight, settings.adapter_weight, queue, settings.parent_weight
        ).id, None
    target = next((e for e in tier if e.id == home), None)
    # Within the load bound: what the session may leave home for (computed where asked).
    fits = None if interactive and free else _within_bound(tier, settings.session_load_factor)
    brk: AffinityBreak | None = None
    if target is None:
        brk = AffinityBreak.HOME_UNUSABLE
    elif _lost_its_prompt(target, free if fits is None else fits, weight):
        brk = AffinityBreak.HOME_COLD
    elif target.has_room(queue):
        pass  # room at home (a free batch slot): staying costs nothing, leaving its cache
    elif not _within_bound((target,), settings.session_load_factor, tier):
        brk = AffinityBreak.HOME_OVER_BOUND
    elif interactive and free:
        brk = AffinityBreak.HOME_BUSY
    if brk is None:
        assert target is not None
        return target.id, None
    pool = free if fits is None else (fits or tier)
    return _best(pool, (), weight, settings.adapter_weight, queue).id, brk


def _lost_its_prompt(home: EndpointState, others: Sequence[EndpointState], weight: float) -> bool:
    """Whether a session should follow its prompt away from `home`: another endpoint it may go
    to (a free slot, or within the load bound) holds `FOLLOW_CACHE_MARGIN` more of it."""
    if weight <= 0:
        return False
    return any(e.id != home.id and e.cached - home.cached >= FOLLOW_CACHE_MARGIN for e in others)
