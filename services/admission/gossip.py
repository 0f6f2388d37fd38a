"""Load gossip: every instance's live leases per endpoint, so every instance sees the same load.

A grant or an end here changes this instance's count on an endpoint (`Ledger.on_endpoint_change`
calls `endpoint_changed`); the changes of one event-loop turn go to the peers at the next turn
(``llmgw.v1.admission.load``, a `FlowLoad`), so a peer sees a grant before its next dispatch
tick, or each would spend the same headroom. A full report goes every second (`heartbeat`);
a peer's report that shows fewer requests than before frees room here (`peer_freed`: its loans
may lend again, and requests held for quota look again).

`LoadGossip` writes only this instance's and its peers' counts on the load board; it reads the
ledger's counts per endpoint and never changes the ledger.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from llmgw.services.admission.loadboard import PEER_FORGET_AFTER
from llmgw.wire import ADMISSION_LOAD_SUBJECT, FlowLoad

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.aio.msg import Msg

    from llmgw.core.ledger import Ledger
    from llmgw.services.admission.decision import Current
    from llmgw.services.admission.loadboard import LoadBoard
    from llmgw.services.admission.membership import Membership

_LOAD_HEARTBEAT = 1.0  # seconds between full reports


class LoadGossip:
    """This instance's load sent to its peers, and theirs taken in."""

    def __init__(
        self,
        nc: NATS,
        current: Current,
        load: LoadBoard,
        ledger: Ledger,
        membership: Membership,
        *,
        peer_freed: Callable[[str], None],
        spawn: Callable[[Awaitable[Any]], None],
        clock: Callable[[], float],
    ) -> None:
        self.nc = nc
        self.current = current  # the scope: the routing bucket its peers share
        self.load = load
        self.ledger = ledger
        self.membership = membership
        self.peer_freed = peer_freed  # a peer's request ended: room may be back here
        self._spawn = spawn
        self._clock = clock
        self._scheduled = False
        self._changed: set[str] = set()
        self._sent_at = 0.0

    def endpoint_changed(self, endpoint: str, count: int) -> None:
        self.load.set_own(endpoint, count, self._clock())
        if self.load.knows(endpoint):
            self._changed.add(endpoint)
            if not self._scheduled and self.membership.has_peers():
                # Sent at the next loop turn, batching this turn's changes: peers must see a
                # grant before their next dispatch tick, or each would spend the same headroom.
                self._scheduled = True
                asyncio.get_running_loop().call_soon(self.send, False)

    def send(self, full: bool) -> None:
        self._scheduled = False
        now = self._clock()
        endpoints = self.load.endpoints() if full else sorted(self._changed)
        self._changed.clear()
        if full:
            self._sent_at = now
        message = FlowLoad(
            instance=self.membership.instance,
            scope=self.current.config.pinning.bucket,
            at=now,
            full=full,
            inflight={e: self.ledger.endpoint_leases(e) for e in endpoints},
        )
        if self.nc.is_connected:
            self._spawn(self.nc.publish(ADMISSION_LOAD_SUBJECT, message.model_dump_json().encode()))

    def heartbeat(self, now: float) -> None:
        """A full report, once a second, while there are peers to read it."""
        if now - self._sent_at >= _LOAD_HEARTBEAT and len(self.membership.live()) > 1:
            self.send(True)

    async def on_load(self, msg: Msg) -> None:
        try:
            load = FlowLoad.model_validate_json(msg.data)
        except ValidationError:
            return
        if (
            load.instance != self.membership.instance
            and load.scope == self.current.config.pinning.bucket
        ):
            fewer = self.load.peer_load(
                load.instance, load.at, load.inflight, self._clock(), full=load.full
            )
            if fewer:  # a request of the peer's ended: it may lend again
                self.peer_freed(load.instance)

    def forget_gone(self) -> None:
        """Peers no longer live are forgotten."""
        live = self.membership.live()
        for peer in list(self.load._peers):
            if peer not in live:
                self.load.forget_peer(peer)

    def live_peers(self) -> int:
        now = self._clock()
        return sum(1 for at, _ in self.load._peers.values() if now - at <= PEER_FORGET_AFTER)
