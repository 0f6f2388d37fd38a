"""The fleet bucket: writers change endpoints by compare-and-swap; every service follows it.

Writers (`FleetBucket`: `llmgw endpoints`, the admin HTTP API, seeding at start) change one
endpoint's record by CAS, so two operators never lose a change silently; removing deletes the
key (a tombstone every follower sees).

Readers (`FleetMirror`: admission, scraper, edge) never read the bucket on a request's path:
one KV watch delivers every record at start and every change after, and each change becomes a
new immutable `llmgw.fleet.Fleet` handed to the listeners in one call (a listener swaps its
snapshot whole). A record that does not decode is logged and treated as absent.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from nats.js.errors import NotFoundError
from pydantic import ValidationError

from llmgw.clock import SYSTEM, Clock, TimeSource, wall_of
from llmgw.config.fleet import fleet_bucket
from llmgw.core.fleet import EndpointState, seed_missing
from llmgw.fleet import (
    APPLIED_KEY,
    ENDPOINT_PREFIX,
    AppliedConfig,
    Fleet,
    FleetRecord,
    endpoint_key,
    live_config,
    seed_key,
)
from llmgw.state.follow import WatchFollower
from llmgw.state.kv import CasConflict, KVEntry, KVStore
from llmgw.state.nats_kv import NatsKV, open_routing_bucket

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from llmgw.config.catalog import EndpointConfig
    from llmgw.config.schema import Config

__all__ = [
    "EndpointExists",
    "EndpointNotFound",
    "FleetBucket",
    "FleetMirror",
    "open_fleet",
    "read_live_config",
    "start_fleet",
]

log = logging.getLogger("llmgw.fleet")

_MAX_CAS = 10


class EndpointNotFound(LookupError):
    """No endpoint with that id in the fleet."""


class EndpointExists(ValueError):
    """An endpoint with that id is already in the fleet (add refuses to replace it)."""


async def open_fleet(nc: NATS, config: Config, clock: Clock | TimeSource = SYSTEM) -> FleetBucket:
    """The fleet bucket (file storage: the fleet outlives a server restart), created on first
    use; `clock` stamps its records."""
    name = fleet_bucket(config)
    kv = await open_routing_bucket(
        nc.jetstream(),
        name,
        storage="file",
        replicas=config.replicas_of(name),
        history=1,
    )
    return FleetBucket(kv, clock)


async def read_live_config(nc: NATS, config: Config) -> Config:
    """What the services run on now, read once for a tool (a service follows it with a
    `FleetMirror`): `config` with the live fleet applied (`llmgw.fleet.live_config`, as admission
    applies it). A cluster that never ran has no fleet bucket: then the file's config (what its
    first start would seed the fleet with); the bucket is not created here."""
    js = nc.jetstream()
    name = fleet_bucket(config)
    try:
        info = await js.stream_info(f"KV_{name}")
    except NotFoundError:
        return config
    bucket = FleetBucket(NatsKV(js, name, direct=bool(info.config.allow_direct)))
    return live_config(config, await bucket.snapshot())


class FleetBucket:
    def __init__(self, kv: KVStore, clock: Clock | TimeSource = SYSTEM) -> None:
        self.kv = kv
        self._clock = wall_of(clock)

    async def seed(self, config: Config) -> list[str]:
        """Seed the fleet from the config's endpoints, once per distinct endpoint list (a seed
        mark records it): create those the fleet lacks, and bring a record that an earlier
        file seeded (`source: config`) up to date with this file, keeping its state. A record
        added by the API or by registration wins over the file. The ids written."""
        mark = seed_key(config)
        if await self.kv.get(mark) is not None:
            return []
        live = {e.key[len(ENDPOINT_PREFIX) :]: e for e in await self.kv.list(ENDPOINT_PREFIX)}
        wanted = set(seed_missing([e.id for e in config.endpoints], live))
        written = []
        for endpoint in config.endpoints:
            record = FleetRecord(endpoint=endpoint, source="config", changed_at=self._clock())
            with contextlib.suppress(CasConflict):  # another service seeded it meanwhile
                if endpoint.id in wanted:
                    await self.kv.create(endpoint_key(endpoint.id), record.to_bytes())
                    written.append(endpoint.id)
                    continue
                entry = live[endpoint.id]
                stored = _decode(entry.key, entry.value)
                if stored is None or stored.source != "config" or stored.endpoint == endpoint:
                    continue
                record = record.model_copy(update={"state": stored.state})
                await self.kv.update(entry.key, record.to_bytes(), entry.revision)
                written.append(endpoint.id)
        with contextlib.suppress(CasConflict):
            await self.kv.create(mark, b"{}")
        return written

    async def fleet(self) -> Fleet:
        records: dict[str, FleetRecord] = {}
        revision = 0
        for entry in await self.kv.list(ENDPOINT_PREFIX):
            record = _decode(entry.key, entry.value)
            if record is not None:
                records[record.id] = record
            revision = max(revision, entry.revision)
        return Fleet(records, revision)

    async def snapshot(self) -> Fleet:
        """The fleet as a `FleetMirror` holds it (its records and the applied config), read
        once."""
        records: dict[str, FleetRecord] = {}
        revision, applied, config_revision = 0, None, 0
        for entry in await self.kv.list(""):
            if entry.key == APPLIED_KEY:
                applied = _decode_applied(entry.value)
                config_revision = entry.revision if applied is not None else 0
            elif entry.key.startswith(ENDPOINT_PREFIX):
                record = _decode(entry.key, entry.value)
                if record is not None:
                    records[record.id] = record
                revision = max(revision, entry.revision)
        return Fleet(records, revision, applied, config_revision)

    async def revisions(self) -> dict[str, tuple[FleetRecord, int]]:
        """Every record with the revision of its last write (what a CAS on it expects)."""
        found = {}
        for entry in await self.kv.list(ENDPOINT_PREFIX):
            record = _decode(entry.key, entry.value)
            if record is not None:
                found[record.id] = (record, entry.revision)
        return found

    async def apply_config(self, applied: AppliedConfig) -> int:
        """Store the config document every service applies; its revision."""
        return await self.kv.put(APPLIED_KEY, applied.to_bytes())

    async def applied(self) -> AppliedConfig | None:
        """The config document last applied (None: none, or one that does not decode)."""
        entry = await self.kv.get(APPLIED_KEY)
        return None if entry is None else _decode_applied(entry.value)

    async def get(self, endpoint_id: str) -> tuple[FleetRecord, int]:
        entry = await self.kv.get(endpoint_key(endpoint_id))
        record = None if entry is None else _decode(entry.key, entry.value)
        if entry is None or record is None:
            raise EndpointNotFound(f"no endpoint {endpoint_id!r} in the fleet")
        return record, entry.revision

    async def add(self, record: FleetRecord) -> int:
        """Store a new endpoint; EndpointExists when the id is taken."""
        stamped = record.model_copy(update={"changed_at": self._clock()})
        try:
            return await self.kv.create(endpoint_key(record.id), stamped.to_bytes())
        except CasConflict:
            raise EndpointExists(f"endpoint {record.id!r} is already in the fleet") from None

    async def change(
        self, endpoint_id: str, change: Callable[[FleetRecord], FleetRecord]
    ) -> FleetRecord:
        """Apply `change` to the record by CAS (re-read and re-applied on a conflict)."""
        changed = await self.change_if(endpoint_id, change)
        assert changed is not None
        return changed[0]

    async def change_if(
        self, endpoint_id: str, change: Callable[[FleetRecord], FleetRecord | None]
    ) -> tuple[FleetRecord, int] | None:
        """Apply `change` to the record by CAS (re-read and re-applied on a conflict); None
        from `change`: nothing to write. The record written and its revision, or None."""
        for _ in range(_MAX_CAS):
            record, revision = await self.get(endpoint_id)
            changed = change(record)
            if changed is None:
                return None
            changed = changed.model_copy(update={"changed_at": self._clock()})
            try:
                written = await self.kv.update(
                    endpoint_key(endpoint_id), changed.to_bytes(), revision
                )
                return changed, written
            except CasConflict:
                continue
        raise CasConflict(endpoint_key(endpoint_id), None, "too many concurrent writers")

    async def replace(self, record: FleetRecord, revision: int) -> int:
        """Write `record` only if its key's last write is still `revision` (one CAS, no retry:
        CasConflict when anything wrote it since it was read); the new revision."""
        stamped = record.model_copy(update={"changed_at": self._clock()})
        return await self.kv.update(endpoint_key(record.id), stamped.to_bytes(), revision)

    async def update(self, endpoint: EndpointConfig) -> FleetRecord:
        return await self.change(
            endpoint.id, lambda record: record.model_copy(update={"endpoint": endpoint})
        )

    async def set_state(self, endpoint_id: str, state: EndpointState) -> FleetRecord:
        return await self.change(
            endpoint_id, lambda record: record.model_copy(update={"state": state})
        )

    async def remove(self, endpoint_id: str, expected: FleetRecord | None = None) -> FleetRecord:
        """Delete the endpoint's record (`expected`: only if it is still that record)."""
        for _ in range(_MAX_CAS):
            record, revision = await self.get(endpoint_id)
            if expected is not None and record != expected:
                raise CasConflict(endpoint_key(endpoint_id), revision, "changed meanwhile")
            try:
                await self.kv.delete(endpoint_key(endpoint_id), revision)
                return record
            except CasConflict:
                continue
        raise CasConflict(endpoint_key(endpoint_id), None, "too many concurrent writers")


def _decode(key: str, value: bytes) -> FleetRecord | None:
    try:
        record = FleetRecord.model_validate_json(value)
    except ValidationError as exc:
        log.warning("fleet record %s does not decode (treated as absent): %s", key, exc)
        return None
    if endpoint_key(record.id) != key:
        log.warning("fleet record %s names endpoint %s (treated as absent)", key, record.id)
        return None
    return record


def _decode_applied(value: bytes) -> AppliedConfig | None:
    try:
        return AppliedConfig.model_validate_json(value)
    except ValidationError as exc:
        log.warning("the applied config does not decode (ignored): %s", exc)
        return None


class FleetMirror(WatchFollower):
    """The fleet as one immutable `Fleet`, fed by a watch; listeners get each new snapshot."""

    what = "fleet"
    log = log

    def __init__(self, bucket: FleetBucket, clock: Clock | TimeSource = SYSTEM) -> None:
        super().__init__()
        self.bucket = bucket
        self._clock = wall_of(clock)
        self.fleet = Fleet()
        self.changes = 0
        self.last_change: float | None = None
        self._records: dict[str, FleetRecord] = {}
        self._applied: AppliedConfig | None = None
        self._config_revision = 0
        self._listeners: list[Callable[[Fleet], None]] = []

    def on_change(self, listener: Callable[[Fleet], None]) -> None:
        """Call `listener(fleet)` on every snapshot from now on (a listing after a failed
        watch too, and the first one when the bucket was late at start)."""
        self._listeners.append(listener)

    async def _watch(self) -> None:
        watch = self.bucket.kv.watch("")
        async with contextlib.aclosing(watch):
            entries = await self.bucket.kv.list("")
            self._records = {}
            self._applied, self._config_revision = None, 0
            revision = 0
            for entry in entries:
                self._take(entry)
                revision = max(revision, entry.revision)
            self._publish(revision)
            self.ready.set()
            async for entry in watch:
                if entry.revision <= self.fleet.revision:
                    continue  # the watch's replay of what the listing had
                if self._take(entry):
                    self._publish(entry.revision)

    def _take(self, entry: KVEntry) -> bool:
        """Take one entry in; whether it changed the fleet (seed marks do not)."""
        if entry.key == APPLIED_KEY:
            applied = None if entry.deleted else _decode_applied(entry.value)
            self._applied, self._config_revision = applied, entry.revision if applied else 0
            return True
        if not entry.key.startswith(ENDPOINT_PREFIX):
            return False
        endpoint_id = entry.key[len(ENDPOINT_PREFIX) :]
        record = None if entry.deleted else _decode(entry.key, entry.value)
        if record is None:
            self._records.pop(endpoint_id, None)
        else:
            self._records[endpoint_id] = record
        return True

    def _publish(self, revision: int) -> None:
        self.fleet = Fleet(dict(self._records), revision, self._applied, self._config_revision)
        self.changes += 1
        self.last_change = self._clock()
        for listener in self._listeners:
            try:
                listener(self.fleet)
            except Exception:  # one listener's bug must not stop the others or the watch
                log.exception("applying fleet revision %d failed", revision)


async def start_fleet(nc: NATS, config: Config, *, seed: bool) -> FleetMirror:
    """The live fleet as a service follows it, mirrored by a watch. `seed`: seed it from the
    config's endpoints first (unless `fleet.seed` is off). Admission and the scraper both
    seed, so whichever starts first finds the fleet (seeding is idempotent, by CAS)."""
    bucket = await open_fleet(nc, config)
    if seed and config.fleet.seed:
        written = await bucket.seed(config)
        if written:
            log.info("seeded the fleet with %s", ", ".join(written))
    mirror = FleetMirror(bucket)
    await mirror.start()
    return mirror
