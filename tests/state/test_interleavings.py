"""Random interleavings of routing operations never break an invariant, and never leak.

Every KV call of a running operation parks in MemoryKV's `before_op` hook; at each step
hypothesis chooses: start an operation (new pin, pinned, temporary, repin, release, renew,
expire leases, expire pins, repair) on one of two instances, let one parked operation take its
next KV step, crash one (it never runs again: a process dying between two steps), or move the
clock. Two checks:

- after every step, the clients' view: a lease a client holds and that is live by the clock
  still holds its slot, and is listed in its pin while that pin exists (no theft, no pin
  expiring under it);
- at the end, the history checker replays every write (I2a-d, double grants, pin deleted while
  listing leases), then, traffic stopped, the reaper primitives bring every count back to zero
  (I1: crashes leak nothing for longer than the timeouts).
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from routing_helpers import SteppedClock

from llmgw.config.catalog import Limits
from llmgw.core.leasekeys import LeaseSlotValue, PinValue, model_key, pin_key
from llmgw.core.leases import Admission, AdmissionResult, Lease, PinMatch, RepinResult
from llmgw.state import KVEntry, MemoryKV, check_history
from llmgw.state.routing_state import RoutingState

MODEL = "llama-3.1-8b"
LEASE_TIMEOUT = 30.0
PIN_INACTIVITY_TIMEOUT = 300.0
GRACE = 60.0
LIMITS: dict[tuple[str, str], Limits | None] = {
    ("iris", MODEL): Limits(
        max_pinned_sessions=2,
        max_global_in_flight_request_slots=3,
        global_in_flight_request_slots_reserved_for_pinned_sessions=1,
        max_per_session_in_flight_request_slots=2,
    ),
    ("iris-b", MODEL): Limits(
        max_pinned_sessions=1,
        max_global_in_flight_request_slots=2,
        global_in_flight_request_slots_reserved_for_pinned_sessions=1,
        max_per_session_in_flight_request_slots=1,
    ),
    ("tensorx", MODEL): None,
}
PROVIDERS = ["iris", "iris-b", "tensorx"]
SESSIONS = ["s1", "s2"]
OPERATIONS = [
    "new",
    "pinned",
    "get_then_pinned",
    "temporary",
    "repin",
    "release",
    "renew",
    "expire_leases",
    "expire_pins",
    "repair",
]
# Weights by repetition; hypothesis shrinks towards the first entry (let an operation proceed).
ACTIONS = ["step", "step", "step", "step", "start", "start", "start", "tick", "crash"]
MAX_RUNNING = 4
SETTLE_TURNS = 10_000


@dataclass
class _Op:
    seq: int
    name: str
    started_at: float
    task: asyncio.Task[Any]
    lease_id: str | None = None  # the held lease a release/renew works on

    def __repr__(self) -> str:  # how a failing example names it
        return f"{self.name}#{self.seq}"


@dataclass
class Scheduler:
    """Parks every KV call of the operations it started until a step lets it through."""

    ops: dict[asyncio.Task[Any], _Op] = field(default_factory=dict)
    parked: dict[asyncio.Task[Any], asyncio.Future[None]] = field(default_factory=dict)

    async def before_op(self, op_name: str, key: str) -> None:
        task = asyncio.current_task()
        if task not in self.ops:
            return  # setup, mirror watches, the test's own reads
        assert task is not None
        gate = asyncio.get_running_loop().create_future()
        self.parked[task] = gate
        await gate

    def waiting(self) -> list[_Op]:
        return sorted((self.ops[t] for t in self.parked), key=lambda op: op.seq)

    async def settle(self) -> None:
        """Run the loop until every operation is parked at a KV call or finished."""
        for _ in range(SETTLE_TURNS):
            if all(t.done() or t in self.parked for t in self.ops):
                return
            await asyncio.sleep(0)
        raise AssertionError("an operation neither parks nor finishes")

    def step(self, op: _Op) -> None:
        self.parked.pop(op.task).set_result(None)

    def crash(self, op: _Op) -> None:
        self.parked.pop(op.task)
        op.task.cancel()


class Scenario:
    def __init__(self, data: st.DataObject) -> None:
        self.data = data
        self.clock = SteppedClock()
        self.scheduler = Scheduler()
        self.kv = MemoryKV(clock=self.clock, before_op=self.scheduler.before_op)
        self.states = [
            RoutingState(
                self.kv,
                LIMITS,
                clock=self.clock,
                rng=random.Random(seed),
                lease_timeout=LEASE_TIMEOUT,
                pin_inactivity_timeout=PIN_INACTIVITY_TIMEOUT,
                instance_id=f"e{seed}",
            )
            for seed in (1, 2)
        ]
        self.held: dict[str, Lease] = {}  # leases clients hold (newest revision)
        self.busy: set[str] = set()  # held leases with a release/renew in flight
        self.current: dict[str, KVEntry] = {}  # the bucket now, replayed from its history
        self.replayed = 0
        self.seq = itertools.count()
        # Swarm testing: each example enables a subset of the operations, so rare sequences
        # of a few kinds (expire, re-grant, stale release...) are not drowned by the others.
        self.enabled = self.draw(
            st.lists(st.sampled_from(OPERATIONS), min_size=1, unique=True), "enabled operations"
        )

    def draw(self, strategy: st.SearchStrategy[Any], label: str) -> Any:
        return self.data.draw(strategy, label=label)

    # ---- operations -------------------------------------------------------------------------

    def start(self, name: str, coro: Coroutine[Any, Any, Any], lease_id: str | None = None):
        task = asyncio.get_running_loop().create_task(coro)
        self.scheduler.ops[task] = _Op(next(self.seq), name, self.clock.now, task, lease_id)

    def start_random_operation(self) -> None:
        state = self.states[self.draw(st.integers(0, 1), "instance")]
        free_leases = sorted(set(self.held) - self.busy)
        kinds = [k for k in self.enabled if free_leases or k not in ("release", "renew")]
        if not kinds:
            kinds = ["temporary"]
        kind = self.draw(st.sampled_from(kinds), "operation")

        def session() -> str:
            return self.draw(st.sampled_from(SESSIONS), "session")

        def provider() -> str:
            return self.draw(st.sampled_from(PROVIDERS), "provider")

        now = self.clock.now
        if kind == "new":
            self.start(kind, state.try_admit_unpinned_session_request(provider(), MODEL, session()))
        elif kind == "pinned":
            self.start(kind, state.try_admit_pinned_session_request(MODEL, session()))
        elif kind == "get_then_pinned":  # the seed's flow: the pin read is handed over
            self.start(kind, _get_and_admit_pinned(state, session()))
        elif kind == "temporary":
            self.start(kind, state.try_admit_request_without_pin(provider(), MODEL))
        elif kind == "repin":
            self.start(kind, _get_and_repin(state, session(), provider()))
        elif kind == "expire_leases":
            self.start(kind, state.expire_leases(now))
        elif kind == "expire_pins":
            self.start(kind, state.expire_pins(now))
        elif kind == "repair":
            # The documented assumption: the grace exceeds any running operation's duration.
            oldest = min(
                (op.started_at for op in self.scheduler.ops.values() if not op.task.done()),
                default=now,
            )
            self.start(kind, state.repair(now, max(GRACE, now - oldest + 1)))
        else:
            lease_id = self.draw(st.sampled_from(free_leases), "lease")
            lease = self.held[lease_id]
            if kind == "release":
                del self.held[lease_id]  # a releasing client no longer holds it
                refresh = self.draw(st.booleans(), "refresh_pin")
                self.start(kind, state.release_request_lease(lease, refresh))
            else:
                self.busy.add(lease_id)
                self.start(kind, state.renew_request_lease(lease), lease_id)

    def collect_finished(self) -> None:
        for task, op in list(self.scheduler.ops.items()):
            if not task.done():
                continue
            del self.scheduler.ops[task]
            if task.cancelled():
                if op.lease_id is not None:  # its client died with it
                    self.busy.discard(op.lease_id)
                    self.held.pop(op.lease_id, None)
                continue
            result = task.result()  # an exception here is a bug: let it fail the test
            if op.name == "renew":
                assert op.lease_id is not None
                self.busy.discard(op.lease_id)
                if result is None:
                    self.held.pop(op.lease_id, None)
                else:
                    self.held[op.lease_id] = result
            if isinstance(result, RepinResult):
                if result.pin_match == PinMatch.NOT_MATCHED:
                    assert result.admission is None
                    continue
                result = result.admission
            if isinstance(result, Admission) and result.lease is not None:
                assert result.result == AdmissionResult.ADMITTED
                self.held[result.lease.lease_id] = result.lease

    # ---- checks -----------------------------------------------------------------------------

    def check_held_leases(self) -> None:
        """A live lease a client holds keeps its slot and its place in its (unchanged) pin."""
        for entry in self.kv.history[self.replayed :]:
            self.current[entry.key] = entry
        self.replayed = len(self.kv.history)
        state = {key: entry for key, entry in self.current.items() if not entry.deleted}
        for lease in self.held.values():
            if self.clock.now >= lease.renewed_at + LEASE_TIMEOUT:
                continue  # expired: the reaper may take it
            entry = state.get(lease.key)
            assert entry is not None, f"live lease {lease.lease_id} lost its key {lease.key}"
            value = LeaseSlotValue.from_json(entry.value)
            assert value.is_taken and value.lease_id == lease.lease_id, (
                f"live lease {lease.lease_id} lost its slot {lease.key} to {value}"
            )
            if lease.pin_id is None or lease.session is None:
                continue
            pin_entry = state.get(pin_key(model_key(lease.model), lease.session))
            if pin_entry is None:
                continue  # the pin moved on and expired later: no longer this lease's pin
            pin = PinValue.from_json(pin_entry.value)
            if pin.pin_id == lease.pin_id:
                assert lease.lease_id in pin.leases, (
                    f"live lease {lease.lease_id} missing from its pin {pin}"
                )

    async def run(self) -> None:
        for state in self.states:
            await state.start()
        # Start from a pinned session with a request in flight on each limited provider.
        for session, provider in zip(SESSIONS, PROVIDERS, strict=False):
            admission = await self.states[0].try_admit_unpinned_session_request(
                provider, MODEL, session
            )
            assert admission.lease is not None
            self.held[admission.lease.lease_id] = admission.lease
        try:
            await self.play()
            await self.finish()
        finally:
            for task in self.scheduler.ops:
                task.cancel()
            for state in self.states:
                await state.close()

    async def play(self) -> None:
        steps = self.draw(st.integers(1, 80), "steps")
        for _ in range(steps):
            waiting = self.scheduler.waiting()
            full = len(self.scheduler.ops) >= MAX_RUNNING
            actions = [
                a
                for a in ACTIONS
                if (waiting or a not in ("step", "crash")) and not (full and a == "start")
            ]
            action = self.draw(st.sampled_from(actions), "action")
            if action == "step" or action == "crash":
                op = self.draw(st.sampled_from(waiting), "which")
                (self.scheduler.step if action == "step" else self.scheduler.crash)(op)
            elif action == "start":
                self.start_random_operation()
            else:
                self.clock.advance(self.draw(st.sampled_from([1.0, 29.0, 31.0, 301.0]), "tick"))
            await self.scheduler.settle()
            self.collect_finished()
            self.check_held_leases()

    async def finish(self) -> None:
        # Let every surviving operation complete, then stop all traffic.
        while self.scheduler.ops:
            waiting = self.scheduler.waiting()
            if waiting:
                self.scheduler.step(waiting[0])
            await self.scheduler.settle()
            self.collect_finished()
            self.check_held_leases()
        violations = check_history(self.kv.history, LIMITS, LEASE_TIMEOUT)
        assert violations == [], "\n".join(map(str, violations))
        for lease in list(self.held.values()):
            await self.states[0].release_request_lease(lease, refresh_pin=True)
        # I1: past every timeout and grace, one pass of the reaper leaves nothing behind.
        now = self.clock.advance(LEASE_TIMEOUT + GRACE + PIN_INACTIVITY_TIMEOUT)
        reaper = self.states[1]
        await reaper.expire_leases(now)
        await reaper.repair(now, GRACE)
        await reaper.expire_pins(now)
        usage = await reaper.usage()
        leftovers = [p for p in usage.pairs if p.pins or p.pin_slots_taken or p.leases]
        assert leftovers == [], leftovers
        violations = check_history(self.kv.history, LIMITS, LEASE_TIMEOUT)
        assert violations == [], "\n".join(map(str, violations))


async def _get_and_admit_pinned(state: RoutingState, session: str) -> Admission | None:
    pin = await state.get_pin(MODEL, session)
    if pin is None:
        return None
    return await state.try_admit_pinned_session_request(MODEL, session, pin=pin)


async def _get_and_repin(state: RoutingState, session: str, provider: str) -> RepinResult | None:
    pin = await state.get_pin(MODEL, session)
    if pin is None:
        return None
    return await state.try_compare_and_swap_pin_and_admit_request(pin, MODEL, session, provider)


@settings(
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.data())
def test_random_interleavings_with_crashes_keep_every_invariant(data: st.DataObject) -> None:
    asyncio.run(Scenario(data).run())
