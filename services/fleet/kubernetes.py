"""The engines behind a Kubernetes Service, followed into the live fleet (`fleet.kubernetes`).

The reaper runs one `SliceWatcher`: it lists the Service's EndpointSlices
(``GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices?labelSelector=...``), then
watches from the list's ``resourceVersion`` (``watch=1``, newline-delimited ``{"type",
"object"}`` events: ADDED, MODIFIED, DELETED, BOOKMARK; an ERROR, e.g. 410 Gone when the
version is too old, or a closed stream, lists again). After every change it reconciles the
fleet with the ready endpoints of all slices (`llmgw.core.fleet.slice_endpoints`): a new one is
added (source ``kubernetes``; models from the config section, else the engine's
``/v1/models``), one that came back is undrained, one that left or is no longer ready is
drained, and a drained one is removed once no admission instance holds a lease on it (checked
again every `interval`). Only records it added (source ``kubernetes``) are ever touched.
Several reapers reconcile alike; each write is a CAS, so they do not fight.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from llmgw.core.fleet import EndpointState, slice_endpoints
from llmgw.services.fleet.ops import FleetError, FleetOps
from llmgw.state.kv import CasConflict

if TYPE_CHECKING:
    from llmgw.config.fleet import KubernetesDiscovery

__all__ = ["SliceWatcher", "kubernetes_client"]

log = logging.getLogger("llmgw.fleet.kubernetes")


class _Relist(Exception):
    """The watch cannot go on from its version (410 Gone, an ERROR event): list again."""


def kubernetes_client(settings: KubernetesDiscovery) -> httpx.AsyncClient:
    """A client of the API server: the configured one, else the pod's own (in-cluster)."""
    server = settings.api_server
    if server is None:
        host = os.environ.get("KUBERNETES_SERVICE_HOST", "kubernetes.default.svc")
        server = f"https://{host}:{os.environ.get('KUBERNETES_SERVICE_PORT', '443')}"
    headers = {"accept": "application/json"}
    token = Path(settings.token_file)
    if token.exists():
        headers["authorization"] = f"Bearer {token.read_text().strip()}"
    verify: Any = True
    if settings.ca_file and Path(settings.ca_file).exists():
        verify = settings.ca_file
    return httpx.AsyncClient(
        base_url=server.rstrip("/"),
        headers=headers,
        verify=verify,
        timeout=httpx.Timeout(10.0, read=None),  # a watch waits for events as long as it takes
        trust_env=False,
    )


class SliceWatcher:
    def __init__(
        self,
        ops: FleetOps,
        settings: KubernetesDiscovery,
        client: httpx.AsyncClient,
        leases: Callable[[], Awaitable[dict[str, int] | None]],
        *,
        interval: float = 2.0,
    ) -> None:
        self.ops = ops
        self.settings = settings
        self.client = client
        self._leases = leases
        self.interval = interval
        self.slices: dict[str, dict[str, str]] = {}  # slice name -> {endpoint id: url}
        self.reconciled = 0
        self._lock = asyncio.Lock()
        self._path = f"/apis/discovery.k8s.io/v1/namespaces/{settings.namespace}/endpointslices"

    @property
    def desired(self) -> dict[str, str]:
        return {e: url for found in self.slices.values() for e, url in found.items()}

    async def run(self, stop: asyncio.Event) -> None:
        sweeper = asyncio.create_task(self._sweep(stop))
        try:
            while not stop.is_set():
                try:
                    version = await self._list()
                    await self._watch(version, stop)
                except asyncio.CancelledError:
                    raise
                except _Relist:
                    log.info("EndpointSlice watch expired; listing again")
                except Exception as exc:  # API server away: try again
                    log.warning("EndpointSlice watch failed (%r); again in 1 s", exc)
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(1.0):
                            await stop.wait()
        finally:
            sweeper.cancel()
            await asyncio.gather(sweeper, return_exceptions=True)

    async def _sweep(self, stop: asyncio.Event) -> None:
        """Drained endpoints are removed once their leases ended: checked every interval."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval):
                    await stop.wait()
            try:
                await self.reconcile()
            except Exception:
                log.warning("fleet reconciliation failed", exc_info=True)

    async def _list(self) -> str:
        response = await self.client.get(
            self._path, params={"labelSelector": self.settings.selector}
        )
        response.raise_for_status()
        body = response.json()
        self.slices = {}
        for item in body.get("items") or []:
            self._take("ADDED", item)
        await self.reconcile()
        return str(body.get("metadata", {}).get("resourceVersion", ""))

    async def _watch(self, version: str, stop: asyncio.Event) -> None:
        params = {
            "labelSelector": self.settings.selector,
            "watch": "1",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
        }
        async with self.client.stream("GET", self._path, params=params) as response:
            if response.status_code == 410:
                raise _Relist
            response.raise_for_status()
            async for line in response.aiter_lines():
                if stop.is_set():
                    return
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    raise _Relist
                if kind in ("ADDED", "MODIFIED", "DELETED") and self._take(kind, obj):
                    await self.reconcile()
        raise _Relist  # the server ended the watch (its timeout): list and watch again

    def _take(self, kind: str, obj: dict[str, Any]) -> bool:
        name = str(obj.get("metadata", {}).get("name", ""))
        before = self.slices.get(name)
        if kind == "DELETED":
            self.slices.pop(name, None)
        else:
            self.slices[name] = slice_endpoints(
                obj, port_name=self.settings.port_name, id_prefix=self.settings.id_prefix
            )
        return self.slices.get(name) != before

    async def reconcile(self) -> None:
        async with self._lock:
            await self._reconcile()
            self.reconciled += 1

    async def _reconcile(self) -> None:
        desired = self.desired
        fleet = await self.ops.bucket.fleet()
        for endpoint_id, url in desired.items():
            record = fleet.records.get(endpoint_id)
            if record is None:
                await self._add(endpoint_id, url)
            elif (
                record.source == "kubernetes"
                and record.state is EndpointState.DRAINING
                and not record.unserved  # drained by the model follower: its to undrain
            ):
                await self._quietly(self.ops.set_state(endpoint_id, EndpointState.ACTIVE))
        gone = [
            r for r in fleet.records.values() if r.source == "kubernetes" and r.id not in desired
        ]
        if not gone:
            return
        leases = None
        for record in gone:
            if record.state is EndpointState.ACTIVE:
                log.info("endpoint %s left its Service (or is not ready): draining", record.id)
                await self._quietly(self.ops.set_state(record.id, EndpointState.DRAINING))
                continue
            if leases is None:
                leases = await self._leases()
            if leases is not None and leases.get(record.id, 0) == 0:
                with contextlib.suppress(CasConflict, LookupError):
                    await self.ops.bucket.remove(record.id, expected=record)
                    log.info("endpoint %s drained: removed", record.id)

    async def _add(self, endpoint_id: str, url: str) -> None:
        spec: dict[str, Any] = {"id": endpoint_id, "url": url, "provider": self.settings.provider}
        if self.settings.models:
            spec["models"] = list(self.settings.models)
        if self.settings.capacity is not None:
            spec["capacity"] = self.settings.capacity
        try:
            await self.ops.add(spec, probe=False, source="kubernetes")
            log.info("endpoint %s (%s) joined from its Service", endpoint_id, url)
        except FleetError as exc:  # not serving yet, or nothing of ours: next reconcile
            log.warning("endpoint %s (%s) not added: %s", endpoint_id, url, exc.message)

    @staticmethod
    async def _quietly(change: Awaitable[object]) -> None:
        with contextlib.suppress(FleetError, CasConflict):
            await change
