"""A three-node JetStream cluster from the wheel: start, R3 buckets, CAS, node loss and recovery.

Each test starts its own cluster (about a second): the destructive ones kill nodes. Waiting is
always polling a condition under a deadline (`eventually`), never a fixed sleep. A SIGKILLed
stream leader is replaced after a Raft election timeout (4-9 s in nats-server), so the tests
that kill a leader allow 15 s for it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client as NatsClient
from nats.errors import Error as NatsError
from timing import eventually

from llmgw.nats_cluster import EmbeddedNatsCluster
from llmgw.nats_embedded import NatsStartError
from llmgw.state import CasConflict, NatsKV, open_routing_bucket

ELECTION_DEADLINE_S = 15.0
BUCKET = "routing_r3"
UNAVAILABLE = (NatsError, TimeoutError)  # a node between leaders: not yet, poll again
STREAM = f"KV_{BUCKET}"


async def cas_until_done(kv: NatsKV, key: str, value: bytes, revision: int, timeout: float) -> int:
    """`kv.update` retried through unavailability; the new revision.

    A timed-out publish may still have been applied (its ack was lost): the retry then meets
    a CAS conflict with our own write. Telling that from a real conflict needs a read, as any
    CAS client over NATS must.
    """

    async def attempt() -> int | None:
        try:
            return await kv.update(key, value, revision)
        except CasConflict:
            entry = await kv.get(key)
            if entry is not None and entry.value == value:
                return entry.revision
            raise

    return await eventually(
        attempt, timeout, f"CAS update of {key!r} accepted", interval=0.05, ignoring=UNAVAILABLE
    )


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def connect(urls: str | list[str]) -> NatsClient:
    return await nats.connect(
        urls, connect_timeout=1, reconnect_time_wait=0.1, max_reconnect_attempts=-1
    )


@pytest_asyncio.fixture
async def cluster() -> AsyncIterator[EmbeddedNatsCluster]:
    async with EmbeddedNatsCluster(kill_with_parent=True) as started:
        yield started


@pytest_asyncio.fixture
async def full_list_client(cluster: EmbeddedNatsCluster) -> AsyncIterator[NatsClient]:
    client = await connect(cluster.urls)
    try:
        yield client
    finally:
        await client.close()


async def test_start_returns_a_ready_cluster_of_three_distinct_nodes(
    cluster: EmbeddedNatsCluster, full_list_client: NatsClient
) -> None:
    nodes = cluster.nodes
    assert len(nodes) == 3
    assert len({n.client_port for n in nodes} | {n.cluster_port for n in nodes}) == 6
    assert len({n.name for n in nodes}) == 3 and len({n.pid for n in nodes}) == 3
    assert cluster.url == ",".join(n.url for n in nodes) == ",".join(cluster.urls)
    assert all("Server is ready" in n.log_path.read_text() for n in nodes)
    assert cluster.meta_leader() in (0, 1, 2)

    # An R3 bucket can be created at once, and every replica is current right after a write.
    js = full_list_client.jetstream(timeout=2)
    kv = await open_routing_bucket(js, BUCKET, replicas=3)
    revision = await kv.create("pin.m.s", b"engine-1")
    info = await js.stream_info(STREAM)
    assert info.config.num_replicas == 3
    assert info.cluster is not None and info.cluster.leader in {n.name for n in nodes}
    assert cluster.stream_leader(STREAM) == next(
        n.index for n in nodes if n.name == info.cluster.leader
    )
    await eventually(
        lambda: asyncio.to_thread(
            lambda: all(cluster.replica_last_seq(i, STREAM) == revision for i in range(3))
        ),
        5,
        "every replica at the first write",
        interval=0.05,
        ignoring=UNAVAILABLE,
    )


async def test_cas_holds_through_any_node(cluster: EmbeddedNatsCluster) -> None:
    clients = [await nats.connect(url, allow_reconnect=False) for url in cluster.urls]
    try:
        stores = [await open_routing_bucket(c.jetstream(), BUCKET, replicas=3) for c in clients]
        first = await stores[0].create("pin.m.s", b"engine-1")
        second = await stores[1].update("pin.m.s", b"engine-2", first)
        assert second > first
        with pytest.raises(CasConflict):
            await stores[2].update("pin.m.s", b"engine-3", first)  # stale, via a third node
        with pytest.raises(CasConflict):
            await stores[2].create("pin.m.s", b"engine-3")
        for store in stores:  # direct gets may lag on a follower: poll, then compare
            entry = await eventually(
                lambda store=store: _at_revision(store, "pin.m.s", second),
                5,
                "read back",
                interval=0.05,
                ignoring=UNAVAILABLE,
            )
            assert entry.value == b"engine-2"
    finally:
        for client in clients:
            await client.close()


async def _at_revision(store: NatsKV, key: str, revision: int):  # type: ignore[no-untyped-def]
    entry = await store.get(key)
    return entry if entry is not None and entry.revision == revision else None


async def test_killing_the_stream_leader_keeps_a_full_list_client_writing(
    cluster: EmbeddedNatsCluster, full_list_client: NatsClient
) -> None:
    kv = await open_routing_bucket(full_list_client.jetstream(timeout=1), BUCKET, replicas=3)
    first = await kv.create("pin.m.s", b"engine-1")
    leader = cluster.stream_leader(STREAM)
    assert leader is not None
    killed_pid = cluster.nodes[leader].pid
    assert killed_pid is not None

    cluster.kill(leader)
    assert _process_gone(killed_pid) and not cluster.nodes[leader].running

    # A write succeeds once the two survivors elect a leader, whichever node the client was on.
    second = await cas_until_done(kv, "pin.m.s", b"engine-2", first, ELECTION_DEADLINE_S)
    assert second > first
    new_leader = cluster.stream_leader(STREAM)
    assert new_leader is not None and new_leader != leader
    # CAS still decides: the revision from before the failover is stale now.
    with pytest.raises(CasConflict):
        await kv.update("pin.m.s", b"engine-3", first)
    third = await kv.update("pin.m.s", b"engine-3", second)

    # The old leader comes back with its store, name and ports and catches up.
    await cluster.arestart(leader)
    assert cluster.nodes[leader].running and cluster.nodes[leader].pid != killed_pid

    def caught_up() -> bool:
        info = cluster.stream_info(STREAM) or {}
        replicas = {r["name"]: r for r in (info.get("cluster") or {}).get("replicas") or []}
        name = cluster.nodes[leader].name
        return cluster.replica_last_seq(leader, STREAM) == third and bool(
            replicas.get(name, {}).get("current")
        )

    await eventually(
        lambda: asyncio.to_thread(caught_up),
        10,
        "the restarted node current",
        interval=0.05,
        ignoring=UNAVAILABLE,
    )

    # Through the restarted node alone, the latest value is read and CAS works.
    solo = await nats.connect(cluster.nodes[leader].url, allow_reconnect=False)
    try:
        store = await open_routing_bucket(solo.jetstream(timeout=1), BUCKET, replicas=3)
        entry = await eventually(
            lambda: _at_revision(store, "pin.m.s", third),
            5,
            "read back",
            interval=0.05,
            ignoring=UNAVAILABLE,
        )
        assert entry.value == b"engine-3"
        assert await store.update("pin.m.s", b"engine-4", third) > third
    finally:
        await solo.close()


async def test_a_leader_stopped_cleanly_hands_over_without_an_election_timeout(
    cluster: EmbeddedNatsCluster, full_list_client: NatsClient
) -> None:
    kv = await open_routing_bucket(full_list_client.jetstream(timeout=0.5), BUCKET, replicas=3)
    revision = await kv.create("pin.m.s", b"engine-1")
    leader = cluster.stream_leader(STREAM)
    assert leader is not None
    await asyncio.to_thread(cluster.kill, leader, signal.SIGTERM)
    # A crash costs an election timeout (>= 4 s); a clean shutdown transfers leadership first.
    await cas_until_done(kv, "pin.m.s", b"engine-2", revision, 3.0)
    assert cluster.stream_leader(STREAM) not in (None, leader)


async def test_losing_a_follower_does_not_interrupt_writes(
    cluster: EmbeddedNatsCluster, full_list_client: NatsClient
) -> None:
    kv = await open_routing_bucket(full_list_client.jetstream(timeout=1), BUCKET, replicas=3)
    revision = await kv.create("lease.a", b"0")
    leader = cluster.stream_leader(STREAM)
    follower = next(i for i in range(3) if i != leader)
    cluster.kill(follower)
    started = time.monotonic()
    for step in range(1, 21):  # quorum (2 of 3) is intact: no election, no retries needed
        revision = await cas_until_done(kv, "lease.a", str(step).encode(), revision, 5)
    assert time.monotonic() - started < 5
    assert cluster.stream_leader(STREAM) == leader

    await cluster.arestart(follower)
    await eventually(
        lambda: asyncio.to_thread(lambda: cluster.replica_last_seq(follower, STREAM) == revision),
        10,
        "the follower caught up on 20 writes",
        interval=0.05,
        ignoring=UNAVAILABLE,
    )


def test_stop_ends_every_node_and_removes_the_temporary_root() -> None:
    cluster = EmbeddedNatsCluster().start()
    pids = [n.pid for n in cluster.nodes]
    root = cluster.root_dir
    assert root is not None and all((n.store_dir / "jetstream").is_dir() for n in cluster.nodes)
    cluster.stop()
    assert all(pid is not None and _process_gone(pid) for pid in pids)
    assert not root.exists()
    cluster.stop()  # idempotent
    with pytest.raises(RuntimeError, match="not running"):
        _ = cluster.url


def test_a_given_store_dir_is_kept_one_directory_per_node(tmp_path: Path) -> None:
    with EmbeddedNatsCluster(store_dir=tmp_path, name="kept") as cluster:
        assert [n.store_dir for n in cluster.nodes] == [tmp_path / f"kept-{i}" for i in range(3)]
    assert all((tmp_path / f"kept-{i}" / "nats-server.log").is_file() for i in range(3))


def test_a_node_that_cannot_start_fails_the_start_with_its_log_and_leaves_nothing() -> None:
    cluster = EmbeddedNatsCluster(extra_args=["-c", "/nonexistent/llmgw-nats.conf"])
    with pytest.raises(NatsStartError, match=r"llmgw-0: .*exited with code") as excinfo:
        cluster.start()
    assert "llmgw-nats.conf: no such file" in str(excinfo.value)  # the node's log tail
    with pytest.raises(RuntimeError, match="not running"):
        _ = cluster.nodes
    assert cluster.root_dir is None  # the temporary root is gone


def test_fewer_than_three_nodes_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 3 servers"):
        EmbeddedNatsCluster(2)


async def test_a_port_taken_between_its_pick_and_the_nodes_start_is_picked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ports a cluster picks were free a moment ago; another process may bind one first
    (seen in CI as NatsPortInUse). The start is made again on newly picked ports."""
    import socket

    import llmgw.nats_cluster as nats_cluster

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        real = nats_cluster._distinct_free_ports
        picked: list[list[int]] = []

        def pick(host: str, count: int, avoid: set[int] | None = None) -> list[int]:
            ports = real(host, count, avoid)
            if not picked:  # the first layout's client ports: one was taken meanwhile
                ports[0] = busy
            picked.append(ports)
            return ports

        monkeypatch.setattr(nats_cluster, "_distinct_free_ports", pick)
        async with EmbeddedNatsCluster(kill_with_parent=True) as started:
            assert busy not in {n.client_port for n in started.nodes}
            assert len(started.nodes) == 3 and started.meta_leader() in (0, 1, 2)
        assert len(picked) == 4  # client and cluster ports, twice
