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

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from nats.js.errors import APIError

from llmgw.natsconn import Refusals, connect_options, open_connection
from llmgw.state.nats_kv import open_routing_bucket
from llmgw.wire import ADMISSION_HANDOVER_PREFIX

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from llmgw.config import Config
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


# A write the stream refuses after the server allowed it: no key has this many revisions, so
# the routing bucket answers "wrong last sequence" and stores nothing.
_NEVER_THIS_SEQUENCE = str(2**63 - 1)


async def instance_grants_problem(config: Config) -> str | None:
    """Why this edge's NATS user may not run an admission instance (``admission.colocated``),
    or None. The instance connects with the edge's credentials and must open and write the
    routing bucket and listen on admission subjects; with one NATS user per role the edge role
    may do neither (docs/keys.md, "NATS permissions"). Checked on a connection of its own: the
    bucket is opened (created if missing, as the instance would), a write is published that
    the stream refuses without storing anything (a wrong expected revision), and a subscription
    to this instance's handover subject is flushed. A denial is the server's own permissions
    violation; anything else (a slow server, a bucket of other settings) is left to the
    instance's start to report."""
    refusals = Refusals()
    options = connect_options(config.nats, "llmgw-edge-admission-check")
    options.update(max_reconnect_attempts=1, reconnect_time_wait=0.1, error_cb=refusals.record)
    timeout = config.nats.request_timeout
    try:
        nc = await open_connection(**options)
    except Exception:
        return None  # unreachable: the edge's own connection says so
    try:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(4 * timeout):
                await _touch_routing_bucket(nc, config, timeout)
        with contextlib.suppress(Exception):
            probe = f"{ADMISSION_HANDOVER_PREFIX}grants-check-{uuid.uuid4().hex[:8]}"
            sub = await nc.subscribe(probe)
            # The server answers a denied SUB before this PONG. nats-py annotates the
            # timeout int but only waits on it with asyncio (a float is fine).
            await nc.flush(timeout)  # type: ignore[arg-type]
            await sub.unsubscribe()
    finally:
        with contextlib.suppress(Exception):
            await nc.close()
    if not refusals.denied:
        return None
    user = f"nats.user {config.nats.user!r}" if config.nats.user else "its NATS credentials"
    default = "" if "colocated" in config.admission.model_fields_set else " (the default)"
    return (
        f"admission.colocated is true{default}, so this edge runs an admission instance, but "
        f"NATS refused the edge's user ({user}) what an instance needs: {refusals.denied[0]}. "
        "Set admission.colocated: false (or LLMGW_ADMISSION__COLOCATED=false) and run `llmgw "
        "admission` as the admission role, as compose, Kubernetes and `llmgw up --secure` do; "
        "or connect the edge as a user with the admission role's grants (docs/keys.md, NATS "
        "permissions)"
    )


async def _touch_routing_bucket(nc: NATS, config: Config, timeout: float) -> None:
    js = nc.jetstream(timeout=timeout)
    bucket = config.pinning.bucket
    await open_routing_bucket(
        js,
        bucket,
        storage=config.pinning.storage,
        replicas=config.replicas_of(bucket),
        history=config.pinning.history,
    )
    subject = f"$KV.{bucket}.grants-check.{uuid.uuid4().hex[:8]}"
    headers = {"Nats-Expected-Last-Subject-Sequence": _NEVER_THIS_SEQUENCE}
    with contextlib.suppress(APIError):  # the stream's refusal: the write was allowed
        await js.publish(subject, b"", headers=headers)
