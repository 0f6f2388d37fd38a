"""The edge's admission client with an admission instance in the same process
(``admission.colocated``).

A request whose shard the colocated instance owns is decided by a direct call
(`AdmissionService.admit_here`): the same decision, ledger and invariants as over NATS, minus
the round trip (request, reply and two process switches). Every other request, and one whose
shard moves away while it waits, goes to its owner through the NATS client (`remote`), which
also answers readiness and probes. The edge's composition root starts the instance before the
edge serves and stops it after the edge has drained (services/edge/main.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmgw.contracts import AdmissionClient
    from llmgw.services.admission.service import AdmissionService
    from llmgw.wire import AdmitReply, AdmitRequest


class ColocatedAdmission:
    """`AdmissionClient`: the colocated instance first, the shard's owner over NATS else."""

    def __init__(self, local: AdmissionService, remote: AdmissionClient) -> None:
        self.local = local
        self.remote = remote
        self.decided_here = 0  # requests decided by the colocated instance (tests, metrics)

    async def admit(
        self,
        request: AdmitRequest,
        client_gone: Callable[[], Awaitable[object]] | None = None,
    ) -> tuple[AdmitReply, bool]:
        if self.local.nc.is_connected:  # without NATS its ownership cannot be trusted
            here = await self.local.admit_here(request, client_gone)
            if here is not None:
                self.decided_here += 1
                return here
        return await self.remote.admit(request, client_gone)

    def ready(self) -> bool:
        return self.remote.ready()

    async def probe(self) -> bool:
        return await self.remote.probe()

    async def start(self) -> None:
        await self.remote.start()

    async def stop(self) -> None:
        await self.remote.stop()
