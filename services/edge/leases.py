"""Holding a request lease in the edge: renew while the request runs, release once at the end.

Ownership: the edge owns a lease from the admission reply until `finish()`.
While it runs, the lease is renewed every lease_timeout/3 by compare-and-
swap. A renewal that finds the lease gone (it expired and the reaper
reclaimed it, e.g. after this process was paused) marks it lost and calls
`on_lost`, which cancels the upstream request; a lost lease is never
released, so a slot since granted to another request is never freed.

`finish()` runs the release in a background task that the request's own
cancellation (client disconnect) cannot interrupt, and only after any
renewal in flight has landed, so the release always names the lease's
newest revision.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmgw.core.leases import Lease, Pin
    from llmgw.state.routing_state import RoutingState

log = logging.getLogger("llmgw.edge.leases")


class LeaseHolder:
    """One request's lease; `finish(success)` exactly once."""

    def __init__(
        self,
        state: RoutingState,
        lease: Lease,
        *,
        renew_every: float,
        refresh_pin_on_success: bool,
        background: set[asyncio.Task[None]],
        pin: Pin | None = None,
    ) -> None:
        self.lease = lease
        self._pin = pin  # as admission left it: a hint for the release
        self.lost = False
        self.on_lost: Callable[[], None] | None = None
        self._state = state
        self._renew_every = renew_every
        self._refresh = refresh_pin_on_success
        self._background = background
        self._stop = asyncio.Event()
        # Most requests end before their first renewal is due: the renewal task
        # starts only then, so a short request costs a timer, not a task.
        self._renewal: asyncio.Task[None] | None = None
        self._first_renewal = asyncio.get_running_loop().call_later(
            renew_every, self._start_renewing
        )

    def _start_renewing(self) -> None:
        if not self._stop.is_set():
            self._renewal = asyncio.create_task(self._renew_until_stopped(), name="lease-renewal")

    async def _renew_until_stopped(self) -> None:
        while True:
            try:
                renewed = await self._state.renew_request_lease(self.lease)
            except Exception:
                # NATS unreachable: try again next interval; the lease stays valid until
                # lease_timeout.
                log.warning(
                    "lease %s: renewal failed; will retry", self.lease.lease_id, exc_info=True
                )
            else:
                if renewed is None:
                    self.lost = True
                    log.warning("lease %s was lost; ending its request", self.lease.lease_id)
                    if self.on_lost is not None:
                        self.on_lost()
                    return
                self.lease = renewed
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._renew_every):
                    await self._stop.wait()
            if self._stop.is_set():
                return

    def finish(self, success: bool) -> None:
        """Stop renewing and release (refreshing the pin only on success), off the request path.

        Only the first call counts: a stream's end and its response's close may both call it.
        """
        if self._stop.is_set():
            return
        self._stop.set()
        self._first_renewal.cancel()
        task = asyncio.create_task(self._release(success), name="lease-release")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, success: bool) -> None:
        if self._renewal is not None:
            await self._renewal  # a renewal in flight lands first: release names its revision
        if self.lost:
            return
        try:
            await self._state.release_request_lease(
                self.lease, refresh_pin=success and self._refresh, pin=self._pin
            )
        except Exception:
            # Left to the reaper, which reclaims it after lease_timeout.
            log.warning("lease %s: release failed", self.lease.lease_id, exc_info=True)
