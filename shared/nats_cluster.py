"""A JetStream cluster of `nats-server` children on loopback, for `llmgw up` and for tests.

Each node is an `EmbeddedNats` (same binary discovery, version check, readiness and failure
handling) with its own client port, cluster (route) port, HTTP monitoring port, server name and
store directory. Every node routes to every other one; all share one cluster name.

Invariants:
- `start()` returns only when every node accepts clients and answers a JetStream API request,
  every node names the same meta leader, and that leader sees every other node as a current
  peer: a bucket with up to min(size, 5) replicas can be created at once.
- A node's client port, cluster port, server name and store directory are fixed at the first
  `start()` and kept by `kill(i)` and `restart(i)`, so a restarted node rejoins as the same
  peer, catches up from its own store plus the others, and clients that hold the full server
  list (`url`) find it again. (The monitoring port may change on restart: nothing outside
  this module uses it.)
- A failed start stops every node and removes the temporary root; the error names the node
  and carries its log tail.
- `stop()` is idempotent. With `store_dir=None` the cluster owns a temporary root holding every
  node's store and log, removed by `stop()`; a `store_dir` given by the caller is kept (one
  subdirectory per node, named after the node).

Ownership: the cluster owns its node processes. `nodes` hands out views for reading (pid, URL,
log); kill, restart and stop them through the cluster. Spawning binds die-with-parent to the
calling thread (see `die_with_parent`): from asyncio code use `astart`/`arestart`, which spawn
in the event loop's thread and only wait in a worker thread.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmgw.clock import SYSTEM, Clock, TimeSource, monotonic_of
from llmgw.nats_embedded import (
    MIN_NATS_VERSION,
    EmbeddedNats,
    NatsPortInUse,
    NatsServerError,
    NatsStartError,
    ServerLifetime,
    find_nats_server,
    js_api_request,
    port_is_free,
)

__all__ = ["MIN_CLUSTER_SIZE", "ClusterNode", "EmbeddedNatsCluster"]

# Raft needs a majority: 3 servers is the smallest cluster that survives losing one.
MIN_CLUSTER_SIZE = 3
_POLL_INTERVAL = 0.05
_HTTP_TIMEOUT = 1.0
_LOG_TAIL_LINES = 8
_SIGNALLED_EXIT_TIMEOUT = 10.0  # seconds a signalled node may take to exit before SIGKILL


_PORT_ATTEMPTS = 3  # starts on freshly picked ports when one was taken meanwhile


@dataclass(eq=False)
class ClusterNode:
    """One node of the cluster: fixed identity (index, name, ports, store) and its server."""

    index: int
    name: str
    host: str
    client_port: int
    cluster_port: int
    store_dir: Path
    server: EmbeddedNats

    @property
    def url(self) -> str:
        """The client URL (stable across restarts, valid while the node is down too)."""
        return f"nats://{self.host}:{self.client_port}"

    @property
    def cluster_url(self) -> str:
        return f"nats://{self.host}:{self.cluster_port}"

    @property
    def pid(self) -> int | None:
        return self.server.process.pid if self.server.process is not None else None

    @property
    def running(self) -> bool:
        return self.server.running

    @property
    def log_path(self) -> Path:
        return self.store_dir / "nats-server.log"

    @property
    def monitor_url(self) -> str | None:
        return self.server.monitor_url

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        return self.server.log_tail(lines)


class EmbeddedNatsCluster(ServerLifetime):
    """`size` nats-server processes forming one JetStream cluster on `host`.

    `port`: the first client port (nodes take `port`, `port+1`, ...); 0 picks free ports.
    Cluster ports are always picked free (nothing outside the cluster connects to them).
    """

    def __init__(
        self,
        size: int = MIN_CLUSTER_SIZE,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        store_dir: str | Path | None = None,
        name: str = "llmgw",
        binary: str | Path | None = None,
        min_version: tuple[int, int, int] = MIN_NATS_VERSION,
        extra_args: Sequence[str] = (),
        kill_with_parent: bool = False,
        clock: Clock | TimeSource = SYSTEM,
        client_auth: tuple[str, str] | None = None,
    ) -> None:
        if size < MIN_CLUSTER_SIZE:
            raise ValueError(
                f"a JetStream cluster needs at least {MIN_CLUSTER_SIZE} servers, got {size}"
            )
        if not 0 <= port <= 65535 - (size - 1):
            raise ValueError(f"port must be within 0..{65535 - (size - 1)}, got {port}")
        self.size = size
        self.host = host
        self.requested_port = port
        self.name = name
        self.binary = Path(binary) if binary is not None else None
        self.min_version = min_version
        self.extra_args = tuple(extra_args)
        self.kill_with_parent = kill_with_parent
        self.client_auth = client_auth  # (user, password) of JetStream API probes, if needed
        self._clock = monotonic_of(clock)
        self._given_store_dir = Path(store_dir) if store_dir is not None else None
        self._temp_root: Path | None = None
        self._nodes: list[ClusterNode] = []

    # -- public state ---------------------------------------------------------------------

    @property
    def nodes(self) -> tuple[ClusterNode, ...]:
        if not self._nodes:
            raise NatsServerError("the embedded NATS cluster is not running")
        return tuple(self._nodes)

    @property
    def urls(self) -> list[str]:
        """Every node's client URL, down nodes included (they are the server list)."""
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        """The comma-separated server list, usable as `nats.url` / `LLMGW_NATS__URL`."""
        return ",".join(self.urls)

    @property
    def version(self) -> tuple[int, int, int] | None:
        return self._nodes[0].server.version if self._nodes else None

    @property
    def root_dir(self) -> Path | None:
        """The directory holding every node's store (temporary unless `store_dir` was given)."""
        return self._given_store_dir or self._temp_root

    # -- lifecycle ------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> EmbeddedNatsCluster:
        """Start every node and wait for the cluster to be ready (module invariants).

        Ports this cluster picked itself were free when picked; another process may bind one
        before the node does. Such a start is stopped and made again on newly picked ports
        (`_PORT_ATTEMPTS` in all); a port the caller asked for is not replaced."""
        for attempt in itertools.count(1):
            try:
                self.spawn()
                self._wait_started(timeout)
                return self
            except NatsPortInUse:
                if not self._may_pick_again(attempt):
                    raise
        raise AssertionError("itertools.count ends")

    async def astart(self, ready_within: float = 30.0) -> EmbeddedNatsCluster:
        """`start` from async code: the nodes are spawned from this thread (their parent-death
        signal follows the thread that spawned them), the wait runs in another."""
        for attempt in itertools.count(1):
            try:
                self.spawn()
                await asyncio.to_thread(self._wait_started, ready_within)
                return self
            except NatsPortInUse:
                if not self._may_pick_again(attempt):
                    raise
        raise AssertionError("itertools.count ends")

    def _may_pick_again(self, attempts: int) -> bool:
        """After `attempts` starts that found a port taken: whether to start again on newly
        picked ports (never when the caller asked for the ports)."""
        return not self.requested_port and attempts < _PORT_ATTEMPTS

    def spawn(self) -> None:
        """Lay out the nodes and spawn every process without waiting (see `start`)."""
        if self._nodes:
            raise NatsServerError(f"the embedded NATS cluster {self.name!r} is already running")
        binary = self.binary or find_nats_server()
        self._nodes = self._layout(binary)
        try:
            for node in self._nodes:
                self._spawn_node(node)
        except BaseException:
            self.stop(timeout=2.0)
            raise

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM every node at once, wait (SIGKILL after `timeout`); remove a temporary root."""
        for node in self._nodes:
            process = node.server.process
            if process is not None and process.poll() is None:
                process.terminate()
        for node in self._nodes:
            node.server.stop(timeout)
        self._nodes = []
        if self._temp_root is not None:
            shutil.rmtree(self._temp_root, ignore_errors=True)
            self._temp_root = None

    async def astop(self, grace: float = 5.0) -> None:
        await asyncio.to_thread(self.stop, grace)

    def kill(self, index: int, sig: signal.Signals = signal.SIGKILL) -> int | None:
        """Signal node `index` and wait for its exit; returns its exit code. The store stays.

        SIGKILL (default) is a crash: the node's Raft groups must elect new leaders after an
        election timeout. SIGTERM is a clean shutdown: nats-server hands its leaderships over.
        """
        node = self.nodes[index]
        process = node.server.process
        if process is not None and process.poll() is None:
            process.send_signal(sig)
            try:
                process.wait(_SIGNALLED_EXIT_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return node.server.stop()  # reaps it and removes its ports file

    def restart(self, index: int, timeout: float = 30.0) -> ClusterNode:
        """Start node `index` again (stopping it first if it runs) with its store, name, ports.

        Returns once it answers JetStream and the meta leader sees it current; its streams
        catch up in the background (poll `stream_info` / `replica_last_seq` for that).
        """
        node = self._prepare_restart(index)
        self._wait_restarted(node, timeout)
        return node

    async def arestart(self, index: int, timeout: float = 30.0) -> ClusterNode:
        node = self._prepare_restart(index)
        await asyncio.to_thread(self._wait_restarted, node, timeout)
        return node

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Return once the running nodes agree on a meta leader that sees them all current.

        Down nodes are left out of the check; raises NatsStartError after `timeout`.
        """
        deadline = self._clock() + timeout
        while True:
            problem = self._meta_problem()
            if problem is None:
                return
            if self._clock() >= deadline:
                tails = "\n".join(
                    f"--- {node.name}:\n{node.log_tail()}" for node in self._nodes if node.running
                )
                raise NatsStartError(
                    f"NATS cluster {self.name!r} not ready after {timeout:g}s: {problem}\n{tails}"
                )
            time.sleep(_POLL_INTERVAL)

    # -- JetStream views ------------------------------------------------------------------

    def stream_info(self, stream: str, timeout: float = 1.0) -> dict[str, Any] | None:
        """`$JS.API.STREAM.INFO.<stream>` asked of the first running node that answers.

        The stream's leader answers it, so None while the stream has no leader (an election
        after its leader died) or when the stream does not exist.
        """
        for node in self._nodes:
            if not node.running:
                continue
            reply = js_api_request(
                node.host,
                node.client_port,
                f"$JS.API.STREAM.INFO.{stream}",
                timeout=timeout,
                auth=self.client_auth,
            )
            if reply is not None and "error" not in reply:
                return reply
        return None

    def stream_leader(self, stream: str) -> int | None:
        """Index of the node leading `stream` (e.g. "KV_<bucket>"), None if it has none now."""
        info = self.stream_info(stream)
        leader = ((info or {}).get("cluster") or {}).get("leader")
        return self._index_of(leader)

    def meta_leader(self) -> int | None:
        """Index of the node leading the JetStream meta group, as the first running node sees it."""
        for node in self._nodes:
            meta = self._meta(node)
            if meta is not None:
                return self._index_of(meta.get("leader"))
        return None

    def replica_last_seq(self, index: int, stream: str) -> int | None:
        """Last sequence in node `index`'s own replica of `stream` (its monitoring endpoint).

        Node-local, unlike `stream_info` (which the leader answers): a restarted node has
        caught up on `stream` once this reaches the leader's last sequence.
        """
        jsz = self._jsz(self.nodes[index], "accounts=true&streams=true")
        for account in (jsz or {}).get("account_details") or []:
            for detail in account.get("stream_detail") or []:
                if detail.get("name") == stream:
                    return int((detail.get("state") or {}).get("last_seq", 0))
        return None

    # -- internals ------------------------------------------------------------------------

    def _layout(self, binary: Path) -> list[ClusterNode]:
        if self._given_store_dir is not None:
            root = self._given_store_dir
            root.mkdir(parents=True, exist_ok=True)
        else:
            self._temp_root = root = Path(tempfile.mkdtemp(prefix="llmgw-nats-cluster-"))
        client_ports = self._client_ports()
        cluster_ports = _distinct_free_ports(self.host, self.size, avoid=set(client_ports))
        nodes = []
        for index in range(self.size):
            name = f"{self.name}-{index}"
            routes = ",".join(
                f"nats://{self.host}:{port}" for i, port in enumerate(cluster_ports) if i != index
            )
            args = [
                "--cluster_name", self.name,
                "--cluster", f"nats://{self.host}:{cluster_ports[index]}",
                "--routes", routes,
                "-m", "-1",  # monitoring on a free port, read from the ports file
                *self.extra_args,
            ]  # fmt: skip
            store = root / name
            server = EmbeddedNats(
                self.host,
                client_ports[index],
                store_dir=store,
                binary=binary,
                min_version=self.min_version,
                extra_args=args,
                server_name=name,
                kill_with_parent=self.kill_with_parent,
                client_auth=self.client_auth,
            )
            nodes.append(
                ClusterNode(
                    index, name, self.host, client_ports[index], cluster_ports[index], store, server
                )
            )
        return nodes

    def _client_ports(self) -> list[int]:
        if self.requested_port:
            return [self.requested_port + i for i in range(self.size)]
        return _distinct_free_ports(self.host, self.size)

    def _spawn_node(self, node: ClusterNode) -> None:
        if not port_is_free(node.host, node.cluster_port):
            raise NatsPortInUse(
                f"{node.name}: cluster port {node.host}:{node.cluster_port} is in use"
            )
        try:
            node.server.spawn()
        except NatsServerError as exc:
            raise type(exc)(f"{node.name}: {exc}") from exc

    def _wait_node(self, node: ClusterNode, deadline: float) -> None:
        try:
            node.server.wait_ready(max(deadline - self._clock(), 0.1))
        except NatsServerError as exc:
            raise type(exc)(f"{node.name}: {exc}") from exc

    def _wait_started(self, timeout: float) -> None:
        deadline = self._clock() + timeout
        try:
            for node in self._nodes:
                self._wait_node(node, deadline)
            self.wait_ready(max(deadline - self._clock(), 0.1))
        except BaseException:
            self.stop(timeout=2.0)
            raise

    def _prepare_restart(self, index: int) -> ClusterNode:
        node = self.nodes[index]
        node.server.stop()  # a running node stops gracefully; an exited one is reaped
        self._spawn_node(node)
        return node

    def _wait_restarted(self, node: ClusterNode, timeout: float) -> None:
        deadline = self._clock() + timeout
        self._wait_node(node, deadline)
        self.wait_ready(max(deadline - self._clock(), 0.1))

    def _index_of(self, server_name: object) -> int | None:
        return next((n.index for n in self._nodes if n.name == server_name), None)

    def _jsz(self, node: ClusterNode, query: str = "") -> dict[str, Any] | None:
        if not node.running or node.monitor_url is None:
            return None
        url = f"{node.monitor_url}/jsz" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=_HTTP_TIMEOUT) as response:
                body = json.loads(response.read())
        except (OSError, ValueError, urllib.error.URLError):
            return None
        return body if isinstance(body, dict) else None

    def _meta(self, node: ClusterNode) -> dict[str, Any] | None:
        meta = (self._jsz(node) or {}).get("meta_cluster")
        return meta if isinstance(meta, dict) else None

    def _meta_problem(self) -> str | None:
        """Why the cluster is not ready yet (see `wait_ready`), or None when it is."""
        running = [node for node in self._nodes if node.running]
        if not running:
            return "no node is running"
        leaders = {}
        for node in running:
            meta = self._meta(node)
            if meta is None:
                return f"{node.name} does not report JetStream cluster state yet"
            leaders[node.name] = meta.get("leader") or None
        if len(set(leaders.values())) != 1 or None in leaders.values():
            return f"no agreed meta leader yet ({leaders})"
        leader_name = next(iter(leaders.values()))
        leader_index = self._index_of(leader_name)
        if leader_index is None:
            return f"meta leader {leader_name!r} is not a node of this cluster"
        meta = self._meta(self._nodes[leader_index]) or {}
        peers = {peer.get("name"): peer for peer in meta.get("replicas") or []}
        for node in running:
            if node.index == leader_index:
                continue
            peer = peers.get(node.name)
            if peer is None or not peer.get("current") or peer.get("offline"):
                return f"meta leader {leader_name} does not see {node.name} current yet"
        return None


def _distinct_free_ports(host: str, count: int, avoid: set[int] | None = None) -> list[int]:
    """`count` distinct ports that were free a moment ago (the nodes bind them themselves).

    Not `llmgw.serving.free_port`: the NATS modules stay free of the HTTP server stack.
    """
    ports: list[int] = []
    taken = set(avoid or ())
    while len(ports) < count:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in taken:
            ports.append(port)
            taken.add(port)
    return ports
