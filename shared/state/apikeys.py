"""The key bucket: API keys by digest (`llmgw.core.apikeys`), and the edge's local mirror of it.

Writers (`KeyBucket`: the `llmgw keys` CLI, seeding, `llmgw up`'s development key) change a
key by compare-and-swap, so two operators editing one key never lose a change silently.
Revoking deletes the key: a tombstone every watcher sees.

Readers (`KeyMirror`: every edge) never read the bucket per request: a KV watch delivers every
key at start and every change after, into a dict by digest. A revocation reaches every edge as
fast as a watch delivers a write (well under a second on loopback; docs/keys.md measures it);
the mirror also tracks when it last heard from the bucket, so an edge knows how stale it is.
A value that does not decode is logged (by key id, never the value) and treated as absent.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from llmgw.clock import Clock, TimeSource, wall_of
from llmgw.core.apikeys import API_KEY_PREFIX, ApiKey, ApiKeyError, key_id_of
from llmgw.state.follow import WatchFollower
from llmgw.state.kv import CasConflict, KVStore
from llmgw.state.nats_kv import open_routing_bucket

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from llmgw.config.schema import Config

__all__ = ["KeyBucket", "KeyMirror", "KeyNotFound", "open_key_bucket"]

log = logging.getLogger("llmgw.keys")

_MAX_CAS = 10


class KeyNotFound(LookupError):
    """No key with that id (or id prefix), or more than one."""


async def open_key_bucket(nc: NATS, config: Config) -> KeyBucket:
    """The key bucket (file storage, created on first use)."""
    kv = await open_routing_bucket(
        nc.jetstream(),
        config.auth.bucket,
        storage="file",
        replicas=config.replicas_of(config.auth.bucket),
        history=1,
    )
    return KeyBucket(kv)


class KeyBucket:
    def __init__(self, kv: KVStore) -> None:
        self.kv = kv

    async def create(self, key: ApiKey) -> int:
        """Store a new key; CasConflict if a key with that digest exists."""
        return await self.kv.create(key.kv_key, key.to_json())

    async def put(self, key: ApiKey) -> int:
        """Create or replace (seeding: the file is the truth for the keys it names)."""
        for _ in range(_MAX_CAS):
            entry = await self.kv.get(key.kv_key)
            try:
                if entry is None:
                    return await self.kv.create(key.kv_key, key.to_json())
                return await self.kv.update(key.kv_key, key.to_json(), entry.revision)
            except CasConflict:
                continue
        raise CasConflict(key.kv_key, None, "too many concurrent writers")

    async def list(self) -> list[ApiKey]:
        keys = []
        for entry in await self.kv.list(API_KEY_PREFIX):
            try:
                keys.append(ApiKey.from_json(entry.value))
            except ApiKeyError as exc:
                log.warning("key %s does not decode: %s", _id_of(entry.key), exc)
        return keys

    async def find(self, key_id: str) -> tuple[ApiKey, int]:
        """The key whose id starts with `key_id` (at least 6 hex digits), and its revision."""
        key_id = key_id.strip().lower()
        if len(key_id) < 6:
            raise KeyNotFound("give at least 6 characters of the key id")
        matches = [
            e for e in await self.kv.list(API_KEY_PREFIX) if _id_of(e.key).startswith(key_id)
        ]
        if len(matches) != 1:
            raise KeyNotFound(
                f"no key with id {key_id}" if not matches else f"key id {key_id} is ambiguous"
            )
        return ApiKey.from_json(matches[0].value), matches[0].revision

    async def update(self, key_id: str, change: Callable[[ApiKey], ApiKey]) -> ApiKey:
        """Apply `change` to the key by CAS (re-read and re-applied on a conflict)."""
        for _ in range(_MAX_CAS):
            key, revision = await self.find(key_id)
            changed = change(key)
            try:
                await self.kv.update(key.kv_key, changed.to_json(), revision)
                return changed
            except CasConflict:
                continue
        raise CasConflict(key_id, None, "too many concurrent writers")

    async def revoke(self, key_id: str) -> ApiKey:
        key, revision = await self.find(key_id)
        await self.kv.delete(key.kv_key, revision)
        return key


def _id_of(kv_key: str) -> str:
    return key_id_of(kv_key[len(API_KEY_PREFIX) :])


class KeyMirror(WatchFollower):
    """Every key of the bucket by digest, fed by one watch. `get` is a dict lookup."""

    what = "key"
    log = log

    def __init__(self, kv: KVStore, clock: Clock | TimeSource) -> None:
        super().__init__()
        self._kv = kv
        self._clock = wall_of(clock)
        self.keys: dict[str, ApiKey] = {}
        self.last_change: float | None = None
        self.changes = 0
        self._listeners: list[Callable[[str, ApiKey | None], None]] = []

    def get(self, digest: str) -> ApiKey | None:
        return self.keys.get(digest)

    def on_change(self, listener: Callable[[str, ApiKey | None], None]) -> None:
        """Call `listener(digest, key or None)` on every change after the initial replay."""
        self._listeners.append(listener)

    async def _watch(self) -> None:
        watch = self._kv.watch(API_KEY_PREFIX)
        async with contextlib.aclosing(watch):
            # The listing is the snapshot (an empty bucket replays nothing to wait for); after a
            # failed watch it also drops keys revoked meanwhile. The watch's own replay of the
            # current values repeats it harmlessly.
            entries = await self._kv.list(API_KEY_PREFIX)
            listed = {e.key[len(API_KEY_PREFIX) :] for e in entries}
            for entry in entries:
                self._apply(entry.key, entry.value, entry.deleted, notify=self.ready.is_set())
            for digest in [d for d in self.keys if d not in listed]:
                self._apply(API_KEY_PREFIX + digest, b"", True, notify=self.ready.is_set())
            self.ready.set()
            async for entry in watch:
                self._apply(entry.key, entry.value, entry.deleted, notify=True)

    def _apply(self, kv_key: str, value: bytes, deleted: bool, *, notify: bool) -> None:
        digest = kv_key[len(API_KEY_PREFIX) :]
        key: ApiKey | None = None
        if not deleted:
            try:
                key = ApiKey.from_json(value)
            except ApiKeyError as exc:
                log.warning("key %s does not decode (treated as absent): %s", _id_of(kv_key), exc)
        if key is None or key.digest != digest:
            self.keys.pop(digest, None)
            key = None
        else:
            self.keys[digest] = key
        self.last_change = self._clock()
        self.changes += 1
        if notify:
            for listener in self._listeners:
                listener(digest, key)
