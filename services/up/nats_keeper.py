"""Keeps `llmgw up`'s embedded NATS server, or the nodes of its embedded cluster, running.

Policy (the same as for the services, `restart.py`): a node that exits is reported and started
again with its own store, name and ports after the policy's backoff, so it rejoins the cluster
and catches up from its peers; the other nodes keep serving meanwhile (a 3-node cluster keeps
its quorum with one node down). A node that exits `max_exits` times within the window is broken:
the keeper calls `on_give_up` and `llmgw up` stops with exit code 1.

A single server (`OneServer`) is kept the same way: started again on its port with its store,
so the services' connections reconnect to the URL they have and the buckets are as they were
(pins, leases, members). Nothing serves NATS while it is down: the edge answers as
`admission.on_nats_outage` says (503 with Retry-After by default) until it is back.

Ownership: the cluster (its processes and stores) belongs to `llmgw up`'s main function, which
stops it after the services; the keeper only restarts nodes, one at a time, from the event
loop's thread (die-with-parent is bound to the spawning thread, see `arestart`). A restart in
progress when the keeper is cancelled finishes its bounded readiness wait in a worker thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from llmgw.clock import SYSTEM, Clock, TimeSource, monotonic_of
from llmgw.nats_cluster import EmbeddedNatsCluster
from llmgw.nats_embedded import EmbeddedNats, NatsServerError
from llmgw.services.up.restart import RestartPolicy

DEFAULT_POLL_INTERVAL_S = 0.25
DEFAULT_RESTART_TIMEOUT_S = 30.0


def node_label(index: int) -> str:
    """How `llmgw up` prefixes a node's lines (the plan's name for it)."""
    return f"nats-{index}"


class OneServer:
    """A single embedded server as `NatsKeeper` sees a cluster: one node (`llmgw up` labels
    it "nats": `NatsKeeper(OneServer(server), label=..., back=...)`)."""

    index = 0

    def __init__(self, server: EmbeddedNats) -> None:
        self.server = server

    @property
    def nodes(self) -> tuple[OneServer]:
        return (self,)

    @property
    def running(self) -> bool:
        return self.server.running

    @property
    def pid(self) -> int:
        return self.server.pid

    async def arestart(self, index: int, timeout: float) -> OneServer:
        await self.server.arestart(timeout)
        return self


class NatsKeeper:
    """Polls the nodes of `cluster`; restarts one that exited, per `RestartPolicy`. `label`
    names a node in the lines it says, `back` how a node that is ready again stands."""

    def __init__(
        self,
        cluster: EmbeddedNatsCluster | OneServer,
        *,
        say: Callable[[str], None],
        on_give_up: Callable[[str], None],
        policy_factory: Callable[[], RestartPolicy] = RestartPolicy,
        clock: Clock | TimeSource = SYSTEM,
        poll_interval: float = DEFAULT_POLL_INTERVAL_S,
        restart_timeout: float = DEFAULT_RESTART_TIMEOUT_S,
        label: Callable[[int], str] = node_label,
        back: str = "rejoined the cluster",
    ) -> None:
        self._cluster = cluster
        self._label = label
        self._back = back
        self._say = say
        self._on_give_up = on_give_up
        self._policies = [policy_factory() for _ in cluster.nodes]
        self._clock = monotonic_of(clock)
        self._poll_interval = poll_interval
        self._restart_timeout = restart_timeout
        self.restarts = 0  # successful restarts, for tests and the curious

    async def run(self) -> None:
        """Watch until cancelled, or until a node crash-loops (then `on_give_up` was called)."""
        while True:
            for node in self._cluster.nodes:
                if not node.running and not await self._recover(node.index):
                    return
            await asyncio.sleep(self._poll_interval)

    async def _recover(self, index: int) -> bool:
        """Restart node `index` until it is ready again; False once the policy gives up."""
        label = self._label(index)
        policy = self._policies[index]
        process = self._cluster.nodes[index].server.process
        what = f"exited with code {process.poll() if process is not None else None}"
        while True:
            decision = policy.record_exit(self._clock())
            if not decision.restart:
                reason = (
                    f"[{label}] {what}; {decision.exits_in_window} exits within "
                    f"{policy.window:g}s, giving up"
                )
                self._say(reason)
                self._on_give_up(reason)
                return False
            self._say(
                f"[{label}] {what}; restarting it with its store "
                f"({decision.exits_in_window}/{decision.max_exits}) in {decision.delay:g}s"
            )
            await asyncio.sleep(decision.delay)
            try:
                node = await self._cluster.arestart(index, self._restart_timeout)
            except NatsServerError as exc:
                what = f"did not come back ({str(exc).splitlines()[0]})"
                continue
            self.restarts += 1
            self._say(f"[{label}] ready again (pid {node.pid}), {self._back}")
            return True
