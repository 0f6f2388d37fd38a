"""The edge's graceful stop (SIGTERM): unready first, then drain, then cut what is left.

1. **Unready** (`begin`): ``/ready`` answers 503 ``draining`` at once, so a load balancer that
   polls it stops sending new requests here; for ``router.drain_delay`` the edge still serves
   every request that arrives (the balancer has not noticed yet), each answered with
   ``Connection: close`` so clients and proxies do not keep reusing a connection to this edge.
2. **Drain**: the listener closes (no new connections), idle connections close, and running
   requests, streams included, run on until they end or ``router.drain_timeout`` has passed.
3. **Cut** (`cut`): at that deadline every request still holding a lease is ended by the edge:
   its upstream call is closed, a stream gets one SSE error event (``shutting_down``), a request
   whose answer had not begun gets 503 ``shutting_down`` with Retry-After. Each ends through its
   attempt's normal ending, so its lease is released in its ``RequestEnded`` (never left to
   expire) and the endpoint's breaker learns nothing from it: the endpoint did not fail.

Invariant: from `begin` on, readiness is false and stays false; a lease is released exactly once
whether its request ended by itself or was cut.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from llmgw.clock import SYSTEM, Clock, TimeSource, monotonic_of

if TYPE_CHECKING:
    from starlette.types import Message, Send

    from llmgw.contracts import LeaseStore

SHUTDOWN_MESSAGE = (
    "The gateway instance serving this request is shutting down and ended it after its drain "
    "deadline. Retry it."
)
_CUT_EVERY = 0.05  # seconds between cut rounds (a request may take its lease meanwhile)


class EdgeDrain:
    """Shutdown state of one edge process (see the module docstring)."""

    def __init__(self, monotonic: Clock | TimeSource = SYSTEM) -> None:
        self._monotonic = monotonic_of(monotonic)
        self.draining = False
        self.began_at: float | None = None
        self.cut_requests = 0  # requests ended by the drain deadline

    def begin(self) -> None:
        if not self.draining:
            self.draining = True
            self.began_at = self._monotonic()

    async def cut(self, leases: LeaseStore[Any], within: float) -> int:
        """End every request that still holds a lease, until none does or `within` seconds (of
        this drain's clock) have passed; returns how many were cut."""
        until = self._monotonic() + within
        cut: set[str] = set()
        while leases.held:
            for lease_id, hold in list(leases.held.items()):
                hold.cut()
                cut.add(lease_id)
            if self._monotonic() >= until:
                break
            await asyncio.sleep(_CUT_EVERY)
        self.cut_requests += len(cut)
        return len(cut)


def with_connection_close(send: Send) -> Send:
    """An ASGI `send` that adds ``Connection: close`` to the response start (while draining)."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"connection"]
            headers.append((b"connection", b"close"))
            message = {**message, "headers": headers}
        await send(message)

    return sending
