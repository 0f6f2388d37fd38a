"""What only the JetStream adapter has: bucket opening, server timestamps, nats-py interop."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NatsClient
from nats.errors import ConnectionClosedError
from nats.js.api import StorageType
from nats.js.kv import KeyValue

from llmgw.nats_embedded import EmbeddedNats
from llmgw.state import BucketConfigMismatch, CasConflict, NatsKV, open_routing_bucket


async def test_open_routing_bucket_creates_once_and_binds_from_racing_instances(
    nats_client: NatsClient, unique_id: str
) -> None:
    js = nats_client.jetstream()
    name = f"routing_{unique_id}"
    try:
        stores = await asyncio.gather(*(open_routing_bucket(js, name) for _ in range(4)))
        info = await js.stream_info(f"KV_{name}")
        assert info.config.max_msgs_per_subject == 1
        assert info.config.storage == StorageType.FILE
        assert info.config.allow_direct
        revision = await stores[0].create("pin.m.s", b"v")
        for store in stores:
            entry = await store.get("pin.m.s")
            assert entry is not None and entry.revision == revision
        again = await open_routing_bucket(js, name)
        assert (await again.get("pin.m.s")) is not None  # binding keeps the data
    finally:
        await js.delete_key_value(name)


async def test_open_routing_bucket_refuses_an_existing_bucket_of_another_shape(
    nats_client: NatsClient, unique_id: str
) -> None:
    js = nats_client.jetstream()
    name = f"routing_{unique_id}"
    try:
        await open_routing_bucket(js, name, storage="memory", history=4)
        with pytest.raises(BucketConfigMismatch, match=r"storage.*history"):
            await open_routing_bucket(js, name)
        await open_routing_bucket(js, name, storage="memory", history=4)
    finally:
        await js.delete_key_value(name)


async def test_reads_carry_the_server_time_of_the_write(routing_bucket: NatsKV) -> None:
    before = time.time()
    revision = await routing_bucket.create("pin.m.s", b"v")
    after = time.time()
    slack = 1.0  # client and server share the clock; allow for rounding only
    entry = await routing_bucket.get("pin.m.s")
    assert entry is not None and before - slack <= entry.timestamp <= after + slack
    (listed,) = await routing_bucket.list("pin.")
    assert listed.revision == revision and listed.timestamp == pytest.approx(entry.timestamp)
    async with contextlib.aclosing(routing_bucket.watch("pin.")) as watch:
        async with asyncio.timeout(5):
            watched = await anext(watch)
    assert watched.timestamp == pytest.approx(entry.timestamp)


async def test_wraps_a_bucket_opened_with_nats_py_and_sees_its_writes(kv_bucket: KeyValue) -> None:
    store = NatsKV.from_key_value(kv_bucket)
    revision = await kv_bucket.put("pin.m.s", b"from nats-py")
    entry = await store.get("pin.m.s")
    assert entry is not None and (entry.value, entry.revision) == (b"from nats-py", revision)
    await kv_bucket.delete("pin.m.s")
    assert await store.get("pin.m.s") is None
    assert await store.create("pin.m.s", b"again") > revision
    with pytest.raises(CasConflict):
        await store.delete("pin.m.s", revision)  # nats-py itself raises BadRequestError here


async def test_a_watch_ends_with_an_error_when_its_connection_is_closed(
    nats_url: str, routing_bucket: NatsKV
) -> None:
    client = await nats.connect(nats_url, allow_reconnect=False)
    store = NatsKV(client.jetstream(), routing_bucket.bucket)
    await routing_bucket.create("pin.m.s", b"v")
    async with contextlib.aclosing(store.watch("pin.")) as watch:
        async with asyncio.timeout(5):
            assert (await anext(watch)).key == "pin.m.s"
            await client.close()
            with pytest.raises(ConnectionClosedError):
                await anext(watch)


async def test_a_watch_resumes_after_the_server_restarts(tmp_path: Path) -> None:
    first = await EmbeddedNats(store_dir=tmp_path).astart()
    port = first.port
    reconnected = asyncio.Event()

    async def on_reconnect() -> None:
        reconnected.set()

    client = await nats.connect(
        first.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1, reconnected_cb=on_reconnect
    )
    second: EmbeddedNats | None = None
    try:
        store = await open_routing_bucket(client.jetstream(), "restart")
        await store.create("pin.m.a", b"before")
        async with contextlib.aclosing(store.watch("pin.")) as watch:
            async with asyncio.timeout(5):
                assert (await anext(watch)).value == b"before"
            await first.astop()
            second = await EmbeddedNats(port=port, store_dir=tmp_path).astart()
            async with asyncio.timeout(15):
                await reconnected.wait()
                revision = await store.create("pin.m.b", b"after")
                entry = await anext(watch)
            assert (entry.key, entry.value, entry.revision) == ("pin.m.b", b"after", revision)
    finally:
        await client.close()
        await first.astop()
        if second is not None:
            await second.astop()
