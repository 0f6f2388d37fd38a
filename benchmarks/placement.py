"""Placement with every policy on at once: a realistic mix on our engines.

The cluster is `llmgw up` with the shipped defaults (config/local.yaml: flow control on, its
providers, limits and models; every other section at its default), but its four upstreams run in
this process, so that every request's fate is observed exactly where it happens:

- two vLLM-like engines of the managed provider `iris`, 8 and 16 batch slots (configured as
  ``endpoints[].capacity``, as for a real engine), and the two third-party deployments of
  `tensorx` (the parameters of config/local.yaml);
- when a request reaches an engine and has to wait for a batch slot, the other engine's state is
  read at that instant (same event loop, same clock): did it have a free slot (nothing waiting,
  fewer running than its slots)? When a request reaches a third party, the same question is asked
  of both engines. A request is identified by its prompt's token ids (every prompt is unique).

Measures (each phase on its own; figures in docs/benchmarks.md, "Placement"):

- **mix** at 50% and 90% of managed capacity (capacity = sum over engines of slots / the service
  time of one request at a full batch): Poisson arrivals, 70% one-shot requests and 30% turns of
  multi-turn chats (5-10 turns, each resending the conversation, so prefixes grow), bands mixed
  (platinum 10%, gold 50%, silver 20%, bronze 20%; a chat keeps its band). Reported: the share of
  requests sent to a third party while an engine had a free slot; the share of chat turns (after
  the first) on the session's replica, the engine its previous turn ran on and whose prefix
  cache holds the conversation (and, stricter, on its first turn's engine); prefix-cache hits of chat turns against the
  workload's ideal (what the engine's prefix cache would hit if every turn ran where the previous
  ones did: the full blocks shared with the previous turn's prompt, computed with the simulator's
  own tokenizer); interactive (platinum, gold) requests that waited at an engine while the other
  had a free slot;
- **cold start**: 16 concurrent gold requests on the fresh cluster (24 free slots): how many went
  to a third party;
- **one-shots**: 300 one-shot conversations (more than the pin table's 200), then a new
  multi-turn session on the idle cluster: where it is pinned;
- **return home**: a session pinned on the third party during an engine outage, then served on
  while the engines are healthy again: when its pin comes back (pinning.return_home_after, 30 s).

Limits as a platform team sets them (``--limits capacity``, the default): the managed pair's
``max_global_in_flight_request_slots`` G is the engines' batch slots (24), 6 of them reserved for
pinned sessions, so the limits bind. A request sent to a third party is *avoidable* when the
engines' own running + waiting count (read at that instant) was below G - R for a new session
(routes new_pin, unpinned, overflow) or below G for a pinned session's temporary fallback: a lone
admission instance holding the whole limit would have kept it. ``--limits local`` keeps
config/local.yaml's limits (G = 64: they never bind here).

Several admission instances (``--admission-instances N``): `llmgw up`'s edge runs one, and N - 1
more run as `llmgw admission` processes joined to the same NATS; the sessions' shards split
between them, and so does each limit (ADR 0002's quotas).

    python benchmarks/placement.py [--seconds 60] [--runs 1] [--admission-instances N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import nats
import yaml

from llmgw.services.sim.apps import create_engine_app, create_provider_app
from llmgw.services.sim.engine_model import SeqState
from llmgw.services.sim.engine_runtime import EngineBackend
from llmgw.services.sim.params import EngineParams, ProviderParams
from llmgw.services.sim.tokenizer import hash_token_blocks, render_chat, token_ids
from llmgw.serving import RunningServer, start_server
from llmgw.wire import ADMISSION_HEALTH_SUBJECT, HealthReply

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interference import UpCluster, cluster_ports

REPO = Path(__file__).resolve().parents[1]
LOCAL_CONFIG = REPO / "config" / "local.yaml"
MODEL = "llama-3.3-70b"
MODELS = [MODEL, "qwen2.5-32b"]
ENGINES = {"engine-1": 8, "engine-2": 16}  # id -> batch slots
OUTPUT_TOKENS = 64  # every request's max_tokens (a fixed service time)
ONE_SHOT_SHARE = 0.7
TURNS = (5, 10)
THINK_TIME = 0.5  # mean seconds between a chat's reply and its next turn (exponential)
BANDS = {"platinum": 0.1, "gold": 0.5, "silver": 0.2, "bronze": 0.2}
INTERACTIVE = {"platinum", "gold"}
CAPACITY_LIMITS = {  # --limits capacity: G = the engines' batch slots
    "max_pinned_sessions": 200,
    "max_global_in_flight_request_slots": sum(ENGINES.values()),
    "global_in_flight_request_slots_reserved_for_pinned_sessions": 6,
    "max_per_session_in_flight_request_slots": 4,
}
NEW_SESSION_ROUTES = {"new_pin", "unpinned", "overflow"}
OPENING_WORDS = 60  # ~120 tokens of a conversation's first message
FOLLOW_UP_WORDS = 15
_WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()


def _simulated(endpoint: str) -> dict[str, Any]:
    """config/local.yaml's simulator parameters of `endpoint` (without its kind)."""
    data = yaml.safe_load(LOCAL_CONFIG.read_text())
    found = next(e for e in data["endpoints"] if e["id"] == endpoint)["simulate"]
    return {k: v for k, v in found.items() if k != "kind"}


def engine_params(slots: int, seed: int) -> EngineParams:
    """config/local.yaml's engine with `slots` batch slots."""
    return EngineParams.model_validate(
        {**_simulated("engine-1"), "max_num_seqs": slots, "seed": seed}
    )


PROVIDERS = {  # config/local.yaml's third parties
    name: ProviderParams.model_validate(_simulated(name))
    for name in ("tensorx-east", "tensorx-west")
}


def managed_capacity(prompt_tokens: int = 200) -> float:
    """Requests per second the engines complete with every slot busy."""
    total = 0.0
    for slots in ENGINES.values():
        p = engine_params(slots, 0)
        service = (
            p.prefill_base
            + p.prefill_per_token * prompt_tokens
            + OUTPUT_TOKENS * (p.itl_base + p.itl_per_running_seq * slots)
        )
        total += slots / service
    return total


def prompt_key(tokens: Iterable[int]) -> int:
    return hash(tuple(tokens))


@dataclass(slots=True)
class Arrival:
    """A request as an upstream saw it arrive."""

    upstream: str
    managed: bool
    waited: bool = False  # an engine: it could not start at once
    free_elsewhere: bool = False  # another engine (any, for a third party) had a free slot
    engines_busy: int = 0  # the engines' running + waiting at that instant
    engines_holding: tuple[int, ...] = ()  # the prompt keys of those requests


class SimFarm:
    """The cluster's upstreams on one event loop in a thread of this process."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.engines: dict[str, EngineBackend] = {}
        self.apps: dict[str, Any] = {}
        self.arrivals: dict[int, Arrival] = {}
        self._held: dict[int, Any] = {}  # prompt key -> sequence, of requests at the engines
        self.servers: dict[str, RunningServer] = {}
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> dict[str, str]:
        self._thread.start()
        return asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    async def _start(self) -> dict[str, str]:
        for index, (endpoint, slots) in enumerate(ENGINES.items(), start=1):
            app = create_engine_app(engine_params(slots, index), MODELS)
            self.engines[endpoint] = app.backend
            self._hook(endpoint, app.backend, managed=True)
            self.apps[endpoint] = app
        for endpoint, params in PROVIDERS.items():
            app = create_provider_app(params, MODELS)
            self._hook(endpoint, app.backend, managed=False)
            self.apps[endpoint] = app
        for endpoint, app in self.apps.items():
            self.servers[endpoint] = await start_server(app)
        return {endpoint: server.url for endpoint, server in self.servers.items()}

    def _free(self, backend: EngineBackend) -> bool:
        state = backend.state()  # advances the engine to now
        return state["waiting"] == 0 and state["running"] < backend.params.max_num_seqs

    def _busy(self) -> int:
        """Requests the engines run or hold waiting now."""
        total = 0
        for backend in self.engines.values():
            state = backend.state()
            total += state["running"] + state["waiting"]
        return total

    def _hook(self, endpoint: str, backend: Any, *, managed: bool) -> None:
        original = backend.start

        def start(prompt: Any, limits: Any, priority: int = 0, lora: str | None = None) -> Any:
            generation = original(prompt, limits, priority, lora)
            others = [b for e, b in self.engines.items() if e != endpoint]
            arrival = Arrival(endpoint, managed)
            arrival.engines_busy = self._busy()
            self._held = {
                k: seq
                for k, seq in self._held.items()
                if seq.state in (SeqState.WAITING, SeqState.RUNNING)
            }
            arrival.engines_holding = tuple(self._held)
            if managed:
                self._held[prompt_key(prompt)] = generation.seq
                arrival.waited = generation.seq.state is SeqState.WAITING
                arrival.free_elsewhere = arrival.waited and any(self._free(b) for b in others)
            else:
                arrival.free_elsewhere = any(self._free(b) for b in others)
            self.arrivals[prompt_key(prompt)] = arrival
            return generation

        backend.start = start

    def set_healthy(self, healthy: bool) -> None:
        def change() -> None:
            for endpoint in self.engines:
                self.apps[endpoint].faults.unhealthy = not healthy

        self.loop.call_soon_threadsafe(change)

    def stop(self) -> None:
        async def stop_all() -> None:
            for server in self.servers.values():
                await server.stop(timeout=2)

        asyncio.run_coroutine_threadsafe(stop_all(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def placement_config(
    path: Path, urls: dict[str, str], *, limits: str = "capacity", nats_port: int = 0
) -> Path:
    """config/local.yaml on free ports, its endpoints pointing at the farm (no `simulate`);
    with `limits` "capacity", the managed pair's limits are the engines' capacity."""
    data = yaml.safe_load(LOCAL_CONFIG.read_text())
    admin, port = cluster_ports()
    data["listen"] = f"127.0.0.1:{port()}"
    data["admin_listen"] = f"127.0.0.1:{admin}"
    data["nats"] = {"url": "embedded", "embedded_port": nats_port}
    if limits == "capacity":
        for provider in data["providers"]:
            for model in provider["models"]:
                if provider["id"] == "iris" and model["name"] == MODEL:
                    model["limits"] = dict(CAPACITY_LIMITS)
    endpoints = []
    for endpoint in data["endpoints"]:
        endpoint.pop("simulate", None)
        endpoint["url"] = urls[endpoint["id"]]
        if endpoint["id"] in ENGINES:
            endpoint["capacity"] = ENGINES[endpoint["id"]]
        endpoints.append(endpoint)
    assert {e["id"] for e in endpoints} == set(urls), "config/local.yaml's endpoints changed"
    data["endpoints"] = endpoints
    data["auth"] = {"mode": "none"}  # the scenario's tenants are bearer tokens, not API keys
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# ---- the client side ---------------------------------------------------------------------------


@dataclass(slots=True)
class Sent:
    """One request and what became of it."""

    conversation: str
    turn: int  # 0: the first (or only) request of its conversation
    band: str
    key: int
    status: int = 0
    provider: str = ""
    endpoint: str = ""
    route: str = ""
    cached: int = 0
    ideal: int = 0  # prefix-cache hit if the conversation so far were cached where it runs


@dataclass
class Phase:
    sent: list[Sent] = field(default_factory=list)


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(count))


def ideal_hit(previous: list[int] | None, tokens: list[int], block_size: int = 16) -> int:
    """The engine's prefix-cache hit for `tokens` if `previous` was the last prompt it ran."""
    if previous is None:
        return 0
    shared = 0
    for a, b in zip(
        hash_token_blocks(previous, block_size), hash_token_blocks(tokens, block_size), strict=False
    ):
        if a != b:
            break
        shared += 1
    if shared * block_size >= len(tokens):
        shared -= 1  # the last prompt token is always recomputed
    return shared * block_size


class Client:
    def __init__(self, http: aiohttp.ClientSession, api: str, seed: int = 1) -> None:
        self.http = http
        self.api = api
        self.rng = random.Random(seed)
        self.serial = 0

    def conversation(self, tag: str) -> str:
        self.serial += 1
        return f"{tag}-{self.serial}"

    async def send(
        self,
        phase: Phase,
        conversation: str,
        turn: int,
        band: str,
        messages: list[dict[str, str]],
        previous: list[int] | None,
        max_tokens: int = OUTPUT_TOKENS,
    ) -> tuple[Sent, str, list[int]]:
        tokens = token_ids(render_chat(messages))
        sent = Sent(conversation, turn, band, prompt_key(tokens), ideal=ideal_hit(previous, tokens))
        phase.sent.append(sent)
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True}
        reply = ""
        try:
            async with self.http.post(
                f"{self.api}/chat/completions", json=body, headers={"x-llmgw-band": band}
            ) as response:
                sent.status = response.status
                sent.provider = response.headers.get("x-llmgw-provider", "")
                sent.endpoint = response.headers.get("x-llmgw-endpoint", "")
                sent.route = response.headers.get("x-llmgw-route", "")
                data = await response.json(content_type=None)
            if sent.status == 200:
                reply = data["choices"][0]["message"]["content"]
                details = data.get("usage", {}).get("prompt_tokens_details") or {}
                sent.cached = details.get("cached_tokens") or 0
        except (aiohttp.ClientError, ValueError, KeyError):
            sent.status = sent.status or -1
        return sent, reply, tokens

    async def one_shot(self, phase: Phase, band: str, max_tokens: int = OUTPUT_TOKENS) -> Sent:
        name = self.conversation("one")
        messages = [{"role": "user", "content": f"{name} {words(self.rng, OPENING_WORDS)}"}]
        sent, _, _ = await self.send(phase, name, 0, band, messages, None, max_tokens)
        return sent

    async def chat(
        self, phase: Phase, band: str, turns: int, think: float = THINK_TIME
    ) -> list[Sent]:
        name = self.conversation("chat")
        rng = random.Random(name)
        messages = [{"role": "user", "content": f"{name} {words(rng, OPENING_WORDS)}"}]
        previous: list[int] | None = None
        results = []
        for turn in range(turns):
            sent, reply, previous = await self.send(phase, name, turn, band, messages, previous)
            results.append(sent)
            if sent.status != 200:
                break
            messages += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": words(rng, FOLLOW_UP_WORDS)},
            ]
            await asyncio.sleep(rng.expovariate(1 / think) if think else 0)
        return results

    async def mix(self, rate: float, seconds: float, think: float = THINK_TIME) -> Phase:
        """Poisson arrivals of `rate` requests/s for `seconds`: one-shots and chat turns."""
        phase = Phase()
        mean_turns = sum(TURNS) / 2
        one_shots = rate * ONE_SHOT_SHARE
        chats = rate * (1 - ONE_SHOT_SHARE) / mean_turns
        # The schedule is drawn first, from its own seeded generator: every run of a phase sends
        # the same conversations at the same offsets, whatever ran before it.
        rng = random.Random(f"mix-{rate:.3f}-{seconds}")
        schedule: list[tuple[float, str, int]] = []  # (offset, band, turns; 0 = one-shot)
        at = rng.expovariate(one_shots + chats)
        while at < seconds:
            one = rng.random() < one_shots / (one_shots + chats)
            band = rng.choices(list(BANDS), list(BANDS.values()))[0]
            schedule.append((at, band, 0 if one else rng.randint(*TURNS)))
            at += rng.expovariate(one_shots + chats)
        tasks: list[asyncio.Task[Any]] = []
        started = time.monotonic()
        for offset, band, turns in schedule:
            await asyncio.sleep(max(0.0, started + offset - time.monotonic()))
            if turns == 0:
                tasks.append(asyncio.create_task(self.one_shot(phase, band)))
            else:
                tasks.append(asyncio.create_task(self.chat(phase, band, turns, think)))
        await asyncio.gather(*tasks)
        return phase


# ---- measures ----------------------------------------------------------------------------------


def share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def mix_figures(
    phase: Phase, arrivals: dict[int, Arrival], limits: tuple[int, int]
) -> dict[str, Any]:
    """``limits``: the managed pair's (G, R), for the avoidable offloads."""
    done = [s for s in phase.sent if s.status == 200]
    seen = [(s, arrivals[s.key]) for s in done if s.key in arrivals]
    third = [(s, a) for s, a in seen if not a.managed]
    third_free = [s for s, a in third if a.free_elsewhere]
    total, reserved = limits
    avoidable_new = [
        s for s, a in third if s.route in NEW_SESSION_ROUTES and a.engines_busy < total - reserved
    ]
    avoidable_pinned = [s for s, a in third if s.route == "temporary" and a.engines_busy < total]
    # Sharper: a new session sent away while the engines held fewer than G - R requests of
    # unreserved leases (every route but "pinned"; a request of unknown route counts as one)
    # and fewer than G in all: a lone instance had room for it, whatever the pins held.
    routes = {s.key: s.route for s in phase.sent}
    unreserved_new = [
        s
        for s, a in third
        if s.route in NEW_SESSION_ROUTES
        and a.engines_busy < total
        and sum(routes.get(k) != "pinned" for k in a.engines_holding) < total - reserved
    ]
    avoidable_routes: dict[str, int] = {}
    for sent in avoidable_new:
        avoidable_routes[sent.route] = avoidable_routes.get(sent.route, 0) + 1
    interactive = [(s, a) for s, a in seen if s.band in INTERACTIVE]
    waited_free = [s for s, a in interactive if a.managed and a.waited and a.free_elsewhere]
    ran = {(s.conversation, s.turn): s.endpoint for s in done}
    later = [s for s in done if s.turn > 0 and (s.conversation, s.turn - 1) in ran]
    on_replica = [s for s in later if s.endpoint == ran[(s.conversation, s.turn - 1)]]
    on_first = [s for s in later if s.endpoint == ran.get((s.conversation, 0))]
    cached = sum(s.cached for s in later)
    ideal = sum(s.ideal for s in later)
    third_routes: dict[str, int] = {}
    for sent, _ in third:
        label = f"{sent.route}/{sent.band}"
        third_routes[label] = third_routes.get(label, 0) + 1
    # Where the prefix hits short of the ideal were lost: turns run on the third party, or on
    # our engines off their replica, or on it (evicted from its prefix cache meanwhile).
    lost = {"third_party": 0, "off_replica": 0, "on_replica": 0}
    for sent in later:
        if sent.provider == "tensorx":
            lost["third_party"] += sent.ideal - sent.cached
        elif sent.endpoint != ran[(sent.conversation, sent.turn - 1)]:
            lost["off_replica"] += sent.ideal - sent.cached
        else:
            lost["on_replica"] += sent.ideal - sent.cached
    return {
        "requests": len(phase.sent),
        "failed": len(phase.sent) - len(done),
        "third_party": len(third),
        "third_party_while_free": share(len(third_free), len(done)),
        "third_party_while_free_n": len(third_free),
        "third_party_routes": sorted({s.route for s in third_free}),
        "avoidable_new_session": share(len(avoidable_new), len(done)),
        "avoidable_new_session_n": len(avoidable_new),
        "avoidable_pinned_fallback": share(len(avoidable_pinned), len(done)),
        "avoidable_pinned_fallback_n": len(avoidable_pinned),
        "avoidable_routes": avoidable_routes,
        "avoidable_unreserved_new_session": share(len(unreserved_new), len(done)),
        "avoidable_unreserved_new_session_n": len(unreserved_new),
        "avoidable_unreserved_by_band": {
            band: sum(s.band == band for s in unreserved_new)
            for band in sorted({s.band for s in unreserved_new})
        },
        "turns_on_replica": share(len(on_replica), len(later)),
        "turns_on_first_replica": share(len(on_first), len(later)),
        "later_turns": len(later),
        "prefix_vs_ideal": share(cached, ideal),
        "prefix_lost": {where: share(n, ideal) for where, n in lost.items()},
        # The engines' running + waiting seen by each arrival, on average: at one arrival rate,
        # more means requests stayed longer (Little's law), e.g. engines slowed by the host.
        "engines_busy_mean": sum(a.engines_busy for _, a in seen) / len(seen) if seen else 0.0,
        "third_party_by_route_band": dict(sorted(third_routes.items())),
        "interactive": len(interactive),
        "interactive_waited_while_free": share(len(waited_free), len(interactive)),
        "interactive_waited_while_free_n": len(waited_free),
        "interactive_waited": sum(1 for _, a in interactive if a.managed and a.waited),
    }


async def cold_start(client: Client, count: int = 16) -> dict[str, Any]:
    phase = Phase()
    await asyncio.gather(*(client.one_shot(phase, "gold") for _ in range(count)))
    return {
        "requests": count,
        "third_party": sum(1 for s in phase.sent if s.provider == "tensorx"),
        "failed": sum(1 for s in phase.sent if s.status != 200),
    }


async def one_shots_then_session(
    client: Client, count: int = 300, concurrency: int = 16
) -> dict[str, Any]:
    """`count` one-shot conversations (short replies), then a new 5-turn chat."""
    phase = Phase()
    queue = iter(range(count))

    async def worker() -> None:
        for _ in queue:
            await client.one_shot(phase, "gold", max_tokens=4)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    chat = await client.chat(Phase(), "gold", 5, think=0.1)
    return {
        "one_shots": count,
        "one_shots_on_third_party": sum(1 for s in phase.sent if s.provider == "tensorx"),
        "one_shots_failed": sum(1 for s in phase.sent if s.status != 200),
        "session_providers": [s.provider for s in chat],
        "session_routes": [s.route for s in chat],
    }


async def pin_on_third_party(client: Client, farm: SimFarm, timeout: float = 20) -> list[Any]:
    """An engine outage: a new session is pinned on the third party; the engines come back.
    Returns the conversation's state to continue it (see `return_home`)."""
    farm.set_healthy(False)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            name = client.conversation("away")
            messages = [{"role": "user", "content": f"{name} {words(client.rng, 20)}"}]
            sent, reply, tokens = await client.send(Phase(), name, 0, "gold", messages, None, 4)
            if sent.status == 200 and sent.provider == "tensorx":
                messages += [
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": "again"},
                ]
                return [name, messages, tokens, time.monotonic()]
            await asyncio.sleep(0.2)
        raise RuntimeError("the outage never sent a new session to the third party")
    finally:
        farm.set_healthy(True)
        await until_managed(client)


async def until_managed(client: Client, timeout: float = 20) -> None:
    """Until a new conversation lands on our engines again (the scraper saw them healthy)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (await client.one_shot(Phase(), "gold", max_tokens=1)).provider == "iris":
            return
        await asyncio.sleep(0.2)
    raise RuntimeError("the engines never came back")


async def next_turn(client: Client, away: list[Any]) -> Sent:
    """One more turn of the session pinned away (`away` is updated for the next one)."""
    name, messages, tokens, _ = away
    sent, reply, away[2] = await client.send(
        Phase(), name, len(messages) // 2, "gold", messages, tokens, 4
    )
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "more"}]
    return sent


async def return_home(
    client: Client, away: list[Any], timeout: float = 60, every: float = 1.0
) -> dict[str, Any]:
    """Continue the session pinned away: one turn every `every` s until its pin comes home."""
    pinned_at = away[3]
    providers = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sent = await next_turn(client, away)
        providers.append(sent.provider)
        if sent.route == "returned_home":
            return {"returned_after": time.monotonic() - pinned_at, "providers": providers}
        await asyncio.sleep(every)
    return {"returned_after": None, "providers": providers}


def http_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=120)
    )


async def scenario(
    api: str,
    farm: SimFarm,
    seconds: float,
    loads: Iterable[float],
    think: float = THINK_TIME,
    limits: tuple[int, int] = (64, 16),
    outage: bool = True,
) -> dict[str, Any]:
    """Every measure on one fresh cluster, in an order that leaves each its conditions: the
    cold start first, then the outage that pins a session away (it returns home at the end,
    once pinning.return_home_after has passed; not without `outage`), the one-shots, the
    mixes."""
    results: dict[str, Any] = {}
    took: dict[str, float] = {}  # each measure's wall seconds
    began = time.monotonic()

    def lap(name: str) -> None:
        nonlocal began
        took[name] = round(time.monotonic() - began, 1)
        began = time.monotonic()

    async with http_session() as http:
        client = Client(http, api)
        results["cold_start"] = await cold_start(client)
        lap("cold_start")
        if outage:
            away = await pin_on_third_party(client, farm)
            early = await next_turn(client, away)  # engines healthy again, hysteresis not over
            lap("outage")
        results["one_shots"] = await one_shots_then_session(client)
        lap("one_shots")
        capacity = managed_capacity()
        for load in loads:
            phase = await client.mix(load * capacity, seconds, think)
            results[f"mix_{round(load * 100)}"] = {
                "rate": load * capacity,
                **mix_figures(phase, farm.arrivals, limits),
            }
            lap(f"mix_{round(load * 100)}")
        if outage:
            results["return_home"] = {
                "before_return_home_after": [early.provider, early.route],
                **await return_home(client, away),
            }
            lap("return_home")
    results["seconds"] = took
    return results


def run_once(
    workdir: Path,
    seconds: float,
    loads: Iterable[float],
    think: float = THINK_TIME,
    *,
    instances: int = 1,
    limits: str = "capacity",
    separate: bool = False,
    outage: bool = True,
) -> dict[str, Any]:
    """A fresh cluster: the farm, `llmgw up` in front of it (and `instances` - 1 more admission
    processes), the scenario, then all of it stopped."""
    farm = SimFarm()
    urls = farm.start()
    _, port = cluster_ports()
    nats_port = port()
    config = placement_config(workdir / "placement.yaml", urls, limits=limits, nats_port=nats_port)
    data = yaml.safe_load(config.read_text())
    if separate:  # every instance a process of its own: no decision in the edge
        data.setdefault("admission", {})["colocated"] = False
        config.write_text(yaml.safe_dump(data, sort_keys=False))
    pair = next(
        m.get("limits") or {}
        for p in data["providers"]
        if p["id"] == "iris"
        for m in p["models"]
        if m["name"] == MODEL
    )
    pair_limits = (
        pair.get("max_global_in_flight_request_slots", 0),
        pair.get("global_in_flight_request_slots_reserved_for_pinned_sessions", 0),
    )
    extra: list[subprocess.Popen[bytes]] = []
    admins = [data["admin_listen"]]
    try:
        cluster = UpCluster(config)
        try:
            api = cluster.api()
            if instances > 1:
                joined = workdir / "admission.yaml"
                data["nats"] = {"url": f"nats://127.0.0.1:{nats_port}"}
                joined.write_text(yaml.safe_dump(data, sort_keys=False))
                for _ in range(instances - 1):
                    admins.append(f"127.0.0.1:{port()}")
                    extra.append(start_admission(joined, admins[-1]))
                asyncio.run(until_serving(f"nats://127.0.0.1:{nats_port}", instances))
            result = asyncio.run(
                scenario(api, farm, seconds, loads, think, pair_limits, outage=outage)
            )
            result["admission_instances"] = instances
            result["quota_loans"] = asyncio.run(loan_counts(admins))
            return result
        finally:
            for process in extra:
                stop_process(process)
            cluster.stop()
    finally:
        farm.stop()


async def loan_counts(admins: list[str]) -> dict[str, float]:
    """llmgw_admission_quota_loans_total by source, quota_lent_total and offloads_total by reason
    (the whole run: every phase), summed over the
    admission instances' admin ports (the edge's holds its colocated instance's)."""
    totals: dict[str, float] = {}
    for line in await admin_metrics(admins):
        if line.startswith("llmgw_admission_offloads_total{"):
            name, value = line.rsplit(" ", 1)
            key = "offloads:" + name.split('reason="', 1)[1].rstrip('"}')
            totals[key] = totals.get(key, 0.0) + float(value)
        elif line.startswith(
            ("llmgw_admission_quota_loans_total", "llmgw_admission_quota_lent_total")
        ):
            name, value = line.rsplit(" ", 1)
            key = name.removeprefix("llmgw_admission_quota_").replace('{source="', ":")
            key = key.rstrip('"}')
            totals[key] = totals.get(key, 0.0) + float(value)
    return totals


async def admin_metrics(admins: list[str]) -> list[str]:
    """The /metrics lines of every admin address in `admins` that answers."""
    lines: list[str] = []
    async with http_session() as http:
        for admin in admins:
            try:
                async with http.get(f"http://{admin}/metrics") as response:
                    lines += (await response.text()).splitlines()
            except aiohttp.ClientError:
                continue
    return lines


def start_admission(config: Path, admin: str) -> subprocess.Popen[bytes]:
    """One more admission instance, `llmgw admission --config`, as a process of its own."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LLMGW_")}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmgw",
            "admission",
            "--config",
            str(config),
            "--admin-listen",
            admin,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def stop_process(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


async def until_serving(url: str, instances: int, timeout: float = 60) -> None:
    """Until `instances` admission instances answer health, each serving some shards."""
    nc = await nats.connect(url)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            answers: dict[str, int] = {}
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            await nc.publish(ADMISSION_HEALTH_SUBJECT, b"{}", reply=inbox)
            end = time.monotonic() + 0.5
            while (left := end - time.monotonic()) > 0:
                try:
                    msg = await sub.next_msg(timeout=left)
                except Exception:
                    break
                health = HealthReply.model_validate_json(msg.data)
                answers[health.instance] = health.shards
                if len(answers) >= instances and all(answers.values()):
                    break  # every instance answered: no need to listen out the window
            await sub.unsubscribe()
            if len(answers) >= instances and all(answers.values()):
                return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"{instances} admission instances never all served shards")
    finally:
        await nc.close()


def percent(value: float) -> str:
    return f"{value * 100:.1f}%"


def summary(results: dict[str, Any]) -> str:
    lines = []
    for name, figures in results.items():
        if name.startswith("mix_"):
            lines.append(
                f"{name[4:]}% load ({figures['rate']:.1f} req/s, {figures['requests']} requests, "
                f"{figures['failed']} failed): third party while an engine had a free slot "
                f"{percent(figures['third_party_while_free'])} "
                f"({figures['third_party_while_free_n']} of {figures['third_party']} sent there); "
                f"avoidable: new sessions {percent(figures['avoidable_new_session'])} "
                f"({figures['avoidable_new_session_n']}), pinned fallbacks "
                f"{percent(figures['avoidable_pinned_fallback'])} "
                f"({figures['avoidable_pinned_fallback_n']}, routes "
                f"{figures['avoidable_routes']}); new sessions sent away while the engines held "
                f"fewer than G - R unreserved "
                f"{percent(figures['avoidable_unreserved_new_session'])} "
                f"({figures['avoidable_unreserved_new_session_n']}, by band "
                f"{figures['avoidable_unreserved_by_band']}); "
                f"turns on the session's replica {percent(figures['turns_on_replica'])} "
                f"(of {figures['later_turns']}; on its first turn's "
                f"{percent(figures['turns_on_first_replica'])}); prefix hits vs ideal "
                f"{percent(figures['prefix_vs_ideal'])} (lost: "
                + ", ".join(f"{k} {percent(v)}" for k, v in figures["prefix_lost"].items())
                + f"); engines' running + waiting at arrivals {figures['engines_busy_mean']:.1f}"
                f"; third party by route/band {figures['third_party_by_route_band']}; "
                f"interactive waited at an engine while "
                f"the other had a free slot {percent(figures['interactive_waited_while_free'])} "
                f"({figures['interactive_waited_while_free_n']} of {figures['interactive']}, "
                f"{figures['interactive_waited']} waited at all)"
            )
        else:
            lines.append(f"{name}: {figures}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=60, help="seconds of arrivals per load")
    parser.add_argument("--runs", type=int, default=1, help="fresh clusters, one after another")
    parser.add_argument(
        "--loads", type=float, nargs="+", default=[0.5, 0.9], help="shares of managed capacity"
    )
    parser.add_argument(
        "--admission-instances",
        type=int,
        default=1,
        help="admission instances: the edge's, and N - 1 `llmgw admission` processes",
    )
    parser.add_argument(
        "--separate",
        action="store_true",
        help="no admission in the edge: every instance a process of its own",
    )
    parser.add_argument(
        "--limits",
        choices=["capacity", "local"],
        default="capacity",
        help="the managed pair's limits: the engines' capacity (G = 24, R = 6; default) or "
        "config/local.yaml's",
    )
    args = parser.parse_args()
    print(f"managed capacity: {managed_capacity():.1f} requests/s", file=sys.stderr)
    runs = []
    with tempfile.TemporaryDirectory(prefix="llmgw-placement-") as tmp:
        for run in range(args.runs):
            result = run_once(
                Path(tmp),
                args.seconds,
                args.loads,
                instances=args.admission_instances,
                limits=args.limits,
                separate=args.separate,
            )
            print(f"run {run + 1}:\n{summary(result)}", file=sys.stderr)
            runs.append(result)
    if args.runs > 1:
        for name in runs[0]:
            if name.startswith("mix_"):
                for key in (
                    "avoidable_new_session",
                    "avoidable_unreserved_new_session",
                    "avoidable_pinned_fallback",
                    "third_party_while_free",
                    "turns_on_replica",
                    "prefix_vs_ideal",
                    "interactive_waited_while_free",
                ):
                    values = [r[name][key] for r in runs]
                    print(f"{name} {key}: median {percent(statistics.median(values))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
