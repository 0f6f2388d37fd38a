"""The engine's KV cache events on the wire: a real engine app on uvicorn, a pyzmq SUB for the
live stream and a DEALER for replays, as a gateway consumes vLLM's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import msgpack
import pytest_asyncio
import zmq
import zmq.asyncio
from sim_helpers import Serve

from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.services.sim.tokenizer import render_chat, token_ids

MODEL = "sim-llama"
TOPIC = b"kv@engine-1@sim-llama"
BS = 4
END_SEQ = (-1).to_bytes(8, "big", signed=True)
TIMEOUT = 5.0


THREE = ("one prompt for the cache", "two prompts for the cache", "three prompts now")


def engine(**overrides: Any) -> EngineParams:
    return EngineParams.zero_delay(
        block_size=BS,
        kv_events_endpoint="tcp://127.0.0.1:*",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
        kv_events_topic=TOPIC.decode(),
        **overrides,
    )


def user(text: str, model: str = MODEL) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1}


@dataclass
class Batch:
    seq: int
    ts: float
    events: list[Any]
    data_parallel_rank: int | None
    payload: bytes


def decode(seq: bytes, payload: bytes) -> Batch:
    ts, events, rank = msgpack.unpackb(payload)
    return Batch(int.from_bytes(seq, "big"), ts, events, rank, payload)


class Consumer:
    """One engine's events: a SUB socket for the live stream, a DEALER for replays."""

    def __init__(self, ctx: zmq.asyncio.Context, state: dict[str, Any]) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.sub.connect(state["endpoint"])
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.connect(state["replay_endpoint"])

    async def subscribe(self, http: httpx.AsyncClient) -> int:
        """Return once the subscription is live; the next batch's number.

        A PUB socket drops what it sends before it knows a subscriber, so reset the (empty)
        prefix cache until one of its AllBlocksCleared batches arrives, then read up to the last.
        """
        deadline = time.monotonic() + TIMEOUT
        sent = 0
        while True:
            assert time.monotonic() < deadline, "the subscription never went live"
            assert (await http.post("/reset_prefix_cache")).status_code == 200
            sent += 1
            if await self.sub.poll(20):
                break
        while (batch := await self.next()).seq != sent - 1:
            assert batch.events == [{"type": "AllBlocksCleared"}]
        return sent

    async def next(self) -> Batch:
        topic, seq, payload = await asyncio.wait_for(self.sub.recv_multipart(), TIMEOUT)
        assert topic == TOPIC and len(seq) == 8
        return decode(seq, payload)

    async def replay(self, start: int) -> list[Batch]:
        """The batches the engine replays from `start`, up to its end marker."""
        await self.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        batches = []
        while True:
            frames = await asyncio.wait_for(self.dealer.recv_multipart(), TIMEOUT)
            if frames[2] == END_SEQ:
                assert frames == [b"", b"", END_SEQ, b""]
                return batches
            delimiter, topic, seq, payload = frames
            assert (delimiter, topic) == (b"", TOPIC)
            batches.append(decode(seq, payload))


Subscribed = Callable[[EngineParams], Awaitable[tuple[httpx.AsyncClient, Consumer, int]]]


@pytest_asyncio.fixture
async def subscribed(serve: Serve) -> AsyncIterator[Subscribed]:
    """`await subscribed(params)` -> an HTTP client of an engine serving `params`, a Consumer
    subscribed to its events, and the number of the next batch."""
    ctx = zmq.asyncio.Context()

    async def _subscribed(params: EngineParams) -> tuple[httpx.AsyncClient, Consumer, int]:
        client = await serve(create_engine_app(params, [MODEL]))
        consumer = Consumer(ctx, (await client.get("/sim/state")).json()["kv_events"])
        return client, consumer, await consumer.subscribe(client)

    try:
        yield _subscribed
    finally:
        ctx.destroy(linger=0)


async def chat(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply


async def chats(client: httpx.AsyncClient, *texts: str) -> None:
    """One single-message chat per text, one after the other."""
    for text in texts:
        await chat(client, user(text))


def chains(batches: list[Batch]) -> dict[int, list[int]]:
    """Each stored block hash -> the tokens from the prompt's start through that block, from
    the events' parent links and token ids only."""
    known: dict[int, list[int]] = {}
    for batch in batches:
        for event in batch.events:
            if event["type"] != "BlockStored":
                continue
            parent = event["parent_block_hash"]
            tokens = [] if parent is None else known[parent]
            for index, block_hash in enumerate(event["block_hashes"]):
                size = event["block_size"]
                tokens = tokens + event["token_ids"][index * size : (index + 1) * size]
                known[block_hash] = tokens
    return known


def full_blocks(tokens: list[int]) -> list[int]:
    return tokens[: len(tokens) // BS * BS]


async def test_requests_sharing_a_prefix_publish_chained_stores_in_order(
    subscribed: Subscribed,
) -> None:
    client, consumer, start = await subscribed(engine())
    system = {"role": "system", "content": "You are a careful assistant; cite the manual."}
    conversations = [
        [system, {"role": "user", "content": "How do I rotate the signing keys?"}],
        [system, {"role": "user", "content": "Where are the audit logs kept?"}],
    ]
    for messages in conversations:
        await chat(client, {"model": MODEL, "messages": messages, "max_tokens": 1})
    first, second = await consumer.next(), await consumer.next()
    assert (first.seq, second.seq) == (start, start + 1)
    assert first.data_parallel_rank == 0 and abs(first.ts - time.time()) < 60
    known = chains([first, second])
    prompts = [token_ids(render_chat(messages)) for messages in conversations]
    for batch, tokens in zip((first, second), prompts, strict=True):
        (event,) = batch.events
        assert event["type"] == "BlockStored"
        assert known[event["block_hashes"][-1]] == full_blocks(tokens)
        assert (event["block_size"], event["medium"], event["lora_name"]) == (BS, "GPU", None)
    # The second prompt stored only what follows the blocks it shares with the first.
    shared = next(i for i, (a, b) in enumerate(zip(*prompts, strict=False)) if a != b) // BS
    assert shared >= 1
    assert second.events[0]["parent_block_hash"] == first.events[0]["block_hashes"][shared - 1]
    assert second.events[0]["token_ids"] == full_blocks(prompts[1])[shared * BS :]


async def test_evicted_blocks_are_removed_and_the_rest_is_what_the_engine_caches(
    subscribed: Subscribed,
) -> None:
    client, consumer, _ = await subscribed(engine(num_gpu_blocks=8))
    texts = ["alpha beta gamma delta", "red green blue cyan", "one two three four five"]
    await chats(client, *texts)
    batches = [await consumer.next() for _ in texts]  # one step each: evict, store
    live: dict[int, int] = {}
    removed = 0
    for batch in batches:
        for event in batch.events:
            if event["type"] == "BlockStored":
                for block_hash in event["block_hashes"]:
                    live[block_hash] = live.get(block_hash, 0) + 1
            else:
                assert event == {
                    "type": "BlockRemoved",
                    "block_hashes": event["block_hashes"],
                    "medium": "GPU",
                    "group_idx": 0,
                }
                (block_hash,) = event["block_hashes"]
                assert live.pop(block_hash) == 1  # only a block stored before is removed
                removed += 1
    assert removed > 0
    state = (await client.get("/sim/state")).json()
    assert state["kv_blocks"]["cached"] == len(live)


async def test_a_prefix_cache_reset_publishes_all_blocks_cleared(
    subscribed: Subscribed,
) -> None:
    client, consumer, _ = await subscribed(engine())
    await chat(client, user("keep this prompt in the cache please"))
    stored = (await consumer.next()).events[0]
    response = await client.post("/reset_prefix_cache")
    assert (response.status_code, response.content) == (200, b"")
    assert (await consumer.next()).events == [{"type": "AllBlocksCleared"}]
    assert (await client.get("/sim/state")).json()["kv_blocks"]["cached"] == 0
    reply = await chat(client, user("keep this prompt in the cache please"))
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # The same engine stores the same prompt under the same hashes again.
    assert (await consumer.next()).events[0]["block_hashes"] == stored["block_hashes"]


async def test_replay_returns_kept_batches_from_a_start_then_the_end_marker(
    subscribed: Subscribed,
) -> None:
    client, consumer, start = await subscribed(engine(kv_events_buffer_steps=3))
    await chats(client, *THREE, "fourth")
    live = [await consumer.next() for _ in range(4)]
    assert [batch.seq for batch in live] == [start, start + 1, start + 2, start + 3]
    # The ring keeps 3 batches: a start older than that replays from the oldest kept.
    assert [batch.payload for batch in await consumer.replay(0)] == [b.payload for b in live[1:]]
    assert [batch.seq for batch in await consumer.replay(start + 2)] == [start + 2, start + 3]
    assert await consumer.replay(start + 10) == []


async def test_skipped_batches_leave_a_gap_that_replay_fills(
    subscribed: Subscribed,
) -> None:
    client, consumer, start = await subscribed(engine())
    knobs = (await client.post("/sim/faults", json={"kv_events_skip": 2})).json()
    assert knobs["kv_events_skip"] == 2
    await chats(client, *THREE)
    after_gap = await consumer.next()
    assert after_gap.seq == start + 2
    assert (await client.get("/sim/faults")).json()["kv_events_skip"] == 0
    replayed = await consumer.replay(start)
    assert [batch.seq for batch in replayed] == [start, start + 1, start + 2]
    assert replayed[2].payload == after_gap.payload
    assert all(batch.events[0]["type"] == "BlockStored" for batch in replayed)
    counts = (await client.get("/sim/state")).json()["kv_events"]
    assert (counts["skipped"], counts["next_seq"]) == (2, start + 3)


async def test_lost_batches_leave_a_gap_that_replay_cannot_fill(
    subscribed: Subscribed,
) -> None:
    client, consumer, start = await subscribed(engine())
    await client.post("/sim/faults", json={"kv_events_lose": 2})
    await chats(client, *THREE)
    assert (await consumer.next()).seq == start + 2
    replayed = await consumer.replay(start)
    assert [batch.seq for batch in replayed] == [start + 2]  # its first is past the start
    assert (await client.get("/sim/faults")).json()["kv_events_lose"] == 0


async def test_a_restart_numbers_from_zero_with_new_hashes_and_no_clear_event(
    subscribed: Subscribed,
) -> None:
    client, consumer, _ = await subscribed(engine())
    await chat(client, user("a prompt that outlives nothing"))
    before = (await consumer.next()).events[0]
    knobs = (await client.post("/sim/faults", json={"kv_events_restart": True})).json()
    assert knobs["kv_events_restart"] is False  # done
    state = (await client.get("/sim/state")).json()
    assert (state["kv_events"]["next_seq"], state["kv_blocks"]["cached"]) == (0, 0)
    assert await consumer.replay(0) == []
    await chat(client, user("a prompt that outlives nothing"))
    after = await consumer.next()
    assert after.seq == 0
    (event,) = after.events  # no AllBlocksCleared: a restarting engine announces nothing
    assert event["token_ids"] == before["token_ids"] and event["parent_block_hash"] is None
    assert not set(event["block_hashes"]) & set(before["block_hashes"])


async def test_positional_encoding_and_an_adapter_s_blocks(subscribed: Subscribed) -> None:
    params = engine(kv_events_encoding="positional", lora_modules=["sql-lora=/adapters/sql"])
    client, consumer, _ = await subscribed(params)
    await chat(client, user("select the rows", model="sql-lora"))
    (event,) = (await consumer.next()).events
    tokens = full_blocks(token_ids(render_chat([{"role": "user", "content": "select the rows"}])))
    blocks = len(tokens) // BS
    assert event == [
        "BlockStored",
        event[1],
        None,
        tokens,
        BS,
        None,
        "GPU",
        "sql-lora",
        [["sql-lora"]] * blocks,
        0,
        "full_attention",
        None,
    ]
    assert len(event[1]) == blocks


async def test_reset_prefix_cache_waits_for_idle_unless_told_to_reset_running_requests(
    serve: Serve,
) -> None:
    client = await serve(create_engine_app(EngineParams(itl_base=0.01, block_size=BS), [MODEL]))
    await chat(client, user("cached before the long request"))
    body = {**user("a long one"), "max_tokens": 500, "stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert (await client.post("/reset_prefix_cache")).status_code == 200
        state = (await client.get("/sim/state")).json()
        assert state["running"] == 1 and state["kv_blocks"]["cached"] > 0  # refused
        await client.post("/reset_prefix_cache", params={"reset_running_requests": "true"})
        assert (await client.get("/sim/state")).json()["kv_blocks"]["cached"] == 0
