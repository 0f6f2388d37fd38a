"""What an operator may do to the live fleet, checked: one implementation behind the
`llmgw endpoints` CLI and the admin HTTP API.

Every change is validated before anything is written, and a refused change writes nothing:

- a spec is an endpoint as the config file writes it (`EndpointConfig`: unknown fields, bad
  URLs, a weight of 0 are errors naming the field) whose provider and models the config knows;
- a new or moved URL must answer (any HTTP answer counts; `probe=False` skips the check);
- an id already in the fleet is refused by `add` (`update` changes it);
- `remove` takes a draining endpoint once no admission instance holds a lease on it (it waits
  up to `wait` seconds for that), or any endpoint with `force`.

Errors are `FleetError`s carrying the HTTP status and code the admin API answers with.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import httpx
from pydantic import ValidationError

from llmgw.broadcast import ask_instances
from llmgw.clock import SYSTEM, Clock, TimeSource, monotonic_of, wall_of
from llmgw.config.catalog import EndpointConfig
from llmgw.core.fleet import (
    EndpointState,
    RemoveVerdict,
    match_served,
    remove_verdict,
    served_models,
)
from llmgw.fleet import FleetRecord, Source, applied_config, endpoint_problems
from llmgw.state.fleet import EndpointExists, EndpointNotFound, FleetBucket, FleetMirror

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from llmgw.config.schema import Config

__all__ = ["FleetCalls", "FleetError", "FleetOps", "FollowedConfig", "admission_leases"]

_PROBE_TIMEOUT = 3.0
_ANSWER_WINDOW = 0.3  # seconds to collect every admission instance's state answer
_POLL = 0.25


def _models_from_engine(spec: Mapping[str, Any]) -> bool:
    """Whether `spec`'s models will come from its engine (`FleetOps._with_models`)."""
    return isinstance(spec, Mapping) and "models" not in spec


class FleetCalls(Protocol):
    """The fleet's calls as the CLI makes them: `FleetOps` over NATS, or the admin API over
    HTTP (`llmgw.services.fleet.adminclient.AdminApi`). Each returns the endpoint as
    `describe` shows it (`list`: every endpoint), or raises `FleetError`."""

    async def list(self) -> list[dict[str, Any]]: ...

    async def show(self, endpoint_id: str) -> dict[str, Any]: ...

    async def add(self, spec: Mapping[str, Any], *, probe: bool = True) -> dict[str, Any]: ...

    async def update(
        self, endpoint_id: str, changes: Mapping[str, Any], *, probe: bool = True
    ) -> dict[str, Any]: ...

    async def set_state(self, endpoint_id: str, state: EndpointState) -> dict[str, Any]: ...

    async def remove(
        self, endpoint_id: str, *, force: bool = False, wait: float = 0.0
    ) -> dict[str, Any]: ...

    async def register(
        self, spec: Mapping[str, Any], ttl: Any, *, probe: bool = True
    ) -> dict[str, Any]: ...

    async def heartbeat(self, endpoint_id: str) -> dict[str, Any]: ...


class FleetError(Exception):
    """A refused change: nothing was written. `status`/`code`/`param` shape the API's answer."""

    def __init__(self, message: str, *, status: int = 400, code: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": "invalid_request_error",
                "code": self.code,
                "param": self.param,
            }
        }


async def admission_leases(nc: NATS, window: float = _ANSWER_WINDOW) -> dict[str, int] | None:
    """Live leases per endpoint, summed over every admission instance that answers within
    `window`; None when none answers (then nobody can say a drain is done)."""
    replies = await ask_instances(nc, window)
    if not replies:
        return None
    total: dict[str, int] = {}
    for reply in replies:
        for endpoint, count in reply.leases_by_endpoint.items():
            total[endpoint] = total.get(endpoint, 0) + count
    return total


async def running_config(bucket: FleetBucket, config: Config) -> Config:
    """What a tool checks a change against: its file's config with the applied config's live
    fields on top (`llmgw.fleet.applied_config`), as the cluster runs it: a provider an
    applied config added takes endpoints."""
    applied = await bucket.applied()
    return config if applied is None else applied_config(config, applied)


class FollowedConfig:
    """`running_config` for a long-running caller (the reaper's Kubernetes watcher): `base` with
    the applied config's live fields on top, from the fleet as `mirror` follows it (as
    admission follows it), parsed once per applied revision. A `FleetOps` config."""

    def __init__(self, base: Config, mirror: FleetMirror) -> None:
        self._base = base
        self._mirror = mirror
        self._revision = 0
        self._config = base

    def __call__(self) -> Config:
        fleet = self._mirror.fleet
        if fleet.config_revision != self._revision:
            applied = fleet.applied
            self._config = self._base if applied is None else applied_config(self._base, applied)
            self._revision = fleet.config_revision
        return self._config


class FleetOps:
    def __init__(
        self,
        bucket: FleetBucket,
        config: Config | Callable[[], Config],
        leases: Callable[[], Awaitable[dict[str, int] | None]],
        *,
        probe_client: httpx.AsyncClient | None = None,
        clock: Clock | TimeSource = SYSTEM,
        wall: Clock | TimeSource = SYSTEM,
    ) -> None:
        self.bucket = bucket
        # what a change is checked against: the config the cluster runs on (an applied
        # config's providers and models too), read at each change when given as a callable
        self._config = config
        self._leases = leases
        self._probe_client = probe_client
        self._clock = monotonic_of(clock)
        self._wall = wall_of(wall)

    @classmethod
    def on(
        cls,
        nc: NATS,
        bucket: FleetBucket,
        config: Config | Callable[[], Config],
        *,
        clock: Clock = SYSTEM,
    ) -> FleetOps:
        """Checked changes over the connection `nc`: the leases on an endpoint are those the
        admission instances answering on it hold (`admission_leases`)."""
        return cls(bucket, config, lambda: admission_leases(nc), clock=clock, wall=clock)

    @property
    def config(self) -> Config:
        return self._config() if callable(self._config) else self._config

    # ---- reading ----------------------------------------------------------------------------

    async def list(self) -> list[dict[str, Any]]:
        fleet = await self.bucket.fleet()
        leases = await self._leases()
        return [
            describe(record, None if leases is None else leases.get(record.id, 0))
            for record in fleet.records.values()
        ]

    async def show(self, endpoint_id: str) -> dict[str, Any]:
        record, _ = await self._get(endpoint_id)
        leases = await self._leases()
        return describe(record, None if leases is None else leases.get(endpoint_id, 0))

    # ---- changing ---------------------------------------------------------------------------

    async def add(
        self, spec: Mapping[str, Any], *, probe: bool = True, source: Source = "api"
    ) -> dict[str, Any]:
        from_engine = _models_from_engine(spec)
        spec, adapters = await self._with_models(spec)
        endpoint = self._validate(spec)
        fleet = await self.bucket.fleet()
        if endpoint.id in fleet.records:
            raise FleetError(
                f"endpoint {endpoint.id!r} is already in the fleet (use update to change it)",
                status=409,
                code="endpoint_exists",
                param="id",
            )
        if probe:
            await self._probe(endpoint)
        record = FleetRecord(
            endpoint=endpoint, source=source, models_from_engine=from_engine, adapters=adapters
        )
        try:
            await self.bucket.add(record)
        except EndpointExists as exc:
            raise FleetError(str(exc), status=409, code="endpoint_exists", param="id") from None
        return describe(record, 0)

    async def register(
        self, spec: Mapping[str, Any], ttl: Any, *, probe: bool = True
    ) -> dict[str, Any]:
        """An engine announcing itself: added (or, registering again, brought up to date and
        active) with a heartbeat TTL; drained once silent for it (`HeartbeatJanitor`)."""
        if ttl is None:
            raise FleetError(
                "heartbeat_ttl: required: a registration without a heartbeat would never leave "
                "(use add for an endpoint managed by hand)",
                code="invalid_value",
                param="heartbeat_ttl",
            )
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 1 <= ttl <= 3600:
            raise FleetError(
                "heartbeat_ttl: seconds between 1 and 3600 expected",
                code="invalid_value",
                param="heartbeat_ttl",
            )
        from_engine = _models_from_engine(spec)
        spec, adapters = await self._with_models(spec)
        endpoint = self._validate(spec)
        fleet = await self.bucket.fleet()
        known = fleet.records.get(endpoint.id)
        if known is not None and known.source != "register":
            raise FleetError(
                f"endpoint {endpoint.id!r} is in the fleet from {known.source}: it cannot "
                "register over it",
                status=409,
                code="endpoint_exists",
                param="id",
            )
        if probe and (known is None or known.endpoint.url != endpoint.url):
            await self._probe(endpoint)
        registered = FleetRecord(
            endpoint=endpoint,
            state=EndpointState.ACTIVE,
            source="register",
            heartbeat_ttl=float(ttl),
            heartbeat_at=self._wall(),
            models_from_engine=from_engine,
            adapters=adapters,
        )
        if known is None:
            try:
                await self.bucket.add(registered)
            except EndpointExists as exc:
                raise FleetError(str(exc), status=409, code="endpoint_exists") from None
            return describe(registered, 0)
        fields: dict[str, Any] = {
            "endpoint": endpoint,
            "state": EndpointState.ACTIVE,
            "heartbeat_ttl": registered.heartbeat_ttl,
            "heartbeat_at": registered.heartbeat_at,
            "models_from_engine": from_engine,
            "adapters": adapters,
            "unserved": False,
        }
        return describe(
            await self._changed(endpoint.id, lambda r: r.model_copy(update=fields)), None
        )

    async def heartbeat(self, endpoint_id: str) -> dict[str, Any]:
        """A registered endpoint is alive: its heartbeat's time moves to now."""
        record, _ = await self._get(endpoint_id)
        if record.heartbeat_ttl is None:
            raise FleetError(
                f"endpoint {endpoint_id!r} did not register with a heartbeat",
                status=409,
                code="not_registered",
            )
        now = self._wall()
        changed = await self._changed(
            endpoint_id, lambda r: r.model_copy(update={"heartbeat_at": now})
        )
        return describe(changed, None)

    async def update(
        self, endpoint_id: str, changes: Mapping[str, Any], *, probe: bool = True
    ) -> dict[str, Any]:
        record, _ = await self._get(endpoint_id)
        if "id" in changes and changes["id"] != endpoint_id:
            raise FleetError(
                "an endpoint's id cannot change (add a new one, drain and remove this one)",
                code="invalid_value",
                param="id",
            )
        endpoint = self._changed_endpoint(record, changes)
        if probe and endpoint.url != record.endpoint.url:
            await self._probe(endpoint)

        def change(current: FleetRecord) -> FleetRecord:
            # The changes go onto the record as it is at the write (re-read on a conflict): a
            # write that landed since the read above (the model follower's) is kept.
            fields: dict[str, Any] = {"endpoint": self._changed_endpoint(current, changes)}
            if "models" in changes:  # models given by hand end following the engine's list
                fields["models_from_engine"] = False
            return current.model_copy(update=fields)

        changed = await self._changed(endpoint_id, change)
        return describe(changed, None)

    async def set_state(self, endpoint_id: str, state: EndpointState) -> dict[str, Any]:
        await self._get(endpoint_id)
        # A state set by hand ends a drain by the model follower (`unserved`): the operator's.
        fields = {"state": state, "unserved": False}
        changed = await self._changed(endpoint_id, lambda r: r.model_copy(update=fields))
        return describe(changed, None)

    async def remove(
        self, endpoint_id: str, *, force: bool = False, wait: float = 0.0
    ) -> dict[str, Any]:
        deadline = self._clock() + wait
        while True:
            record, _ = await self._get(endpoint_id)
            leases = await self._leases()
            held = 0 if leases is None else leases.get(endpoint_id, 0)
            if leases is None and not force and record.state is EndpointState.DRAINING:
                raise FleetError(
                    "no admission instance answered: cannot tell whether requests still run on "
                    f"{endpoint_id!r} (retry, or remove with force)",
                    status=503,
                    code="admission_unavailable",
                )
            verdict = remove_verdict(record.state, held, force=force)
            if verdict is RemoveVerdict.REMOVE:
                break
            if verdict is RemoveVerdict.NOT_DRAINING:
                raise FleetError(
                    f"endpoint {endpoint_id!r} is {record.state.value}: drain it first (new work "
                    "stops, running requests finish), then remove it; or remove with force",
                    status=409,
                    code="not_draining",
                )
            if self._clock() >= deadline:
                raise FleetError(
                    f"endpoint {endpoint_id!r} still runs {held} request(s): wait for them, "
                    "or remove with force",
                    status=409,
                    code="leases_left",
                )
            await asyncio.sleep(_POLL)
        try:
            removed = await self.bucket.remove(endpoint_id, expected=record)
        except EndpointNotFound:
            raise self._not_found(endpoint_id) from None
        return describe(removed, held)

    # ---- helpers ----------------------------------------------------------------------------

    def _changed_endpoint(self, record: FleetRecord, changes: Mapping[str, Any]) -> EndpointConfig:
        merged = {**record.endpoint.model_dump(mode="json", exclude_none=True), **changes}
        return self._validate(merged)

    def _validate(self, spec: Mapping[str, Any]) -> EndpointConfig:
        if not isinstance(spec, Mapping):
            raise FleetError("an endpoint is a JSON object", code="invalid_value")
        try:
            endpoint = EndpointConfig.model_validate(dict(spec))
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(part) for part in first["loc"]) or None
            message = first["msg"].removeprefix("Value error, ")
            raise FleetError(
                f"{param}: {message}" if param else message, code="invalid_value", param=param
            ) from None
        problems = endpoint_problems(self.config, endpoint)
        if problems:
            param = problems[0].split(":", 1)[0]
            raise FleetError("; ".join(problems), code="invalid_value", param=param)
        return endpoint

    async def _with_models(
        self, spec: Mapping[str, Any]
    ) -> tuple[Mapping[str, Any], dict[str, str]]:
        """`spec`, with the models the engine serves when it names none: its `GET /v1/models`
        (served names and LoRA adapters) matched against the config's models and aliases of
        the endpoint's provider (`llmgw.core.fleet.match_served`); a served name that is an
        alias goes upstream under that name (`upstream_model`, the spec's own on top). And
        those of its models served through an adapter, with the adapter's base."""
        if not isinstance(spec, Mapping) or "models" in spec:
            return spec, {}
        url, provider_id = spec.get("url"), spec.get("provider")
        if not isinstance(url, str) or not isinstance(provider_id, str):
            return spec, {}  # validation names what is missing
        try:
            provider = self.config.provider(provider_id)
        except KeyError:
            return {**spec, "models": []}, {}  # validation names the provider
        base = url.strip().rstrip("/")
        try:
            async with httpx.AsyncClient(timeout=_PROBE_TIMEOUT, trust_env=False) as client:
                response = await client.get(f"{base}/v1/models")
            body = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, OSError, ValueError) as exc:
            raise FleetError(
                f"models: none given, and {base}/v1/models does not answer a model list "
                f"({type(exc).__name__}); give --models",
                status=422,
                code="unreachable",
                param="models",
            ) from None
        served = served_models(body)
        canonical = self.config.model_names()
        found = match_served(served, canonical, [m.name for m in provider.models])
        if not found.models:
            listed = ", ".join(s.id for s in served) or "nothing"
            raise FleetError(
                f"models: none given, and the engine serves {listed}: no model or alias of "
                f"provider {provider_id!r} (add an alias in the config, or give --models)",
                status=422,
                code="no_models",
                param="models",
            )
        renames = {**found.upstream_model, **(spec.get("upstream_model") or {})}
        spec = {**spec, "models": list(found.models), "upstream_model": renames}
        return spec, dict(found.adapters)

    async def _probe(self, endpoint: EndpointConfig) -> None:
        """Refuse a URL nothing answers on: any HTTP answer (even an error status) will do."""
        client = self._probe_client or httpx.AsyncClient(timeout=_PROBE_TIMEOUT, trust_env=False)
        try:
            await client.get(f"{endpoint.url}/v1/models")
        except (httpx.HTTPError, OSError) as exc:
            raise FleetError(
                f"url: nothing answers at {endpoint.url} ({type(exc).__name__}); start the "
                'engine first, or skip the check (--no-probe / "probe": false)',
                status=422,
                code="unreachable",
                param="url",
            ) from None
        finally:
            if self._probe_client is None:
                await client.aclose()

    async def _get(self, endpoint_id: str) -> tuple[FleetRecord, int]:
        try:
            return await self.bucket.get(endpoint_id)
        except EndpointNotFound:
            raise self._not_found(endpoint_id) from None

    async def _changed(
        self, endpoint_id: str, change: Callable[[FleetRecord], FleetRecord]
    ) -> FleetRecord:
        try:
            return await self.bucket.change(endpoint_id, change)
        except EndpointNotFound:
            raise self._not_found(endpoint_id) from None

    @staticmethod
    def _not_found(endpoint_id: str) -> FleetError:
        return FleetError(
            f"no endpoint {endpoint_id!r} in the fleet", status=404, code="endpoint_not_found"
        )


def describe(record: FleetRecord, leases: int | None) -> dict[str, Any]:
    """One endpoint as `list`/`show` and the API print it."""
    endpoint = record.endpoint
    described: dict[str, Any] = {
        "id": endpoint.id,
        "state": record.state.value,
        "source": record.source,
        "provider": endpoint.provider,
        "url": endpoint.url,
        "models": list(endpoint.models),
        "weight": endpoint.weight,
        "capacity": endpoint.capacity,
        "leases": leases,
        "models_from_engine": record.models_from_engine,
    }
    if record.unserved:  # drained by the model follower: its engine serves none of its models
        described["unserved"] = True
    if record.heartbeat_ttl is not None:
        described["heartbeat_ttl"] = record.heartbeat_ttl
        described["heartbeat_at"] = record.heartbeat_at
    return described
