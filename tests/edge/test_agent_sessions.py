"""Agent clients' session headers through the real edge -> admission (NATS) -> simulated engines,
with the shipped `router.session_headers` and `pinning.parent_weight`.

A Claude Code conversation whose opening changes is one session and one pin; a Codex Responses
request is counted in its session and thread; the session header still comes first; `[]` turns
the agent headers off; a sub-agent starts on its parent's engine while that has room, elsewhere
when it has none, and its pin records its parent. Every answer names its session in
`x-llmgw-session`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import nats
import pytest
from anthropic import AsyncAnthropic
from inproc import Cluster, before_any_lease, start_admission, start_edge, stop_servers
from openai import AsyncOpenAI

from llmgw.core.requests import Feature
from llmgw.core.sessions import key_session, session_id
from llmgw.core.shards import shard_of
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import start_server

CLAUDE = "x-claude-code-session-id"
AGENT = "x-claude-code-agent-id"
SESSION = "x-llmgw-session"


@pytest.fixture
def engine_params() -> EngineParams:
    # 20 ms a token: a stream of 100 tokens holds its batch slot for about two seconds.
    return EngineParams.zero_delay(itl_base="20ms")


def message(opening: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m1", "max_tokens": 3, "system": opening, **extra}


def chat(opening: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "m1",
        "max_tokens": 3,
        "messages": [{"role": "system", "content": opening}, {"role": "user", "content": "go"}],
        **extra,
    }


@contextlib.asynccontextmanager
async def gateway_of(
    make_gateway_config: Any, nats_url: str, unique_id: str, **overrides: Any
) -> AsyncIterator[Any]:
    """`gateway_config`'s gateway (edge, one admission instance, engines) with `overrides` of
    its sections, given the engine URLs: `overrides(urls)`."""
    engines = {}
    for seed, name in enumerate(("engine-1", "engine-2", "tensorx-1")):
        params = EngineParams.zero_delay(itl_base="20ms", seed=seed)
        engines[name] = await start_server(create_engine_app(params, ["m1", "m2"]))
    urls = {k: v.url for k, v in engines.items()}
    sections = {k: v(urls) if callable(v) else v for k, v in overrides.items()}
    config = make_gateway_config(nats_url, urls, f"routing_{unique_id}", **sections)
    with before_any_lease(config):
        admission = await start_admission(config, nats_url, instance="adm-a", follow_load=False)
    edge = await start_edge(config, nats_url, edge_id="edge-a")
    try:
        yield edge, admission.service
    finally:
        await edge.stop()
        await admission.stop()
        nc = await nats.connect(nats_url)
        await nc.jetstream().delete_key_value(config.pinning.bucket)
        await nc.close()
        await stop_servers(engines.values())


# ---- the user's case: Claude Code over the Messages API ----------------------------------------


async def test_two_claude_code_messages_with_different_openings_are_one_session_and_one_pin(
    gateway,
):
    client = AsyncAnthropic(
        base_url=gateway.url, api_key="unused", max_retries=0, default_headers={CLAUDE: "cc-1"}
    )
    first = await client.messages.with_raw_response.create(
        **message("You are Claude Code."), messages=[{"role": "user", "content": "fix the bug"}]
    )
    second = await client.messages.with_raw_response.create(
        **message("This session is being continued from a previous conversation."),
        messages=[{"role": "user", "content": "go on"}],
    )
    expected = session_id(Feature.CHAT, "m1", {}, header_key="cc-1")
    assert first.headers[SESSION] == second.headers[SESSION] == expected
    assert first.headers["x-llmgw-endpoint"] == second.headers["x-llmgw-endpoint"]
    assert second.headers["x-llmgw-route"] == "pinned"
    async with httpx.AsyncClient() as http:  # streamed: the same session, named too
        async with http.stream(
            "POST",
            gateway.url + "/v1/messages",
            headers={CLAUDE: "cc-1"},
            json={
                **message("A third opening"),
                "stream": True,
                "messages": [{"role": "user", "content": "and stream it"}],
            },
        ) as streamed:
            assert streamed.status_code == 200 and streamed.headers[SESSION] == expected
            await streamed.aread()
    pins = list(gateway.admission.ledger.pins.values())
    assert [(p.session, p.endpoint) for p in pins] == [
        (expected, first.headers["x-llmgw-endpoint"])
    ]


async def test_a_codex_responses_request_is_counted_in_its_session_and_its_thread(gateway):
    client = AsyncOpenAI(base_url=gateway.url + "/v1", api_key="sk-one", max_retries=0)
    root = {"session-id": "019a-s", "thread-id": "019a-s"}
    one = await client.responses.with_raw_response.create(
        model="m1", input="Plan a trip", max_output_tokens=3, extra_headers=root
    )
    two = await client.responses.with_raw_response.create(
        model="m1", input="Write a poem", max_output_tokens=3, extra_headers=root
    )
    root_session = key_session(("019a-s",), "m1", "responses")
    assert one.headers[SESSION] == two.headers[SESSION] == root_session
    spawned = await client.responses.with_raw_response.create(
        model="m1",
        input="Inspect the repository",
        max_output_tokens=3,
        extra_headers={**root, "thread-id": "019b-t", "x-codex-parent-thread-id": "019a-s"},
    )
    thread = key_session(("019a-s", "019b-t"), "m1", "responses")
    assert spawned.headers[SESSION] == thread
    ledger = gateway.admission.ledger
    assert ledger.pin("m1", root_session).parent is None
    assert ledger.pin("m1", thread).parent == root_session
    assert ledger.pin("m1", thread).shard == ledger.pin("m1", root_session).shard
    assert len(ledger.pins) == 2


async def test_the_session_header_comes_first_and_agent_headers_before_the_user_field(gateway):
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        both = await http.post(
            "/v1/chat/completions",
            headers={"x-session-id": "mine", CLAUDE: "cc-1"},
            json=chat("one"),
        )
        agent = await http.post(
            "/v1/chat/completions", headers={CLAUDE: "cc-1"}, json=chat("two", user="u-7")
        )
        user = await http.post("/v1/chat/completions", json=chat("three", user="u-7"))
        embedded = await http.post(
            "/v1/embeddings", headers={CLAUDE: "cc-1"}, json={"model": "m1", "input": "x"}
        )
    assert both.headers[SESSION] == session_id(Feature.CHAT, "m1", {}, header_key="mine")
    assert agent.headers[SESSION] == session_id(Feature.CHAT, "m1", {}, header_key="cc-1")
    assert user.headers[SESSION] == session_id(Feature.CHAT, "m1", {"user": "u-7"})
    assert embedded.status_code == 200 and SESSION not in embedded.headers  # no session


async def test_an_empty_list_turns_the_agent_headers_off(make_gateway_config, nats_url, unique_id):
    router = {"max_body_bytes": 4096, "load_bucket": f"load_{unique_id}", "session_headers": []}
    async with gateway_of(make_gateway_config, nats_url, unique_id, router=router) as (edge, adm):
        async with httpx.AsyncClient(base_url=edge.url) as http:
            sessions = [
                (
                    await http.post(
                        "/v1/messages",
                        headers={CLAUDE: "cc-1"},
                        json=message(opening, messages=[{"role": "user", "content": "x"}]),
                    )
                ).headers[SESSION]
                for opening in ("first opening", "second opening")
            ]
            kept = await http.post(  # the session header alone still works
                "/v1/chat/completions", headers={"x-session-id": "cc-1"}, json=chat("third")
            )
        assert sessions[0] != sessions[1]  # each opening is its own session again
        assert len(adm.ledger.pins) == 3
        assert kept.headers[SESSION] == session_id(Feature.CHAT, "m1", {}, header_key="cc-1")


# ---- sub-agents start beside their parent ------------------------------------------------------


def two_equal_engines(urls: dict[str, str]) -> list[dict[str, Any]]:
    """iris's two engines at one priority, two batch slots each (what admission counts with
    no scraper running): a new session goes where there is most room, unless it has a parent."""
    return [
        *(
            {"id": n, "url": urls[n], "provider": "iris", "models": ["m1", "m2"], "capacity": 2}
            for n in ("engine-1", "engine-2")
        ),
        {"id": "tensorx-1", "url": urls["tensorx-1"], "provider": "tensorx", "models": ["m1"]},
    ]


async def test_a_sub_agent_starts_on_its_parents_engine_while_it_has_room_else_elsewhere(
    make_gateway_config, nats_url, unique_id
):
    async with (
        gateway_of(make_gateway_config, nats_url, unique_id, endpoints=two_equal_engines) as (
            edge,
            adm,
        ),
        httpx.AsyncClient(base_url=edge.url, timeout=20) as http,
    ):
        parent = {CLAUDE: "cc-9"}
        long = chat("You are the main agent.", max_tokens=100, ignore_eos=True, stream=True)
        async with http.stream("POST", "/v1/chat/completions", headers=parent, json=long) as p1:
            home = p1.headers["x-llmgw-endpoint"]
            other = "engine-2" if home == "engine-1" else "engine-1"
            root = p1.headers[SESSION]
            # One slot of two busy at the parent's engine, the other engine idle: the
            # sub-agent starts beside its parent all the same.
            near = await http.post(
                "/v1/chat/completions",
                headers={**parent, AGENT: "explore-1"},
                json=chat("You are a sub-agent that explores."),
            )
            assert near.headers["x-llmgw-endpoint"] == home, near.headers
            async with http.stream("POST", "/v1/chat/completions", headers=parent, json=long) as p2:
                assert p2.headers["x-llmgw-endpoint"] == home  # now both of its slots are busy
                far = await http.post(
                    "/v1/chat/completions",
                    headers={**parent, AGENT: "explore-2"},
                    json=chat("You are another sub-agent."),
                )
                assert far.headers["x-llmgw-endpoint"] == other, far.headers
                await p2.aread()
            await p1.aread()
        ledger = adm.ledger
        subs = [near.headers[SESSION], far.headers[SESSION]]
        assert subs[0] != subs[1] and root not in subs
        assert [ledger.pin("m1", s).parent for s in subs] == [root, root]
        assert ledger.pin("m1", root).parent is None
        shards = {ledger.pin("m1", s).shard for s in (root, *subs)}
        assert shards == {shard_of(root, adm.config.admission.shards)}  # the family's shard
        await adm.pins.drain()
        stored = {v.value.session: v.value.parent for _, v in await adm.store.all_pins()}
        assert stored == {root: None}  # a new pin is written once its session comes back
        for agent in ("explore-1", "explore-2"):  # each sub-agent's next turn
            again = await http.post(
                "/v1/chat/completions", headers={**parent, AGENT: agent}, json=chat("Go on.")
            )
            assert again.headers["x-llmgw-route"] == "pinned", again.headers
        await adm.pins.drain()
        stored = {v.value.session: v.value.parent for _, v in await adm.store.all_pins()}
        assert stored == {root: None, subs[0]: root, subs[1]: root}


async def test_pinning_parent_weight_0_ignores_the_parent(make_gateway_config, nats_url, unique_id):
    pinning = {"bucket": f"routing_{unique_id}", "lease_timeout": "3s", "parent_weight": 0}
    async with (
        gateway_of(
            make_gateway_config, nats_url, unique_id, endpoints=two_equal_engines, pinning=pinning
        ) as (edge, adm),
        httpx.AsyncClient(base_url=edge.url, timeout=20) as http,
    ):
        parent = {CLAUDE: "cc-9"}
        long = chat("You are the main agent.", max_tokens=100, ignore_eos=True, stream=True)
        async with http.stream("POST", "/v1/chat/completions", headers=parent, json=long) as p1:
            home = p1.headers["x-llmgw-endpoint"]
            sub = await http.post(
                "/v1/chat/completions",
                headers={**parent, AGENT: "explore-1"},
                json=chat("You are a sub-agent that explores."),
            )
            await p1.aread()
        assert sub.headers["x-llmgw-endpoint"] != home  # the engine with most room
        assert adm.ledger.pin("m1", sub.headers[SESSION]).parent == p1.headers[SESSION]


async def test_every_turn_of_a_sub_agent_stays_in_its_session(gateway):
    """After its first request a sub-agent is a session like any other: its turns share one
    pin, whatever its prompt grows to."""
    headers = {CLAUDE: "cc-2", AGENT: "plan-1"}
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        turns = [
            await http.post("/v1/chat/completions", headers=headers, json=chat(text))
            for text in ("first", "second", "third")
        ]
    assert len({t.headers[SESSION] for t in turns}) == 1
    assert [t.headers["x-llmgw-route"] for t in turns] == ["new_pin", "pinned", "pinned"]


async def test_a_sub_agent_is_decided_where_its_parents_pin_is_with_two_admission_instances(
    make_gateway_config, nats_url, unique_id
):
    """With two instances, a sub-agent whose own session id hashes to the other instance's
    shard is still decided by its parent's owner (its family's shard): that one holds the
    parent's pin and sees its request running, so the sub-agent starts beside it. The agent id
    is chosen so that the other instance, which knows neither, would start it elsewhere."""
    engines = {}
    for seed, name in enumerate(("engine-1", "engine-2", "tensorx-1")):
        params = EngineParams.zero_delay(itl_base="20ms", seed=seed)
        engines[name] = await start_server(create_engine_app(params, ["m1", "m2"]))
    urls = {k: v.url for k, v in engines.items()}
    config = make_gateway_config(
        nats_url, urls, f"routing_{unique_id}", endpoints=two_equal_engines(urls)
    )
    cluster = Cluster(config, nats_url)
    try:
        with before_any_lease(config):
            first = await cluster.add_admission("adm-0", follow_load=False)
            second = await cluster.add_admission("adm-1", follow_load=False)
        await cluster.balanced()
        edge = await cluster.add_edge()
        shards = config.admission.shards
        owner = {s: a.service for a in (first, second) for s in a.service.shards.serving}
        async with httpx.AsyncClient(base_url=edge.url, timeout=20) as http:
            parent = {CLAUDE: "cc-2i"}
            long = chat("You are the main agent.", max_tokens=100, ignore_eos=True, stream=True)
            async with http.stream(
                "POST", "/v1/chat/completions", headers=parent, json=long
            ) as running:
                home, root = running.headers["x-llmgw-endpoint"], running.headers[SESSION]
                stranger = next(
                    a for a in (first, second) if a.service is not owner[shard_of(root, shards)]
                ).service

                def elsewhere(agent: str) -> bool:
                    own = key_session(("cc-2i", agent), "m1", "chat")
                    view, _ = stranger.catalog.snapshot("m1", Feature.CHAT, own, (), 0.0)
                    iris = next(p for p in view.providers if p.id == "iris")
                    assert iris.ring is not None
                    return (
                        owner[shard_of(own, shards)] is stranger and iris.ring.walk(own)[0] != home
                    )

                agent = next(f"explore-{n}" for n in range(1000) if elsewhere(f"explore-{n}"))
                sub = await http.post(
                    "/v1/chat/completions",
                    headers={**parent, AGENT: agent},
                    json=chat("You are a sub-agent that explores."),
                )
                await running.aread()
        assert sub.headers["x-llmgw-endpoint"] == home, sub.headers
        decider = owner[shard_of(root, shards)]
        assert decider.ledger.pin("m1", sub.headers[SESSION]).parent == root
        assert stranger.ledger.pin("m1", sub.headers[SESSION]) is None
    finally:
        await cluster.stop()
        await stop_servers(engines.values())
