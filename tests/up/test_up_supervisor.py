"""The `llmgw up` supervisor against stand-in services (real processes, no llmgw services).

The stand-in (fake_service.py) starts in milliseconds, so ordering, restarts, crash
loops and shutdown are tested here; tests/up/test_up_e2e.py runs the real services.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest

from llmgw.services.up.plan import ServiceSpec
from llmgw.services.up.restart import RestartPolicy
from llmgw.services.up.supervisor import ClusterSupervisor

FAKE_SERVICE = Path(__file__).with_name("fake_service.py")


class LineRecorder:
    """A text sink for the supervisor that tests can wait on (no polling sleeps)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._changed = asyncio.Event()
        self._partial = ""

    def write(self, text: str) -> int:
        self._partial += text
        *complete, self._partial = self._partial.split("\n")
        self.lines.extend(complete)
        self._changed.set()
        return len(text)

    def flush(self) -> None:
        pass

    async def wait_for(self, pattern: str, count: int = 1, timeout: float = 10.0) -> re.Match[str]:
        """The `count`-th line matching `pattern`, waiting for it to be written."""
        regex = re.compile(pattern)
        async with asyncio.timeout(timeout):
            while True:
                matches = [m for m in map(regex.search, self.lines) if m]
                if len(matches) >= count:
                    return matches[count - 1]
                self._changed.clear()
                await self._changed.wait()

    def text(self) -> str:
        return "\n".join(self.lines)


def _specs() -> list[ServiceSpec]:
    return [
        ServiceSpec(
            "engine-1",
            ("sim", "engine", "--config", "c.yaml", "--endpoint", "engine-1"),
            "sim-engine",
        ),
        ServiceSpec(
            "remote-1",
            ("sim", "provider", "--config", "c.yaml", "--endpoint", "remote-1"),
            "sim-provider",
        ),
        ServiceSpec("admission", ("admission", "--config", "c.yaml"), "admission"),
        ServiceSpec("edge", ("edge", "--config", "c.yaml"), "edge"),
    ]


def _events(path: Path) -> list[tuple[str, str, int]]:
    if not path.exists():
        return []
    rows = [line.split() for line in path.read_text().splitlines()]
    return [(kind, name, int(pid)) for kind, name, pid in rows]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _make(
    tmp_path: Path,
    behaviour: dict[str, str] | None = None,
    *,
    ready_timeout: float = 10.0,
    grace: float = 5.0,
    max_exits: int = 5,
) -> tuple[ClusterSupervisor, LineRecorder, Path]:
    events = tmp_path / "events.txt"
    env = dict(os.environ)
    env["FAKE_SERVICE_BEHAVIOR"] = json.dumps(behaviour or {})
    env["FAKE_SERVICE_EVENTS"] = str(events)
    recorder = LineRecorder()
    supervisor = ClusterSupervisor(
        _specs(),
        env,
        out=recorder,  # type: ignore[arg-type]
        ready_timeout=ready_timeout,
        grace=grace,
        policy_factory=lambda: RestartPolicy(max_exits=max_exits, window=60, base_delay=0.01),
        command_prefix=(sys.executable, str(FAKE_SERVICE)),
    )
    return supervisor, recorder, events


async def _run_until_ready(supervisor: ClusterSupervisor) -> asyncio.Task[int]:
    ready = asyncio.Event()
    task = asyncio.create_task(supervisor.run(on_ready=ready.set))
    async with asyncio.timeout(20):
        await asyncio.wait(
            [task, asyncio.create_task(ready.wait())], return_when=asyncio.FIRST_COMPLETED
        )
    assert ready.is_set(), f"not ready: {task.result() if task.done() else 'still running'}"
    return task


async def test_starts_tiers_in_order_prefixes_output_and_stops_in_reverse(tmp_path: Path) -> None:
    supervisor, out, events = _make(tmp_path)
    task = await _run_until_ready(supervisor)
    assert supervisor.ready_url("edge") == "http://127.0.0.1:18080"
    assert "[engine-1] hello from engine-1" in out.lines
    assert "[admission] llmgw admission ready" in out.lines
    starts = [name for kind, name, _ in _events(events) if kind == "start"]
    assert set(starts[:2]) == {"engine-1", "remote-1"} and starts[2:] == ["admission", "edge"]

    supervisor.request_stop()
    assert await asyncio.wait_for(task, 20) == 0
    stops = [name for kind, name, _ in _events(events) if kind == "sigterm"]
    assert stops[:2] == ["edge", "admission"] and set(stops[2:]) == {"engine-1", "remote-1"}
    assert not any(_alive(pid) for _, _, pid in _events(events))


async def test_a_killed_child_is_reported_and_restarted(tmp_path: Path) -> None:
    supervisor, out, events = _make(tmp_path)
    task = await _run_until_ready(supervisor)
    first_pid = int((await out.wait_for(r"^\[engine-1\] started pid (\d+)")).group(1))

    os.kill(first_pid, signal.SIGKILL)
    await out.wait_for(r"^\[engine-1\] exited with code -9; restarting \(1/5\)")
    await out.wait_for(r"^\[engine-1\] ready again")
    new_pid = supervisor.pids()["engine-1"]
    assert new_pid != first_pid and _alive(new_pid)

    supervisor.request_stop()
    assert await asyncio.wait_for(task, 20) == 0
    assert not any(_alive(pid) for _, _, pid in _events(events))


async def test_a_crash_loop_stops_the_cluster_with_exit_code_1(tmp_path: Path) -> None:
    supervisor, out, events = _make(tmp_path, max_exits=3)
    task = await _run_until_ready(supervisor)
    for attempt in (1, 2):
        os.kill(supervisor.pids()["admission"], signal.SIGKILL)
        await out.wait_for(rf"^\[admission\] exited with code -9; restarting \({attempt}/3\)")
        await out.wait_for(r"^\[admission\] ready again", count=attempt)
    os.kill(supervisor.pids()["admission"], signal.SIGKILL)

    assert await asyncio.wait_for(task, 20) == 1
    assert re.search(
        r"\[admission\] exited with code -9; 3 exits within 60s, giving up", out.text()
    )
    assert not any(_alive(pid) for _, _, pid in _events(events))


async def test_a_child_exiting_before_ready_fails_the_start(tmp_path: Path) -> None:
    supervisor, out, events = _make(tmp_path, {"admission": "exit-before-ready"})
    assert await asyncio.wait_for(supervisor.run(), 20) == 1
    assert "[admission] cannot bind: address already in use" in out.lines  # its last words
    assert re.search(r"\[admission\] exited with code 3 before it was ready; stopping", out.text())
    assert "edge" not in {name for _, name, _ in _events(events)}
    assert not any(_alive(pid) for _, _, pid in _events(events))


async def test_startup_fails_fast_without_waiting_for_slow_siblings(tmp_path: Path) -> None:
    supervisor, out, events = _make(
        tmp_path, {"engine-1": "exit-before-ready", "remote-1": "silent"}, ready_timeout=60
    )
    assert await asyncio.wait_for(supervisor.run(), 15) == 1  # well before remote-1's timeout
    assert "[engine-1] exited with code 3 before it was ready" in out.text()
    assert not any(_alive(pid) for _, _, pid in _events(events))


async def test_a_silent_child_times_out_and_everything_stops(tmp_path: Path) -> None:
    supervisor, out, events = _make(tmp_path, {"remote-1": "silent"}, ready_timeout=1.0)
    assert await asyncio.wait_for(supervisor.run(), 20) == 1
    assert "[remote-1] printed no ready line within 1s" in out.text()
    assert not any(_alive(pid) for _, _, pid in _events(events))


async def test_a_child_ignoring_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    supervisor, out, events = _make(tmp_path, {"edge": "ignore-sigterm"}, grace=0.5)
    task = await _run_until_ready(supervisor)
    supervisor.request_stop()
    assert await asyncio.wait_for(task, 20) == 0
    assert "[edge] did not stop within 0.5s; killing it" in out.lines
    assert not any(_alive(pid) for _, _, pid in _events(events))


@pytest.mark.parametrize(
    ("exit_times", "expected"),
    [
        pytest.param([0], [(True, 0.5)], id="first-exit-restarts-after-base-delay"),
        pytest.param(
            [0, 1, 2, 3], [(True, 0.5), (True, 1.0), (True, 2.0), (True, 4.0)], id="backoff-doubles"
        ),
        pytest.param(
            [0, 1, 2, 3, 4],
            [(True, 0.5), (True, 1.0), (True, 2.0), (True, 4.0), (False, 0.0)],
            id="fifth-exit-within-window-gives-up",
        ),
        pytest.param(
            [0, 100, 200, 300, 400, 500], [(True, 0.5)] * 6, id="exits-far-apart-always-restart"
        ),
    ],
)
def test_restart_policy(exit_times: list[float], expected: list[tuple[bool, float]]) -> None:
    policy = RestartPolicy(max_exits=5, window=60, base_delay=0.5, max_delay=10)
    got = [(d.restart, d.delay) for d in (policy.record_exit(t) for t in exit_times)]
    assert got == expected


def test_restart_delay_is_capped() -> None:
    policy = RestartPolicy(max_exits=100, window=60, base_delay=1, max_delay=3)
    delays = [policy.record_exit(t).delay for t in range(6)]
    assert delays == [1, 2, 3, 3, 3, 3]
