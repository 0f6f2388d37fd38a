"""Real gateway parts in this process: admission instances and edges, each with its own NATS
connection (exactly as separate processes would have), on real uvicorn servers.

Used by the edge, flow, mesh and chaos tests. Nothing here is a mock: the instances are the
product's services, composed the way their `main` modules compose them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import nats
from timing import eventually

from llmgw.config import Config, limits_from_config
from llmgw.core.ledger import LedgerObserver
from llmgw.events import EventPublisher
from llmgw.services.admission.health import HealthBoard
from llmgw.services.admission.loadboard import LoadBoard, LoadFollower
from llmgw.services.admission.service import AdmissionService
from llmgw.services.edge.app import HotPathApp, create_app
from llmgw.services.edge.main import close_edge_deps, open_edge_deps
from llmgw.serving import RunningServer, start_server
from llmgw.state.setup import open_load_bucket, open_routing_store


class InFlight:
    """ASGI middleware counting the requests an engine is answering (ground truth): `now`,
    `max`, and with a `starts` list in the counter each start's (time, count it brought)."""

    def __init__(self, app: Any, counter: dict[str, Any]) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        self.counter["now"] += 1
        self.counter["max"] = max(self.counter["max"], self.counter["now"])
        if "starts" in self.counter:
            self.counter["starts"].append((time.time(), self.counter["now"]))
        try:
            await self.app(scope, receive, send)
        finally:
            self.counter["now"] -= 1


async def stop_servers(servers: Iterable[RunningServer]) -> None:
    """Stop uvicorn servers together: each stop waits for uvicorn's 0.1 s tick and its 0.1 s
    shutdown pause, so one after another a fixture's engines add ~0.2 s each to every test."""
    await asyncio.gather(*(server.stop() for server in servers))


# A tick: the roll calls of instances that start before anything holds a lease.
QUIET_ROLLCALL_WINDOW = 0.01


@contextlib.contextmanager
def before_any_lease(config: Config) -> Iterator[None]:
    """Admission instances started inside this block start on a fresh routing bucket before
    any request was sent: no lease exists anywhere. An instance that claims shards nobody
    hands it roll-calls the edges for their leases there and listens for
    ``admission.rollcall_window`` (300 ms as shipped); here no answer can name a lease, so the
    window is a tick while they start. It is the config's own again for every roll call after
    the block (a successor's, an adoption's): the instances read it from the config each time."""
    window = config.admission.rollcall_window
    config.admission.rollcall_window = QUIET_ROLLCALL_WINDOW
    try:
        yield
    finally:
        config.admission.rollcall_window = window


@dataclass
class Admission:
    service: AdmissionService
    nc: Any
    follower: LoadFollower | None = None
    stopped: bool = False
    name: str = ""  # as started (its audit trail's name), though it may rejoin under another id

    async def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        await self.service.stop()
        if self.follower is not None:
            await self.follower.stop()
        await self.nc.close()

    async def kill(self) -> None:
        """Die without a word (no handover, no goodbye): what SIGKILL leaves behind."""
        if self.stopped:
            return
        self.stopped = True
        service = self.service
        # The flags its loops check after every await, so none outlives the cancel below.
        service._stopping = True
        service.membership._closed = True
        service.quotas._closed = True
        service.shards.stopping = True
        for task in [*service._loops, *service._tasks]:
            task.cancel()
        for task in service.shards.background():
            task.cancel()
        for task in service.membership._tasks:
            task.cancel()
        for task in service.quotas._tasks:
            task.cancel()
        if service.flow is not None and service.flow._tick_task is not None:
            service.flow._tick_task.cancel()
        await self.nc.close()
        if self.follower is not None:
            await self.follower.stop()


@dataclass
class Edge:
    app: HotPathApp
    server: RunningServer
    deps: Any
    nc: Any

    @property
    def url(self) -> str:
        return self.server.url

    async def stop(self) -> None:
        await self.server.stop()
        await close_edge_deps(self.deps)
        await self.nc.close()


async def connect(nats_url: str, name: str) -> Any:
    """One component's own connection. A comma-separated list (a NATS cluster) is tried in the
    order given and reconnected forever, as the services do (`llmgw.natsconn`): the first
    server is the one this component talks to until it fails."""
    servers = [u.strip() for u in nats_url.split(",") if u.strip()]
    if len(servers) == 1:
        return await nats.connect(servers[0], name=name)
    return await nats.connect(
        servers,
        name=name,
        dont_randomize=True,
        reconnect_time_wait=0.5,
        max_reconnect_attempts=-1,
        connect_timeout=2,
    )


def rotated(nats_url: str, index: int) -> str:
    """The server list starting at its `index`-th server (spreads components over a cluster)."""
    servers = nats_url.split(",")
    k = index % len(servers)
    return ",".join(servers[k:] + servers[:k])


async def start_admission(
    config: Config,
    nats_url: str,
    *,
    instance: str,
    follow_load: bool = True,
    observer: LedgerObserver | None = None,
    **kwargs: Any,
) -> Admission:
    """One admission instance as `llmgw admission` runs it (its load board follows the load
    bucket when `follow_load`)."""
    nc = await connect(nats_url, instance)
    health = kwargs.pop("health", None) or HealthBoard()
    board = kwargs.pop("load", None) or LoadBoard(config, health)
    follower = None
    if follow_load:
        follower = LoadFollower(board, await open_load_bucket(nc, config))
        await follower.start()
    store = await open_routing_store(nc, config)
    service = AdmissionService(
        config,
        nc,
        store,
        instance=instance,
        health=health,
        load=board,
        events=EventPublisher(nc, instance),
        observer=observer,
        **kwargs,
    )
    await service.start()
    return Admission(service, nc, follower, name=instance)


async def start_edge(config: Config, nats_url: str, *, edge_id: str, tracing: Any = None) -> Edge:
    """One edge as `llmgw edge` runs it, on a free port (`tracing`: a `llmgw.tracing.Tracing`
    in place of the config's)."""
    nc = await connect(nats_url, edge_id)
    deps = await open_edge_deps(nc, config, edge_id)
    if tracing is not None:
        deps.tracing = tracing
    app = create_app(config, deps)
    server = await start_server(app)
    return Edge(app, server, deps, nc)


@dataclass
class Cluster:
    """Admission instances and edges sharing one config (and so one routing bucket)."""

    config: Config
    nats_url: str
    admissions: list[Admission] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    observer_for: Any = None  # instance -> LedgerObserver (an AuditLog's), or None
    on_stopped: Any = None  # instance -> None, once an admission instance has stopped

    @property
    def limits(self) -> dict:
        return limits_from_config(self.config)

    async def add_admission(self, instance: str | None = None, **kwargs: Any) -> Admission:
        name = instance or f"admission-{len(self.admissions)}"
        observer = self.observer_for(name) if self.observer_for is not None else None
        url = rotated(self.nats_url, len(self.admissions) + len(self.edges))
        admission = await start_admission(
            self.config, url, instance=name, observer=observer, **kwargs
        )
        self.admissions.append(admission)
        return admission

    async def add_edge(self) -> Edge:
        url = rotated(self.nats_url, len(self.admissions) + len(self.edges))
        edge = await start_edge(self.config, url, edge_id=f"edge-{len(self.edges)}")
        self.edges.append(edge)
        return edge

    def live_admissions(self) -> list[AdmissionService]:
        return [a.service for a in self.admissions if not a.stopped]

    async def settled(self, timeout: float = 10.0) -> None:
        """Until every shard is served by exactly one live instance."""
        shards = self.config.admission.shards

        def served() -> list[int]:
            return sorted(s for a in self.live_admissions() for s in a.shards.serving)

        try:
            await eventually(lambda: served() == list(range(shards)), timeout, interval=0.02)
        except AssertionError:
            raise AssertionError(f"shards not settled: {served()}") from None

    async def balanced(self, timeout: float = 15.0) -> None:
        """Until every shard is served by the live instance rendezvous hashing gives it to."""
        from llmgw.core.shards import desired_owner

        shards = self.config.admission.shards

        def balanced() -> bool:
            live = self.live_admissions()
            names = [a.instance for a in live]
            serving = {s: a.instance for a in live for s in a.shards.serving}
            return all(serving.get(s) == desired_owner(s, names) for s in range(shards))

        await eventually(
            balanced, timeout, "shards balanced over the live instances", interval=0.02
        )

    async def stop(self, *, delete_buckets: bool = True) -> None:
        for edge in self.edges:
            with contextlib.suppress(Exception):
                await edge.stop()
        for admission in self.admissions:
            if admission.stopped:
                continue
            with contextlib.suppress(Exception):
                await admission.stop()
            if self.on_stopped is not None:
                self.on_stopped(admission.name)
        if delete_buckets:
            nc = await connect(self.nats_url, "cleanup")
            js = nc.jetstream()
            for bucket in (self.config.pinning.bucket, self.config.router.load_bucket):
                with contextlib.suppress(Exception):
                    await js.delete_key_value(bucket)
            await nc.close()


class HeaderRecorder:
    """ASGI middleware around an engine: the headers of every POST it received."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.seen: list[dict[str, str]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            self.seen.append({k.decode(): v.decode() for k, v in scope["headers"]})
        await self.app(scope, receive, send)
