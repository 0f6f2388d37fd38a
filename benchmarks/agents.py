"""Agents through the gateway: long sessions over Messages and Responses (the official SDKs),
sub-agents forking from their parent's prefix, tool-call turns, idle gaps, prompts near the
context window.

Engines: four vLLM-like simulated engines in this process (benchmarks/prefix.py's farm and
timing: 4 batch slots, an LRU prefix cache of 16-token blocks, a cold 1,200-token prefill ~0.3
s). Three serve ``agent-8k`` with an 8,192-token window; the fourth serves ``agent-32k`` (32,768
tokens), which ``agent-8k`` names as its fallback. The gateway is `llmgw up` with
config/local.yaml's defaults (flow control, pins, cache-aware placement), a managed-only fleet,
limits G = the model's batch slots.

Workload (deterministic from ``--seed``): ``--agents`` main agents arriving over 20 s, half of
them Claude-Code-like (Messages, the whole conversation resent every turn, its tools declared
and a ``cache_control`` system prompt, the session in ``x-claude-code-session-id``), half
Codex-like (Responses, each turn chained by ``previous_response_id``, the session in Codex's
``session-id`` and ``thread-id`` headers). Each runs 10-40 turns (0.5 s mean think time; half the turns a tool
call and its result) and forks one or two sub-agents (5-10 turns, continuing a copy of its
conversation: Messages resend it, Responses chain from the parent's last response; each
sub-agent its own agent or thread id and its parent's, as Claude Code and Codex send them). 20% of the main agents go idle
once for ``--idle`` seconds (30; real agents: minutes). One agent of each API pastes a 2,500-
token document at three turns, growing past the 8k window: those turns need the fallback.

Every turn's last text carries a unique marker, so each request is matched to what the engine
did with it. Reported, per API (and for sub-agents' first turns): **added latency per turn**
(the client's time for the call minus the engine's, from its arrival to its last token; not
streamed), **cache hits per turn** (prompt tokens the engine served from its prefix cache, and
what the API's usage reported), **sessions kept on their replica** (turns served by the endpoint
that served the session's previous turn; sub-agents' first turns on their parent's), and
**context-window outcomes** of the turns whose prompt (the engine's count, or the gateway's
answer) exceeded 8k.

    python benchmarks/agents.py [--agents 12] [--idle 30] [--seed 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interference import UpCluster, cluster_ports
from prefix import ENGINE_TIMING, LOCAL_CONFIG, Farm, until_placed, words

from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.services.sim.tokenizer import token_ids
from llmgw.serving import start_server

MODEL, LONG_MODEL = "agent-8k", "agent-32k"
WINDOW, LONG_WINDOW = 8192, 32768
SLOTS, GPU_BLOCKS, BLOCK_SIZE = 4, 2048, 16
MAX_TOKENS = 32
SYSTEM_TOKENS, USER_TOKENS, TOOL_TOKENS, DOCUMENT_TOKENS = 1200, 50, 120, 2500
TURNS, SUB_TURNS, THINK, IDLE_SHARE = (10, 40), (5, 10), 0.5, 0.2
SECONDS = 20.0
CONTROL_CALLS = 42  # sequential turns of each API, direct and through the gateway
# The session headers the agent clients send (docs/config.md, "Session headers"): a session id
# shared by the main agent and its sub-agents, each sub-agent's own id and its parent's.
CLAUDE = ("x-claude-code-session-id", "x-claude-code-agent-id", "x-claude-code-parent-agent-id")
CODEX = ("session-id", "thread-id", "x-codex-parent-thread-id")
TOOLS_MESSAGES = [
    {
        "name": "read_file",
        "description": "Read a file of the repository.",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
]
TOOLS_RESPONSES = [
    {
        "type": "function",
        "name": "read_file",
        "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
]


# ---- the workload ------------------------------------------------------------------------------


@dataclass
class Agent:
    """One agent's session: `turns` turns (`tool[i]`: turn i is a tool result), `pauses[i]`
    seconds before turn i, `documents`: turns that paste a long document, `forks[i]`: the
    sub-agents started after turn i's reply."""

    name: str
    api: str  # "messages" or "responses"
    arrival: float
    texts: list[str]
    tool: list[bool]
    pauses: list[float]
    documents: set[int] = field(default_factory=set)
    forks: dict[int, list[Agent]] = field(default_factory=dict)
    parent: str | None = None  # a sub-agent: its parent's id
    session: str = field(default_factory=lambda: str(uuid.uuid4()))  # its own id
    root: str = ""  # the session id of its family (its main agent's id)


def workload(seed: int, agents: int, idle: float) -> list[Agent]:
    rng = random.Random(f"{seed}-agents-{agents}")
    arrivals = sorted(rng.uniform(0, SECONDS) for _ in range(agents))
    idle_ones = set(rng.sample(range(agents), round(IDLE_SHARE * agents)))
    found = []
    for index, arrival in enumerate(arrivals):
        api = "messages" if index % 2 == 0 else "responses"
        main = _agent(rng, f"a{index:02d}", api, arrival, rng.randint(*TURNS))
        session = main.session = main.root = str(uuid.UUID(int=rng.getrandbits(128)))
        if index in idle_ones:
            main.pauses[rng.randint(3, len(main.texts) - 3)] = idle
        if index < 2:  # one agent of each API grows past the window
            main.documents = set(rng.sample(range(2, len(main.texts)), 3))
        for number, at in enumerate(
            sorted(rng.sample(range(1, len(main.texts) - 1), rng.randint(1, 2)))
        ):
            sub = _agent(rng, f"{main.name}/sub{number}", api, 0.0, rng.randint(*SUB_TURNS))
            sub.session = str(uuid.UUID(int=rng.getrandbits(128)))
            sub.parent, sub.root = session, session
            main.forks.setdefault(at, []).append(sub)
        found.append(main)
    return found


def _agent(rng: random.Random, name: str, api: str, arrival: float, turns: int) -> Agent:
    tool = [t > 0 and rng.random() < 0.5 for t in range(turns)]
    texts = [
        words(rng, TOOL_TOKENS if tool[t] else USER_TOKENS, f"{name} turn {t}:")
        for t in range(turns)
    ]
    pauses = [0.0] + [rng.expovariate(1 / THINK) for _ in range(turns - 1)]
    return Agent(name, api, arrival, texts, tool, pauses)


def system_prompt(seed: int) -> str:
    return words(random.Random(f"{seed}-system"), SYSTEM_TOKENS, "You are a coding agent.")


def document(rng: random.Random) -> str:
    return words(rng, DOCUMENT_TOKENS, "Document:")


# ---- the engines -------------------------------------------------------------------------------


class AgentFarm(Farm):
    """Three engines of MODEL (WINDOW) and one of LONG_MODEL (LONG_WINDOW); each request is
    matched to its sequence by the marker at its prompt's end."""

    def __init__(self) -> None:
        super().__init__(GPU_BLOCKS)
        self.served = {e: MODEL for e in self.ids[:3]} | {self.ids[3]: LONG_MODEL}
        for endpoint, model in self.served.items():
            window = LONG_WINDOW if model == LONG_MODEL else WINDOW
            self.params[endpoint] = EngineParams.model_validate(
                {
                    **ENGINE_TIMING,
                    "max_num_seqs": SLOTS,
                    "num_gpu_blocks": GPU_BLOCKS,
                    "block_size": BLOCK_SIZE,
                    "max_model_len": window,
                    "seed": self.ids.index(endpoint),
                }
            )
        self.markers: dict[tuple[int, int], tuple[str, Any]] = {}
        self.wanted: set[tuple[int, int]] = set()  # markers of the requests sent so far
        self.times: dict[str, tuple[float, float]] = {}  # marker -> the engine's HTTP exchange

    async def _start(self) -> dict[str, str]:
        for endpoint in self.ids:
            app = create_engine_app(self.params[endpoint], [self.served[endpoint]])
            self.backends[endpoint] = app.backend
            self._hook(endpoint, app.backend)
            self.servers[endpoint] = await start_server(Timed(app, self.times))
        return {endpoint: server.url for endpoint, server in self.servers.items()}

    def _hook(self, endpoint: str, backend: Any) -> None:
        original = backend.start

        def start(prompt: Any, *args: Any, **kwargs: Any) -> Any:
            generation = original(prompt, *args, **kwargs)
            tail = list(prompt[-64:])
            for i in range(len(tail) - 1):
                key = (tail[i], tail[i + 1])
                if key in self.wanted:
                    self.markers[key] = (endpoint, generation.seq)
            return generation

        backend.start = start


class Timed:
    """An engine app's ASGI wrapper: for each request whose body ends with a marker (`ref
    <8 letters>`), when its first body byte arrived and its last response byte left."""

    def __init__(self, app: Any, times: dict[str, tuple[float, float]]) -> None:
        self.app, self.times = app, times
        self.backend = app.backend

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        began: float | None = None
        body = bytearray()

        async def receiving() -> Any:
            nonlocal began
            message = await receive()
            if began is None:
                began = time.monotonic()
            body.extend(message.get("body", b""))
            return message

        async def sending(message: Any) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                found = MARKER.findall(bytes(body))
                if found and began is not None:
                    self.times[found[-1].decode()] = (began, time.monotonic())

        await self.app(scope, receiving, sending)


MARKER = re.compile(rb"ref ([b-z]{8})")


def new_marker(rng: random.Random) -> tuple[str, tuple[int, int]]:
    """A word of 8 letters: two stand-in tokens, its key in the engines' prompts."""
    text = "".join(rng.choice("bcdfghjklmnpqrstvwxz") for _ in range(8))
    ids = token_ids(" " + text)
    return text, (ids[-2], ids[-1])


# ---- the clients -------------------------------------------------------------------------------


@dataclass
class Turn:
    agent: str
    api: str
    turn: int
    sub: bool
    first: bool
    marker: tuple[int, int]
    marker_text: str = ""
    status: int = 0
    code: str = ""
    message: str = ""
    endpoint: str = ""
    session: str = ""
    fallback_from: str = ""
    seconds: float = 0.0
    usage_prompt: int = 0
    usage_cached: int = 0
    document: bool = False


class Player:
    def __init__(self, api_base: str, farm: AgentFarm, seed: int) -> None:
        import anthropic
        import openai

        root = api_base.removesuffix("/v1")
        self.anthropic = anthropic.AsyncAnthropic(base_url=root, api_key="none", max_retries=0)
        self.openai = openai.AsyncOpenAI(base_url=api_base, api_key="none", max_retries=0)
        self.farm = farm
        self.rng = random.Random(f"{seed}-markers")
        self.system = system_prompt(seed)
        self.turns: list[Turn] = []
        self.last_endpoint: dict[str, str] = {}

    async def play(self, agents: list[Agent]) -> None:
        started = time.monotonic()
        tasks = []
        for agent in agents:
            await asyncio.sleep(max(0.0, started + agent.arrival - time.monotonic()))
            tasks.append(asyncio.create_task(self.run(agent, [], None)))
        await asyncio.gather(*tasks)

    async def run(self, agent: Agent, history: list[Any], previous: str | None) -> None:
        messages = list(history)
        forks = []
        doc_rng = random.Random(agent.name)
        for turn, text in enumerate(agent.texts):
            if turn:
                await asyncio.sleep(agent.pauses[turn])
            marker_text, key = new_marker(self.rng)
            self.farm.wanted.add(key)
            body = text + (("\n" + document(doc_rng)) if turn in agent.documents else "")
            body += f" ref {marker_text}"
            record = Turn(
                agent.name,
                agent.api,
                turn,
                agent.parent is not None,
                turn == 0,
                key,
                marker_text,
                document=turn in agent.documents,
            )
            session, own, parent = CLAUDE if agent.api == "messages" else CODEX
            headers = {session: agent.root}
            if agent.api == "responses":
                headers[own] = agent.session  # Codex: a root thread's id is its session's
            if agent.parent is not None:
                headers[own] = agent.session
                headers[parent] = agent.parent
            began = time.monotonic()
            if agent.api == "messages":
                reply = await self.messages_turn(agent, turn, messages, body, headers, record)
            else:
                reply = await self.responses_turn(agent, turn, previous, body, headers, record)
            record.seconds = time.monotonic() - began
            self.turns.append(record)
            if reply is None:
                break
            if agent.api == "responses":
                previous = reply
            for sub in agent.forks.get(turn, ()):
                forks.append(asyncio.create_task(self.run(sub, list(messages), previous)))
        await asyncio.gather(*forks)

    async def messages_turn(
        self,
        agent: Agent,
        turn: int,
        messages: list[Any],
        body: str,
        headers: dict[str, str],
        record: Turn,
    ) -> str | None:
        import anthropic

        if agent.tool[turn]:
            call = f"toolu_{agent.name.replace('/', '_')}_{turn}"
            messages.append(
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "tool_use",
                            "id": call,
                            "name": "read_file",
                            "input": {"path": "a"},
                        }
                    ],
                }
            )
            messages.append(
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": call, "content": body}],
                }
            )
        else:
            messages.append({"role": "user", "content": body})
        try:
            raw = await self.anthropic.messages.with_raw_response.create(
                model=MODEL,
                max_tokens=MAX_TOKENS,
                system=[
                    {"type": "text", "text": self.system, "cache_control": {"type": "ephemeral"}}
                ],
                tools=TOOLS_MESSAGES,  # type: ignore[arg-type]
                messages=messages,
                extra_headers=headers,
            )
        except anthropic.APIStatusError as exc:
            record.status = exc.status_code
            record.code = _code(exc.body)
            record.message = str(exc.message)[:160]
            return None
        self._headers(record, raw.headers)
        message = await raw.parse()
        record.status = 200
        usage = message.usage
        cached = usage.cache_read_input_tokens or 0
        record.usage_prompt = usage.input_tokens + cached + (usage.cache_creation_input_tokens or 0)
        record.usage_cached = cached
        reply = "".join(b.text for b in message.content if b.type == "text")
        messages.append({"role": "assistant", "content": reply or "ok"})
        return message.id

    async def responses_turn(
        self,
        agent: Agent,
        turn: int,
        previous: str | None,
        body: str,
        headers: dict[str, str],
        record: Turn,
    ) -> str | None:
        import openai

        items: list[Any]
        if agent.tool[turn] and previous is not None:
            call = f"call_{agent.name.replace('/', '_')}_{turn}"
            items = [
                {
                    "type": "function_call",
                    "call_id": call,
                    "name": "read_file",
                    "arguments": '{"path": "a"}',
                },
                {"type": "function_call_output", "call_id": call, "output": body},
            ]
        else:
            items = [{"role": "user", "content": body}]
        try:
            raw = await self.openai.responses.with_raw_response.create(
                model=MODEL,
                instructions=self.system,
                input=items,
                previous_response_id=previous,
                tools=TOOLS_RESPONSES,  # type: ignore[arg-type]
                max_output_tokens=MAX_TOKENS,
                store=True,
                extra_headers=headers,
            )
        except openai.APIStatusError as exc:
            record.status = exc.status_code
            record.code = _code(exc.body)
            record.message = str(exc.message)[:160]
            return None
        self._headers(record, raw.headers)
        response = raw.parse()
        record.status = 200
        if response.usage is not None:
            record.usage_prompt = response.usage.input_tokens
            details = response.usage.input_tokens_details
            record.usage_cached = (details.cached_tokens or 0) if details else 0
        return response.id

    def _headers(self, record: Turn, headers: Any) -> None:
        record.endpoint = headers.get("x-llmgw-endpoint", "")
        record.session = headers.get("x-llmgw-session", "")
        record.fallback_from = headers.get("x-llmgw-fallback-from", "")


def _code(body: Any) -> str:
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict):
            return str(error.get("code") or error.get("type") or "")
        if "code" in body or "type" in body:  # the SDK's body is the error object itself
            return str(body.get("code") or body.get("type") or "")
    return ""


# ---- one run -----------------------------------------------------------------------------------


def gateway_config(
    path: Path, urls: dict[str, str], served: dict[str, str], tokenizer: str | None
) -> None:
    data = yaml.safe_load(LOCAL_CONFIG.read_text())
    admin, port = cluster_ports()
    data["listen"] = f"127.0.0.1:{port()}"
    data["admin_listen"] = f"127.0.0.1:{admin}"
    data["nats"] = {"url": "embedded", "embedded_port": port()}
    data["auth"] = {"mode": "none"}
    data["spend"] = {"currency": "USD"}
    data["models"] = [
        {
            "name": MODEL,
            "routing_profile": "chat",
            "fallbacks": [LONG_MODEL],
            "tokenizer": tokenizer,
        },
        {"name": LONG_MODEL, "routing_profile": "chat", "tokenizer": tokenizer},
    ]
    iris = next(p for p in data["providers"] if p["id"] == "iris")

    def limits(engines: int) -> dict[str, int]:
        return {
            "max_pinned_sessions": 200,
            "max_global_in_flight_request_slots": engines * SLOTS,
            "global_in_flight_request_slots_reserved_for_pinned_sessions": engines,
            "max_per_session_in_flight_request_slots": 4,
        }

    iris["models"] = [
        {"name": MODEL, "features": ["chat"], "limits": limits(3)},
        {"name": LONG_MODEL, "features": ["chat"], "limits": limits(1)},
    ]
    data["providers"] = [iris]
    data["endpoints"] = [
        {
            "id": endpoint,
            "url": url,
            "provider": "iris",
            "models": [served[endpoint]],
            "pool": "local/sim-gpu",
            "capacity": SLOTS,
        }
        for endpoint, url in urls.items()
    ]
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def run(
    workdir: Path, seed: int, agents: int, idle: float, tokenizer: str | None = None
) -> dict[str, Any]:
    farm = AgentFarm()
    urls = farm.start()
    try:
        config = workdir / "agents.yaml"
        gateway_config(config, urls, farm.served, tokenizer)
        cluster = UpCluster(config)
        try:
            api = cluster.api()
            asyncio.run(until_placed(api, model=MODEL))
            began = time.monotonic()
            player = asyncio.run(_play(api, farm, seed, workload(seed, agents, idle)))
            seconds = time.monotonic() - began
            calibration = asyncio.run(control(api, urls[farm.ids[0]], farm, seed, CONTROL_CALLS))
        finally:
            cluster.stop()
    finally:
        farm.stop()
    rows = report(player, farm, seconds)
    rows["sequential"] = calibration
    return rows


async def _play(api: str, farm: AgentFarm, seed: int, agents: list[Agent]) -> Player:
    player = Player(api, farm, seed)
    await player.play(agents)
    return player


async def control(api: str, engine: str, farm: AgentFarm, seed: int, calls: int) -> dict[str, Any]:
    """`calls` sequential turns of each API straight to `engine` and through the gateway, in
    alternation (one session each, a 2,000-token conversation and a new question per turn;
    Responses unchained: the engine stores nothing): each one's time minus the engine's HTTP
    exchange, so what the SDK and the loopback cost is in both and cancels in their difference."""
    import anthropic
    import openai

    rng = random.Random(f"{seed}-control")
    history = words(rng, 2000, "Earlier:")
    system = system_prompt(seed)
    clients = {
        "direct": (
            anthropic.AsyncAnthropic(base_url=engine, api_key="none", max_retries=0),
            openai.AsyncOpenAI(base_url=f"{engine}/v1", api_key="none", max_retries=0),
        ),
        "gateway": (
            anthropic.AsyncAnthropic(base_url=api.removesuffix("/v1"), api_key="none"),
            openai.AsyncOpenAI(base_url=api, api_key="none"),
        ),
    }
    spent: dict[str, list[float]] = {}
    for index in range(calls):
        for path in ("direct", "gateway") if index % 2 == 0 else ("gateway", "direct"):
            messages, responses = clients[path]
            for name in ("messages", "responses"):
                marker, _ = new_marker(rng)
                text = f"{history} Question {index}: {words(rng, 40)} ref {marker}"
                headers = {CLAUDE[0]: f"control-{name}"}
                began = time.monotonic()
                if name == "messages":
                    await messages.messages.create(
                        model=MODEL,
                        max_tokens=MAX_TOKENS,
                        system=system,
                        messages=[{"role": "user", "content": text}],
                        extra_headers=headers,
                    )
                else:
                    await responses.responses.create(
                        model=MODEL,
                        instructions=system,
                        input=text,
                        max_output_tokens=MAX_TOKENS,
                        store=False,
                        extra_headers=headers,
                    )
                took = time.monotonic() - began
                exchange = farm.times.get(marker)
                if exchange is not None and index >= 2:  # the first two warm up
                    spent.setdefault(f"{name} {path}", []).append(
                        took - (exchange[1] - exchange[0])
                    )
    found: dict[str, Any] = {}
    for name in ("messages", "responses"):
        direct = statistics.median(spent[f"{name} direct"])
        gateway = statistics.median(spent[f"{name} gateway"])
        found[name] = {
            "direct_ms": round(direct * 1000, 2),
            "gateway_ms": round(gateway * 1000, 2),
            "added_p50_ms": round((gateway - direct) * 1000, 2),
            "calls": len(spent[f"{name} gateway"]),
        }
    return found


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(player: Player, farm: AgentFarm, seconds: float) -> dict[str, Any]:
    rows: dict[str, Any] = {"seconds": seconds}
    for api in ("messages", "responses"):
        turns = [t for t in player.turns if t.api == api]
        served = [t for t in turns if t.status == 200 and t.marker in farm.markers]
        added, prompt, cached, usage_cached = [], 0, 0, 0
        for t in served:
            _, seq = farm.markers[t.marker]
            exchange = farm.times.get(t.marker_text)
            if exchange is not None:
                added.append(t.seconds - (exchange[1] - exchange[0]))
            prompt += seq.prompt_tokens
            cached += seq.cached_tokens
            usage_cached += t.usage_cached
        firsts = [t for t in served if t.sub and t.first]
        first_cached = sum(farm.markers[t.marker][1].cached_tokens for t in firsts)
        first_prompt = sum(farm.markers[t.marker][1].prompt_tokens for t in firsts)
        kept = moved = 0
        last: dict[str, str] = {}
        parent_of: dict[str, str] = {}
        for t in sorted(turns, key=lambda t: (t.agent, t.turn)):
            if t.status != 200 or t.fallback_from:
                continue
            endpoint = farm.markers[t.marker][0] if t.marker in farm.markers else t.endpoint
            if t.agent in last:
                kept += last[t.agent] == endpoint
                moved += last[t.agent] != endpoint
            last[t.agent] = endpoint
            parent_of.setdefault(t.agent, endpoint)
        near_parent = sum(
            1
            for t in firsts
            if farm.markers[t.marker][0] == parent_of.get(t.agent.split("/sub")[0])
        )
        big = [t for t in turns if t.document or _too_long(t, farm)]
        outcomes: dict[str, int] = {}
        for t in big:
            if t.status == 200:
                key = f"served by {(t.fallback_from and LONG_MODEL) or 'its model'}"
            else:
                key = f"{t.status} {t.code}"
            outcomes[key] = outcomes.get(key, 0) + 1
        errors: dict[str, int] = {}
        samples: set[str] = set()
        for t in turns:
            if t.status != 200:
                key = f"{t.status} {t.code}"
                errors[key] = errors.get(key, 0) + 1
                samples.add(f"{key}: {t.message}")
        rows[api] = {
            "turns": len(turns),
            "served": len(served),
            "errors": errors,
            "added_p50_ms": _ms(_pct(added, 0.5)),
            "added_p90_ms": _ms(_pct(added, 0.9)),
            "engine_cache_hit": cached / prompt if prompt else None,
            "usage_cached_over_engine": usage_cached / cached if cached else None,
            "sub_first_turns": len(firsts),
            "sub_first_cache_hit": first_cached / first_prompt if first_prompt else None,
            "sub_first_on_parent_endpoint": near_parent,
            "turns_on_previous_endpoint": kept / (kept + moved) if kept + moved else None,
            "sessions_seen": len({t.session for t in turns if t.session}),
            "agents": len({t.agent for t in turns}),
            "long_prompt_outcomes": outcomes,
            "error_samples": sorted(samples)[:4],
        }
    return rows


def _too_long(t: Turn, farm: AgentFarm) -> bool:
    if t.marker in farm.markers:
        return bool(farm.markers[t.marker][1].prompt_tokens > WINDOW)
    return t.code == "context_length_exceeded"


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=12)
    parser.add_argument("--idle", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--tokenizer",
        choices=["engine"],
        help="models[].tokenizer (exact prompt tokens from the engines' /tokenize); default none",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(Path(tmp), args.seed, args.agents, args.idle, args.tokenizer)
    print(json.dumps(rows, indent=2))
    for api in ("messages", "responses"):
        row = rows[api]
        print(
            f"{api}: {row['served']}/{row['turns']} turns served; added p50/p90"
            f" {row['added_p50_ms']} / {row['added_p90_ms']} ms; engine cache hit"
            f" {_share(row['engine_cache_hit'])}; sub-agents' first turns {_share(row['sub_first_cache_hit'])}"
            f" ({row['sub_first_on_parent_endpoint']}/{row['sub_first_turns']} on the parent's"
            f" engine); turns on the previous turn's engine {_share(row['turns_on_previous_endpoint'])};"
            f" long prompts {row['long_prompt_outcomes']}; errors {row['errors']}"
        )
    for api, row in rows["sequential"].items():
        print(
            f"{api}, sequential: per turn minus the engine's exchange, direct {row['direct_ms']}"
            f" ms, through the gateway {row['gateway_ms']} ms: added {row['added_p50_ms']} ms (p50)"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


if __name__ == "__main__":
    raise SystemExit(main())
