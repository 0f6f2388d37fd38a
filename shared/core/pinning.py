"""The admission-and-pinning algorithm of the founding document, step for step.

`place_request` decides, for one request, which provider runs it and under
which lease. Every state transition goes through the `RoutingStatePort`,
whose operations are each atomic (compare-and-swap on the shared bucket);
between them anything may change, which is why several branches end in
"route again". After at most `max_routing_attempts` the request is rejected
as unavailable.

Who owns what: a lease returned in a Placement belongs to the caller from
that moment (the edge renews it and releases it exactly once). A lease this
module took but cannot use is released here before returning.

Branches (seed names in brackets):
- no session -> temporary fallback over all providers [execute_request_without_pinning]
- not pinned -> first suitable provider admits and pins [execute_not_yet_pinned_request]
- pinned, provider fine -> admit on it; pin changed/gone -> route again;
  per-session or global limit -> temporary fallback elsewhere, the pin stays
  [execute_pinned_request]
- pinned, provider unsupported or degraded -> move the pin by CAS to the
  next suitable provider with capacity [try_repin_to_other_provider_and_retry_execute]
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from llmgw.core.leases import Admission, AdmissionResult, Lease, Pin, PinMatch, RepinResult
from llmgw.core.requests import Feature


class RoutingStatePort(Protocol):
    """The atomic operations of ROUTING_STATE (seed 000) the algorithm needs."""

    def has_limits(self, provider: str, model: str) -> bool: ...

    async def get_pin(self, model: str, session: str) -> Pin | None: ...

    async def try_admit_unpinned_session_request(
        self, provider: str, model: str, session: str, *, edge_id: str | None = None
    ) -> Admission: ...

    async def try_admit_pinned_session_request(
        self, model: str, session: str, *, pin: Pin | None = None, edge_id: str | None = None
    ) -> Admission: ...

    async def try_compare_and_swap_pin_and_admit_request(
        self,
        expected_pin: Pin,
        model: str,
        session: str,
        provider: str,
        *,
        edge_id: str | None = None,
    ) -> RepinResult: ...

    async def try_admit_request_without_pin(
        self, provider: str, model: str, *, edge_id: str | None = None
    ) -> Admission: ...


class ProviderCatalog(Protocol):
    """Which providers exist, in priority order, and what they can do right now."""

    def in_priority_order(self) -> Sequence[str]:
        """Managed providers first (by priority), then unlimited ones."""
        ...

    def supports(self, provider: str, model: str, feature: Feature) -> bool: ...

    def degraded(self, provider: str, model: str) -> bool:
        """True only for a managed provider that cannot serve `model` now (never for unlimited)."""
        ...

    def is_unlimited(self, provider: str) -> bool:
        """A third-party provider without limits (seed 000's "unlimited")."""
        ...


class Route(enum.StrEnum):
    """How a placed request relates to its session's pin (a metrics label)."""

    PINNED = "pinned"  # admitted on the session's existing pin
    NEW_PIN = "new_pin"  # created the session's pin
    REPINNED = "repinned"  # moved the pin off an unsupported/degraded provider
    TEMPORARY = "temporary"  # capacity spike on the pin's provider: ran elsewhere, pin kept
    UNPINNED = "unpinned"  # no session (e.g. embeddings)
    OVERFLOW = "overflow"  # flow control: the managed pool was saturated; ran on a third party


@dataclass(frozen=True, slots=True)
class Placement:
    """Run the request on `provider`; hold `lease` (None: none needed) until it ends."""

    provider: str
    route: Route
    lease: Lease | None
    refresh_pin_on_success: bool
    pin: Pin | None = None
    moved_from: Pin | None = None  # REPINNED: the pin as it was before the move


class Rejection(enum.StrEnum):
    UNSUPPORTED = "unsupported"  # no provider serves (model, feature)
    UNAVAILABLE = (
        "unavailable"  # every suitable provider is degraded or full, or routing kept racing
    )


class _Retry:
    """Sentinel: the state changed under us; start routing over."""


RETRY = _Retry()
Outcome = Placement | Rejection
_Step = Outcome | _Retry
Pause = Callable[[int], Awaitable[None]]


async def _no_pause(attempt: int) -> None:
    return None


@dataclass
class PinningRouter:
    """Runs the algorithm over a routing state and a provider catalog.

    `pause(attempt)` is awaited before each re-routing attempt after the
    first: a short jittered backoff lets a concurrent pin creation finish
    instead of spending every attempt in the same race.
    """

    state: RoutingStatePort
    catalog: ProviderCatalog
    max_routing_attempts: int = 10
    pause: Pause = _no_pause

    async def place(
        self, model: str, feature: Feature, session: str | None, *, edge_id: str | None = None
    ) -> Outcome:
        if not any(
            self.catalog.supports(p, model, feature) for p in self.catalog.in_priority_order()
        ):
            return Rejection.UNSUPPORTED
        if session is None:
            return await self._temporary_fallback(model, feature, None, edge_id, Route.UNPINNED)
        for attempt in range(self.max_routing_attempts):
            if attempt:
                await self.pause(attempt)
            pin = await self.state.get_pin(model, session)
            if pin is None:
                step = await self._not_yet_pinned(model, feature, session, edge_id)
            else:
                step = await self._pinned(model, feature, session, pin, edge_id)
            if not isinstance(step, _Retry):
                return step
        return Rejection.UNAVAILABLE

    async def place_overflow(
        self, model: str, feature: Feature, *, edge_id: str | None = None
    ) -> Outcome:
        """Place on the first usable unlimited provider, leaving every pin alone.

        Flow control's overflow: the managed pool is saturated for the request's band, so it runs
        elsewhere this once. No pin is created or moved (a session stays with our own providers,
        which the algorithm prefers), and the pin's countdown is not refreshed.
        """
        for provider in self.catalog.in_priority_order():
            if self.catalog.is_unlimited(provider) and self._usable(provider, model, feature):
                return Placement(provider, Route.OVERFLOW, None, False)
        return Rejection.UNAVAILABLE

    def can_overflow(self, model: str, feature: Feature) -> bool:
        return any(
            self.catalog.is_unlimited(p) and self._usable(p, model, feature)
            for p in self.catalog.in_priority_order()
        )

    def _usable(self, provider: str, model: str, feature: Feature) -> bool:
        return self.catalog.supports(provider, model, feature) and not self.catalog.degraded(
            provider, model
        )

    async def _not_yet_pinned(
        self, model: str, feature: Feature, session: str, edge_id: str | None
    ) -> _Step:
        for provider in self.catalog.in_priority_order():
            if not self._usable(provider, model, feature):
                continue
            admission = await self.state.try_admit_unpinned_session_request(
                provider, model, session, edge_id=edge_id
            )
            if admission.result is AdmissionResult.ALREADY_PINNED:
                return RETRY
            if admission.result is AdmissionResult.ADMITTED:
                return Placement(provider, Route.NEW_PIN, admission.lease, True, admission.pin)
            # A managed provider without pin or request capacity: try the next one.
        return Rejection.UNAVAILABLE

    async def _pinned(
        self, model: str, feature: Feature, session: str, pin: Pin, edge_id: str | None
    ) -> _Step:
        if pin.pending:
            return RETRY  # another request is creating or moving this pin: follow it
        if not self._usable(pin.provider, model, feature):
            return await self._repin(model, feature, session, pin, edge_id)
        admission = await self.state.try_admit_pinned_session_request(
            model, session, pin=pin, edge_id=edge_id
        )
        if admission.result is AdmissionResult.SESSION_NOT_PINNED:
            return RETRY  # the pin disappeared between lookup and admission
        if admission.result is AdmissionResult.ALREADY_PINNED or (
            admission.pin is not None and admission.pin.id != pin.id
        ):
            # The pin changed between lookup and admission; a lease taken on the
            # stale pin has already been given back (without refreshing the pin).
            return RETRY
        if admission.result in (
            AdmissionResult.PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED,
            AdmissionResult.GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED,
        ):
            # A capacity spike must not destroy the pin: run elsewhere this once.
            return await self._temporary_fallback(
                model, feature, pin.provider, edge_id, Route.TEMPORARY
            )
        if admission.result is AdmissionResult.ADMITTED:
            return Placement(pin.provider, Route.PINNED, admission.lease, True, admission.pin)
        return Rejection.UNAVAILABLE

    async def _repin(
        self, model: str, feature: Feature, session: str, current: Pin, edge_id: str | None
    ) -> _Step:
        for provider in self.catalog.in_priority_order():
            if provider == current.provider or not self._usable(provider, model, feature):
                continue
            result = await self.state.try_compare_and_swap_pin_and_admit_request(
                current, model, session, provider, edge_id=edge_id
            )
            if result.pin_match is not PinMatch.MATCHED or result.admission is None:
                return RETRY
            admission = result.admission
            if admission.result is AdmissionResult.ADMITTED:
                return Placement(
                    provider,
                    Route.REPINNED,
                    admission.lease,
                    True,
                    admission.pin,
                    moved_from=current,
                )
            if admission.result is AdmissionResult.ALREADY_PINNED:
                return RETRY
            if admission.pin is not None:
                current = admission.pin  # the same pin, at the revision it was restored to
            # The target lacks pin or request capacity; the pin is unchanged:
            # try the next provider with the same expected pin.
        return Rejection.UNAVAILABLE

    async def _temporary_fallback(
        self, model: str, feature: Feature, excluded: str | None, edge_id: str | None, route: Route
    ) -> Outcome:
        for provider in self.catalog.in_priority_order():
            if provider == excluded or not self._usable(provider, model, feature):
                continue
            if self.state.has_limits(provider, model):
                admission = await self.state.try_admit_request_without_pin(
                    provider, model, edge_id=edge_id
                )
                if admission.result is not AdmissionResult.ADMITTED:
                    continue
                return Placement(provider, route, admission.lease, False)
            # Providers without limits need no lease for requests that are not
            # associated with one of their pins.
            return Placement(provider, route, None, False)
        return Rejection.UNAVAILABLE
