"""The xdist workers' gate (tests/latency_gate.py): the latency unit waits for the modules
running outside it, no module starts while it waits or runs, and its companions pass freely.

Each gate opens its own descriptors, and flock locks of separate descriptors exclude each other
within one process as between processes: threads stand in for the workers. Whether a lock is
held is asked of the files directly (a non-blocking flock on a fresh descriptor), not guessed
from time.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from latency_gate import LatencyGate
from timing import eventually

WAIT = 10.0  # seconds a thread may take to get through a gate that is open


def _free(folder: Path, name: str, how: int) -> bool:
    """Whether `name` could be locked `how` (LOCK_SH or LOCK_EX) now."""
    descriptor = os.open(folder / name, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(descriptor, how | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(descriptor)  # closing drops a lock it got
    return True


def _held_back(thread: threading.Thread) -> bool:
    """Whether `thread` is still waiting a moment after it was started (a gate that let it
    through would let it end)."""
    thread.join(0.2)
    return thread.is_alive()


@pytest.fixture
def started() -> Iterator[Callable[[Callable[[], None]], threading.Thread]]:
    threads: list[threading.Thread] = []

    def start(work: Callable[[], None]) -> threading.Thread:
        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        threads.append(thread)
        return thread

    yield start
    for thread in threads:
        thread.join(WAIT)


async def test_the_unit_waits_for_running_modules_and_no_module_starts_until_it_ends(
    tmp_path: Path, started
) -> None:
    running = LatencyGate(str(tmp_path), companions=0)
    unit = LatencyGate(str(tmp_path), companions=0)
    later = LatencyGate(str(tmp_path), companions=0)

    running.enter("shared")
    assert not _free(tmp_path, "room", fcntl.LOCK_EX)
    unit_in = started(lambda: unit.enter("exclusive"))
    # The unit has the turnstile (no module may start) and waits for the module running.
    await eventually(lambda: not _free(tmp_path, "turnstile", fcntl.LOCK_EX), WAIT, "the turnstile")
    assert unit.holding is None
    later_in = started(lambda: later.enter("shared"))

    running.leave()
    unit_in.join(WAIT)
    assert unit.holding == "exclusive"
    assert not _free(tmp_path, "room", fcntl.LOCK_SH)  # nothing else runs beside it
    assert _held_back(later_in) and later.holding is None  # waiting at the turnstile

    unit.leave()
    later_in.join(WAIT)
    assert later.holding == "shared"
    later.leave()
    assert _free(tmp_path, "room", fcntl.LOCK_EX) and _free(tmp_path, "turnstile", fcntl.LOCK_EX)


def test_modules_share_the_gate_and_companions_pass_it_while_the_unit_runs(
    tmp_path: Path, started
) -> None:
    first, second = (LatencyGate(str(tmp_path), companions=1) for _ in range(2))
    unit = LatencyGate(str(tmp_path), companions=1)
    other = LatencyGate(str(tmp_path), companions=1)

    first.enter("shared")  # the first to ask becomes the run's companion
    second.enter("shared")  # modules outside the unit share the room
    assert first.companion and not second.companion
    assert not _free(tmp_path, "room", fcntl.LOCK_EX)
    second.leave()

    unit_in = started(lambda: unit.enter("exclusive"))
    unit_in.join(WAIT)  # the companion's module does not hold the unit back
    assert unit.holding == "exclusive"
    first.leave()
    first_in = started(lambda: first.enter("shared"))
    first_in.join(WAIT)  # ... and its next one starts while the unit runs
    assert first.holding == "shared"
    other_in = started(lambda: other.enter("shared"))
    assert _held_back(other_in) and other.holding is None  # no companion's place left
    unit.leave()
    other_in.join(WAIT)
    assert other.holding == "shared"


def test_a_worker_that_dies_holding_the_gate_releases_it(tmp_path: Path) -> None:
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the worker: takes the gate for the unit, then dies without leaving
        LatencyGate(str(tmp_path), companions=0).enter("exclusive")
        os.write(write, b"in")
        os._exit(0)
    os.close(write)
    assert os.read(read, 2) == b"in"
    os.close(read)
    os.waitpid(child, 0)
    assert _free(tmp_path, "room", fcntl.LOCK_EX) and _free(tmp_path, "turnstile", fcntl.LOCK_EX)
