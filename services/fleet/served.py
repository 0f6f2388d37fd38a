"""Endpoints whose models came from their engine follow what it serves (in the reaper).

Every `interval` the follower reads the fleet and, for each active endpoint added, registered
or discovered without `models` (`FleetRecord.models_from_engine`), reads its engine's
`GET /v1/models` again and matches the served names against the config the cluster runs on
(`llmgw.core.fleet.served_change`): a LoRA adapter loaded at run time (vLLM's
`/v1/load_lora_adapter`) whose name is a model or an alias of the config is served there from
then on; one unloaded is no longer placed there (requests running on it finish: their leases
are never revoked). An engine that does not answer, or lists none of the provider's models,
keeps what it had: health checks and the scraper judge an engine that is down. But an endpoint
whose every model came through an adapter, unloaded while the engine still lists the
adapter's base, serves nothing of ours: it is drained (`FleetRecord.unserved`: it keeps its
models, as a record must name one) and made active again when the engine serves one of ours.

Between two sweeps, an edge whose attempt got a managed engine's 404 for a model the fleet lists
there (outcome `model_unloaded`) says so (`ModelsStale` on ``llmgw.v1.fleet.models_stale``, one
reaper of the queue group hears it: `listen`): that endpoint's list is read at once
(`stale`), after `GATHER` seconds in which the notices of the same burst (other edges', other
requests') join it; a notice that arrives while the list is being read is answered by one more
read after it (the engine may have answered before the change). So a burst of 404s is one read.

Each engine's list is followed as soon as it is read, by CAS on the record read again then
(and again on a conflict), so a registrant's heartbeats, however often they land, never lose
the change. A change by hand that landed meanwhile wins: a record that no longer follows its
engine, moved to another URL or provider, or was drained is left alone (the next read judges
it). Several reapers may run: the first write makes the others' changes nothing to write. One
HTTP client is kept for the follower's life.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Literal

import httpx
from pydantic import ValidationError

from llmgw.config.catalog import EndpointConfig
from llmgw.config.schema import Config
from llmgw.core.fleet import EndpointState, ServedModel, served_change, served_models
from llmgw.fleet import FleetRecord, endpoint_problems
from llmgw.state.fleet import FleetBucket
from llmgw.state.kv import CasConflict
from llmgw.wire import MODELS_STALE_SUBJECT, ModelsStale

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription

__all__ = ["GATHER", "ServedModelsFollower", "Trigger"]

log = logging.getLogger("llmgw.fleet")

_TIMEOUT = 3.0
_AT_ONCE = 16  # engines asked at the same time
GATHER = 0.05  # seconds a notice waits for the others of its burst before the list is read
QUEUE = "llmgw-reaper"  # one reaper hears each notice
# What made the follower read an engine's list: its interval, or an edge's notice.
Trigger = Literal["interval", "model_unloaded"]


class ServedModelsFollower:
    """`config`: what the cluster runs on, read at each sweep (the file's config with the
    applied one's live fields on top: an alias added by `llmgw config apply` counts)."""

    def __init__(
        self,
        bucket: FleetBucket,
        config: Callable[[], Awaitable[Config]],
        *,
        interval: float,
        client: httpx.AsyncClient | None = None,
        scope: str = "",
        on_read: Callable[[Trigger], None] | None = None,
    ) -> None:
        self.bucket = bucket
        self._config = config
        self.interval = interval
        self._client = client
        self._gate = asyncio.Semaphore(_AT_ONCE)
        self.changed = 0  # records this follower rewrote
        self._unmatched: set[str] = set()  # endpoints logged as serving none of ours
        self.scope = scope  # the fleet bucket's name: notices of other gateways are not ours
        self._on_read = on_read  # each engine list read (llmgw_reaper_model_list_reads)
        # Endpoints with a read asked by a notice: "gathering" (its GATHER wait), "reading",
        # or "again" (a notice came while reading: one more read after it).
        self._stale: dict[str, str] = {}
        self._rereads: set[asyncio.Task[None]] = set()
        self.notices = 0  # notices of this gateway heard

    async def run(self, stop: asyncio.Event) -> None:
        own = self._client is None
        if own:
            self._client = httpx.AsyncClient(timeout=_TIMEOUT, trust_env=False)
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.interval):
                        await stop.wait()
                if stop.is_set():
                    break
                try:
                    await self.sweep()
                except Exception:  # NATS trouble: try again next time
                    log.warning("served-models sweep failed", exc_info=True)
        finally:
            for task in list(self._rereads):
                task.cancel()
            await self.rereads_done()
            if own and self._client is not None:
                await self._client.aclose()
                self._client = None

    async def listen(self, nc: NATS) -> Subscription:
        """Hear the edges' notices (one reaper of the queue group hears each)."""
        return await nc.subscribe(MODELS_STALE_SUBJECT, queue=QUEUE, cb=self._on_notice)

    async def _on_notice(self, msg: Msg) -> None:
        try:
            notice = ModelsStale.model_validate_json(msg.data)
        except ValidationError:
            return
        if notice.scope == self.scope:
            self.notices += 1
            self.stale(notice.endpoint)

    def stale(self, endpoint_id: str) -> None:
        """Read `endpoint_id`'s list soon: after `GATHER` seconds, once for every notice that
        arrives until the read starts; one more read after it for any that arrives during it."""
        state = self._stale.get(endpoint_id)
        if state is None:
            self._stale[endpoint_id] = "gathering"
            task = asyncio.create_task(self._reread(endpoint_id), name="models-reread")
            self._rereads.add(task)
            task.add_done_callback(self._rereads.discard)
        elif state == "reading":
            self._stale[endpoint_id] = "again"

    async def rereads_done(self) -> None:
        """Until every read asked by a notice so far has ended."""
        while self._rereads:
            await asyncio.gather(*self._rereads, return_exceptions=True)

    async def _reread(self, endpoint_id: str) -> None:
        try:
            while True:
                await asyncio.sleep(GATHER)
                self._stale[endpoint_id] = "reading"
                try:
                    await self.sweep(only=endpoint_id)
                except Exception:  # NATS trouble: the next notice or sweep tries again
                    log.warning("reading the models of %s failed", endpoint_id, exc_info=True)
                if self._stale.get(endpoint_id) != "again":
                    return
                self._stale[endpoint_id] = "gathering"
        finally:
            self._stale.pop(endpoint_id, None)

    async def sweep(self, only: str | None = None) -> None:
        """Read the lists of every endpoint that follows its engine (`only`: that one, for a
        notice) and follow what changed."""
        if only is None:
            entries = await self.bucket.revisions()
        else:
            try:
                entries = {only: await self.bucket.get(only)}
            except LookupError:
                return  # removed meanwhile
        following = {
            endpoint_id: entry
            for endpoint_id, entry in entries.items()
            if entry[0].models_from_engine and _followed_state(entry[0])
        }
        if not following:
            return
        config = await self._config()
        trigger: Trigger = "interval" if only is None else "model_unloaded"
        await asyncio.gather(*(self._read(config, r, trigger) for r, _ in following.values()))

    async def _read(self, config: Config, record: FleetRecord, trigger: Trigger) -> None:
        """Read one engine's list and follow it at once (not after every other engine's)."""
        served = await self._served(record.endpoint.url, trigger)
        if served is not None:
            await self._follow(config, record, served)

    async def _served(self, url: str, trigger: Trigger) -> list[ServedModel] | None:
        """The engine's served names; None when it does not answer a model list."""
        assert self._client is not None, "sweep runs inside run(), or with a client given"
        if self._on_read is not None:
            self._on_read(trigger)
        async with self._gate:
            try:
                response = await self._client.get(f"{url}/v1/models")
                if response.status_code != 200:
                    return None
                return served_models(response.json())
            except (httpx.HTTPError, OSError, ValueError):
                return None

    async def _follow(self, config: Config, read: FleetRecord, served: list[ServedModel]) -> None:
        """Write what the engine serves now into the record, read again at the write."""
        outcome: list[FleetRecord] = []  # the record as it was and as written

        def follow(record: FleetRecord) -> FleetRecord | None:
            endpoint = record.endpoint
            if (
                not record.models_from_engine
                or not _followed_state(record)
                or endpoint.url != read.endpoint.url
                or endpoint.provider != read.endpoint.provider
            ):
                return None  # changed by hand since the list was asked for: next time
            followed = self._followed(config, record, served)
            if followed is not None:
                outcome[:] = [record, followed]
            return followed

        # Removed meanwhile, or a conflict on every one of the tries: next time.
        with contextlib.suppress(CasConflict, LookupError):
            if await self.bucket.change_if(read.id, follow) is not None:
                self.changed += 1
                was, now = outcome
                if now.unserved:
                    log.warning(
                        "endpoint %s serves none of provider %s's models now (its adapters "
                        "were unloaded): drained until it serves one again",
                        now.id,
                        now.endpoint.provider,
                    )
                else:
                    log.info(
                        "endpoint %s serves %s now (was %s)",
                        now.id,
                        ", ".join(now.endpoint.models),
                        "nothing" if was.unserved else ", ".join(was.endpoint.models),
                    )

    def _followed(
        self, config: Config, record: FleetRecord, served: list[ServedModel]
    ) -> FleetRecord | None:
        """The record serving what its engine lists, or None: nothing to change (or a change
        that does not fit the config, logged)."""
        endpoint = record.endpoint
        try:
            provider = config.provider(endpoint.provider)
        except KeyError:
            return None  # the live config left this endpoint out already (live_config)
        canonical = config.model_names()
        offered = [m.name for m in provider.models]
        change = served_change(
            endpoint.models, endpoint.upstream_model, served, canonical, offered, record.adapters
        )
        if change is not None and not change.models:  # its adapters unloaded: nothing of ours
            if record.unserved:
                return None
            return record.model_copy(update={"state": EndpointState.DRAINING, "unserved": True})
        ours = any(canonical.get(s.id) in offered for s in served)
        if change is None:
            if record.unserved and ours:  # it serves its models again
                return record.model_copy(update={"state": EndpointState.ACTIVE, "unserved": False})
            if not ours:
                if endpoint.id not in self._unmatched:
                    self._unmatched.add(endpoint.id)
                    listed = ", ".join(s.id for s in served) or "nothing"
                    log.warning(
                        "endpoint %s serves %s: none of provider %s's models; keeping %s",
                        endpoint.id,
                        listed,
                        endpoint.provider,
                        ", ".join(endpoint.models),
                    )
            else:
                self._unmatched.discard(endpoint.id)
            return None
        self._unmatched.discard(endpoint.id)
        fields = endpoint.model_dump(mode="json", exclude_none=True)
        fields.update(models=list(change.models), upstream_model=dict(change.upstream_model))
        try:
            followed = EndpointConfig.model_validate(fields)
        except ValidationError as exc:
            log.warning("endpoint %s: what its engine serves does not fit: %s", endpoint.id, exc)
            return None
        problems = endpoint_problems(config, followed)
        if problems:
            log.warning("endpoint %s: %s", endpoint.id, "; ".join(problems))
            return None
        update: dict[str, object] = {"endpoint": followed, "adapters": dict(change.adapters)}
        if record.unserved:
            update.update(state=EndpointState.ACTIVE, unserved=False)
        return record.model_copy(update=update)


def _followed_state(record: FleetRecord) -> bool:
    """Active, or drained by the follower itself (`unserved`): a drain by hand, the janitor's
    or a Service's is left alone."""
    return record.state is EndpointState.ACTIVE or record.unserved
