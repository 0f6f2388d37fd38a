"""The gate between pytest-xdist workers that keeps the latency unit's company small.

The tests that measure on the wall clock (marked `latency`) and those that drive hundreds of
concurrent requests against real timeouts (`heavy`) form one unit of work, run on one worker
(tests/conftest.py). On a machine with fewer cores than workers, the other workers' modules
would slow it down, and it them: so the unit runs with at most `UNIT_COMPANIONS` workers running
modules beside it, and the rest wait at this gate until it has ended.
"""

from __future__ import annotations

import fcntl
import os

__all__ = ["UNIT_COMPANIONS", "LatencyGate"]

# Workers that run their modules beside the latency unit. Run alone, the unit keeps about a third
# of one core busy (2:34 of CPU in 7:05 on 2026-12-07) and the other modules about half of one
# (8:43 in 15:30): two of them beside it leave the machine's 2 cores some room, where four
# workers at once starved tests past their timeouts.
UNIT_COMPANIONS = int(os.environ.get("LLMGW_TEST_UNIT_COMPANIONS", "2"))


class LatencyGate:
    """One xdist worker's side of the gate (one per worker process).

    Files the workers lock (flock) in a folder shared by the run's workers. The first
    `companions` workers to start a module outside the unit each take a `companion-<i>` file
    for good and pass the gate freely. Any other worker holds `room` shared while it runs a
    module outside the unit, from its first test's set-up to its last test's teardown (the
    module's fixtures and the processes they start included); the unit's worker holds `room`
    exclusively from the unit's first test to its last. The unit's worker takes `turnstile`
    before it waits for `room`, and the others take `turnstile` for a moment before they enter
    `room`: no module starts while the unit waits for those running to end. A worker that dies
    drops its locks with its process."""

    def __init__(self, folder: str, companions: int = UNIT_COMPANIONS) -> None:
        self._folder = folder
        self._companions = companions
        self._turnstile = self._open("turnstile")
        self._room = self._open("room")
        self._companion: bool | None = None  # unknown until its first module outside the unit
        self.holding: str | None = None  # "shared", "exclusive" or None

    def _open(self, name: str) -> int:
        return os.open(os.path.join(self._folder, name), os.O_RDWR | os.O_CREAT)

    @property
    def companion(self) -> bool:
        """Whether this worker runs its modules beside the unit (decided at its first ask)."""
        if self._companion is None:
            self._companion = False
            for index in range(self._companions):
                descriptor = self._open(f"companion-{index}")
                try:
                    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(descriptor)
                    continue
                self._companion = True  # the descriptor stays open: the lock lasts the run
                break
        return self._companion

    def enter(self, how: str) -> None:
        """Hold the gate `how` ("shared": a module outside the unit; "exclusive": the unit),
        waiting as long as it takes."""
        if self.holding == how:
            return
        self.leave()
        if how == "exclusive":
            fcntl.flock(self._turnstile, fcntl.LOCK_EX)
            fcntl.flock(self._room, fcntl.LOCK_EX)
        elif not self.companion:
            fcntl.flock(self._turnstile, fcntl.LOCK_EX)
            try:
                fcntl.flock(self._room, fcntl.LOCK_SH)
            finally:
                fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        self.holding = how

    def leave(self) -> None:
        if self.holding is None:
            return
        if self.holding == "exclusive" or not self._companion:
            fcntl.flock(self._room, fcntl.LOCK_UN)
        if self.holding == "exclusive":
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        self.holding = None
