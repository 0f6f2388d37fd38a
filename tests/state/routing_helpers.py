"""Shared pieces of the routing-state tests: limits, a stepped clock, a KV that can interpose
another operation (or a crash) before a chosen call, and the invariant check over a history."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from llmgw.config.catalog import Limits
from llmgw.state import KVEntry, KVStore

MODEL = "llama-3.1-8b"  # dots: never raw in a key
IRIS = "iris"  # P=2, G=4, R=1, S=2
IRIS_B = "iris-b"  # P=1, G=2, R=1, S=1: one unreserved slot
TENSORX = "tensorx"  # no limits
LEASE_TIMEOUT = 30.0
PIN_INACTIVITY_TIMEOUT = 300.0
GRACE = 60.0

LIMITS: dict[tuple[str, str], Limits | None] = {
    (IRIS, MODEL): Limits(
        max_pinned_sessions=2,
        max_global_in_flight_request_slots=4,
        global_in_flight_request_slots_reserved_for_pinned_sessions=1,
        max_per_session_in_flight_request_slots=2,
    ),
    (IRIS_B, MODEL): Limits(
        max_pinned_sessions=1,
        max_global_in_flight_request_slots=2,
        global_in_flight_request_slots_reserved_for_pinned_sessions=1,
        max_per_session_in_flight_request_slots=1,
    ),
    (TENSORX, MODEL): None,
}


class SteppedClock:
    """The injected clock: time moves only when a test moves it."""

    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


class Crash(Exception):
    """The process running the operation died at this point (nothing after it runs)."""


async def crash() -> None:
    raise Crash


@dataclass
class _Hook:
    op: str
    key_prefix: str
    action: Callable[[], Awaitable[None]]
    remaining: int = 1


@dataclass
class SteppedKV:
    """A KVStore passing every call to `inner`, after running a registered action first.

    `on("update", "pin.", action)` runs `action` (another instance's operation on `inner`, or
    `crash`) just before this store's next update of a key starting with "pin.".
    """

    inner: KVStore
    hooks: list[_Hook] = field(default_factory=list)

    def on(
        self, op: str, key_prefix: str, action: Callable[[], Awaitable[None]], *, times: int = 1
    ) -> None:
        self.hooks.append(_Hook(op, key_prefix, action, times))

    async def _before(self, op: str, key: str) -> None:
        for hook in self.hooks:
            if hook.remaining and hook.op == op and key.startswith(hook.key_prefix):
                hook.remaining -= 1
                await hook.action()

    async def get(self, key: str) -> KVEntry | None:
        await self._before("get", key)
        return await self.inner.get(key)

    async def create(self, key: str, value: bytes) -> int:
        await self._before("create", key)
        return await self.inner.create(key, value)

    async def update(self, key: str, value: bytes, revision: int) -> int:
        await self._before("update", key)
        return await self.inner.update(key, value, revision)

    async def delete(self, key: str, revision: int) -> int:
        await self._before("delete", key)
        return await self.inner.delete(key, revision)

    async def put(self, key: str, value: bytes) -> int:
        await self._before("put", key)
        return await self.inner.put(key, value)

    async def list(self, prefix: str) -> list[KVEntry]:
        await self._before("list", prefix)
        return await self.inner.list(prefix)

    def watch(self, prefix: str) -> AsyncIterator[KVEntry]:
        return self.inner.watch(prefix)


async def yield_to_other_tasks(op_name: str, key: str) -> None:
    # A network store suspends on every call; MemoryKV tasks interleave only if it does too.
    await asyncio.sleep(0)
