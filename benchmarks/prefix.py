"""Cache-aware placement: prompt tokens served from the engines' prefix caches, and TTFT, for
llmgw against a tenant-partition oracle, round robin and llmgw cache-blind, on the same arrivals.

Engines: four vLLM-like simulated engines run in this process (one event loop in a thread, as
benchmarks/placement.py's farm), each with 4 batch slots (max_num_seqs), an LRU prefix cache of
16-token blocks, and a prefill of 5 ms + 0.25 ms per uncached prompt token (a cold 1,200-token
prompt: ~0.3 s), then 32 output tokens at 5 ms + 0.2 ms per running sequence each. Every
router gets four fresh engines (empty caches) and the same arrivals.

Routers (``--variants``):

- ``oracle``: each tenant (agents: each session tree) sent straight to one engine (t mod 4);
- ``round-robin``: requests sent straight to the engines in turn;
- ``blind``: llmgw with ``prefix.enabled: false`` (placement as before cache-aware placement);
- ``llmgw``: llmgw with the shipped prefix defaults, one admission instance (the edge's);
- ``llmgw-n2``, ``llmgw-n4``: the same with 2 or 4 admission instances (the edge's, and
  ``llmgw admission`` processes joined to its NATS: benchmarks/placement.py's `run_once`);
- ``llmgw-sized``: llmgw with ``prefix.default_kv_tokens`` set to the engines' KV cache (what
  bounds each endpoint's index when the engine's size does not reach admission).

Every llmgw router is `llmgw up` with config/local.yaml's defaults otherwise (flow control and
its bands: every request is gold, an interactive band), a managed-only fleet (no third party),
and limits G = 16 = the engines' slots, R = 4 reserved for pinned sessions, 200 pins, 4 in flight
per session. A variant of engines with KV cache events (``precise``) is one more `Variant` whose
`engine_fields` and `endpoint_fields` turn them on, on both sides.

Workloads (``--phases``), each deterministic from ``--seed``:

- ``main``: 12 tenants, each with its own system prompt of distinct text (1,200 tokens by the
  simulator's tokenizer); 300 sessions of 1-3 turns whose arrivals are a Poisson process over
  30 s (tenants uniform); each turn a ~50-token user message, the conversation resending the
  earlier turns (and the replies as received), 1 s mean (exponential) between a reply and the
  next turn; streamed, so TTFT is measured at the client. Each engine's cache (400 blocks)
  holds about a third of the tenants' prompts (4 x 75 blocks) plus its running requests' own;
- ``agents``: 16 session trees arriving over 20 s, each a main agent of 10-14 turns (a tenant's
  system prompt, ~60-token tool results, 0.5 s mean between turns) that forks 2 sub-agents
  (at two of its turns, each continuing a copy of the parent's conversation so far for 3-5
  turns of its own, alongside the parent); 20% of the trees go idle for 20 s once between two
  turns (the "minutes" of a real agent, scaled to the run). Every agent sends its own
  ``x-session-id``: a sub-agent's first request is a new session, placed by its prompt. Engines
  of 1,024 blocks (about six trees' conversations); the oracle keeps each tree on one engine;
- ``skew``: ``main`` with one tenant sending 50% of the sessions.

Reported per router: prompt tokens served from cache / prompt tokens (the responses'
``usage.prompt_tokens_details.cached_tokens``, and the engines' own prefix-cache counters),
TTFT p50/p90 at the client and at the engine (queue wait included), errors, requests per engine,
the ratios to the oracle; and, sampled every 20 ms, the worst "requests waiting at one engine
while another had a free batch slot" (the largest queue seen at such a moment, the share of
samples with one, and its integral in request-seconds). Figures in docs/benchmarks.md,
"Cache-aware placement".

    python benchmarks/prefix.py [--phases main agents skew] [--variants NAME ...] [--seed 1]
                                [--scale 1.0] [--runs 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.engine_runtime import EngineBackend
from llmgw.services.sim.params import EngineParams
from llmgw.services.sim.tokenizer import token_ids
from llmgw.serving import RunningServer, free_port, start_server

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interference import UpCluster, cluster_ports
from placement import admin_metrics, start_admission, stop_process, until_serving

REPO = Path(__file__).resolve().parents[1]
LOCAL_CONFIG = REPO / "config" / "local.yaml"
MODEL = "llama-3.3-70b"
ENGINES = 4
SLOTS = 4  # each engine's max_num_seqs
BLOCK_SIZE = 16
GPU_BLOCKS = {"main": 400, "skew": 400, "agents": 1024}
ENGINE_TIMING = {  # a cold 1,200-token prompt: 5 ms + 1,200 x 0.25 ms ~ 0.3 s
    "prefill_base": 0.005,
    "prefill_per_token": 0.00025,
    "itl_base": 0.005,
    "itl_per_running_seq": 0.0002,
}
MAX_TOKENS = 32
LIMITS = {
    "max_pinned_sessions": 200,
    "max_global_in_flight_request_slots": ENGINES * SLOTS,  # G = the engines' slots
    "global_in_flight_request_slots_reserved_for_pinned_sessions": 4,
    "max_per_session_in_flight_request_slots": 4,
}
TENANTS = 12
SYSTEM_TOKENS = 1200
USER_TOKENS = 50
TOOL_TOKENS = 60
SESSIONS, SECONDS, TURNS, THINK = 300, 30.0, (1, 3), 1.0
TREES, TREE_SECONDS, AGENT_TURNS, AGENT_THINK = 16, 20.0, (10, 14), 0.5
FORKS, SUB_TURNS, IDLE_SHARE, IDLE = 2, (3, 5), 0.2, 20.0
SKEW = 0.5  # the skewed mix: tenant 0's share of the sessions
SAMPLE_EVERY = 0.02
SLOW_TTFT = 0.15  # seconds: half a cold prefill of a tenant's prompt
SESSION_HEADER = "x-session-id"

# Words of about four bytes per simulator token (3.8 measured), as English text with a real
# tokenizer: the gateway's prefix index sizes each engine's cache at 4 bytes of prompt a token.
_VOCAB = """the of and to in is for with as on by at from that this are be it or an was have not
but all can your will more one about when which their there use each how if we what some these
may other into new time only than its over such after first also most where data system user
model request answer policy account service order value customer report support product change
issue review update record billing invoice contract shipping return refund delivery payment
security access privacy schedule priority ticket agent manager team office region market price
plan level limit status error detail summary context history version release feature option
setting profile document section clause term notice period amount balance credit debit
transfer number address email phone name date total final draft check confirm approve reject
escalate resolve close open pending active""".split()


# ---- the workload ------------------------------------------------------------------------------


def tokens(text: str) -> int:
    return len(token_ids(text))


def words(rng: random.Random, count: int, head: str = "") -> str:
    """`head`, then random words up to about `count` simulator tokens in all."""
    out = [head] if head else []
    have = tokens(head)
    while have < count:
        word = rng.choice(_VOCAB)
        out.append(word)
        have += -(-len(word) // 4)
    return " ".join(out)


def tenant_prompt(seed: int, tenant: int) -> str:
    """Tenant `tenant`'s system prompt: distinct text from its first block on."""
    rng = random.Random(f"{seed}-tenant-{tenant}")
    return words(rng, SYSTEM_TOKENS, f"Tenant {tenant:02d} policy {rng.getrandbits(32):08x}.")


@dataclass
class Conversation:
    """One conversation: its tenant's system prompt, then `users` turns (a sub-agent first
    continues a copy of its parent's conversation so far), `pauses[i]` seconds after the reply
    to turn i - 1 (`pauses[0]`: unused), and the sub-agents it forks after a turn's reply."""

    name: str
    tenant: int
    tree: int
    arrival: float  # seconds from the phase's start (a sub-agent: when its parent forks it)
    users: list[str]
    pauses: list[float]
    forks: dict[int, list[Conversation]] = field(default_factory=dict)
    session_header: bool = False  # send its name as x-session-id
    idles: bool = False


def chat_workload(
    seed: int, sessions: int = SESSIONS, seconds: float = SECONDS, skew: float | None = None
) -> list[Conversation]:
    """`sessions` conversations of TURNS turns, Poisson arrivals over `seconds` (conditioned on
    their number: uniform order statistics), tenants uniform or tenant 0 `skew` of them."""
    rng = random.Random(f"{seed}-chats-{sessions}-{seconds}-{skew}")
    arrivals = sorted(rng.uniform(0, seconds) for _ in range(sessions))
    found = []
    for index, arrival in enumerate(arrivals):
        if skew is not None:
            tenant = 0 if rng.random() < skew else rng.randrange(1, TENANTS)
        else:
            tenant = rng.randrange(TENANTS)
        turns = rng.randint(*TURNS)
        name = f"s{index:03d}"
        found.append(
            Conversation(
                name,
                tenant,
                tenant,
                arrival,
                [words(rng, USER_TOKENS, f"Question {name}.{t}:") for t in range(turns)],
                [0.0] + [rng.expovariate(1 / THINK) for _ in range(turns - 1)],
            )
        )
    return found


def agent_workload(
    seed: int, trees: int = TREES, seconds: float = TREE_SECONDS, idle: float = IDLE
) -> list[Conversation]:
    """`trees` main agents (with their sub-agents), arrivals uniform over `seconds`."""
    rng = random.Random(f"{seed}-agents-{trees}-{seconds}")
    arrivals = sorted(rng.uniform(0, seconds) for _ in range(trees))
    idle_trees = set(rng.sample(range(trees), round(IDLE_SHARE * trees)))
    found = []
    for tree, arrival in enumerate(arrivals):
        name = f"tree{tree:02d}"
        turns = rng.randint(*AGENT_TURNS)
        main = Conversation(
            name,
            tree % TENANTS,
            tree,
            arrival,
            [words(rng, TOOL_TOKENS, f"Tool result {name}.{t}:") for t in range(turns)],
            [0.0] + [rng.expovariate(1 / AGENT_THINK) for _ in range(turns - 1)],
            session_header=True,
        )
        if tree in idle_trees:
            main.pauses[rng.randint(3, turns - 3)] = idle
            main.idles = True
        for number, at in enumerate(sorted(rng.sample(range(1, turns - 2), FORKS))):
            sub = f"{name}/sub{number}"
            count = rng.randint(*SUB_TURNS)
            main.forks.setdefault(at, []).append(
                Conversation(
                    sub,
                    main.tenant,
                    tree,
                    0.0,
                    [words(rng, TOOL_TOKENS, f"Subtask {sub}.{t}:") for t in range(count)],
                    [0.0] + [rng.expovariate(1 / AGENT_THINK) for _ in range(count - 1)],
                    session_header=True,
                )
            )
        found.append(main)
    return found


# ---- the engines -------------------------------------------------------------------------------


def engine_params(index: int, gpu_blocks: int, extra: dict[str, Any] | None = None) -> EngineParams:
    return EngineParams.model_validate(
        {
            **ENGINE_TIMING,
            "max_num_seqs": SLOTS,
            "num_gpu_blocks": gpu_blocks,
            "block_size": BLOCK_SIZE,
            "max_model_len": 16384,
            "seed": index,
            **(extra or {}),
        }
    )


class Farm:
    """Four engines on one event loop in a thread of this process; what they ran, and their
    running and waiting counts sampled every SAMPLE_EVERY seconds."""

    def __init__(self, gpu_blocks: int, extra: Callable[[int], dict[str, Any]] | None = None):
        self.loop = asyncio.new_event_loop()
        self.ids = [f"engine-{i}" for i in range(1, ENGINES + 1)]
        self.params = {
            e: engine_params(i, gpu_blocks, extra(i) if extra else None)
            for i, e in enumerate(self.ids, start=1)
        }
        self.backends: dict[str, EngineBackend] = {}
        self.servers: dict[str, RunningServer] = {}
        self.sequences: list[tuple[str, Any]] = []  # (engine, sequence) while recording
        self.samples: list[tuple[float, tuple[tuple[int, int], ...]]] = []
        self.recording = False
        self._sampler: asyncio.Task[None] | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> dict[str, str]:
        self._thread.start()
        return self._call(self._start())

    def _call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(60)

    async def _start(self) -> dict[str, str]:
        for endpoint in self.ids:
            app = create_engine_app(self.params[endpoint], [MODEL])
            self.backends[endpoint] = app.backend
            self._hook(endpoint, app.backend)
            self.servers[endpoint] = await start_server(app)
        return {endpoint: server.url for endpoint, server in self.servers.items()}

    def _hook(self, endpoint: str, backend: EngineBackend) -> None:
        original = backend.start

        def start(*args: Any, **kwargs: Any) -> Any:
            generation = original(*args, **kwargs)
            if self.recording:
                self.sequences.append((endpoint, generation.seq))
            return generation

        backend.start = start  # type: ignore[method-assign]

    async def _sample(self) -> None:
        while True:
            counts = []
            for backend in self.backends.values():
                state = backend.state()
                counts.append((state["running"], state["waiting"]))
            self.samples.append((time.monotonic(), tuple(counts)))
            await asyncio.sleep(SAMPLE_EVERY)

    def counters(self) -> dict[str, tuple[int, int]]:
        """Each engine's prefix-cache counters: (tokens looked up, tokens found)."""

        async def read() -> dict[str, tuple[int, int]]:
            found = {}
            for endpoint, backend in self.backends.items():
                state = backend.state()
                found[endpoint] = (
                    state["prefix_cache_queries_total"],
                    state["prefix_cache_hits_total"],
                )
            return found

        return dict(self._call(read()))

    def record(self, on: bool) -> None:
        async def switch() -> None:
            self.recording = on
            if on:
                self._sampler = asyncio.create_task(self._sample())
            elif self._sampler is not None:
                self._sampler.cancel()

        self._call(switch())

    def stop(self) -> None:
        async def stop_all() -> None:
            for server in self.servers.values():
                await server.stop(timeout=2)

        self._call(stop_all())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


# ---- routers -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """A router. Direct ones pick an engine per request (`pick`: engine index from the
    conversation and the request's serial number); llmgw ones are `llmgw up` with `prefix`
    (the config's section; `sized`: its ``default_kv_tokens`` the engines' KV cache) and
    `instances` admission instances. `engine_fields(i)` and `endpoint_fields(i)` add to engine
    i's simulator parameters and to its config entry (a precise variant: the engines' KV cache
    events)."""

    name: str
    pick: Callable[[Conversation, int], int] | None = None
    prefix: dict[str, Any] = field(default_factory=dict)
    instances: int = 1
    sized: bool = False
    engine_fields: Callable[[int], dict[str, Any]] | None = None
    endpoint_fields: Callable[[int], dict[str, Any]] | None = None
    tokenizer: str | None = None  # the model's `tokenizer` (precise: "engine", its /tokenize)


def _oracle(conversation: Conversation, serial: int) -> int:
    # Main and skew: the tenant's engine; agents: the tree's (tree = tenant there up to 12).
    return conversation.tree % ENGINES


def _round_robin(conversation: Conversation, serial: int) -> int:
    return serial % ENGINES


_KV_PORTS: dict[int, tuple[int, int]] = {}  # engine index -> its KV events' PUB and replay ports


def _kv_ports(index: int) -> tuple[int, int]:
    """Engine `index`'s KV event sockets (the same for its simulator and its config entry; new
    ports for each engine index the first time they are asked)."""
    if index not in _KV_PORTS:
        _KV_PORTS[index] = (free_port(), free_port())
    return _KV_PORTS[index]


def _engine_kv_events(index: int) -> dict[str, Any]:
    pub, replay = _kv_ports(index)
    return {
        "kv_events_endpoint": f"tcp://127.0.0.1:{pub}",
        "kv_events_replay_endpoint": f"tcp://127.0.0.1:{replay}",
    }


def _endpoint_kv_events(index: int) -> dict[str, Any]:
    pub, replay = _kv_ports(index)
    return {
        "kv_events": {
            "endpoint": f"tcp://127.0.0.1:{pub}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        }
    }


VARIANTS = {
    v.name: v
    for v in (
        Variant("oracle", pick=_oracle),
        Variant("round-robin", pick=_round_robin),
        Variant("blind", prefix={"enabled": False}),
        Variant("llmgw"),
        Variant("llmgw-n2", instances=2),
        Variant("llmgw-n4", instances=4),
        Variant("llmgw-sized", sized=True),
        # The engines' KV cache events (vLLM's format, from the simulator), read by the
        # scraper, matched with the engines' tokens from their /tokenize.
        Variant(
            "llmgw-precise",
            engine_fields=_engine_kv_events,
            endpoint_fields=_endpoint_kv_events,
            tokenizer="engine",
        ),
        Variant(
            "llmgw-precise-n4",
            instances=4,
            engine_fields=_engine_kv_events,
            endpoint_fields=_endpoint_kv_events,
            tokenizer="engine",
        ),
    )
}
DEFAULT_VARIANTS = {
    "main": ["oracle", "round-robin", "blind", "llmgw", "llmgw-n4", "llmgw-precise"],
    "agents": ["oracle", "round-robin", "blind", "llmgw"],
    "skew": ["oracle", "blind", "llmgw"],
}


def gateway_config(
    path: Path, urls: dict[str, str], variant: Variant, nats_port: int, kv_tokens: int
) -> dict[str, Any]:
    """config/local.yaml's defaults on free ports: one managed provider (`iris`) of four
    engines at `urls` (`kv_tokens` of KV cache each), no third party, the limits above,
    `variant`'s prefix section."""
    data = yaml.safe_load(LOCAL_CONFIG.read_text())
    admin, port = cluster_ports()
    data["listen"] = f"127.0.0.1:{port()}"
    data["admin_listen"] = f"127.0.0.1:{admin}"
    data["nats"] = {"url": "embedded", "embedded_port": nats_port}
    data["auth"] = {"mode": "none"}
    data["spend"] = {"currency": "USD"}  # its prices name the third party
    data["models"] = [{"name": MODEL, "routing_profile": "chat", "tokenizer": variant.tokenizer}]
    iris = next(p for p in data["providers"] if p["id"] == "iris")
    iris["models"] = [{"name": MODEL, "features": ["chat"], "limits": dict(LIMITS)}]
    data["providers"] = [iris]
    data["endpoints"] = [
        {
            "id": endpoint,
            "url": url,
            "provider": "iris",
            "models": [MODEL],
            "pool": "local/sim-gpu",
            "capacity": SLOTS,
            **(variant.endpoint_fields(index) if variant.endpoint_fields else {}),
        }
        for index, (endpoint, url) in enumerate(urls.items(), start=1)
    ]
    if variant.prefix:
        data["prefix"] = dict(variant.prefix)
    if variant.sized:
        data.setdefault("prefix", {})["default_kv_tokens"] = kv_tokens
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return data


@contextlib.contextmanager
def gateway(
    workdir: Path, urls: dict[str, str], variant: Variant, kv_tokens: int
) -> Iterator[tuple[str, list]]:
    """`llmgw up` in front of the engines (and `variant.instances` - 1 more admission
    processes); yields its API's base URL and the admission instances' admin addresses."""
    _, port = cluster_ports()
    nats_port = port()
    config = workdir / f"{variant.name}.yaml"
    data = gateway_config(config, urls, variant, nats_port, kv_tokens)
    admins = [data["admin_listen"]]
    extra = []
    cluster = UpCluster(config)
    try:
        api = cluster.api()
        if variant.instances > 1:
            joined = workdir / f"{variant.name}-admission.yaml"
            data["nats"] = {"url": f"nats://127.0.0.1:{nats_port}"}
            joined.write_text(yaml.safe_dump(data, sort_keys=False))
            for _ in range(variant.instances - 1):
                admins.append(f"127.0.0.1:{port()}")
                extra.append(start_admission(joined, admins[-1]))
            asyncio.run(until_serving(f"nats://127.0.0.1:{nats_port}", variant.instances))
        asyncio.run(until_placed(api))
        yield api, admins
    finally:
        for process in extra:
            stop_process(process)
        cluster.stop()


async def until_placed(api: str, timeout: float = 30, model: str = MODEL) -> None:
    """Until a request is served (the scraper reported the engines), then one scrape interval
    more, so every engine's load and KV cache size are known. The probe's prompt is shorter
    than one prefix block: nothing recorded in the index."""
    body = {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    deadline = time.monotonic() + timeout
    async with http_session() as http:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.post(f"{api}/chat/completions", json=body) as response:
                    await response.read()
                    if response.status == 200:
                        await asyncio.sleep(2.5)  # router.scrape_interval (2 s) and a margin
                        return
            await asyncio.sleep(0.2)
    raise RuntimeError("llmgw never served a request")


async def admission_counts(admins: list[str]) -> dict[str, float]:
    """Placements by route and affinity breaks by reason, summed over the instances."""
    totals: dict[str, float] = {}
    wanted = {
        "llmgw_admission_placements_total": "route",
        "llmgw_admission_affinity_breaks_total": "reason",
    }
    for line in await admin_metrics(admins):
        name = line.split("{", 1)[0]
        if name in wanted:
            labels, value = line.rsplit(" ", 1)
            label = labels.split(f'{wanted[name]}="', 1)[1].split('"', 1)[0]
            key = f"{name.split('_')[2]}:{label}"
            totals[key] = totals.get(key, 0.0) + float(value)
    return totals


# ---- the client --------------------------------------------------------------------------------


@dataclass
class Result:
    conversation: str
    tenant: int
    tree: int
    turn: int
    endpoint: str = ""
    status: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None
    route: str = ""
    error: str = ""


def http_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=120)
    )


class Client:
    """Plays a workload against a router: each conversation a task, started at its arrival."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        system: list[str],
        base: str | None = None,
        engines: dict[str, str] | None = None,
        pick: Callable[[Conversation, int], int] | None = None,
    ) -> None:
        self.http = http
        self.system = system
        self.base = base  # llmgw's API
        self.engines = list((engines or {}).items())
        self.pick = pick
        self.serial = itertools.count()
        self.results: list[Result] = []

    async def play(self, workload: Sequence[Conversation]) -> None:
        started = time.monotonic()
        tasks = []
        for conversation in workload:
            await asyncio.sleep(max(0.0, started + conversation.arrival - time.monotonic()))
            tasks.append(asyncio.create_task(self.converse(conversation, None)))
        await asyncio.gather(*tasks)

    async def converse(
        self, conversation: Conversation, history: list[dict[str, str]] | None
    ) -> None:
        messages = (
            list(history)
            if history is not None
            else [{"role": "system", "content": self.system[conversation.tenant]}]
        )
        forks: list[asyncio.Task[None]] = []
        for turn, user in enumerate(conversation.users):
            if turn:
                await asyncio.sleep(conversation.pauses[turn])
            messages.append({"role": "user", "content": user})
            result, reply = await self.send(conversation, turn, messages)
            self.results.append(result)
            if result.status != 200:
                break
            messages.append({"role": "assistant", "content": reply})
            for sub in conversation.forks.get(turn, ()):
                forks.append(asyncio.create_task(self.converse(sub, list(messages))))
        await asyncio.gather(*forks)

    async def send(
        self, conversation: Conversation, turn: int, messages: list[dict[str, str]]
    ) -> tuple[Result, str]:
        result = Result(conversation.name, conversation.tenant, conversation.tree, turn)
        if self.pick is not None:
            result.endpoint, url = self.engines[self.pick(conversation, next(self.serial))]
            base = f"{url}/v1"
        else:
            assert self.base is not None
            base = self.base
        headers = {SESSION_HEADER: conversation.name} if conversation.session_header else {}
        body = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,  # every answer MAX_TOKENS long: the same decode for every router
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        reply: list[str] = []
        sent = time.monotonic()
        try:
            async with self.http.post(
                f"{base}/chat/completions", json=body, headers=headers
            ) as response:
                result.status = response.status
                result.endpoint = response.headers.get("x-llmgw-endpoint", result.endpoint)
                result.route = response.headers.get("x-llmgw-route", "")
                if response.status != 200:
                    result.error = (await response.text())[:200]
                    return result, ""
                done = False
                async for line in response.content:
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    for choice in chunk.get("choices") or ():
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            if result.ttft is None:
                                result.ttft = time.monotonic() - sent
                            reply.append(text)
                    usage = chunk.get("usage")
                    if usage:
                        result.prompt_tokens = usage["prompt_tokens"]
                        details = usage.get("prompt_tokens_details") or {}
                        result.cached_tokens = details.get("cached_tokens") or 0
                if not done:
                    result.status, result.error = -1, "stream ended without [DONE]"
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            result.status, result.error = -1, repr(exc)[:200]
        return result, "".join(reply)


# ---- one router on one workload ----------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (0..1) of `values`, nearest rank; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def stranded(samples: Sequence[tuple[float, tuple[tuple[int, int], ...]]]) -> dict[str, Any]:
    """Requests waiting at an engine while another had a free batch slot (nothing waiting,
    fewer running than its slots), over the samples: the largest such queue, the share of
    samples with one, and its integral (request-seconds); and the largest queue at all."""
    worst = hits = 0
    integral = 0.0
    peak = 0
    for index, (at, counts) in enumerate(samples):
        peak = max([peak, *(waiting for _, waiting in counts)])
        free = [running < SLOTS and waiting == 0 for running, waiting in counts]
        queues = [
            waiting
            for i, (_, waiting) in enumerate(counts)
            if waiting > 0 and any(f for j, f in enumerate(free) if j != i)
        ]
        if queues:
            hits += 1
            worst = max(worst, max(queues))
            step = samples[index + 1][0] - at if index + 1 < len(samples) else SAMPLE_EVERY
            integral += sum(queues) * step
    return {
        "stranded_worst": worst,
        "stranded_share": hits / len(samples) if samples else 0.0,
        "stranded_request_seconds": integral,
        "waiting_peak": peak,
    }


def measure(
    workdir: Path, phase: str, variant: Variant, workload: list[Conversation], seed: int
) -> dict[str, Any]:
    """`variant` on fresh engines, playing `workload`."""
    system = [tenant_prompt(seed, t) for t in range(TENANTS)]
    farm = Farm(GPU_BLOCKS[phase], variant.engine_fields)
    urls = farm.start()
    try:
        with contextlib.ExitStack() as stack:
            admins: list[str] = []
            base = None
            if variant.pick is None:
                kv_tokens = GPU_BLOCKS[phase] * BLOCK_SIZE
                base, admins = stack.enter_context(gateway(workdir, urls, variant, kv_tokens))
            before = farm.counters()
            farm.record(True)
            began = time.monotonic()
            results = asyncio.run(play(workload, system, base, urls, variant.pick))
            seconds = time.monotonic() - began
            farm.record(False)
            after = farm.counters()
            counts = asyncio.run(admission_counts(admins)) if admins else {}
    finally:
        farm.stop()
    return figures(variant, results, farm, before, after, seconds, counts)


async def play(
    workload: list[Conversation],
    system: list[str],
    base: str | None,
    urls: dict[str, str],
    pick: Callable[[Conversation, int], int] | None,
) -> list[Result]:
    async with http_session() as http:
        client = Client(http, system, base, urls, pick)
        await client.play(workload)
        return client.results


def figures(
    variant: Variant,
    results: list[Result],
    farm: Farm,
    before: dict[str, tuple[int, int]],
    after: dict[str, tuple[int, int]],
    seconds: float,
    counts: dict[str, float],
) -> dict[str, Any]:
    done = [r for r in results if r.status == 200]
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    looked = sum(after[e][0] - before[e][0] for e in after)
    found = sum(after[e][1] - before[e][1] for e in after)
    ttfts = [r.ttft for r in done if r.ttft is not None]
    engine_ttfts = [seq.ttft for _, seq in farm.sequences if seq.ttft is not None]
    per_engine = {e: sum(1 for r in done if r.endpoint == e) for e in farm.ids}
    errors = [r for r in results if r.status != 200]
    return {
        "variant": variant.name,
        "requests": len(results),
        "errors": len(errors),
        "error_samples": sorted({f"{r.status} {r.error}" for r in errors})[:3],
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit": cached / prompt if prompt else 0.0,
        "engine_hit": found / looked if looked else 0.0,
        "ttft_p50": pct(ttfts, 0.5),
        "ttft_p90": pct(ttfts, 0.9),
        "ttft_p99": pct(ttfts, 0.99),
        # Requests whose first token took as long as a cold prefill of a tenant's prompt (~0.3 s)
        # at least half of: the share a p90 turns on, read without a p90's cliff.
        "slow_share": sum(t > SLOW_TTFT for t in ttfts) / len(ttfts) if ttfts else 0.0,
        "engine_ttft_p50": pct(engine_ttfts, 0.5),
        "engine_ttft_p90": pct(engine_ttfts, 0.9),
        "per_engine": per_engine,
        "seconds": seconds,
        "admission": counts,
        **stranded(farm.samples),
    }


def run_phase(
    workdir: Path,
    phase: str,
    variants: Sequence[str],
    seed: int = 1,
    scale: float = 1.0,
    report: Callable[[str], None] = lambda line: None,
) -> list[dict[str, Any]]:
    """Every variant on `phase`'s workload (`scale` shrinks or stretches its arrivals: count
    and duration alike, the rate unchanged; below 1 the agents' idle gaps shrink alike), one
    after another."""
    if phase == "agents":
        trees = max(4, round(TREES * scale))
        workload = agent_workload(seed, trees, TREE_SECONDS * scale, IDLE * min(1.0, scale))
    else:
        skew = SKEW if phase == "skew" else None
        workload = chat_workload(seed, round(SESSIONS * scale), SECONDS * scale, skew)
    rows = []
    for name in variants:
        began = time.monotonic()
        row = measure(workdir, phase, VARIANTS[name], workload, seed)
        row["wall_seconds"] = time.monotonic() - began
        report(f"{phase} {name}: {json.dumps(row)}")
        rows.append(row)
    return rows


# ---- the report --------------------------------------------------------------------------------


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}x"


def table(phase: str, rows: list[dict[str, Any]]) -> str:
    oracle = next((r for r in rows if r["variant"] == "oracle"), None)
    lines = [
        f"{phase}:",
        "| router | requests (errors) | prompt tokens from cache | engines' counters | vs oracle "
        "| TTFT p50 / p90 (ms) | p90 vs oracle | engine TTFT p50 / p90 (ms) | requests per engine "
        "| waiting while another engine had a free slot: worst, share of samples |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['requests']} ({r['errors']}) | {r['hit'] * 100:.1f}% "
            f"| {r['engine_hit'] * 100:.1f}% "
            f"| {ratio(r['hit'], oracle['hit'] if oracle else None)} "
            f"| {ms(r['ttft_p50'])} / {ms(r['ttft_p90'])} "
            f"| {ratio(r['ttft_p90'], oracle['ttft_p90'] if oracle else None)} "
            f"| {ms(r['engine_ttft_p50'])} / {ms(r['engine_ttft_p90'])} "
            f"| {'/'.join(str(n) for n in r['per_engine'].values())} "
            f"| {r['stranded_worst']}, {r['stranded_share'] * 100:.1f}% |"
        )
    for r in rows:
        if r["admission"]:
            lines.append(f"{r['variant']} admission: {r['admission']}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--phases", nargs="+", choices=list(DEFAULT_VARIANTS), default=list(DEFAULT_VARIANTS)
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        help="the routers of every phase (default: each phase's own list)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--scale", type=float, default=1.0, help="the workloads' length (the rate unchanged)"
    )
    parser.add_argument(
        "--runs", type=int, default=1, help="every phase again, on the same arrivals (medians)"
    )
    parser.add_argument("--json", type=Path, help="write every figure there")
    args = parser.parse_args()
    found: dict[str, list[list[dict[str, Any]]]] = {}
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llmgw-prefix-") as tmp:
        for run in range(args.runs):
            for phase in args.phases:
                rows = run_phase(
                    Path(tmp),
                    phase,
                    args.variants or DEFAULT_VARIANTS[phase],
                    args.seed,
                    args.scale,
                    report=lambda line: print(line, file=sys.stderr, flush=True),
                )
                found.setdefault(phase, []).append(rows)
                print(f"run {run + 1}, {table(phase, rows)}", flush=True)
    if args.runs > 1:
        for phase, runs in found.items():
            print(medians(phase, runs))
    print(f"wall time {time.monotonic() - began:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(found, indent=1))
    return 0


def medians(phase: str, runs: list[list[dict[str, Any]]]) -> str:
    """Per router: the median of each run's figures, and every run's, in run order."""
    lines = [
        f"{phase}, {len(runs)} runs, median (each run):",
        "| router | prompt tokens from cache | vs oracle | TTFT p50 (ms) | TTFT p90 (ms) "
        "| p90 vs oracle |",
        "|---|---|---|---|---|---|",
    ]
    by_variant: dict[str, list[dict[str, Any]]] = {}
    for rows in runs:
        oracle = next((r for r in rows if r["variant"] == "oracle"), None)
        for r in rows:
            by_variant.setdefault(r["variant"], []).append(
                {
                    **r,
                    "hit_ratio": r["hit"] / oracle["hit"] if oracle else None,
                    "p90_ratio": r["ttft_p90"] / oracle["ttft_p90"] if oracle else None,
                }
            )

    def cell(rows: list[dict[str, Any]], key: str, form: Callable[[float], str]) -> str:
        values = [r[key] for r in rows if r[key] is not None]
        if not values:
            return "-"
        return f"{form(statistics.median(values))} ({', '.join(form(v) for v in values)})"

    for name, rows in by_variant.items():
        lines.append(
            f"| {name} | {cell(rows, 'hit', lambda v: f'{v * 100:.1f}%')} "
            f"| {cell(rows, 'hit_ratio', lambda v: f'{v:.2f}x')} "
            f"| {cell(rows, 'ttft_p50', lambda v: f'{v * 1000:.0f}')} "
            f"| {cell(rows, 'ttft_p90', lambda v: f'{v * 1000:.0f}')} "
            f"| {cell(rows, 'p90_ratio', lambda v: f'{v:.2f}x')} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
