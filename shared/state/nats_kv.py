"""KVStore over a JetStream KV bucket (nats-py), plus the idempotent bucket opener.

Writes go straight to the bucket's stream (`$KV.<bucket>.<key>`) with the
`Nats-Expected-Last-Subject-Sequence` header, which is what nats-py's KeyValue does too; doing
it here gives one error mapping (a wrong last sequence, 10071/10164, is CasConflict whether it
comes from an update or from a delete, which nats-py reports as a plain BadRequestError) and lets
`delete` return the tombstone's revision.

Reads: `get` is a (direct) last-message-by-subject get; `list` and `watch` run an ordered push
consumer filtered on `$KV.<bucket>.<prefix>>` (deliver last-per-subject), never `kv.keys()`
(which scans the whole bucket). A prefix ending inside a token ("pin.ab") filters on its last
complete token ("$KV.b.pin.>") and drops the other keys client-side.

Tombstones: `get`/`list` hide deletes and purges; `create` over a tombstone CASes from the
tombstone's revision; a watch skips tombstones of keys it has not yet shown during its initial
replay (they are no "current value"), and reports every later delete.

Failures: nats-py re-creates an ordered consumer once its heartbeats stop, so a watch resumes
a few seconds after a server restart (deaf meanwhile: its user must treat what it mirrors as a
hint, which it is anyway); once the client is closed for good, `list` and `watch` raise
ConnectionClosedError (within about a second) instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Mapping
from typing import Any

from nats.aio.msg import Msg
from nats.errors import ConnectionClosedError
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    KeyValueConfig,
    StorageType,
    StreamInfo,
)
from nats.js.errors import APIError, NotFoundError
from nats.js.kv import KeyValue

from llmgw.state.kv import CasConflict, KVEntry, validate_key, validate_prefix

__all__ = ["BucketConfigMismatch", "NatsKV", "open_routing_bucket"]

_WRONG_LAST_SEQUENCE = (10071, 10164)  # JSStreamWrongLastSequence(Constant)Err
_STREAM_NAME_IN_USE = 10058  # stream exists with a different configuration
_LEADER_WAIT = 10.0  # seconds a new replicated bucket may take to elect its leader
_EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
_KV_OPERATION = "KV-Operation"
_MARKER_REASON = "Nats-Marker-Reason"  # server-placed TTL/limit markers (server >= 2.11)
_DELETING_OPERATIONS = ("DEL", "PURGE")
_WATCH_QUEUE_SIZE = 1024
# Seconds between server heartbeats on an idle consumer; nats-py re-creates an ordered consumer
# after two missed ones, so this bounds how long a watch stays deaf after a server restart.
_IDLE_HEARTBEAT = 1.0
# Seconds the server keeps a consumer nobody listens to: a finished list's goes quickly, a
# watch's survives a short disconnection.
_LIST_INACTIVE_THRESHOLD = 2.0
_CLOSED_CHECK_INTERVAL = 1.0  # seconds a quiet watch waits before checking its connection
_WATCH_INACTIVE_THRESHOLD = 30.0


class BucketConfigMismatch(ValueError):
    """The bucket exists with a configuration other than the one asked for."""


def _is_tombstone(headers: Mapping[str, str] | None) -> bool:
    if not headers:
        return False
    return headers.get(_KV_OPERATION) in _DELETING_OPERATIONS or _MARKER_REASON in headers


def _filter_subject(pre: str, prefix: str) -> tuple[str, bool]:
    """The consumer filter for a key prefix, and whether keys still need a startswith check."""
    if prefix == "" or prefix.endswith("."):
        return f"{pre}{prefix}>", False
    head, dot, _ = prefix.rpartition(".")
    return (f"{pre}{head}{dot}>", True)


class NatsKV:
    """KVStore on the JetStream KV bucket `bucket` (see the module docstring for the mapping)."""

    def __init__(self, js: JetStreamContext, bucket: str, *, direct: bool = True) -> None:
        self._js = js
        self.bucket = bucket
        self.stream = f"KV_{bucket}"
        self._pre = f"$KV.{bucket}."
        self._direct = direct

    @classmethod
    def from_key_value(cls, kv: KeyValue) -> NatsKV:
        """Wrap a bucket opened with nats-py (`js.key_value` / `js.create_key_value`).

        nats-py exposes no public accessor for a KeyValue's context and bucket; this reads its
        attributes, so prefer `open_routing_bucket` in product code.
        """
        return cls(kv._js, kv._name, direct=kv._direct)

    # ---- writes --------------------------------------------------------------------------

    async def _publish(
        self, key: str, value: bytes, expected: int | None, headers: dict[str, str] | None = None
    ) -> int:
        all_headers = dict(headers or {})
        if expected is not None:
            all_headers[_EXPECTED_LAST_SUBJECT_SEQ] = str(expected)
        try:
            ack = await self._js.publish(self._pre + key, value, headers=all_headers or None)
        except APIError as exc:
            if exc.err_code in _WRONG_LAST_SEQUENCE:
                raise CasConflict(key, expected, exc.description or "") from None
            raise
        return ack.seq

    @staticmethod
    def _positive(revision: int) -> int:
        if isinstance(revision, bool) or not isinstance(revision, int) or revision < 1:
            raise ValueError(
                f"revision must be a positive int, got {revision!r} (use create for a missing key)"
            )
        return revision

    async def create(self, key: str, value: bytes) -> int:
        validate_key(key)
        try:
            return await self._publish(key, value, 0)
        except CasConflict:
            last = await self._last_message(key)
            if last is None or not last.deleted:
                raise CasConflict(key, None, "key exists") from None
        # The key's last message is a tombstone: CAS from it, so a racing create still loses.
        try:
            return await self._publish(key, value, last.revision)
        except CasConflict:
            raise CasConflict(key, None, "key was re-created concurrently") from None

    async def update(self, key: str, value: bytes, revision: int) -> int:
        validate_key(key)
        return await self._publish(key, value, self._positive(revision))

    async def delete(self, key: str, revision: int) -> int:
        validate_key(key)
        return await self._publish(key, b"", self._positive(revision), {_KV_OPERATION: "DEL"})

    async def put(self, key: str, value: bytes) -> int:
        validate_key(key)
        return await self._publish(key, value, None)

    # ---- reads ---------------------------------------------------------------------------

    async def _last_message(self, key: str) -> KVEntry | None:
        try:
            raw = await self._js.get_msg(self.stream, subject=self._pre + key, direct=self._direct)
        except NotFoundError:
            return None
        if raw.subject != self._pre + key or raw.seq is None:
            return None
        deleted = _is_tombstone(raw.headers)
        timestamp = raw.time.timestamp() if raw.time is not None else 0.0
        return KVEntry(key, b"" if deleted else (raw.data or b""), raw.seq, deleted, timestamp)

    async def get(self, key: str) -> KVEntry | None:
        validate_key(key)
        entry = await self._last_message(key)
        return None if entry is None or entry.deleted else entry

    async def list(self, prefix: str) -> list[KVEntry]:
        validate_prefix(prefix)
        latest: dict[str, KVEntry] = {}
        async with _PrefixConsumer(
            self._js, self.stream, self._pre, prefix, _LIST_INACTIVE_THRESHOLD
        ) as consumer:
            while not consumer.caught_up:
                entry = await consumer.next()
                if entry is not None:
                    latest[entry.key] = entry
            # A key rewritten while the replay ran lost its replayed message (history 1) and
            # its new one may come after "caught up": read on to the prefix's last write as of
            # now, or a listing could miss a live key (and repair would act on its absence).
            target = await self._last_sequence(consumer.subject)
            while consumer.last_sequence < target:
                entry = await consumer.next()
                if entry is not None:
                    latest[entry.key] = entry
        return sorted((e for e in latest.values() if not e.deleted), key=lambda e: e.revision)

    async def _last_sequence(self, subject: str) -> int:
        """Stream sequence of the last message on `subject` (wildcards allowed), 0 if none."""
        try:
            msg = await self._js.get_msg(self.stream, subject=subject, direct=False)
        except NotFoundError:
            return 0
        assert msg.seq is not None  # a stored message always has its sequence
        return msg.seq

    async def watch(self, prefix: str) -> AsyncGenerator[KVEntry, None]:
        validate_prefix(prefix)
        shown: set[str] = set()  # keys shown during the initial replay
        async with _PrefixConsumer(
            self._js, self.stream, self._pre, prefix, _WATCH_INACTIVE_THRESHOLD
        ) as consumer:
            while True:
                live = consumer.caught_up  # decided before this message: it may end the replay
                entry = await consumer.next()
                if entry is None:
                    continue
                if live or not entry.deleted or entry.key in shown:
                    if not live:
                        shown.add(entry.key)
                    yield entry


class _PrefixConsumer:
    """An ordered push consumer on one key prefix, last value per key first, then live writes.

    `caught_up` turns true once the initial replay is consumed: the consumer had nothing to
    deliver when created, or a delivered message reported no pending messages behind it.
    """

    def __init__(
        self, js: JetStreamContext, stream: str, pre: str, prefix: str, inactive_threshold: float
    ) -> None:
        self._js = js
        self._inactive_threshold = inactive_threshold
        self._stream = stream
        self._pre = pre
        self._prefix = prefix
        self._subject, self._needs_filter = _filter_subject(pre, prefix)
        self.subject = self._subject
        self._queue: asyncio.Queue[Msg] = asyncio.Queue(maxsize=_WATCH_QUEUE_SIZE)
        self._sub: Any = None
        self.caught_up = False
        self.last_sequence = 0  # stream sequence of the last message received (any key)

    async def __aenter__(self) -> _PrefixConsumer:
        # The same ordered push consumer `js.subscribe(ordered_consumer=True)` makes, created
        # here so its creation reply tells how many messages the initial replay holds (saves a
        # consumer-info round trip). The server delivers nothing until the inbox has interest.
        config = ConsumerConfig(
            deliver_subject=self._js._nc.new_inbox(),
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            filter_subject=self._subject,
            ack_policy=AckPolicy.NONE,
            max_deliver=1,
            ack_wait=22 * 3600,
            flow_control=True,
            idle_heartbeat=_IDLE_HEARTBEAT,
            inactive_threshold=self._inactive_threshold,
            num_replicas=1,
            mem_storage=True,
        )
        info = await self._js.add_consumer(self._stream, config=config)
        self.caught_up = info.num_pending == 0
        self._sub = await self._js.subscribe_bind(
            self._stream, config, info.name, cb=self._queue.put, ordered_consumer=True
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._close()

    async def _close(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def next(self) -> KVEntry | None:
        """The next message as an entry; None if its key is outside the prefix.

        Raises ConnectionClosedError once the connection is closed for good (nats-py re-creates
        the consumer by itself across reconnections, so only a closed client ends a watch).
        """
        while True:
            try:
                async with asyncio.timeout(_CLOSED_CHECK_INTERVAL):
                    msg = await self._queue.get()
                break
            except TimeoutError:
                if self._js._nc.is_closed:
                    raise ConnectionClosedError from None
        meta = msg.metadata
        self.last_sequence = max(self.last_sequence, meta.sequence.stream)
        if meta.num_pending == 0:
            self.caught_up = True
        key = msg.subject[len(self._pre) :]
        if self._needs_filter and not key.startswith(self._prefix):
            return None
        deleted = _is_tombstone(msg.headers)
        return KVEntry(
            key,
            b"" if deleted else msg.data,
            meta.sequence.stream,
            deleted,
            meta.timestamp.timestamp(),
        )


async def open_routing_bucket(
    js: JetStreamContext,
    name: str,
    *,
    storage: str = "file",
    replicas: int = 1,
    history: int = 1,
    max_age: float | None = None,
) -> NatsKV:
    """Bind the bucket `name`, creating it first if missing; safe to race from many instances.
    `max_age` (seconds): how long an entry is kept, set when the bucket is created.

    An existing bucket must have the asked storage, replicas and history, else
    BucketConfigMismatch names the differing fields (changing them needs `js.update_stream` on
    `KV_<name>`, a deliberate operation, not a side effect of starting a service).
    """
    storage_type = StorageType(storage)
    stream = f"KV_{name}"
    try:
        info = await js.stream_info(stream)
    except NotFoundError:
        config = KeyValueConfig(
            bucket=name,
            history=history,
            storage=storage_type,
            replicas=replicas,
            direct=True,
            ttl=max_age,
        )
        try:
            await js.create_key_value(config)
        except APIError as exc:
            if exc.err_code != _STREAM_NAME_IN_USE:
                raise
        # Read back whatever exists now (ours or a racing instance's) and check it.
        info = await js.stream_info(stream)
    _check_bucket(name, info, storage=storage_type, replicas=replicas, history=history)
    if replicas > 1:
        info = await _with_leader(js, stream, info)
    return NatsKV(js, name, direct=bool(info.config.allow_direct))


async def _with_leader(
    js: JetStreamContext, stream: str, info: StreamInfo, wait: float = _LEADER_WAIT
) -> StreamInfo:
    """A replicated bucket just created on a fresh cluster has no leader for a moment: writes
    then get no response from the stream. Wait (up to `wait` seconds) until it has one."""
    deadline = asyncio.get_running_loop().time() + wait
    while (info.cluster is None or not info.cluster.leader) and (
        asyncio.get_running_loop().time() < deadline
    ):
        await asyncio.sleep(0.1)
        info = await js.stream_info(stream)
    return info


def _check_bucket(
    name: str, info: StreamInfo, *, storage: StorageType, replicas: int, history: int
) -> None:
    config = info.config
    actual = {
        "storage": StorageType(config.storage) if config.storage else StorageType.FILE,
        "replicas": config.num_replicas or 1,
        "history": config.max_msgs_per_subject,
    }
    wanted = {"storage": storage, "replicas": replicas, "history": history}
    wrong = [
        f"{field}: bucket has {actual[field]!r}, asked for {wanted[field]!r}"
        for field in wanted
        if actual[field] != wanted[field]
    ]
    if wrong:
        raise BucketConfigMismatch(
            f"KV bucket {name!r} exists with another configuration: " + "; ".join(wrong)
        )
