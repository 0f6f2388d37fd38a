"""The keeper of `llmgw up`'s NATS cluster nodes, against a fake cluster (no processes)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from llmgw.nats_embedded import NatsStartError
from llmgw.services.up.nats_keeper import NatsKeeper
from llmgw.services.up.restart import RestartPolicy


@dataclass
class _Process:
    code: int | None = None

    def poll(self) -> int | None:
        return self.code


@dataclass
class _Server:
    process: _Process = field(default_factory=_Process)


@dataclass
class _Node:
    index: int
    running: bool = True
    pid: int = 100
    server: _Server = field(default_factory=_Server)


class _FakeCluster:
    """Node 1 crashes once; `arestart` fails `failures` times before it succeeds."""

    def __init__(self, failures: int = 0) -> None:
        self.nodes = [_Node(i) for i in range(3)]
        self.failures = failures
        self.restarted: list[int] = []

    def crash(self, index: int) -> None:
        node = self.nodes[index]
        node.running, node.server.process.code = False, -9

    async def arestart(self, index: int, timeout: float) -> _Node:
        self.restarted.append(index)
        if self.failures:
            self.failures -= 1
            raise NatsStartError("nats-server exited with code 1 during start; log tail:\n...")
        node = self.nodes[index]
        node.running, node.pid, node.server = True, node.pid + 1, _Server()
        return node


class _Output:
    """The keeper's lines; `ready_again` is set once it reports a node back."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.ready_again = asyncio.Event()

    def say(self, line: str) -> None:
        self.lines.append(line)
        if "ready again" in line:
            self.ready_again.set()


def _keeper(cluster: _FakeCluster, out: _Output, gave_up: list[str]) -> NatsKeeper:
    return NatsKeeper(
        cluster,  # type: ignore[arg-type]
        say=out.say,
        on_give_up=gave_up.append,
        policy_factory=lambda: RestartPolicy(max_exits=3, base_delay=0.0),
        clock=lambda: 0.0,
        poll_interval=0.001,
    )


async def test_a_crashed_node_is_reported_and_restarted_with_its_store() -> None:
    cluster, out, gave_up = _FakeCluster(), _Output(), []
    keeper = _keeper(cluster, out, gave_up)
    task = asyncio.create_task(keeper.run())
    cluster.crash(1)
    await asyncio.wait_for(out.ready_again.wait(), 5)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert keeper.restarts == 1 and cluster.restarted == [1] and cluster.nodes[1].running
    assert not gave_up
    assert out.lines == [
        "[nats-1] exited with code -9; restarting it with its store (1/3) in 0s",
        "[nats-1] ready again (pid 101), rejoined the cluster",
    ]


async def test_a_node_that_keeps_failing_to_start_stops_llmgw_up() -> None:
    cluster, out, gave_up = _FakeCluster(failures=10), _Output(), []
    keeper = _keeper(cluster, out, gave_up)
    cluster.crash(2)
    await asyncio.wait_for(keeper.run(), 5)  # returns once the policy gives up
    assert cluster.restarted == [2, 2]
    assert gave_up == [
        "[nats-2] did not come back (nats-server exited with code 1 during start; log tail:); "
        "3 exits within 60s, giving up"
    ]
    assert out.lines[-1] == gave_up[0]
