"""A gateway of real processes for rolling restarts: simulated engines and provider (`llmgw sim`),
admission instances, a reaper, a scraper and edges, all on one config with the shipped
defaults (flow control on); a client-side round robin that, like a load balancer, sends no new
request to an edge whose ``/ready`` is false; steady load of streamed and non-streamed chat
with sessions; and the protocol's own observables for the invariants (the admission state
subject, the edges' roll call).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml
from cluster import Service

from llmgw.core.quota import NO_COUNTS, QuotaCounts
from llmgw.serving import free_port
from llmgw.wire import (
    ADMISSION_ROLLCALL_SUBJECT,
    ADMISSION_STATE_SUBJECT,
    RollCall,
    RollCallAnswer,
    StateReply,
)

MODEL = "chat-model"
SHARDS = 32  # the shipped default
LIMITS = {  # small enough that the managed provider is full at times: the rest goes to "c"
    "max_pinned_sessions": 8,
    "max_global_in_flight_request_slots": 6,
    "global_in_flight_request_slots_reserved_for_pinned_sessions": 2,
    "max_per_session_in_flight_request_slots": 2,
}


def write_config(
    path: Path,
    nats_url: str,
    bucket: str,
    urls: dict[str, str],
    pinning: dict | None = None,
    **router: object,
) -> Path:
    """Managed provider "a" (two engines, small limits), unlimited provider "c"; admission in
    processes of its own (`colocated: false`), so edges and admission instances roll apart."""
    data = {
        "listen": f"127.0.0.1:{free_port()}",
        "admin_listen": f"127.0.0.1:{free_port()}",
        "nats": {"url": nats_url},
        "router": {"scrape_interval": "250ms", "load_bucket": f"load_{bucket}", **router},
        "timeouts": {"first_token": "30s", "idle": "30s", "total": "60s"},
        "pinning": {"bucket": bucket, "history": 64, **(pinning or {})},
        "admission": {"colocated": False},
        "models": [{"name": MODEL}],
        "providers": [
            {"id": "a", "kind": "managed", "models": [{"name": MODEL, "limits": LIMITS}]},
            {"id": "c", "kind": "unlimited", "models": [{"name": MODEL}]},
        ],
        "endpoints": [
            {"id": "engine-1", "url": urls["engine-1"], "provider": "a", "models": [MODEL]},
            {"id": "engine-2", "url": urls["engine-2"], "provider": "a", "models": [MODEL]},
            {"id": "deploy-c", "url": urls["deploy-c"], "provider": "c", "models": [MODEL]},
        ],
    }
    path.write_text(yaml.safe_dump(data))
    return path


def start_simulators() -> tuple[dict[str, str], list[Service]]:
    """Two engines with small batches (they saturate under the load) and a paced provider."""
    urls, services = {}, []
    for name, kind, settings in (
        ("engine-1", "engine", ("max_num_seqs=4", "itl_base=10ms")),
        ("engine-2", "engine", ("max_num_seqs=4", "itl_base=10ms")),
        ("deploy-c", "provider", ("tokens_per_second=200", "base_latency=20ms")),
    ):
        port = free_port()
        urls[name] = f"http://127.0.0.1:{port}"
        extra = [f"--set={s}" for s in settings]
        services.append(Service(f"sim {kind}", None, "--port", str(port), "--model", MODEL, *extra))
    return urls, services


@dataclass
class EdgeProcess:
    service: Service
    url: str
    admin: str
    ready: bool = False


class Gateway:
    """Every service process by kind; `start`/`stop_one` as a rolling restart needs them."""

    def __init__(self, config: Path) -> None:
        self.config = config
        self.services: dict[str, list[Service]] = {"admission": [], "reaper": [], "scraper": []}
        self.edges: list[EdgeProcess] = []
        self.retired: list[Service] = []

    def start(self, kind: str) -> Service | EdgeProcess:
        if kind == "edge":
            listen, admin = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
            service = Service("edge", self.config, "--listen", listen, "--admin-listen", admin)
            edge = EdgeProcess(service, f"http://{listen}", f"http://{admin}")
            self.edges.append(edge)
            return edge
        service = Service(kind, self.config)
        self.services[kind].append(service)
        return service

    async def started(self, kind: str) -> Service | EdgeProcess:
        started = self.start(kind)
        service = started.service if isinstance(started, EdgeProcess) else started
        await asyncio.to_thread(service.wait_ready)
        return started

    async def sigterm(self, service: Service, timeout: float = 30) -> int:
        """SIGTERM and wait for the exit; its exit code."""
        service.process.terminate()
        code = await asyncio.to_thread(service.process.wait, timeout)
        self.retired.append(service)
        for kind in self.services.values():
            if service in kind:
                kind.remove(service)
        return code

    def stop(self) -> None:
        """SIGTERM to every process at once, then wait for each (killed if it lingers)."""
        services = [e.service for e in self.edges] + [
            s for kind in self.services.values() for s in kind
        ]
        for service in services:
            if service.process.poll() is None:
                service.process.terminate()
        for service in services:
            service.stop()


class Balancer:
    """Client-side round robin over the edges whose ``/ready`` answered 200 at the last poll
    (every `every` seconds), as a load balancer's health check would."""

    def __init__(self, gateway: Gateway, every: float = 0.1) -> None:
        self.gateway = gateway
        self.every = every
        self._turn = itertools.count()
        self._task: asyncio.Task[None] | None = None

    def pick(self) -> EdgeProcess | None:
        ready = [e for e in self.gateway.edges if e.ready]
        return ready[next(self._turn) % len(ready)] if ready else None

    async def _poll(self, http: aiohttp.ClientSession) -> None:
        while True:
            for edge in list(self.gateway.edges):
                try:
                    async with http.get(edge.admin + "/ready") as r:
                        edge.ready = r.status == 200
                except aiohttp.ClientError:
                    edge.ready = False
            await asyncio.sleep(self.every)

    def start(self, http: aiohttp.ClientSession) -> None:
        self._task = asyncio.create_task(self._poll(http))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


@dataclass
class Results:
    ok: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    by_edge: Counter = field(default_factory=Counter)


def chat(session: str, stream: bool, rng: random.Random) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"conversation {session}"}],
        "max_tokens": rng.randint(5, 30),
        "stream": stream,
    }


async def one_request(
    http: aiohttp.ClientSession, edge: EdgeProcess, session: str, stream: bool, rng, results
) -> None:
    """One request; anything but a complete answer is recorded as a failure."""
    kind = "stream" if stream else "plain"
    try:
        async with http.post(
            edge.url + "/v1/chat/completions",
            json=chat(session, stream, rng),
            headers={"x-session-id": session},
        ) as r:
            body = await r.read()
            if r.status != 200:
                results.failures.append(f"{kind} {r.status} {body[:200]!r}")
                return
            if stream:
                events = [line[6:] for line in body.decode().splitlines() if line[:6] == "data: "]
                if events[-1:] != ["[DONE]"] or any('"error"' in e for e in events):
                    results.failures.append(f"stream ended without [DONE]: {events[-2:]}")
                    return
            elif not json.loads(body).get("choices"):
                results.failures.append(f"plain 200 without choices: {body[:200]!r}")
                return
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        results.failures.append(f"{kind} {type(exc).__name__}: {exc}")
        return
    results.ok[kind] += 1
    results.by_edge[edge.url] += 1


async def steady_load(
    balancer: Balancer,
    http: aiohttp.ClientSession,
    sessions: int,
    stop: asyncio.Event,
    results: Results,
    seed: int = 20261201,
) -> None:
    """`sessions` clients, each one conversation: a request after the other, streamed or not."""

    async def client(index: int) -> None:
        rng = random.Random(seed + index)
        session = f"conversation-{index}"
        while not stop.is_set():
            edge = balancer.pick()
            if edge is None:
                results.failures.append("no edge was ready")
                await asyncio.sleep(0.1)
                continue
            await one_request(http, edge, session, rng.random() < 0.5, rng, results)
            await asyncio.sleep(rng.uniform(0, 0.05))

    await asyncio.gather(*(client(i) for i in range(sessions)))


async def admission_states(nc, wait: float = 0.3) -> list[StateReply]:
    """Every live admission instance's answer on the state subject (collected for `wait`)."""
    replies: list[StateReply] = []
    inbox = nc.new_inbox()

    async def collect(msg) -> None:  # type: ignore[no-untyped-def]
        replies.append(StateReply.model_validate_json(msg.data))

    sub = await nc.subscribe(inbox, cb=collect)
    await nc.publish(ADMISSION_STATE_SUBJECT, b"", reply=inbox)
    await asyncio.sleep(wait)
    await sub.unsubscribe()
    return replies


def over_limits(states: list[StateReply], limits: dict) -> list[str]:
    """Pairs whose leases, unreserved leases or pins, summed over every instance's answer to
    one state request, exceed the pair's limits (G, G - R, P).

    The instances answer the same message within a fraction of a millisecond, so a lease
    moving between two of them in a handover could in principle be counted twice (a false
    alarm, never a missed breach); a request lasts hundreds of milliseconds here. An
    instance's own quota is not compared: while a shard it handed over is unsettled, the quota
    it shows is lowered twice on purpose (more conservative, not a breach).
    """
    totals: dict[tuple[str, str], QuotaCounts] = {}
    for state in states:
        for pair in state.pairs:
            key = (pair.provider, pair.model)
            held = QuotaCounts(pair.leases, pair.unreserved, pair.pins)
            totals[key] = totals.get(key, NO_COUNTS).plus(held)
    breaches = []
    for pair, (leases, unreserved, pins) in totals.items():
        limit = limits.get(pair)
        if limit is None:
            continue
        g = limit.max_global_in_flight_request_slots
        r = limit.global_in_flight_request_slots_reserved_for_pinned_sessions
        if leases > g or unreserved > g - r or pins > limit.max_pinned_sessions:
            breaches.append(f"{pair}: leases {leases}, unreserved {unreserved}, pins {pins}")
    return breaches


async def watch_limits(nc, limits: dict, stop: asyncio.Event, samples: list, breaches: list):  # type: ignore[no-untyped-def]
    while not stop.is_set():
        states = await admission_states(nc, wait=0.2)
        samples.append(states)
        breaches.extend(over_limits(states, limits))


async def leases_of_edges(nc, wait: float = 0.5) -> dict[str, set[str]]:
    """Roll call over every shard: what each live edge holds (answers collected for `wait`)."""
    answers: dict[str, set[str]] = {}

    async def collect(msg) -> None:  # type: ignore[no-untyped-def]
        answer = RollCallAnswer.model_validate_json(msg.data)
        answers[answer.edge] = {lease.lease_id for lease in answer.leases}

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=collect)
    call = RollCall(owner="rolling-test", shards=tuple(range(SHARDS)))
    await nc.publish(ADMISSION_ROLLCALL_SUBJECT, call.model_dump_json().encode(), reply=inbox)
    await asyncio.sleep(wait)
    await sub.unsubscribe()
    return answers
