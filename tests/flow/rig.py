"""A flow-control rig on real parts: nats-server, the load bucket, admission instances in-process.

Engine load is whatever the test writes into the load bucket as `EndpointReport`s, exactly as
the scraper would: tests choose saturation precisely instead of hoping a simulator reaches it.
Requests are AdmitRequests over NATS, exactly as an edge sends them.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import nats

from llmgw.config import Config, config_from_dict
from llmgw.load import EndpointReport, LoadSample, report_key
from llmgw.services.admission.health import HealthBoard
from llmgw.services.admission.loadboard import LoadBoard, LoadFollower
from llmgw.services.admission.service import AdmissionService
from llmgw.state.nats_kv import open_routing_bucket
from llmgw.state.setup import open_routing_state
from llmgw.wire import (
    ADMISSION_CANCEL_SUBJECT,
    ADMISSION_REQUEST_SUBJECT,
    AdmitCancel,
    AdmitReply,
    AdmitRequest,
)

MODEL = "m1"
ENDPOINTS = ("engine-1", "engine-2")
# The `stack` fixture's (tests/flow/conftest.py) lease limits and a minimal chat request.
EDGE_LIMITS = {
    "max_pinned_sessions": 100,
    "max_global_in_flight_request_slots": 100,
    "global_in_flight_request_slots_reserved_for_pinned_sessions": 10,
    "max_per_session_in_flight_request_slots": 10,
}
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def rig_config(
    nats_url: str,
    unique_id: str,
    *,
    urls: dict[str, str] | None = None,
    limits: dict[str, int] | None = None,
    router: dict[str, Any] | None = None,
    **admission: Any,
) -> Config:
    """Managed `iris` (two engines; lease limits only if given) and unlimited `tensorx`, for m1.

    ``urls`` maps endpoint ids (engine-1, engine-2, tensorx-1) to real servers where requests
    are relayed; without them nothing listens (tests that only ask admission).
    """
    urls = urls or {}
    iris_model: dict[str, Any] = {"name": MODEL}
    if limits:
        iris_model["limits"] = limits
    return config_from_dict(
        {
            "nats": {"url": nats_url, "request_timeout": "2s"},
            "router": {"load_bucket": f"load_{unique_id}", "stale_after": "5s", **(router or {})},
            "pinning": {"bucket": f"routing_{unique_id}"},
            "scoring": {"target_waiting": 4, "kv_ceiling": 0.9},
            "admission": {"interval": "5ms", **admission},
            "models": [{"name": MODEL}],
            "providers": [
                {"id": "iris", "kind": "managed", "priority": 100, "models": [iris_model]},
                {"id": "tensorx", "kind": "unlimited", "models": [{"name": MODEL}]},
            ],
            "endpoints": [
                {
                    "id": e,
                    "url": urls.get(e, f"http://127.0.0.1:1/{e}"),
                    "provider": "iris",
                    "models": [MODEL],
                }
                for e in ENDPOINTS
            ]
            + [
                {
                    "id": "tensorx-1",
                    "url": urls.get("tensorx-1", "http://127.0.0.1:1/t"),
                    "provider": "tensorx",
                    "models": [MODEL],
                }
            ],
        },
        source="<flow rig>",
        env={},
    )


@dataclass
class Rig:
    config: Config
    nc: Any
    load_kv: Any
    admissions: list[AdmissionService] = field(default_factory=list)
    _closers: list[Callable[[], Any]] = field(default_factory=list)

    async def add_admission(self) -> AdmissionService:
        nc = await nats.connect(self.nc.connected_url.geturl())
        board = LoadBoard(self.config, HealthBoard())
        follower = LoadFollower(board, self.load_kv)
        await follower.start()
        instance = f"admission-{len(self.admissions)}"
        routing = await open_routing_state(nc, self.config, instance_id=instance)
        service = AdmissionService(
            self.config, nc, routing, board.health, load=board, instance=instance
        )
        await service.start()
        self.admissions.append(service)

        async def close() -> None:
            await service.stop()
            await follower.stop()
            await routing.close()
            await nc.close()

        self._closers.append(close)
        return service

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
    ) -> None:
        """Write a scraper report and wait until every admission instance has applied it."""
        before = [a.load.reports for a in self.admissions]
        report = EndpointReport(
            endpoint=endpoint,
            provider="iris",
            pool="p",
            models=(MODEL,),
            healthy=healthy,
            sample=LoadSample(dialect="vllm", running=running, waiting=waiting, kv_usage=kv_usage),
            capacity=capacity,
            scraped_at=time.time() if at is None else at,
            scraper="test",
        )
        await self.load_kv.put(report_key(endpoint), report.to_bytes())
        await until(
            lambda: all(a.load.reports > b for a, b in zip(self.admissions, before, strict=True))
        )

    async def report_all(self, **kwargs: Any) -> None:
        for endpoint in ENDPOINTS:
            await self.report(endpoint, **kwargs)

    async def ask(
        self,
        *,
        band: str | None = None,
        tenant: str | None = None,
        request_id: str | None = None,
        timeout: float = 10,
    ) -> AdmitReply:
        request = AdmitRequest(
            request_id=request_id or uuid.uuid4().hex,
            edge_id="edge-test",
            model=MODEL,
            feature="chat",
            band=band,
            tenant=tenant,
        )
        msg = await self.nc.request(
            ADMISSION_REQUEST_SUBJECT, request.model_dump_json().encode(), timeout=timeout
        )
        return AdmitReply.model_validate_json(msg.data)

    async def cancel(self, request_id: str) -> None:
        await self.nc.publish(
            ADMISSION_CANCEL_SUBJECT, AdmitCancel(request_id=request_id).model_dump_json().encode()
        )

    def queued(self) -> int:
        return sum(len(a.flow.queues) for a in self.admissions if a.flow is not None)

    async def close(self) -> None:
        for close in reversed(self._closers):
            await close()
        js = self.nc.jetstream()
        for bucket in (self.config.router.load_bucket, self.config.pinning.bucket):
            try:
                await js.delete_key_value(bucket)
            except Exception:
                pass
        await self.nc.close()


async def open_rig(
    nats_url: str,
    unique_id: str,
    instances: int = 1,
    *,
    urls: dict[str, str] | None = None,
    limits: dict[str, int] | None = None,
    router: dict[str, Any] | None = None,
    **admission: Any,
) -> Rig:
    config = rig_config(nats_url, unique_id, urls=urls, limits=limits, router=router, **admission)
    nc = await nats.connect(nats_url)
    load_kv = await open_routing_bucket(
        nc.jetstream(), config.router.load_bucket, storage="memory", history=1
    )
    rig = Rig(config, nc, load_kv)
    for _ in range(instances):
        await rig.add_admission()
    return rig


async def until(
    condition: Callable[[], bool], timeout: float = 5.0, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)
