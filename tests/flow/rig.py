"""A flow-control rig on real parts: nats-server, the load bucket, admission instances in-process.

Engine load is whatever the test writes into the load bucket as `EndpointReport`s, exactly as
the scraper would: tests choose saturation precisely instead of hoping a simulator reaches it.
Requests are AdmitRequests over NATS, exactly as an edge sends them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import nats
from inproc import Cluster, before_any_lease
from timing import eventually

from llmgw.config import Config, config_from_dict
from llmgw.config.sections import default_bands
from llmgw.core.ledger import LeaseRecord
from llmgw.core.shards import shard_of
from llmgw.load import EndpointReport, LoadSample, report_key
from llmgw.services.admission.loadboard import FOREIGN_WINDOW
from llmgw.services.admission.service import AdmissionService
from llmgw.services.edge.admission_client import NatsAdmission
from llmgw.services.edge.prompts import PromptChains
from llmgw.state.setup import open_load_bucket
from llmgw.wire import (
    ADMISSION_CANCEL_SUBJECT,
    REQUEST_STATS_SUBJECT,
    AdmitCancel,
    AdmitReply,
    AdmitRequest,
    ReplyStatus,
    RequestEnded,
)

MODEL = "m1"
ENDPOINTS = ("engine-1", "engine-2")
RIG_CAPACITY = 8  # each engine's configured batch slots
# The `stack` fixture's (tests/flow/conftest.py) lease limits and a minimal chat request.
EDGE_LIMITS = {
    "max_pinned_sessions": 100,
    "max_global_in_flight_request_slots": 100,
    "global_in_flight_request_slots_reserved_for_pinned_sessions": 10,
    "max_per_session_in_flight_request_slots": 10,
}
# Limits that bind: G = 8 (R = 2) for engines reported with room for 64.
BINDING_LIMITS = {
    "max_pinned_sessions": 50,
    "max_global_in_flight_request_slots": 8,
    "global_in_flight_request_slots_reserved_for_pinned_sessions": 2,
    "max_per_session_in_flight_request_slots": 4,
}
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
# The default bands without their batch headroom: the rig's tests count what the saturation
# ceilings let through (reports of full batches with nothing waiting are "room"); the headroom
# has tests of its own (test_flow_control.py, the test_batch_headroom ones).
CEILING_BANDS = [{**band.model_dump(), "batch_headroom": 0} for band in default_bands()]


def rig_config(
    nats_url: str,
    unique_id: str,
    *,
    urls: dict[str, str] | None = None,
    limits: dict[str, int] | None = None,
    router: dict[str, Any] | None = None,
    timeouts: dict[str, Any] | None = None,
    endpoints: dict[str, dict[str, Any]] | None = None,
    third_party: bool = True,
    **admission: Any,
) -> Config:
    """Managed `iris` (two engines; lease limits only if given) and unlimited `tensorx`, for m1
    (``third_party`` False: no `tensorx`, a fleet of our own engines only).

    ``urls`` maps endpoint ids (engine-1, engine-2, tensorx-1) to real servers where requests
    are relayed; without them nothing listens (tests that only ask admission). ``endpoints``:
    more fields of an endpoint by id (e.g. its priority), ``timeouts``: the timeouts section.
    """
    urls = urls or {}
    extra = endpoints or {}
    iris_model: dict[str, Any] = {"name": MODEL}
    if limits:
        iris_model["limits"] = limits
    return config_from_dict(
        {
            "nats": {"url": nats_url, "request_timeout": "2s"},
            "router": {"load_bucket": f"load_{unique_id}", "stale_after": "5s", **(router or {})},
            "pinning": {"bucket": f"routing_{unique_id}"},
            "scoring": {"target_waiting": 4, "kv_ceiling": 0.9},
            "admission": {
                "interval": "5ms",
                "heartbeat": "200ms",
                # Nothing here kills an instance, so nothing waits for the TTL; a short one would
                # fence (and so drop and rejoin) an instance whose heartbeat a loaded host delays.
                "member_ttl": "10s",
                "bands": CEILING_BANDS,
                **admission,
            },
            "models": [{"name": MODEL}],
            "providers": [
                {"id": "iris", "kind": "managed", "priority": 100, "models": [iris_model]},
                *(
                    [{"id": "tensorx", "kind": "unlimited", "models": [{"name": MODEL}]}]
                    * third_party
                ),
            ],
            "endpoints": [
                {
                    "id": e,
                    "url": urls.get(e, f"http://127.0.0.1:1/{e}"),
                    "provider": "iris",
                    "models": [MODEL],
                    # Engines of 8 batch slots, configured: a count above 8 is queue whatever
                    # the reports say (`capacity: None` in `endpoints` leaves it to be learned).
                    "capacity": RIG_CAPACITY,
                    **extra.get(e, {}),
                }
                for e in ENDPOINTS
            ]
            + [
                {
                    "id": "tensorx-1",
                    "url": urls.get("tensorx-1", "http://127.0.0.1:1/t"),
                    "provider": "tensorx",
                    "models": [MODEL],
                    **extra.get("tensorx-1", {}),
                }
            ]
            * third_party,
            **({"timeouts": timeouts} if timeouts else {}),
        },
        source="<flow rig>",
        env={},
    )


@dataclass
class Rig:
    config: Config
    nc: Any
    load_kv: Any
    cluster: Cluster
    client: NatsAdmission
    _closers: list[Callable[[], Any]] = field(default_factory=list)

    @property
    def admissions(self) -> list[AdmissionService]:
        return self.cluster.live_admissions()

    async def add_admission(self) -> AdmissionService:
        admission = await self.cluster.add_admission()
        await self.cluster.settled()
        return admission.service

    async def report(
        self,
        endpoint: str,
        *,
        running: int,
        waiting: int = 0,
        capacity: int = 8,
        healthy: bool = True,
        at: float | None = None,
        kv_usage: float = 0.1,
        kv_blocks: tuple[int, int] | None = None,
        lora_adapters: tuple[str, ...] | None = None,
    ) -> None:
        """Write a scraper report and wait until every admission instance has applied it
        (`kv_blocks`: the engine's KV block size and number of blocks, as its
        `vllm:cache_config_info` says)."""
        before = [a.load.reports for a in self.admissions]
        report = EndpointReport(
            endpoint=endpoint,
            provider="iris",
            pool="p",
            models=(MODEL,),
            healthy=healthy,
            sample=LoadSample(
                dialect="vllm",
                running=running,
                waiting=waiting,
                kv_usage=kv_usage,
                block_size=kv_blocks[0] if kv_blocks else None,
                num_gpu_blocks=kv_blocks[1] if kv_blocks else None,
                lora_adapters=lora_adapters,
            ),
            metrics="full",
            capacity=capacity,
            scraped_at=time.time() if at is None else at,
            scraper="test",
        )
        await self.load_kv.put(report_key(endpoint), report.to_bytes())
        await eventually(
            lambda: all(a.load.reports > b for a, b in zip(self.admissions, before, strict=True))
        )

    async def report_all(self, **kwargs: Any) -> None:
        for endpoint in ENDPOINTS:
            await self.report(endpoint, **kwargs)

    def request(
        self,
        *,
        band: str | None = None,
        tenant: str | None = None,
        request_id: str | None = None,
        session: str | None = None,
        shard: int | None = None,
        prompt: bytes | None = None,
    ) -> AdmitRequest:
        """An edge's request; `prompt`: canonical prompt bytes, sent as their chain."""
        shards = self.config.admission.shards
        if shard is None:
            shard = shard_of(session, shards) if session is not None else 0
        chain = PromptChains(self.config).of_bytes(prompt, MODEL) if prompt else None
        return AdmitRequest(
            id=request_id or uuid.uuid4().hex,
            edge="edge-test",
            model=MODEL,
            feature="chat",
            shard=shard,
            band=band,
            tenant=tenant,
            session=session,
            prefix=chain.text if chain else b"",
            prompt_bytes=chain.length if chain else 0,
        )

    async def ask(
        self,
        *,
        band: str | None = None,
        tenant: str | None = None,
        request_id: str | None = None,
        session: str | None = None,
        shard: int | None = None,
        timeout: float = 10,
        prompt: bytes | None = None,
    ) -> AdmitReply:
        """Ask admission exactly as an edge does (waiting through the queue if it queues)."""
        request = self.request(
            band=band,
            tenant=tenant,
            request_id=request_id,
            session=session,
            shard=shard,
            prompt=prompt,
        )
        async with asyncio.timeout(timeout):
            reply, _ = await self.client.admit(request)
        return reply

    async def finish_all(self) -> int:
        """Every granted request ends now (its edge reports it, as after a real request), and
        the engines' next reports no longer see the gateway's own requests of before."""
        ended = 0
        for service in self.admissions:
            for lease_id in list(service.ledger.leases):
                await self.end(service, lease_id)
                ended += 1
        await self.nc.flush()
        await eventually(lambda: all(not a.ledger.leases for a in self.admissions), what="releases")
        # Past the window in which admission compares an engine reading with its own count.
        await asyncio.sleep(2 * FOREIGN_WINDOW + 0.06)
        return ended

    async def end(self, service: AdmissionService, lease_id: str) -> None:
        """The request of `service`'s lease `lease_id` ends, as its edge reports it."""
        message = request_ended(service.ledger.leases[lease_id], sent=False)
        await self.nc.publish(REQUEST_STATS_SUBJECT, message.model_dump_json().encode())

    def shard_of_instance(self, service: AdmissionService) -> int:
        """A shard `service` serves (to send a request to that instance)."""
        return min(service.shards.serving)

    async def cancel(self, request_id: str) -> None:
        await self.nc.publish(
            ADMISSION_CANCEL_SUBJECT, AdmitCancel(id=request_id).model_dump_json().encode()
        )

    def queued(self) -> int:
        return sum(len(a.flow.queues) for a in self.admissions if a.flow is not None)

    async def close(self) -> None:
        for close in reversed(self._closers):
            await close()
        await self.client.stop()
        await self.cluster.stop()
        await self.nc.close()


def request_ended(lease: LeaseRecord, *, sent: bool) -> RequestEnded:
    """What an edge publishes when the request of `lease` ends well."""
    return RequestEnded(
        id=uuid.uuid4().hex,
        edge=lease.edge,
        lease=lease.lease_id,
        shard=lease.shard,
        ok=True,
        outcome="success",
        model=lease.model,
        provider=lease.provider,
        endpoint=lease.endpoint or "?",
        ended_at=time.time(),
        sent=sent,
    )


def admitted(reply: AdmitReply) -> bool:
    return reply.status is ReplyStatus.ADMITTED


async def open_rig(
    nats_url: str,
    unique_id: str,
    instances: int = 1,
    *,
    urls: dict[str, str] | None = None,
    limits: dict[str, int] | None = None,
    router: dict[str, Any] | None = None,
    timeouts: dict[str, Any] | None = None,
    endpoints: dict[str, dict[str, Any]] | None = None,
    third_party: bool = True,
    observer_for: Any = None,
    **admission: Any,
) -> Rig:
    """``observer_for``: instance -> LedgerObserver (an AuditLog's), for the checker."""
    config = rig_config(
        nats_url,
        unique_id,
        urls=urls,
        limits=limits,
        router=router,
        timeouts=timeouts,
        endpoints=endpoints,
        third_party=third_party,
        **admission,
    )
    nc = await nats.connect(nats_url)
    load_kv = await open_load_bucket(nc, config)
    cluster = Cluster(config, nats_url, observer_for=observer_for)
    with before_any_lease(config):
        for _ in range(instances):
            await cluster.add_admission()
        await cluster.settled()
        if instances > 1:
            await cluster.balanced()
    client = NatsAdmission(
        nc, request_timeout=config.nats.request_timeout, queue_ttl=config.admission.queue_ttl
    )
    await client.start()
    return Rig(config, nc, load_kv, cluster, client)


__all__ = [
    "BINDING_LIMITS",
    "ENDPOINTS",
    "MODEL",
    "Rig",
    "admitted",
    "contextlib",
    "open_rig",
]
