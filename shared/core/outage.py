"""Local admission while NATS is unreachable (``admission.on_nats_outage: local``).

With NATS down no admission instance can be asked, so an edge in `local` mode decides alone,
conservatively, from its config and what it last heard:

- a provider/model pair with limits gets at most ``local_share(G, edges)`` = floor(G / edges) of
  this edge's requests at once, where ``edges`` is the number of edges the admission instances
  last reported hearing from (at least 1): all edges together stay within G;
- a session gets at most S (``max_per_session_in_flight_request_slots``) of them;
- no pin is created, moved or used (the request runs once, as placement runs a request without
  a session), so pins and their limit P are untouched;
- providers in the config's priority order (managed first), the first with room wins; within it
  the endpoint with the fewest of this edge's local requests per unit of weight, skipping the
  endpoints the request already tried;
- unlimited providers have no limits, so a request a managed provider cannot take
  here runs on the first unlimited one that serves the model.

This is coarser than admission (no engine load, no health, no flow control, no fallbacks), and
says so: the route of such a request is ``local``. When NATS returns the edge hands its local
grants to the shards' owners, which take them into their books as far as their quota covers.

Pure: no clock, no I/O. The budget is owned by one edge's event loop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["LocalBudget", "LocalChoice", "LocalEndpoint", "LocalProvider", "local_share"]

_K = TypeVar("_K")


def local_share(global_slots: int, edges: int) -> int:
    """This edge's part of a pair's G while it decides alone: floor(G / edges), edges >= 1."""
    return global_slots // max(1, edges)


@dataclass(frozen=True, slots=True)
class LocalEndpoint:
    id: str
    url: str
    upstream_model: str
    weight: int = 100


@dataclass(frozen=True, slots=True)
class LocalProvider:
    """One provider serving the request's model, with its limits of that pair (None: none)."""

    id: str
    unlimited: bool
    endpoints: tuple[LocalEndpoint, ...]
    global_slots: int | None = None  # G
    per_session: int | None = None  # S


@dataclass(frozen=True, slots=True)
class LocalChoice:
    provider: LocalProvider
    endpoint: LocalEndpoint


class LocalBudget:
    """This edge's local grants in flight: per pair, per (pair, session) and per endpoint.

    Invariant: for every pair with limits, ``pairs[pair] <= local_share(G, edges)`` at the moment
    of each grant, and ``sessions[(pair, session)] <= S``; `give_back` undoes exactly one `take`.
    """

    def __init__(self) -> None:
        self.pairs: Counter[tuple[str, str]] = Counter()
        self.sessions: Counter[tuple[str, str, str]] = Counter()
        self.endpoints: Counter[str] = Counter()

    def choose(
        self,
        providers: Sequence[LocalProvider],
        model: str,
        session: str | None,
        exclude: Collection[str],
        edges: int,
    ) -> LocalChoice | None:
        """The first provider in order with room and an endpoint not yet tried, or None."""
        for provider in providers:
            endpoints = [e for e in provider.endpoints if e.id not in exclude]
            if not endpoints or not self._has_room(provider, model, session, edges):
                continue
            endpoint = min(endpoints, key=lambda e: self.endpoints[e.id] / e.weight)
            return LocalChoice(provider, endpoint)
        return None

    def _has_room(
        self, provider: LocalProvider, model: str, session: str | None, edges: int
    ) -> bool:
        if provider.unlimited or provider.global_slots is None:
            return True
        pair = (provider.id, model)
        if self.pairs[pair] >= local_share(provider.global_slots, edges):
            return False
        return not (
            session is not None
            and provider.per_session is not None
            and self.sessions[(provider.id, model, session)] >= provider.per_session
        )

    def take(self, choice: LocalChoice, model: str, session: str | None) -> None:
        provider = choice.provider.id
        self.pairs[(provider, model)] += 1
        if session is not None:
            self.sessions[(provider, model, session)] += 1
        self.endpoints[choice.endpoint.id] += 1

    def give_back(self, provider: str, endpoint: str, model: str, session: str | None) -> None:
        _decrement(self.pairs, (provider, model))
        if session is not None:
            _decrement(self.sessions, (provider, model, session))
        _decrement(self.endpoints, endpoint)

    def in_flight(self) -> int:
        return sum(self.endpoints.values())


def _decrement(counter: Counter[_K], key: _K) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]
