"""An in-process KVStore: the test double of the JetStream KV adapter, with the same contract.

Ownership and concurrency: one MemoryKV belongs to one event loop. Each operation runs the
optional `before_op(op_name, key)` hook first, then checks and applies its write with no await in
between, so every operation is atomic; the hook is where a test parks a task to force an
interleaving (for example: let task A read, then let task B write, then let A's CAS fail).

Revisions come from one bucket-wide counter, as stream sequences do. Failed writes consume no
revision. Every applied write is appended to `history` in revision order (deletes as
`deleted=True` entries), which is what the history checker replays.
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import AsyncGenerator, Awaitable, Callable

from llmgw.clock import SYSTEM, Clock, TimeSource, wall_of
from llmgw.state.kv import CasConflict, KVEntry, validate_key, validate_prefix

__all__ = ["BeforeOp", "MemoryKV"]

BeforeOp = Callable[[str, str], Awaitable[None]]


class MemoryKV:
    """KVStore in memory. `clock` stamps KVEntry.timestamp (inject a test clock to control it)."""

    def __init__(
        self,
        *,
        clock: Clock | TimeSource = SYSTEM,
        before_op: BeforeOp | None = None,
    ) -> None:
        self.before_op = before_op
        self.history: list[KVEntry] = []
        self._clock = wall_of(clock)
        self._revision = 0
        self._last: dict[str, KVEntry] = {}  # last write per key, tombstones included
        self._watchers: list[tuple[str, asyncio.Queue[KVEntry]]] = []

    @property
    def revision(self) -> int:
        """The bucket's last revision (0 before the first write)."""
        return self._revision

    async def _enter(self, op_name: str, key: str) -> None:
        if self.before_op is not None:
            await self.before_op(op_name, key)

    def _live(self, key: str) -> KVEntry | None:
        entry = self._last.get(key)
        return None if entry is None or entry.deleted else entry

    def _apply(self, key: str, value: bytes, *, deleted: bool = False) -> int:
        self._revision += 1
        entry = KVEntry(
            key, b"" if deleted else bytes(value), self._revision, deleted, float(self._clock())
        )
        self._last[key] = entry
        self.history.append(entry)
        for prefix, queue in self._watchers:
            if key.startswith(prefix):
                queue.put_nowait(entry)
        return entry.revision

    def _check_revision(self, key: str, revision: int) -> None:
        if isinstance(revision, bool) or not isinstance(revision, int) or revision < 1:
            raise ValueError(
                f"revision must be a positive int, got {revision!r} (use create for a missing key)"
            )
        # Like a stream's last-subject-sequence check: a tombstone is a revision too.
        last = self._last.get(key)
        if last is None or last.revision != revision:
            actual = (
                "missing"
                if last is None
                else (f"deleted at {last.revision}" if last.deleted else f"at {last.revision}")
            )
            raise CasConflict(key, revision, f"key is {actual}")

    async def get(self, key: str) -> KVEntry | None:
        validate_key(key)
        await self._enter("get", key)
        return self._live(key)

    async def create(self, key: str, value: bytes) -> int:
        validate_key(key)
        await self._enter("create", key)
        live = self._live(key)
        if live is not None:
            raise CasConflict(key, None, f"key exists at {live.revision}")
        return self._apply(key, value)

    async def update(self, key: str, value: bytes, revision: int) -> int:
        validate_key(key)
        await self._enter("update", key)
        self._check_revision(key, revision)
        return self._apply(key, value)

    async def delete(self, key: str, revision: int) -> int:
        validate_key(key)
        await self._enter("delete", key)
        self._check_revision(key, revision)
        return self._apply(key, b"", deleted=True)

    async def put(self, key: str, value: bytes) -> int:
        validate_key(key)
        await self._enter("put", key)
        return self._apply(key, value)

    async def list(self, prefix: str) -> list[KVEntry]:
        validate_prefix(prefix)
        await self._enter("list", prefix)
        return self._snapshot(prefix)

    def _snapshot(self, prefix: str) -> builtins.list[KVEntry]:  # `list` is the method here
        entries = [e for k, e in self._last.items() if k.startswith(prefix) and not e.deleted]
        return sorted(entries, key=lambda e: e.revision)

    async def watch(self, prefix: str) -> AsyncGenerator[KVEntry, None]:
        validate_prefix(prefix)
        await self._enter("watch", prefix)
        # Snapshot and registration happen with no await in between: no write falls in a gap.
        queue: asyncio.Queue[KVEntry] = asyncio.Queue()
        registration = (prefix, queue)
        initial = self._snapshot(prefix)
        self._watchers.append(registration)
        try:
            for entry in initial:
                yield entry
            while True:
                yield await queue.get()
        finally:
            self._watchers.remove(registration)
