"""Recorders of every write a bucket applied, in order, for the history checker.

`HistoryRecorder` follows a JetStream KV bucket's whole stream (`$KV.<bucket>.>`) from its first
message with an ordered push consumer and turns each message into a KVEntry (deletes, purges and
server limit markers as `deleted=True`). `MemoryHistory` offers the same interface over
`MemoryKV.history`. Both: `entries` (recorded so far), `await sync()` (wait until every write
applied so far is recorded; returns a copy), `await stop()`.

Completeness. The bucket's stream numbers writes 1, 2, 3... with no holes, so the recorder can
tell when it missed one: a bucket keeps only `history` messages per key, and a write superseded
before the consumer delivered it is gone. Start the recorder before the traffic (it then sees
every write as it lands; misses need a consumer falling behind by a whole key history) and give
test buckets a deeper history where possible. `sync()` reads the revisions the consumer missed
from the stream while it still keeps them (an ordered consumer made again on another server,
after its own died, skips what it had not delivered); those it no longer keeps are listed in
`gaps`, and `sync()` raises HistoryIncomplete unless told to accept them.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Protocol

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from nats.js.errors import NotFoundError

from llmgw.state.kv import KVEntry
from llmgw.state.memory_kv import MemoryKV

__all__ = ["HistoryIncomplete", "HistoryRecorder", "KVHistory", "MemoryHistory"]

_KV_OPERATION = "KV-Operation"
_MARKER_REASON = "Nats-Marker-Reason"


class HistoryIncomplete(RuntimeError):
    """The recorder missed writes (listed in `gaps` as inclusive revision ranges)."""

    def __init__(self, gaps: list[tuple[int, int]]) -> None:
        self.gaps = list(gaps)
        shown = ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in self.gaps[:10])
        more = f" and {len(self.gaps) - 10} more" if len(self.gaps) > 10 else ""
        super().__init__(f"history has missing revisions: {shown}{more}")


class KVHistory(Protocol):
    @property
    def entries(self) -> list[KVEntry]: ...

    async def sync(self, timeout: float = 5.0, *, allow_gaps: bool = False) -> list[KVEntry]: ...

    async def stop(self) -> None: ...


class MemoryHistory:
    """KVHistory over a MemoryKV: its history is complete by construction."""

    def __init__(self, kv: MemoryKV) -> None:
        self._kv = kv

    @property
    def entries(self) -> list[KVEntry]:
        return self._kv.history

    @property
    def gaps(self) -> list[tuple[int, int]]:
        return []

    async def sync(self, timeout: float = 5.0, *, allow_gaps: bool = False) -> list[KVEntry]:
        return list(self._kv.history)

    async def stop(self) -> None:
        return None


class HistoryRecorder:
    """Records every message of the KV bucket `bucket` in stream order (see module docstring).

    Use as `async with HistoryRecorder(js, bucket) as recorder: ...` or call start()/stop().
    """

    def __init__(self, js: JetStreamContext, bucket: str) -> None:
        self._js = js
        self.bucket = bucket
        self.stream = f"KV_{bucket}"
        self._pre = f"$KV.{bucket}."
        self._entries: list[KVEntry] = []
        self.gaps: list[tuple[int, int]] = []
        self._last_revision = 0
        self._progress = asyncio.Condition()
        self._sub: Any = None

    @property
    def entries(self) -> list[KVEntry]:
        return self._entries

    async def start(self) -> HistoryRecorder:
        if self._sub is not None:
            raise RuntimeError("the recorder is already started")
        self._sub = await self._js.subscribe(
            f"{self._pre}>",
            stream=self.stream,
            cb=self._record,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL,
            idle_heartbeat=1.0,  # after a server restart, resume within seconds
            inactive_threshold=30.0,
        )
        return self

    async def stop(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def __aenter__(self) -> HistoryRecorder:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def _record(self, msg: Msg) -> None:
        meta = msg.metadata
        revision = meta.sequence.stream
        if revision <= self._last_revision:
            return  # redelivery after an ordered-consumer reset: already recorded
        if revision > self._last_revision + 1:
            self.gaps.append((self._last_revision + 1, revision - 1))
        self._entries.append(
            self._entry(msg.subject, msg.data, msg.headers, revision, meta.timestamp.timestamp())
        )
        self._last_revision = revision
        async with self._progress:
            self._progress.notify_all()

    def _entry(
        self,
        subject: str,
        data: bytes | None,
        headers: dict[str, str] | None,
        revision: int,
        timestamp: float,
    ) -> KVEntry:
        headers = headers or {}
        deleted = headers.get(_KV_OPERATION) in ("DEL", "PURGE") or _MARKER_REASON in headers
        return KVEntry(
            key=subject[len(self._pre) :],
            value=b"" if deleted or data is None else data,
            revision=revision,
            deleted=deleted,
            timestamp=timestamp,
        )

    async def _fill_gaps(self) -> None:
        """Read the missed revisions the stream still keeps, one by one (an ordered consumer
        whose server died skips what it had not delivered when it is made again elsewhere);
        what the stream no longer keeps stays in `gaps`."""
        found: list[KVEntry] = []
        left: list[tuple[int, int]] = []
        for first, last in self.gaps:
            for revision in range(first, last + 1):
                try:
                    msg = await self._js.get_msg(self.stream, revision)
                except NotFoundError:
                    left.append((revision, revision))
                    continue
                at = msg.time.timestamp() if msg.time is not None else 0.0
                found.append(self._entry(msg.subject or "", msg.data, msg.headers, revision, at))
        if found:
            self._entries = sorted([*self._entries, *found], key=lambda e: e.revision)
        self.gaps = left

    async def sync(self, timeout: float = 5.0, *, allow_gaps: bool = False) -> list[KVEntry]:
        """Wait until every write applied so far is recorded; a copy of the entries. Revisions
        the consumer missed are read from the stream if it still keeps them.

        Raises TimeoutError if the recorder does not catch up within `timeout` seconds, and
        HistoryIncomplete if revisions were missed for good (unless allow_gaps).
        """
        if self._sub is None:
            raise RuntimeError("the recorder is not started")
        info = await self._js.stream_info(self.stream)
        target = info.state.last_seq
        async with asyncio.timeout(timeout), self._progress:
            await self._progress.wait_for(lambda: self._last_revision >= target)
        if self.gaps:
            await self._fill_gaps()
        if self.gaps and not allow_gaps:
            raise HistoryIncomplete(self.gaps)
        return list(self._entries)
